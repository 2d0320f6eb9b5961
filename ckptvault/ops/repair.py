"""``repair-index``: make the index say what the packs hold, after damage.

Each pack's sealed header describes its chunks (docs/format.md), so the packs that no readable
index object describes are indexed again from their headers, and index objects that name packs
which are gone are rewritten without them, in one new index object, before the objects it
replaces are removed. Until then, reads go around a damaged index object
(``Repository.load_index``) and fall back from a missing pack to another copy of a chunk, and
prune refuses while an index object is damaged (it would take those packs for leftovers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..blob import Kind
from ..errors import CkptVaultError, IntegrityError, StorageError, UnsupportedFormatError, spelled
from ..repository import Repository
from ..repository.pack import TRAILER, PackEntry, header_range, lies_whole_in, read_pack_header
from ..store.failures import object_fault
from .gc import GcPlan, execute_gc, verify_exclusive_lock


@dataclass(frozen=True)
class IndexRepair:
    damaged: list[str]  # IDs of the damaged index objects (removed unless dry_run)
    packs_reindexed: int  # packs in no readable index, indexed again from their headers
    unreadable_packs: list[str]  # packs in no readable index whose header is damaged too: their chunks are lost
    missing_packs: list[str]  # packs the index named that are gone from the store (dropped from the index)
    dry_run: bool
    damaged_chunks: list[str] = field(default_factory=list)  # read_data: chunks that did not verify (dropped)
    unread_packs: list[str] = field(default_factory=list)  # read_data: packs that could not be read (kept as indexed)
    failing_packs: list[str] = field(default_factory=list)  # read_data: packs the storage fails to serve (below):
    # in unread_packs, or with drop_failing indexed without their chunks
    salvaged_packs: list[str] = field(default_factory=list)  # header damaged: indexed from a damaged index object
    rewritten_packs: list[str] = field(default_factory=list)  # read_data: indexed packs whose header was damaged,
    # copied into new packs (their chunks that verify) and removed
    revived_packs: list[str] = field(default_factory=list)  # indexed without chunks (dropped), read whole now:
    # their chunks that verify indexed again
    kept_packs: list[str] = field(default_factory=list)  # read_data: header damaged, and bytes of them that no
    # index entry accounts for (a chunk a damaged index object no longer describes may be there): not rewritten
    cut_short_packs: list[str] = field(default_factory=list)  # not read_data: indexed packs that end before a
    # chunk the index places in them (from the listing's sizes), whose entries it keeps (read_data drops them)


def repair_index(
    repo: Repository, *, dry_run: bool = False, read_data: bool = False, drop_failing: bool = False
) -> IndexRepair:
    """The caller holds the exclusive lock (for a real run). An index object this ckptvault cannot
    read because it is newer (UnsupportedFormatError) is not damage: it raises, and nothing changes.

    ``read_data``: also read every indexed pack and drop from the index each chunk that does not
    verify (as ``restic repair packs`` does), so that the next backup of the files holding it stores
    it again instead of deduplicating against the damaged copy; the snapshots that need it restore
    again once one has (a chunk is named by its content).

    ``drop_failing`` (implies ``read_data``): every chunk of a pack the storage answers for but fails on
    every attempt (a server error: ``store.failures.object_fault``) is dropped too. Only on request: a
    storage fault that passes answers the same. The pack stays, indexed without chunks, so nothing reads
    it again; prune removes it. Until then, a later ``read_data`` repair indexes again the chunks of such
    a pack that read and verify by then (the fault passed) and are stored nowhere else: dropping is
    undone, not final."""
    read_data = read_data or drop_failing  # they are found by reading every pack
    damaged: dict[bytes, str] = {}
    objects = repo.read_index_objects(damaged=damaged)
    stored = repo.list_packs()
    gone = {pack_id for packs in objects.values() for pack_id in packs if pack_id not in stored}
    unread: list[bytes] = []
    failing: list[bytes] = []  # in unread too
    headless: set[bytes] = set()  # indexed packs whose own header is damaged
    kept: set[bytes] = set()  # of those, packs holding bytes no index entry accounts for
    bad_chunks = (
        _chunks_that_do_not_verify(repo, objects, stored, gone, unread, failing, headless, kept) if read_data else {}
    )
    dropped = dict(bad_chunks)
    if drop_failing:
        for packs in objects.values():
            dropped.update({p: {e.chunk_id for e in entries} for p, entries in packs.items() if p in failing})
    revived = _chunks_that_verify_now(repo, objects, stored, gone | dropped.keys() | set(unread)) if read_data else {}
    stale = [index_id for index_id, packs in objects.items() if (gone | dropped.keys() | revived.keys()) & packs.keys()]
    indexed = {pack_id for packs in objects.values() for pack_id in packs}
    cut_short = {
        pack_id
        for packs in objects.values()
        for pack_id, entries in packs.items()
        if pack_id in stored and any(not lies_whole_in(e.offset, e.stored_len, stored[pack_id]) for e in entries)
    }
    described, unreadable = repo.headers_of_unindexed_packs(indexed, stored)
    # A pack whose header is damaged, in no readable index: a damaged index object may still be its only
    # map. What it says of the pack is taken where each chunk verifies (deleting it lost the pack).
    for index_id in damaged:
        for pack_id, entries in repo.salvage_index_entries(index_id, unreadable).items():
            described.setdefault(pack_id, []).extend(e for e in entries if e not in described.get(pack_id, ()))
    salvaged = sorted(p.hex() for p in described if p in unreadable)
    unreadable = [p for p in unreadable if p not in described]
    rewritten: dict[bytes, list[PackEntry]] = {
        pack_id: [e for e in entries if e.chunk_id not in dropped.get(pack_id, ())]
        for index_id in stale
        for pack_id, entries in objects[index_id].items()
        if pack_id not in gone
    }
    if not dry_run:
        verify_exclusive_lock(repo)
        if described or rewritten:
            repo.write_index({**rewritten, **described, **revived})  # before removing the objects it replaces
        for index_id in [*damaged, *stale]:
            repo.delete_index(index_id)
        if headless:
            _rewrite_headless_packs(repo, headless, bad_chunks)
    return IndexRepair(
        damaged=sorted(i.hex() for i in damaged),
        packs_reindexed=len(described),
        unreadable_packs=sorted(p.hex() for p in unreadable),
        missing_packs=sorted(p.hex() for p in gone),
        dry_run=dry_run,
        damaged_chunks=sorted({c.hex() for chunks in bad_chunks.values() for c in chunks}),
        unread_packs=sorted(p.hex() for p in unread if p not in dropped),
        failing_packs=sorted(p.hex() for p in failing),
        salvaged_packs=salvaged,
        rewritten_packs=sorted(p.hex() for p in headless),
        revived_packs=sorted(p.hex() for p in revived),
        kept_packs=sorted(p.hex() for p in kept),
        cut_short_packs=[] if read_data else sorted(p.hex() for p in cut_short),  # read_data: in damaged_chunks
    )


def _chunks_that_verify_now(
    repo: Repository, objects: dict[bytes, dict[bytes, list[PackEntry]]], stored: dict[bytes, int], skip: set[bytes]
) -> dict[bytes, list[PackEntry]]:
    """Pack ID -> its chunks that read and verify and are in no other indexed pack, for each pack indexed
    without chunks (dropped by --drop-failing-packs, or every chunk found damaged) that reads whole now,
    with a sound header (``skip``: packs gone, dropped now, or that failed to read in this repair). A chunk
    a later backup stored again is not indexed twice: prune would keep one copy, the once failing one as
    likely as the new."""
    with_chunks = {pack_id for packs in objects.values() for pack_id, entries in packs.items() if entries}
    chunkless = {pack_id for packs in objects.values() for pack_id in packs} - with_chunks - skip
    revived: dict[bytes, list[PackEntry]] = {}
    for pack_id in sorted(chunkless):
        try:
            data = repo.read_pack(pack_id, stored.get(pack_id))
            entries = read_pack_header(repo.codec, pack_id, data)
        except CkptVaultError:
            continue  # still failing, or damaged (too big to be a pack, too): it stays dropped
        good = []
        for e in entries:
            if repo.index.get(e.chunk_id) is not None:
                continue
            try:
                repo.decode_chunk(e.chunk_id, data[e.offset : e.offset + e.stored_len], e.raw_len, e.base_id)
            except CkptVaultError:
                continue
            good.append(e)
        if good:
            revived[pack_id] = good
    return revived


def _rewrite_headless_packs(repo: Repository, headless: set[bytes], bad_chunks: dict[bytes, set[bytes]]) -> None:
    """A pack whose header is damaged is read through the index alone, and would be lost with its index
    object; check reports it at every run. Its chunks that verify are copied into new packs (with sound
    headers), under one consolidated index, and it goes: prune's repacking, forced for these packs."""
    indexed: dict[bytes, list[PackEntry]] = {}
    objects = repo.read_index_objects()
    for packs in objects.values():
        indexed.update(packs)
    stored = repo.list_packs()
    plan = GcPlan(pack_sizes=stored, index_objects=len(objects), index_ids=set(objects))
    for pack_id, entries in indexed.items():
        if pack_id not in stored:
            continue
        if pack_id in headless:
            plan.repack[pack_id] = [e for e in entries if e.chunk_id not in bad_chunks.get(pack_id, ())]
        else:
            plan.keep_packs[pack_id] = entries
    execute_gc(repo, plan, repacked_first=True)


