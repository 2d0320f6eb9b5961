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

import functools
import os
import shlex
from collections.abc import Callable, Container
from dataclasses import dataclass

from ..errors import (
    IntegrityError,
    ObjectNotFoundError,
    SnapshotNotFoundError,
    SourceError,
    UsageError,
    check_command,
    check_hint,
    spelled,
)
from ..repository import Repository
from ..repository.pack import lies_whole_in
from ..snapshot.model import FileEntry, Snapshot
from .catalog import TreeLoader
from .names import STATE_FOLDERS, WATCH_STATE_FOLDER, is_unfinished
from .restore import file_hash
from .scan import NO_EXCLUDES, Excludes, SourceItem, scan_sources, unreadable_hint

LeftOut = Callable[[str], bool]  # a path in a snapshot -> whether its backup left that file out
Held = tuple[str, list[FileEntry], int]  # where a tree holds the local files: prefix, entries, files left out

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
    load_tree: TreeLoader,
    vault_folder: str | None = None,
    exclude: Excludes = NO_EXCLUDES,
) -> BackupStatus:
    """``exclude``: files the backups left out, left out of the comparison too. Without it every file
    counts: a snapshot that holds all but what its own --exclude patterns left out is named in the
    detail (deleting the folder would lose those files), and the answer stays no."""
    try:
        scan = scan_sources(  # as a backup sees it
            [path], skip_unreadable=False, vault_folder=vault_folder, exclude=exclude, purpose="compare"
        )
    except SourceError as exc:
        if exc.hint != unreadable_hint():
            raise
        raise SourceError(exc.path, exc.reason, UNREADABLE_HINT) from None  # not backup's --skip-unreadable
    local = _LocalFiles(scan.source_paths[0], {i.path: i for i in scan.items if i.kind == "file"}, load_tree)
    partly = ""  # the newest snapshot that holds all but what its backup left out
    for snap in sorted(snapshots, key=lambda s: s.time, reverse=True):
        patterns = None if exclude or partly else _recorded_excludes(snap)
        if patterns is None and local.too_many_for(snap):
            continue
        tree = local.files_of(snap)
        if tree is None:
            continue
        found = local.held_in(tree, None)
        if found is not None:
            return local.stored_in(repo, snap, found)
        partly = partly or local.held_but_left_out(snap, tree, patterns)
    unread = f" (the tree of snapshot(s) {', '.join(local.damaged)} is damaged: run: {check_command()})"
    detail = f"no snapshot holds its {len(local.files)} file(s) with the same content"
    return local.status(False, f"{detail}{unread if local.damaged else ''}{partly}{_watched_hint(path)}")


def _watched_hint(path: str) -> str:
    """A folder a watch sidecar ships is in no one snapshot: each checkpoint folder in it is its own."""
    if not os.path.isdir(os.path.join(path, WATCH_STATE_FOLDER)):
        return ""
    with os.scandir(path) as entries:
        folders = sorted(e.name for e in entries if e.is_dir() and e.name not in STATE_FOLDERS)
    example = shlex.quote(os.path.join(path, folders[0] if folders else "NAME"))
    return f"; a watch ships each checkpoint folder in it as a snapshot of its own: ask about those (status {example})"


