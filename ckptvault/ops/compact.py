"""Compacting index objects during backups, so that a vault that is never pruned does not make every
command read thousands of them.

Every backup writes an index object per 8 packs it uploads (so that a killed backup's packs are
indexed as it goes), and only ``prune`` consolidated them: a training job that saves every 30 minutes
and never prunes had 1,000 saves' worth of objects after three weeks (8 per GB saved), and a fresh
machine's first command (the restore after an instance was lost) read every one of them.

So a backup, under its shared lock and after its snapshot is written, writes the entries of the small
index objects (under ``SMALL_INDEX_BYTES``) as one object (more when ``INDEX_ENTRIES_PER_OBJECT`` calls
for it) once there are more than ``COMPACT_AT`` of them, then deletes them. A compacted object stays
small until it reaches that size, so it is compacted again with the next ones: the objects number at
most ``COMPACT_AT`` plus the index's size over ``SMALL_INDEX_BYTES``.

Safe beside other backups and readers, as prune's consolidation is: the new object is written before any
object it replaces is deleted, so every listing names every pack (a reader that finds a listed object
gone lists again: ``Repository.read_index_objects``, ``_merge_new_index_objects``); only objects this
Repository read whole are replaced; a process killed in between leaves entries named twice, which
readers take as one. Prune (an exclusive lock) cannot run meanwhile.
"""

from __future__ import annotations

from ..errors import CkptVaultError
from ..repository import Repository
from ..repository.pack import PackEntry
from .gc import each, index_batches

COMPACT_AT = 32  # more small index objects than this and a backup compacts them
SMALL_INDEX_BYTES = 1 << 20  # ~20,000 entries: an object this big is left as it is


def compact_index(repo: Repository) -> int:
    """Replace the small index objects by one when there are more than ``COMPACT_AT``; how many were
    replaced (0: too few, or one was damaged or gone meanwhile, left for a later backup or a prune)."""
    if repo.known_index_objects <= COMPACT_AT:
        return 0  # as of this backup's last look (no listing on every backup); others' are seen by a later one
    small = [index_id for index_id, size in repo.list_index_sizes().items() if size < SMALL_INDEX_BYTES]
    if len(small) <= COMPACT_AT:
        return 0
    merged: dict[bytes, dict[PackEntry, None]] = {}
    for index_id in small:
        try:
            packs = repo.read_index_object(index_id)
        except CkptVaultError:
            return 0  # damaged (repair-index's job) or replaced meanwhile: leave them all
        for pack_id, entries in packs.items():
            merged.setdefault(pack_id, {}).update(dict.fromkeys(entries))
    for batch in index_batches({pack_id: list(entries) for pack_id, entries in merged.items()}):
        repo.write_index(batch)  # checks the lock: one lost to a prune writes nothing
    repo.locks.check_held_age(exclusive=False)
    repo.index_objects_absorbed(small)
    each(repo.delete_index, small, lock_check=lambda: repo.locks.check_held_age(exclusive=False))
    return len(small)


def compact_or_warn(repo: Repository) -> list[str]:
    """``compact_index`` after a backup or copy, under its lock: its snapshots are stored, so a failure to
    compact the index objects is a warning (the next backup tries again), not the command's failure."""
    try:
        compact_index(repo)
    except CkptVaultError as exc:
        return [f"could not compact the vault's index objects ({exc}); the next backup tries again"]
    return []
