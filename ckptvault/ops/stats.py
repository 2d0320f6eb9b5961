"""Repository statistics: what the snapshots hold versus what the repository stores.

Of the whole vault (``compute_stats``: every chunk the index holds, every object stored), or of some
snapshots (``compute_selected_stats``: the chunks their files reference, read from their trees, with
the delta bases those chunks need: what keeping just these snapshots takes, restic's ``raw-data``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from ..repository import Repository
from ..repository.format import PACKS_PREFIX, id_from_key
from ..repository.index import ChunkLocation
from ..snapshot.model import FileEntry, Snapshot


@dataclass(frozen=True)
class SnapshotStats:
    id: str
    time: datetime  # UTC, timezone-aware: the snapshot's Snapshot.time
    tags: dict[str, str]
    logical_bytes: int
    new_bytes: int  # raw bytes of chunks the snapshot's backup added
    stored_bytes: int  # bytes the snapshot's backup added to the repository
    delta_saved_bytes: int = 0  # estimated bytes its delta chunks saved over plain coding
    hostname: str = ""  # the host its backup ran on (or that backup --host named): the snapshot's hostname


@dataclass(frozen=True)
class VaultStats:
    snapshots: int
    logical_bytes: int  # sum of every snapshot's file sizes
    unique_bytes: int  # raw size of the distinct chunks stored
    stored_bytes: int  # bytes of every object in the repository
    chunks: int
    packs: int
    per_snapshot: list[SnapshotStats]
    delta_chunks: int = 0  # chunks stored as deltas (codec 3), from the index
    delta_bytes: int = 0  # their raw bytes
    delta_stored_bytes: int = 0  # their stored bytes
    delta_saved_bytes: int = 0  # estimated bytes saved by delta coding (sum over the snapshots' backups)
    # delta chunks no snapshot's summary accounts for (copied in: a copy's summary leaves the delta figures
    # out; or added by a backup whose snapshot was forgotten): their saving is not in delta_saved_bytes
    delta_saving_unknown: int = 0
    unindexed_packs: int = 0  # packs no index object names: their chunks are not counted in unique bytes
    # snapshot objects that cannot be read: their files are not in logical_bytes, their chunks are in
    # unique_bytes, so the ratios are not told (None) while there are any
    unreadable_snapshots: int = 0
    # True: the figures are of chosen snapshots (``Vault.stats(snapshots, tags=, hosts=)``), not the whole
    # vault: unique bytes and chunks are those their files reference, stored bytes and packs those chunks and
    # the delta bases they need take in packs (no metadata), delta figures of the referenced chunks
    selected: bool = False

    @property
    def dedup_ratio(self) -> float | None:
        """Logical bytes per unique byte: what deduplication saved (None: not told, see above)."""
        if self.unreadable_snapshots and not self.selected:
            return None
        return self.logical_bytes / self.unique_bytes if self.unique_bytes else 1.0

    @property
    def total_ratio(self) -> float | None:
        """Logical bytes per stored byte: deduplication and compression together (None: not told)."""
        if self.unreadable_snapshots and not self.selected:
            return None
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 1.0


def compute_stats(repo: Repository, snapshots: list[Snapshot], unreadable: int = 0) -> VaultStats:
    objects = repo.store.list("")
    packs = {id_from_key(o.key) for o in objects if o.key.startswith(PACKS_PREFIX)} - {None}
    return _stats(
        repo,
        snapshots,
        [loc for _, loc in repo.index.items()],
        stored_bytes=sum(o.size for o in objects),
        packs=packs,
        unreadable=unreadable,
    )


def compute_selected_stats(
    repo: Repository, snapshots: list[Snapshot], trees: Iterable[list[FileEntry]], unreadable: int = 0
) -> VaultStats:
    """The figures of ``snapshots`` alone (``trees``: their trees, in any order). A chunk in no index (its
    pack is unindexed, ``unindexed_packs``) is not counted, as in ``compute_stats``."""
    referenced = {c for tree in trees for e in tree if e.type == "file" for c in e.chunks}
    found = {c: loc for c in referenced if (loc := repo.index.get(c)) is not None}
    needed = dict(found)  # with the delta bases (at any depth) a referenced chunk is read through
    bases = [loc.base_id for loc in found.values() if loc.base_id is not None]
    while bases:
        base = bases.pop()
        if base not in needed and (loc := repo.index.get(base)) is not None:
            needed[base] = loc
            if loc.base_id is not None:
                bases.append(loc.base_id)
    listed = {id_from_key(o.key) for o in repo.store.list(PACKS_PREFIX)} - {None}
    return _stats(
        repo,
        snapshots,
        list(found.values()),
        stored_bytes=sum(loc.stored_len for loc in needed.values()),
        packs=listed,
        counted_packs=len({loc.pack_id for loc in needed.values()}),
        unreadable=unreadable,
        selected=True,
    )


def _stats(
    repo: Repository,
    snapshots: list[Snapshot],
    chunks: list[ChunkLocation],
    *,
    stored_bytes: int,
    packs: set[bytes | None],
    counted_packs: int | None = None,
    unreadable: int,
    selected: bool = False,
) -> VaultStats:
    """``chunks``: the distinct chunks counted; ``packs``: the packs the storage lists (those in no index are
    told apart); ``counted_packs``: how many packs the figures cover (default: every listed one)."""
    deltas = [loc for loc in chunks if loc.base_id is not None]
    return VaultStats(
        snapshots=len(snapshots),
        logical_bytes=sum(s.summary.logical_bytes for s in snapshots),
        unique_bytes=sum(loc.raw_len for loc in chunks),
        stored_bytes=stored_bytes,
        chunks=len(chunks),
        packs=len(packs) if counted_packs is None else counted_packs,
        per_snapshot=[
            SnapshotStats(
                id=s.id,
                time=s.time,
                tags=s.tags,
                logical_bytes=s.summary.logical_bytes,
                new_bytes=s.summary.new_bytes,
                stored_bytes=s.summary.stored_bytes,
                delta_saved_bytes=s.summary.delta_saved_bytes,
                hostname=s.hostname,
            )
            for s in snapshots
        ],
        delta_chunks=len(deltas),
        delta_bytes=sum(loc.raw_len for loc in deltas),
        delta_stored_bytes=sum(loc.stored_len for loc in deltas),
        delta_saved_bytes=sum(s.summary.delta_saved_bytes for s in snapshots),
        delta_saving_unknown=max(0, len(deltas) - sum(s.summary.delta_chunks for s in snapshots)),
        unindexed_packs=len(packs - repo.index.packs),
        unreadable_snapshots=unreadable,
        selected=selected,
    )