def _chunks_that_do_not_verify(
    repo: Repository,
    objects: dict[bytes, dict[bytes, list[PackEntry]]],
    stored: dict[bytes, int],
    skip: set[bytes],
    unread: list[bytes],
    failing: list[bytes],
    headless: set[bytes],
    kept: set[bytes],
) -> dict[bytes, set[bytes]]:
    """Pack ID -> the chunks in it that do not decode and verify, reading each indexed pack once,
    whole (a pack is at most 1 GiB; 16 MiB by default). Packs that cannot be read go to ``unread``,
    and also to ``failing`` where the storage answered for them with a fault of the object; those
    whose own header is damaged go to ``headless`` (to be rewritten), or to ``kept`` when bytes of
    theirs are in no index entry: a chunk that only the damaged header and a damaged index object
    described may be there, and rewriting the pack would delete it. A pack bigger than any pack can be (grown,
    or replaced) is not read whole: each indexed chunk is read on its own, and the pack is rewritten (its chunks
    that verify copied into a new pack): what lies there besides them is not a pack's."""
    packs: dict[bytes, list[PackEntry]] = {}
    for index in objects.values():
        for pack_id, entries in index.items():
            packs.setdefault(pack_id, entries)
    failed: list[tuple[bytes, PackEntry]] = []
    for pack_id in sorted(packs.keys() - skip):
        if stored.get(pack_id, 0) > repo.max_pack_size:
            try:
                failed.extend(_chunks_read_one_by_one(repo, pack_id, packs[pack_id]))
            except CkptVaultError as exc:  # as for a pack read whole: named, nothing dropped, the others go on
                _stop_if_down(repo, exc)
                unread.append(pack_id)
                if object_fault(exc):
                    failing.append(pack_id)
                continue
            headless.add(pack_id)
            continue
        try:
            data = repo.read_pack(pack_id, stored.get(pack_id))
        except CkptVaultError as exc:
            _stop_if_down(repo, exc)
            unread.append(pack_id)  # a read error may pass: nothing is dropped from it unless asked
            if object_fault(exc):
                failing.append(pack_id)
            continue
        try:
            read_pack_header(repo.codec, pack_id, data)
        except IntegrityError:
            if not repo.header_reads_back(pack_id, len(data)):  # damaged as stored, not on its way here
                (kept if _unaccounted_bytes(repo, pack_id, data, packs[pack_id]) else headless).add(pack_id)
        except UnsupportedFormatError:
            pass  # written by a newer ckptvault: not damage
        for e in packs[pack_id]:
            try:
                repo.decode_chunk(e.chunk_id, data[e.offset : e.offset + e.stored_len], e.raw_len, e.base_id)
            except UnsupportedFormatError:
                continue  # written by a newer ckptvault: not damage
            except IntegrityError:
                if not repo.reads_back(pack_id, e):  # never dropped for a read damaged on its way (gz45 #1)
                    failed.append((pack_id, e))
    # A delta fails with its damaged base: that failure is the base's, and once a backup stores the
    # base again the delta reads again (a delta damaged itself too is found by the next --read-data).
    bad_keyframes = {e.chunk_id for _, e in failed if e.base_id is None}
    bad: dict[bytes, set[bytes]] = {}
    for pack_id, e in failed:
        if e.base_id is None or e.base_id not in bad_keyframes:
            bad.setdefault(pack_id, set()).add(e.chunk_id)
    return bad


