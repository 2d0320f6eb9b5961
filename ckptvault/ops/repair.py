"""``repair-index``: rewrite the index after an index object was damaged.

Each pack's sealed header describes its chunks (docs/format.md), so the packs that no readable
index object describes are indexed again from their headers, in one new index object, before the
damaged objects are removed. Until then, reads go around the damage (``Repository.load_index``)
and prune refuses, since it would take those packs for leftovers of a killed backup.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..repository import Repository


@dataclass(frozen=True)
class IndexRepair:
    damaged: list[str]  # IDs of the damaged index objects (removed unless dry_run)
    packs_reindexed: int  # packs in no readable index, indexed again from their headers
    unreadable_packs: list[str]  # packs in no readable index whose header is damaged too: their chunks are lost
    dry_run: bool


def repair_index(repo: Repository, *, dry_run: bool = False) -> IndexRepair:
    """The caller holds the exclusive lock. An index object this ckptvault cannot read because it
    is newer (UnsupportedFormatError) is not damage: it raises, and nothing is changed."""
    damaged: dict[bytes, str] = {}
    indexed = {pack_id for packs in repo.read_index_objects(damaged=damaged).values() for pack_id in packs}
    described, unreadable = repo.headers_of_unindexed_packs(indexed)
    if not dry_run:
        if described:
            repo.write_index(described)  # before removing the objects it replaces
        for index_id in damaged:
            repo.delete_index(index_id)
    return IndexRepair(
        damaged=sorted(i.hex() for i in damaged),
        packs_reindexed=len(described),
        unreadable_packs=sorted(p.hex() for p in unreadable),
        dry_run=dry_run,
    )
