"""Garbage collection: plan which packs go, which are repacked, then execute in a crash-safe order.

Execution order (each step leaves a repository where every kept snapshot restores):
  1. live chunks of mostly-dead packs are copied into new packs, and those are indexed;
  2. one consolidated index of every surviving pack is written;
  3. every other index object is deleted (the consolidated one already lists what they did);
  4. dead and repacked packs are deleted, then trees no snapshot refers to.
A crash anywhere leaves at worst duplicate index entries or unreferenced packs and trees,
which the next prune removes. Callers hold the exclusive lock, so no backup is adding data; one that
holds none is a programming error (RuntimeError: the checks below would have no lock to verify).

That is checked, not assumed: a process suspended past the lock's staleness (or a host whose clock
makes the lock look stale) can have let a backup in, and such a backup may have deduplicated against a
pack this plan deletes. So before each deleting step (3, then 4, then the trees) the exclusive lock this
process holds on the repository is verified (``repo.locks.verify_held()``: still there, refreshed in
time; LockLostError otherwise), and before steps 3 and 4 the index objects and snapshots are listed
again: one that the plan did not read (and this Repository did not write) stops the prune with
VaultLockedError, before it deletes anything more. Stopping there is safe: the consolidated index only
duplicates entries of the objects still present, and packs go only after no index names them.

Live chunks: those of the kept snapshots' trees, plus the delta base of every live chunk (at any
depth), read from the index entries (format 2 names each delta's base), so a base outlives the
snapshot that stored it for as long as a kept snapshot needs a delta against it. Repacking copies
blobs as they are, base references included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from ..errors import (
    IntegrityError,
    UnsupportedFormatError,
    VaultLockedError,
    check_command,
    check_hint,
    repair_index_command,
)
from ..repository import Repository
from ..repository.pack import PackEntry, lies_whole_in

INDEX_ENTRIES_PER_OBJECT = 200_000
MAX_INDEX_OBJECTS = 8  # more than this and GC consolidates them even when nothing is deleted
DELETERS = 8  # objects deleted at once
DEFAULT_REPACK_THRESHOLD = 0.10  # repack a pack once more than 10 % of its bytes are dead
T = TypeVar("T")


@dataclass
class GcPlan:
    delete_packs: dict[bytes, int] = field(default_factory=dict)  # pack ID -> size: no live chunk
    repack: dict[bytes, list[PackEntry]] = field(default_factory=dict)  # pack ID -> live entries to copy
    keep_packs: dict[bytes, list[PackEntry]] = field(default_factory=dict)
    pack_sizes: dict[bytes, int] = field(default_factory=dict)
    index_objects: int = 0
    dead_trees: list[bytes] = field(default_factory=list)
    index_ids: set[bytes] = field(default_factory=set)  # the index objects the plan read
    # the snapshots the plan kept (prune's collect sets it); another one appearing stops the deletions
    snapshot_ids: set[bytes] | None = None

    @property
    def reclaim_bytes(self) -> int:
        """Bytes freed: deleted packs, plus what repacking drops from the repacked ones."""
        repacked = sum(self.pack_sizes[p] - sum(e.stored_len for e in live) for p, live in self.repack.items())
        return sum(self.delete_packs.values()) + repacked

    @property
    def repack_bytes(self) -> int:
        return sum(e.stored_len for live in self.repack.values() for e in live)

    @property
    def has_work(self) -> bool:
        return bool(self.delete_packs or self.repack or self.dead_trees) or self.index_objects > MAX_INDEX_OBJECTS


def plan_gc(repo: Repository, live: set[bytes], live_tree_ids: set[bytes], repack_threshold: float) -> GcPlan:
    """``live``: the chunk IDs the kept snapshots' files name. ``repack_threshold``: a pack whose dead share
    of bytes exceeds it is repacked."""
    indexed: dict[bytes, list[PackEntry]] = {}
    index_objects = repo.read_index_objects()
    for packs in index_objects.values():
        indexed.update(packs)
    stored = repo.list_packs()
    unplaced = _UnplacedChunks(repo, indexed, stored)
    live = _with_bases(live, indexed, unplaced)
    known = {e.chunk_id for entries in indexed.values() for e in entries}
    plan = GcPlan(pack_sizes=stored, index_objects=len(index_objects), index_ids=set(index_objects))

    # A chunk stored twice counts as live in one pack only: the one that keeps the most live bytes, and of
    # those the one with the fewest dead bytes: a prune killed after writing a repacked pack, before deleting
    # the old one, left two packs with the same live chunks, and the old one homing them was repacked again
    def live_then_dead_bytes(pack_id: bytes) -> tuple[int, int]:
        live_bytes = sum(e.stored_len for e in indexed[pack_id] if e.chunk_id in live)
        return live_bytes, live_bytes - sum(e.stored_len for e in indexed[pack_id])

    homed: set[bytes] = set()
    for pack_id in sorted((p for p in indexed if p in stored), key=live_then_dead_bytes, reverse=True):
        entries = indexed[pack_id]
        # A pack cut short (a truncated upload, a damaged disk) homes only the chunks that lie whole in
        # it, and a delta whose base is in no index cannot be read: a pack holding such entries is
        # repacked whatever its dead share, so its readable chunks are salvaged and it goes.
        usable = [
            e
            for e in entries
            if lies_whole_in(e.offset, e.stored_len, stored[pack_id]) and (e.base_id is None or e.base_id in known)
        ]
        cut = len(usable) < len(entries)
        mine = [e for e in usable if e.chunk_id in live and e.chunk_id not in homed]
        homed.update(e.chunk_id for e in mine)
        # shares of the chunks' bytes, not of the file: its header and trailer are never "dead", and
        # counting them so made --repack-threshold 0 rewrite fully live packs at every prune
        live_share = sum(e.stored_len for e in mine) / max(sum(e.stored_len for e in entries), 1)
        if not mine:
            plan.delete_packs[pack_id] = stored[pack_id]
        elif cut or 1 - live_share > repack_threshold:
            plan.repack[pack_id] = mine
        else:
            plan.keep_packs[pack_id] = entries
    for pack_id, size in stored.items():
        if pack_id not in indexed:  # left by a killed backup: nothing can refer to it
            plan.delete_packs[pack_id] = size
    _drop_deltas_losing_their_base(plan, homed)
    missing = live - homed
    if missing:
        raise unplaced.error(missing)
    plan.dead_trees = [t for t in repo.list_tree_ids() if t not in live_tree_ids]
    return plan


def _drop_deltas_losing_their_base(plan: GcPlan, homed: set[bytes]) -> None:
    """A kept pack keeps its dead chunks indexed (a later backup may reuse them), but not a dead delta
    whose base this collection deletes: that entry could never be read again, and check would call
    it damage at every run after."""
    surviving = homed | {e.chunk_id for entries in plan.keep_packs.values() for e in entries}
    while True:
        dropped = False
        for pack_id, entries in plan.keep_packs.items():
            readable = [e for e in entries if e.base_id is None or e.base_id in surviving]
            if len(readable) < len(entries):
                plan.keep_packs[pack_id] = readable
                dropped = True
        if not dropped:
            return
        surviving = homed | {e.chunk_id for entries in plan.keep_packs.values() for e in entries}


def _with_bases(live: set[bytes], indexed: dict[bytes, list[PackEntry]], unplaced: _UnplacedChunks) -> set[bytes]:
    """``live`` plus every delta base a live chunk needs, at any depth. A chunk stored twice may have
    been coded differently in each copy: the bases of every readable copy count, whichever copy is
    kept. A live chunk whose every copy is a delta against a chunk in no index cannot be read."""
    copies: dict[bytes, list[bytes | None]] = {}
    for entries in indexed.values():
        for e in entries:
            copies.setdefault(e.chunk_id, []).append(e.base_id)
    out = set(live)
    todo = list(live)
    while todo:
        for base in copies.get(todo.pop(), ()):
            if base is not None and base in copies and base not in out:
                out.add(base)
                todo.append(base)
    broken = sorted(c for c in out if c in copies and all(b is not None and b not in copies for b in copies[c]))
    if broken:
        lost_base = next(b for b in copies[broken[0]] if b is not None)
        raise IntegrityError(
            f"chunk {broken[0].hex()[:12]} of a kept snapshot is stored as a delta against chunk "
            f"{lost_base.hex()[:12]}, which is in no index ({len(broken)} such chunk(s)); nothing was deleted; "
            + unplaced.way_out({lost_base})
        )
    return out


class _UnplacedChunks:
    """Why chunks that kept snapshots need have no readable home, and what to do, for prune's refusal.
    Only a pack in no index whose header names one of them makes repair-index the way out; chunks in a
    pack cut short, gone from the storage, or in a stray pack whose header is damaged too are lost: the
    files holding them are backed up again, or the snapshots that need them forgotten (``check`` names
    both). The stray packs' headers are read only here, on the way to the refusal."""

    def __init__(self, repo: Repository, indexed: dict[bytes, list[PackEntry]], stored: dict[bytes, int]) -> None:
        self._repo, self._indexed, self._stored = repo, indexed, stored
        self._headers: tuple[dict[bytes, list[PackEntry]], list[bytes]] | None = None

    def _stray_headers(self) -> tuple[dict[bytes, list[PackEntry]], list[bytes]]:
        if self._headers is None:
            self._headers = self._repo.headers_of_unindexed_packs(self._indexed, self._stored)
        return self._headers

    def way_out(self, chunks: set[bytes]) -> str:
        described, _ = self._stray_headers()
        holding = [p for p, entries in described.items() if any(e.chunk_id in chunks for e in entries)]
        if holding:
            them = "it" if len(chunks) == 1 else "them"
            return f"{len(holding)} pack(s) in no index hold {them}: run {repair_index_command()}, then prune again"
        return (
            f"run: {check_command()}, which names the files and snapshots that need them; back those files up "
            "again, or forget those snapshots, then prune again"
        )

    def error(self, missing: set[bytes]) -> IntegrityError:
        stored = self._stored
        holding = {p: [e for e in entries if e.chunk_id in missing] for p, entries in self._indexed.items()}
        cut = sorted(
            p
            for p, entries in holding.items()
            if p in stored and any(not lies_whole_in(e.offset, e.stored_len, stored[p]) for e in entries)
        )
        gone = sorted(p for p, entries in holding.items() if entries and p not in stored)
        _, headless = self._stray_headers()
        found = [
            f"{len(cut)} indexed pack(s) holding them are cut short (truncated; e.g. {cut[0].hex()[:12]}, "
            f"{stored[cut[0]]:,} bytes stored)"
            if cut
            else "",
            f"{len(gone)} indexed pack(s) holding them are missing from the storage (e.g. {gone[0].hex()[:12]})"
            if gone
            else "",
            f"{len(headless)} pack(s) in no index have a damaged header, which nothing can read (e.g. "
            f"{min(headless).hex()[:12]})"
            if headless
            else "",
        ]
        where = "; ".join(f for f in found if f) or "they are in no indexed pack"
        return IntegrityError(
            f"{len(missing)} chunk(s) of kept snapshots (e.g. {min(missing).hex()[:12]}) cannot be read: {where}; "
            f"nothing was deleted; {self.way_out(missing)}"
        )