class _LocalFiles:
    """The files of the local ``path`` as a backup sees them, compared with snapshot trees: each local
    file is hashed at most once, and only when a tree holds it under the same name and size."""

    def __init__(self, path: str, files: dict[str, SourceItem], load_tree: TreeLoader) -> None:
        self.path = path
        self.files = files
        self.total = sum(i.st.st_size for i in files.values())
        self.damaged: list[str] = []  # short IDs of the snapshots whose tree cannot be read
        self._load_tree = load_tree
        self._hashes: dict[str, str] = {}
        # files named as still being written (*.tmp): pinned backups (watch, backup_async) leave them out
        self.unfinished = [rel for rel in files if _being_written(rel)]
        self._least_files = len(files) - len(self.unfinished)
        self._least_bytes = self.total - sum(files[rel].st.st_size for rel in self.unfinished)
        self._one_file = len(files) == 1 and os.path.isfile(path)  # a folder is restored by its names

    def status(self, ok: bool, detail: str, snap: Snapshot | None = None, prefix: str = "") -> BackupStatus:
        return BackupStatus(self.path, ok, snap, prefix, len(self.files), self.total, detail)

    def too_many_for(self, snap: Snapshot) -> bool:
        """Whether ``snap`` is too small to hold every file (but those still being written)."""
        return snap.summary.files < self._least_files or snap.summary.logical_bytes < self._least_bytes

    def files_of(self, snap: Snapshot) -> dict[str, FileEntry] | None:
        # each tree is read once and not kept: a checkpoint of thousands of files and hundreds of
        # snapshots to compare it with would otherwise hold them all (GBs) just to answer "no"
        try:
            return {e.path: e for e in self._load_tree(snap) if e.type == "file"}
        except (ObjectNotFoundError, SnapshotNotFoundError):
            return None  # forgotten meanwhile
        except IntegrityError:  # its tree is damaged: it holds nothing that can be restored
            self.damaged.append(snap.short_id)
            return None

    def same_content(self, rel: str, entry: FileEntry) -> bool:
        if rel not in self._hashes:
            try:
                self._hashes[rel] = file_hash(self.files[rel].abs_path)
            except OSError as exc:
                raise SourceError(self.files[rel].abs_path, exc.strerror or str(exc), UNREADABLE_HINT) from None
        return self._hashes[rel] == entry.blake3

    def held_in(self, tree: dict[str, FileEntry], left_out: LeftOut | None) -> Held | None:
        """(prefix, entries, files left out) where ``tree`` holds every local file but those its
        backup ``left_out``, with the same content."""
        local = self.files
        for prefix in _prefixes(tree, local):
            wanted = [rel for rel in local if not (left_out and left_out(prefix + rel))]
            entries = [e for rel in wanted if (e := tree.get(prefix + rel)) and e.size == local[rel].st.st_size]
            if not wanted or len(entries) < len(wanted):  # sizes first: hashes are read for plausible matches only
                continue
            if all(self.same_content(rel, e) for rel, e in zip(wanted, entries, strict=True)):
                return prefix, entries, len(local) - len(wanted)
        return self._held_under_another_name(tree) if left_out is None else None

    def _held_under_another_name(self, tree: dict[str, FileEntry]) -> Held | None:
        """One file whose bytes a snapshot holds under another name: Lightning's ``last.ckpt``, a copy of
        the newest ``epoch=N-step=M.ckpt``, which its callback ships once, under that name."""
        if not self._one_file:
            return None
        ((rel, item),) = self.files.items()
        size = item.st.st_size
        return next(
            (("", [e], 0) for e in tree.values() if e.size == size > 0 and self.same_content(rel, e)),
            None,
        )

    def held_but_left_out(self, snap: Snapshot, tree: dict[str, FileEntry], patterns: Excludes | None) -> str:
        """The detail's note when ``tree`` holds every file but those its backup left out, else ""."""
        if patterns and (partial := self.held_in(tree, functools.partial(_left_out, patterns))) is not None:
            return (
                f"; snapshot {snap.short_id} holds all but the {partial[2]} file(s) its --exclude patterns "
                f"({', '.join(snap.excludes)}) left out: give status the same patterns to accept that"
            )
        if self.unfinished and (partial := self.held_in(tree, _being_written)) is not None:
            names = ", ".join(self.unfinished[:3]) + (" ..." if len(self.unfinished) > 3 else "")
            return (
                f"; snapshot {snap.short_id} holds all but the {partial[2]} file(s) named as still being written "
                f"({names}), which watch and backup_async leave out: give status --exclude patterns for them "
                "to accept that"
            )
        return ""

    def stored_in(self, repo: Repository, snap: Snapshot, held: Held) -> BackupStatus:
        """The answer once ``snap`` holds every file: yes, unless a chunk of them cannot be read."""
        prefix, entries, _ = held
        repo.load_index()
        missing = _missing_chunks(entries, repo, repo.list_packs())
        if missing.endswith(IN_NO_INDEX):  # dropped as damaged: a backup reads the file and stores it anew
            backup = spelled(f"ckptvault backup {shlex.quote(self.path)}", f"Vault.backup({self.path!r})")
            again = f"back it up again to store those bytes anew: {backup}"
            return self.status(False, f"snapshot {snap.short_id} holds it but {missing}; {again}", snap)
        if missing:  # the index still lists the chunk: a backup would deduplicate against it
            return self.status(False, f"snapshot {snap.short_id} holds it but {missing}{check_hint()}", snap)
        where = f" under {prefix.rstrip('/')}/" if prefix else ""
        if len(entries) == 1 and entries[0].path not in {prefix + rel for rel in self.files}:
            where = f" as {entries[0].path}"  # the same bytes under another name
        return self.status(True, f"in snapshot {snap.short_id}{where}", snap, prefix)


