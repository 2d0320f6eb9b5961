"""Prune and forget: remove snapshots, then reclaim the space nothing else refers to."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..errors import (
    CkptVaultError,
    IntegrityError,
    ObjectNotFoundError,
    SnapshotNotFoundError,
    StorageError,
    StorageFullError,
    check_command,
    forget_command,
    spelled,
)
from ..repository import Repository
from ..repository.format import LOCKS_PREFIX
from ..snapshot.manifest import decode_tree
from ..snapshot.model import Snapshot
from ..snapshot.retention import Decision, RetentionPlan, RetentionPolicy, plan_retention, retention_warnings
from ..snapshot.selection import higher_step_passed_over
from ..store.failures import object_fault, once_mended
from .catalog import refuse_gc_with_unreadable, select_snapshot, unreadable_named, unreadable_stand_in
from .gc import DEFAULT_REPACK_THRESHOLD, STALE_TEMP_AGE_S, GcPlan, each, execute_gc, plan_gc, verify_exclusive_lock
from .memory import read_few_at_a_time
from .retag import interrupted_retags


@dataclass(frozen=True)
class PruneResult:
    retention: RetentionPlan
    gc: GcPlan
    dry_run: bool
    stored_before: int
    stored_after: int  # on a dry run, stored_before less what the plan would free (an estimate)
    warnings: list[str] = field(default_factory=list)  # a rule that did nothing, a run left with no snapshot

    @property
    def forgotten(self) -> list[Snapshot]:
        return self.retention.forget

    @property
    def reclaim_bytes(self) -> int:
        """Freed (a dry run: would be): packs, and the objects of the snapshots and trees that go."""
        return max(0, self.stored_before - self.stored_after)


GONE_NAMED_ONE_BY_ONE = 3  # given snapshots no longer there, each said on its own line


def stored_bytes(repo: Repository) -> int:
    """The vault's objects; locks, the prune's own among them, are no part of what it stores."""
    return sum(o.size for o in repo.store.list("") if not o.key.startswith(LOCKS_PREFIX))


def run_prune(
    repo: Repository,
    snapshots: list[Snapshot],
    policy: RetentionPolicy,
    *,
    dry_run: bool,
    repack_threshold: float = DEFAULT_REPACK_THRESHOLD,
) -> PruneResult:
    """Plan retention and GC; unless ``dry_run``, delete the forgotten snapshots and collect garbage.
    The caller holds the exclusive lock (RuntimeError otherwise); it is verified before each deleting
    step (ops/gc.py)."""
    # the old of a pair a killed tag left is not counted among the newest (of the snapshots --tag selects)
    leftovers = {old: new for old, new in interrupted_retags(snapshots).items() if new.matches(policy.tags)}
    retention = plan_retention([s for s in snapshots if s.id not in leftovers], policy)
    retention = RetentionPlan(
        retention.decisions
        + [
            Decision(s, False, f"left by an interrupted tag beside its retagged copy {leftovers[s.id].short_id}")
            for s in snapshots
            if s.id in leftovers
        ]
    )
    result = collect(repo, retention, dry_run=dry_run, repack_threshold=repack_threshold)
    return replace(result, warnings=retention_warnings(retention, policy, dry_run=dry_run))


def collect(repo: Repository, retention: RetentionPlan, *, dry_run: bool, repack_threshold: float) -> PruneResult:
    keep = retention.keep
    gc = plan_gc(repo, _live_chunks(repo, keep), {bytes.fromhex(s.tree_id) for s in keep}, repack_threshold)
    gc.snapshot_ids = {bytes.fromhex(s.id) for s in keep}  # a snapshot committed meanwhile stops the GC
    before = stored_bytes(repo)
    if dry_run:  # the snapshot and tree objects that go too: most of it where saves are small
        snapshot_bytes = sum(repo.listed_snapshot_size(bytes.fromhex(s.id)) or 0 for s in retention.forget)
        tree_bytes = sum(repo.listed_tree_size(tree_id) or 0 for tree_id in gc.dead_trees)
        after = before - gc.reclaim_bytes - snapshot_bytes - tree_bytes
        return PruneResult(retention, gc, True, before, max(0, after))
    verify_exclusive_lock(repo)  # a prune suspended past its lock's staleness deletes nothing
    forgotten = [(bytes.fromhex(snap.id), bytes.fromhex(snap.tree_id)) for snap in retention.forget]
    try:
        each(lambda ids: repo.delete_snapshot(*ids), forgotten, lock_check=repo.locks.check_held_age)
        deleted_trees = {tree_id for _, tree_id in forgotten}  # gone already: not deleted again by the GC
        gc.dead_trees = [tree_id for tree_id in gc.dead_trees if tree_id not in deleted_trees]
        execute_gc(repo, gc)
    except StorageFullError as exc:
        if not gc.repack:
            raise
        raise StorageFullError(  # repacking writes before it deletes: on a full disk it never gets there
            exc.op,
            exc.key,
            exc.url,
            exc.reason,
            hint=f"free space, or prune with {spelled('--repack-threshold 1', 'repack_threshold=1')} first: it "
            "deletes the packs no snapshot needs without copying any chunk (it writes only the new index); no pack "
            "was deleted",
        ) from exc
    except StorageError as exc:
        if object_fault(exc):  # a pack the storage fails for good: its error says the way on, a rerun fails again
            raise
        # the storage error alone (a server that stopped answering while packs went) said nothing of what the
        # vault was left with, and check then names the packs half way to deletion as "in no index"
        again = spelled("run the command again", "prune again")
        exc.args = (
            f"{exc.args[0]}; prune stopped part way: the snapshots it keeps are intact, and what it was removing "
            f"is partly there still; {again}{once_mended(exc)} to finish the job",
        )
        raise
    repo.store.remove_stale_temp_files(STALE_TEMP_AGE_S)
    return PruneResult(retention, gc, False, before, stored_bytes(repo))


def _live_chunks(repo: Repository, keep: list[Snapshot]) -> set[bytes]:
    """The chunk IDs the kept snapshots' files name, each tree folded in as it is read
    (``read_few_at_a_time``): holding every kept tree took ~35 MB per snapshot of 50,000 files, 1.5 GB
    for 31 of them."""
    live: set[bytes] = set()
    for _, chunk_ids in read_few_at_a_time(repo, lambda snap: _kept_chunks(repo, snap), keep):
        live |= chunk_ids
    return live


def _kept_chunks(repo: Repository, snap: Snapshot) -> set[bytes]:
    """The chunks of a snapshot prune keeps: they must stay. A tree that is missing or damaged stops
    the prune (what it needs is unknown), naming the snapshot and the way out."""
    try:
        return {c for e in decode_tree(repo.load_tree(bytes.fromhex(snap.tree_id))) for c in e.chunks}
    except (IntegrityError, ObjectNotFoundError) as exc:
        state = "missing" if isinstance(exc, ObjectNotFoundError) else f"damaged ({exc})"
        raise IntegrityError(
            f"prune refused: the tree object {snap.tree_id[:12]} of snapshot {snap.short_id}, which it would keep, is "
            f"{state}; run: {check_command()}, then remove the snapshot with: {forget_command([snap.short_id])}"
        ) from None


FORGET_TAKES = "forget latest takes the newest by time, not it (forget an ID to choose)"


def run_forget(
    repo: Repository,
    every: list[Snapshot],
    unreadable_now: Mapping[str, CkptVaultError],
    snapshots: Sequence[str | Snapshot],
    *,
    prune: bool,
    dry_run: bool,
    warn: Callable[[str], None],
) -> PruneResult:
    """Remove ``snapshots`` (specs as ``Vault.forget`` takes them) of ``every`` (the vault's readable
    snapshots, oldest first; ``unreadable_now``: the objects that cannot be decoded, by full ID), and
    with ``prune`` reclaim their space. The caller holds the lock (exclusive with ``prune``)."""
    chosen: set[str] = set()
    unreadable: set[str] = set()
    # Given, but in the vault no longer: a rerun of a forget that was stopped half way goes on
    # with the rest (and its prune) instead of failing on what the first run removed.
    gone: list[tuple[str, SnapshotNotFoundError]] = []  # (as given, why)
    for spec in snapshots:
        if isinstance(spec, Snapshot):  # by its full ID: one forgotten or retagged since is not there
            if spec.id not in {s.id for s in every}:
                gone.append(
                    (
                        spec.short_id,
                        SnapshotNotFoundError(
                            f"snapshot {spec.short_id} is no longer in {repo.store.url}: another process forgot it "
                            "meanwhile, or its tags changed (a retag gives a snapshot a new ID); list them with: "
                            f"{spelled('ckptvault snapshots', 'Vault.snapshots()')}"
                        ),
                    )
                )
            else:
                chosen.add(spec.id)
        elif (bad := unreadable_named(spec, every, unreadable_now)) is not None:
            unreadable.add(bad)
        else:
            try:
                chosen.add(select_snapshot(every, spec, None, unreadable_now).id)
                if spec == "latest" and (note := higher_step_passed_over(every, FORGET_TAKES)) is not None:
                    warn(note)
            except SnapshotNotFoundError as exc:
                if spec == "latest" or any(s.id.startswith(spec.strip().lower()) for s in every):
                    raise  # ambiguous, or no snapshot at all
                gone.append((spec, exc))
    if gone and not (chosen or unreadable or prune):
        raise gone[0][1]  # nothing else to do: a mistyped ID fails as before
    if len(gone) > GONE_NAMED_ONE_BY_ONE:  # the rerun of a forget of hundreds: one line, not hundreds (cp47 #6)
        named = ", ".join(spec for spec, _ in gone[:GONE_NAMED_ONE_BY_ONE])
        warn(
            f"{len(gone)} of the given snapshots are not in {repo.store.url} ({named} and "
            f"{len(gone) - GONE_NAMED_ONE_BY_ONE} more: forgotten already, by an interrupted run or another "
            "process?); skipped"
        )
    else:
        for _, missing in gone:
            warn(f"{missing} (forgotten already, by an interrupted run or another process?); skipped")
    if prune:
        refuse_gc_with_unreadable(unreadable_now, frozenset(unreadable))
    plan = RetentionPlan(
        [Decision(s, s.id not in chosen, "given to forget" if s.id in chosen else "not given") for s in every]
    )
    if not dry_run:
        for snapshot_id in sorted(unreadable):
            repo.delete_snapshot(bytes.fromhex(snapshot_id), None)
    if prune:
        with repo.aborting_writes_on_error():
            result = collect(repo, plan, dry_run=dry_run, repack_threshold=DEFAULT_REPACK_THRESHOLD)
    else:
        if not dry_run:
            for snap in plan.forget:
                repo.delete_snapshot(bytes.fromhex(snap.id), bytes.fromhex(snap.tree_id))
        size = stored_bytes(repo)
        result = PruneResult(plan, GcPlan(), dry_run, size, size)
    if not unreadable:
        return result
    removed = [
        Decision(unreadable_stand_in(i), False, "unreadable snapshot object, given to forget")
        for i in sorted(unreadable)
    ]
    return replace(result, retention=RetentionPlan([*plan.decisions, *removed]))