def _stop_if_down(repo: Repository, exc: CkptVaultError) -> None:
    """A storage that does not answer at all (frozen, unreachable) stops the repair before it changes anything:
    going on, every other pack waited out its deadline in turn (~1 minute a pack by default)."""
    if isinstance(exc, StorageError) and repo.storage_down(exc):
        raise exc.said_as(
            f"{spelled('repair-index', 'repair_index()')} stopped before it changed anything, the storage does not "
            f"answer: {exc}; run it again once the storage answers"
        ) from exc


def _chunks_read_one_by_one(
    repo: Repository, pack_id: bytes, entries: list[PackEntry]
) -> list[tuple[bytes, PackEntry]]:
    """The entries of ``pack_id`` whose blobs, each read on its own, do not decode and verify. A read the
    storage fails raises (a StorageError): the pack could not be read, and none of its chunks is judged (one
    error aborted the whole repair before, with the other packs' findings unwritten)."""
    failed = []
    for e in entries:
        blob = repo.read_pack_blob(pack_id, e)
        try:
            repo.decode_chunk(e.chunk_id, blob, e.raw_len, e.base_id)
        except UnsupportedFormatError:
            continue  # written by a newer ckptvault: not damage
        except IntegrityError:
            if not repo.reads_back(pack_id, e):
                failed.append((pack_id, e))
    return failed


def _unaccounted_bytes(repo: Repository, pack_id: bytes, pack: bytes, entries: list[PackEntry]) -> bool:
    """Whether the data region of ``pack`` has bytes that no entry covers. Where the region ends: the
    trailer says (the header's start); when the trailer is damaged, the header is what follows the last
    entry, if it decodes there; else the whole pack counts (what lies there is not known)."""
    covered = 0
    for start, end in sorted((e.offset, e.offset + e.stored_len) for e in entries):
        if start > covered:
            return True
        covered = max(covered, end)
    try:
        data_end, _ = header_range(pack[len(pack) - TRAILER.size :], len(pack))
    except IntegrityError:
        try:
            repo.codec.decode(Kind.PACK_HEADER, pack_id, pack[covered : len(pack) - TRAILER.size])
        except CkptVaultError:
            return True
        return False
    return covered < data_end