def verify_exclusive_lock(repo: Repository) -> None:
    """The exclusive lock this process holds on ``repo`` is still there and was refreshed in time
    (LockLostError otherwise); RuntimeError when it holds none: garbage collection needs it."""
    if repo.locks.verify_held(exclusive=True) == 0:
        raise RuntimeError(
            f"garbage collection on {repo.store.url} needs the exclusive lock, and this process holds none "
            "on this Repository object: take it first, with repo.locks.acquire(exclusive=True) (Vault.prune does)"
        )


# The forgotten snapshots are deleted before the repack reads (prune's step 2, docs/format.md), so a chunk
# that fails it stops the prune after them: "stopped before deleting anything" said otherwise.
REPACK_STOPPED = (
    "prune stopped before deleting any pack or index object (the snapshots it forgets are removed already; a "
    "later prune reclaims their space)"
)


def execute_gc(repo: Repository, plan: GcPlan, *, repacked_first: bool = False) -> None:
    """``repacked_first``: delete the repacked packs before the old index objects (repair-index's rewrite of
    packs whose header is damaged: once no index named such a pack, nothing could name its chunks, and a
    repair killed there left a pack called unlocatable; killed now, the old objects name a pack that is gone
    whose chunks are all in the new packs, which the rerun drops from the index)."""
    if not plan.has_work:
        return
    verify_exclusive_lock(repo)  # before it writes anything: without the lock it must not start
    # 1. copy live chunks out of mostly-dead packs (verified on the way: never copy damage silently)
    uploaded_before = set(repo.uploaded_packs)
    for pack_id, live in plan.repack.items():
        size = plan.pack_sizes.get(pack_id)
        # one bigger than any pack can be (grown, or replaced) is not read whole: its chunks one by one
        pack = repo.read_pack(pack_id, size) if size is None or size <= repo.max_pack_size else None
        for entry in live:
            if pack is None:
                blob = repo.read_pack_blob(pack_id, entry)
            else:
                blob = pack[entry.offset : entry.offset + entry.stored_len]
            where = f"chunk {entry.chunk_id.hex()[:12]} in pack {pack_id.hex()[:12]}"
            try:
                repo.decode_chunk(entry.chunk_id, blob, entry.raw_len, entry.base_id)
            except UnsupportedFormatError as exc:  # not damage: the ckptvault that wrote it prunes this vault
                raise UnsupportedFormatError(f"{where}: {exc}; {REPACK_STOPPED}; upgrade ckptvault to prune") from exc
            except IntegrityError as exc:
                raise IntegrityError(f"{where} {exc}; {REPACK_STOPPED}{check_hint()}") from exc
            repo.add_chunk_blob(entry.chunk_id, blob, entry.raw_len, entry.base_id)
    repo.flush()
    new_packs = {p: e for p, e in repo.uploaded_packs.items() if p not in uploaded_before}
    # 2. one consolidated index of every surviving pack
    surviving = {**plan.keep_packs, **new_packs}
    old_index_ids = set(repo.list_index_ids())
    kept_index_ids = {repo.write_index(batch) for batch in index_batches(surviving)}
    # 3. drop every other index object, 4. then the packs and trees nothing refers to
    _check_no_other_writer(repo, plan, deleted="no index object or pack")
    if repacked_first:
        each(repo.delete_pack, plan.repack, lock_check=repo.locks.check_held_age)
    each(repo.delete_index, old_index_ids - kept_index_ids, lock_check=repo.locks.check_held_age)
    # the old index objects are gone: the packs planned away are in no index now (readers find them by
    # their headers; the new writer may need them), and prune refuses until they are indexed again
    _check_no_other_writer(
        repo,
        plan,
        deleted="no pack",
        then=f"the packs it meant to delete are in no index now: run {repair_index_command()}, then prune again",
    )
    doomed = [*plan.delete_packs, *([] if repacked_first else plan.repack)]
    each(repo.delete_pack, doomed, lock_check=repo.locks.check_held_age)
    verify_exclusive_lock(repo)
    each(repo.delete_tree, plan.dead_trees, lock_check=repo.locks.check_held_age)
    repo.load_index()


