"""Is this local checkpoint durably stored? The question a script asks before deleting it.

A checkpoint counts as backed up when one committed snapshot holds every one of its files,
under the same relative paths, with the same size and the same BLAKE3 content hash, and every
chunk of those files is in the index and in a pack present in storage. Where it sits in the
snapshot does not matter: ``checkpoints/checkpoint-1200`` is found in a snapshot of
``checkpoint-1200`` itself, of a pin of it, or of the whole ``checkpoints`` folder.
Names, sizes and then hashes are compared in that order, so only plausible candidates cost
a read of the local files, and each local file is hashed at most once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import IntegrityError, ObjectNotFoundError, SnapshotNotFoundError, SourceError
from ..repository import Repository
from ..snapshot.model import FileEntry, Snapshot
from .restore import file_hash
from .scan import NO_EXCLUDES, Excludes, scan_sources, unreadable_hint

# Every file is compared by content: one that cannot be read leaves the answer unknown.
UNREADABLE_HINT = "status compares every file with the vault: make it readable, or ask about a folder without it"


@dataclass(frozen=True)
class BackupStatus:
    path: str
    backed_up: bool
    snapshot: Snapshot | None  # the newest snapshot that holds it
    prefix: str  # where its files sit in that snapshot ("" = the snapshot root)
    files: int
    bytes: int
    detail: str


def backup_status(
    repo: Repository,
    path: str,
    snapshots: list[Snapshot],
    load_tree: Callable[[Snapshot], list[FileEntry]],
    vault_folder: str | None = None,
    exclude: Excludes = NO_EXCLUDES,
) -> BackupStatus:
    """``exclude``: files the backups left out, left out of the comparison too."""
    try:
        scan = scan_sources(  # as a backup sees it
            [path], skip_unreadable=False, vault_folder=vault_folder, exclude=exclude, purpose="compare"
        )
    except SourceError as exc:
        if exc.hint != unreadable_hint():
            raise
        raise SourceError(exc.path, exc.reason, UNREADABLE_HINT) from None  # not backup's --skip-unreadable
    local = {i.path: i for i in scan.items if i.kind == "file"}
    total = sum(i.st.st_size for i in local.values())
    abs_path = scan.source_paths[0]

    def status(ok: bool, detail: str, snap: Snapshot | None = None, prefix: str = "") -> BackupStatus:
        return BackupStatus(abs_path, ok, snap, prefix, len(local), total, detail)

    hashes: dict[str, str] = {}
    first = min(local)
    candidates = [s for s in snapshots if s.summary.files >= len(local) and s.summary.logical_bytes >= total]
    packs: dict[bytes, int] | None = None
    damaged: list[str] = []
    for snap in sorted(candidates, key=lambda s: s.time, reverse=True):
        try:
            tree = {e.path: e for e in load_tree(snap) if e.type == "file"}
        except (ObjectNotFoundError, SnapshotNotFoundError):
            continue  # forgotten meanwhile
        except IntegrityError:  # its tree is damaged: it holds nothing that can be restored
            damaged.append(snap.short_id)
            continue
        for prefix in _prefixes(tree, first):
            entries = [tree.get(prefix + rel) for rel in local]
            if any(e is None or e.size != local[rel].st.st_size for e, rel in zip(entries, local, strict=True)):
                continue
            matched = True
            for entry, rel in zip(entries, local, strict=True):
                if rel not in hashes:
                    try:
                        hashes[rel] = file_hash(local[rel].abs_path)
                    except OSError as exc:
                        raise SourceError(local[rel].abs_path, exc.strerror or str(exc), UNREADABLE_HINT) from None
                if entry is None or hashes[rel] != entry.blake3:
                    matched = False
                    break
            if not matched:
                continue
            if packs is None:
                repo.load_index()
                packs = repo.list_packs()
            missing = _missing_chunks([e for e in entries if e is not None], repo, packs)
            if missing:
                return status(False, f"snapshot {snap.short_id} holds it but {missing}; run: ckptvault check", snap)
            where = f" under {prefix.rstrip('/')}/" if prefix else ""
            return status(True, f"in snapshot {snap.short_id}{where}", snap, prefix)
    unread = f" (the tree of snapshot(s) {', '.join(damaged)} is damaged: run: ckptvault check)" if damaged else ""
    return status(False, f"no snapshot holds its {len(local)} file(s) with the same content{unread}")


def _prefixes(tree: dict[str, FileEntry], rel: str) -> list[str]:
    """Every place in the tree where the local file ``rel`` could sit."""
    found = []
    for path in tree:
        if path == rel:
            found.append("")
        elif path.endswith("/" + rel):
            found.append(path[: len(path) - len(rel)])
    return found


def _missing_chunks(entries: list[FileEntry], repo: Repository, packs: dict[bytes, int]) -> str:
    for entry in entries:
        for chunk_id in entry.chunks:
            loc = repo.index.get(chunk_id)
            if loc is None:
                return f"chunk {chunk_id.hex()[:12]} of {entry.path} is in no index"
            if loc.pack_id not in packs:
                return f"pack {loc.pack_id.hex()[:12]} of {entry.path} is missing"
    return ""
