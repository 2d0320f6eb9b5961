"""``repair-index``: make the index say what the packs hold, after damage.

Each pack's sealed header describes its chunks (docs/format.md), so the packs that no readable
index object describes are indexed again from their headers, and index objects that name packs
which are gone are rewritten without them, in one new index object, before the objects it
replaces are removed. Until then, reads go around a damaged index object
(``Repository.load_index``) and fall back from a missing pack to another copy of a chunk, and
prune refuses while an index object is damaged (it would take those packs for leftovers).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..repository import Repository
from ..repository.pack import TRAILER, PackEntry
from .gc import verify_exclusive_lock


@dataclass(frozen=True)
class IndexRepair:
    damaged: list[str]  # IDs of the damaged index objects (removed unless dry_run)
    packs_reindexed: int  # packs in no readable index, indexed again from their headers
    unreadable_packs: list[str]  # packs in no readable index whose header is damaged too: their chunks are lost
    missing_packs: list[str]  # packs the index named that are gone, or cut short with copies elsewhere (dropped)
    dry_run: bool


def repair_index(repo: Repository, *, dry_run: bool = False) -> IndexRepair:
    """The caller holds the exclusive lock (for a real run). An index object this ckptvault cannot
    read because it is newer (UnsupportedFormatError) is not damage: it raises, and nothing changes."""
    damaged: dict[bytes, str] = {}
    objects = repo.read_index_objects(damaged=damaged)
    stored = repo.list_packs()
    gone = {pack_id for packs in objects.values() for pack_id in packs if pack_id not in stored}
    gone |= _cut_short_with_copies_elsewhere(objects, stored)
    stale = [index_id for index_id, packs in objects.items() if gone & packs.keys()]
    indexed = {pack_id for packs in objects.values() for pack_id in packs}
    described, unreadable = repo.headers_of_unindexed_packs(indexed, stored)
    rewritten: dict[bytes, list[PackEntry]] = {
        pack_id: entries for index_id in stale for pack_id, entries in objects[index_id].items() if pack_id not in gone
    }
    if not dry_run:
        verify_exclusive_lock(repo)
        if described or rewritten:
            repo.write_index({**rewritten, **described})  # before removing the objects it replaces
        for index_id in [*damaged, *stale]:
            repo.delete_index(index_id)
    return IndexRepair(
        damaged=sorted(i.hex() for i in damaged),
        packs_reindexed=len(described),
        unreadable_packs=sorted(p.hex() for p in unreadable),
        missing_packs=sorted(p.hex() for p in gone),
        dry_run=dry_run,
    )


def _cut_short_with_copies_elsewhere(
    objects: dict[bytes, dict[bytes, list[PackEntry]]], sizes: dict[bytes, int]
) -> set[bytes]:
    """Stored packs that end before a chunk the index places in them (truncated), when every chunk
    they hold has a whole copy in another pack (as after a backup that stored them again): they are
    dropped from the index like packs that are gone, and prune then removes them. A cut pack
    holding the only copy of some chunk stays: what lies before the cut still reads."""

    def whole(pack_id: bytes, e: PackEntry) -> bool:
        return e.offset + e.stored_len <= sizes[pack_id] - TRAILER.size

    packs = {pack_id: entries for index in objects.values() for pack_id, entries in index.items() if pack_id in sizes}
    cut = {pack_id for pack_id, entries in packs.items() if not all(whole(pack_id, e) for e in entries)}
    held = {
        e.chunk_id for pack_id, entries in packs.items() if pack_id not in cut for e in entries if whole(pack_id, e)
    }
    return {pack_id for pack_id in cut if all(e.chunk_id in held for e in packs[pack_id])}