def each(delete: Callable[[T], None], items: Iterable[T], *, lock_check: Callable[[], object]) -> None:
    """Several deletes at a time (each is a round trip on remote storage: a prune of 1,000 snapshots
    took 139 s on a 20 ms link one by one). At the first error met in submission order, or at Ctrl-C, the
    deletes not yet started are cancelled (those running finish) and it is raised; the caller's phases
    stay ordered. ``lock_check`` runs before each delete (``repo.locks.check_held_age``: no storage call): a
    prune suspended past its lock's staleness mid-batch deleted the rest of the batch once resumed, packs a
    backup had adopted meanwhile among them (audit mw45 H1)."""

    def guarded(item: T) -> None:
        lock_check()
        delete(item)

    pool = ThreadPoolExecutor(DELETERS)
    try:
        for future in [pool.submit(guarded, item) for item in items]:
            future.result()
    finally:
        pool.shutdown(cancel_futures=True)


def _check_no_other_writer(repo: Repository, plan: GcPlan, *, deleted: str, then: str = "run prune again") -> None:
    """Before a deleting step: the exclusive lock is still ours, and nobody added index objects or
    snapshots since the plan was made (module docstring). Raises LockLostError or VaultLockedError.
    ``deleted``: what the message says was not deleted since (what this prune deleted so far is safe);
    ``then``: what to run."""
    verify_exclusive_lock(repo)
    # this Repository's own index objects: the repack step's and the consolidated ones
    appeared = set(repo.list_index_ids()) - plan.index_ids - repo.written_index_ids
    snapshots: set[bytes] = set()
    if plan.snapshot_ids is not None:
        snapshots = set(repo.list_snapshot_ids()) - plan.snapshot_ids
    if appeared or snapshots:
        what = " and ".join(
            f"{n} {noun}(s)" for n, noun in ((len(appeared), "index object"), (len(snapshots), "snapshot")) if n
        )
        raise VaultLockedError(
            f"prune stopped: another writer added data to {repo.store.url} while this prune ran ({what} "
            f"it did not plan with); {deleted} was deleted since; {then}"
        )


STALE_TEMP_AGE_S = 3600.0  # temp files of a writer this long dead: it cannot be an active upload


def index_batches(packs: dict[bytes, list[PackEntry]]) -> list[dict[bytes, list[PackEntry]]]:
    """``packs`` split into index objects of at most ``INDEX_ENTRIES_PER_OBJECT`` entries (a pack whole)."""
    batches: list[dict[bytes, list[PackEntry]]] = [{}]
    count = 0
    for pack_id, entries in packs.items():
        if count and count + len(entries) > INDEX_ENTRIES_PER_OBJECT:
            batches.append({})
            count = 0
        batches[-1][pack_id] = entries
        count += len(entries)
    return [b for b in batches if b] or [{}]