def _recorded_excludes(snap: Snapshot) -> Excludes | None:
    try:
        return Excludes.parse(snap.excludes) if snap.excludes else None
    except UsageError:  # patterns this ckptvault does not take: compare every file
        return None


def _left_out(excludes: Excludes, path: str) -> bool:
    """Whether a backup with ``excludes`` left out the file at snapshot ``path``, or a folder above it."""
    parts = path.split("/")
    return excludes.match(path, False) or any(excludes.match("/".join(parts[:i]), True) for i in range(1, len(parts)))


def _being_written(path: str) -> bool:
    """Whether a pin leaves the file at ``path`` out: its name, or a folder's on its way, is one a writer
    renames when done (names.is_unfinished)."""
    return any(is_unfinished(part) for part in path.split("/"))


def _prefixes(tree: dict[str, FileEntry], local: Container[str]) -> list[str]:
    """Every place in the tree where a local file sits (the prefix before its local path), in tree order."""
    found: dict[str, None] = {}
    for path in tree:
        cut = 0
        while True:
            if path[cut:] in local:
                found.setdefault(path[:cut])
            cut = path.find("/", cut) + 1
            if cut == 0:
                break
    return list(found)


IN_NO_INDEX = "is in no index"  # what _missing_chunks says of a chunk no index lists


def _missing_chunks(entries: list[FileEntry], repo: Repository, packs: dict[bytes, int]) -> str:
    """Why a chunk of ``entries`` cannot be read from the vault as listed (``packs``: pack ID -> size),
    or "": some copy of each lies whole in a stored pack, and so does the delta base it needs, at any
    depth. A chunk in no index is looked for in the stored packs no index object names (their sealed
    headers, read once), as every reader does. Its bytes are not read (``check --read-data`` does that)."""
    readable: set[bytes] = set()  # only successes are kept: a failure found while a base was still being
    # resolved (a loop) may not hold once that base proves readable through another copy
    resolving: set[bytes] = set()

    def unreadable(chunk_id: bytes) -> str:
        """Why none of the chunk's copies reads, or "" when one does."""
        if chunk_id in readable:
            return ""
        if chunk_id in resolving:
            return "is a delta in a loop of delta bases"
        resolving.add(chunk_id)
        reason = IN_NO_INDEX
        copies = repo.index.locations(chunk_id)
        if not copies and repo.find(chunk_id) is not None:  # in a pack no index object names (one deleted):
            copies = repo.index.locations(chunk_id)  # read by its own header, as restore does, with a warning
        for loc in copies:
            pack = loc.pack_id.hex()[:12]
            if loc.pack_id not in packs:
                reason = f"is in pack {pack}, which is missing"
            elif not lies_whole_in(loc.offset, loc.stored_len, packs[loc.pack_id]):
                reason = f"is in pack {pack}, which is cut short (truncated)"
            elif loc.base_id is not None and (base := unreadable(loc.base_id)):
                reason = f"is a delta against chunk {loc.base_id.hex()[:12]}, which {base}"
            else:
                reason = ""
                readable.add(chunk_id)
                break
        resolving.discard(chunk_id)
        return reason

    for entry in entries:
        for chunk_id in entry.chunks:
            if reason := unreadable(chunk_id):  # the first failure ends the look: nothing to keep of it
                return f"chunk {chunk_id.hex()[:12]} of {entry.path} {reason}"
    return ""
