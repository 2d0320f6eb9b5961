"""Changing a snapshot's tags after the fact (``ckptvault tag``), e.g. marking the best
checkpoint ``keep=best`` so that ``prune --keep-tag keep`` never removes it.

Snapshot objects are immutable (every host caches them by name), so new tags make a new
snapshot object, with the same time, paths, description and summary, and a copy of the tree
(trees belong to one snapshot each: ``forget`` deletes a snapshot's tree with it). The new pair
is written before the old pair is deleted: a process killed in between leaves both snapshots,
each whole, never a snapshot without its tree (SIGTERM and Ctrl-C wait for the old pair to go).
The new snapshot's ID is derived from the old one's and the new tags (``retagged_id``), so that what
a SIGKILL left is known for what it is: the same ``tag`` run again finds its copy written and only
deletes the old pair, and ``prune`` removes the old one of such a pair before it counts snapshots
(two copies of one save took a place of ``--keep-latest``: audit cr45).
Like ``forget``, it takes a shared lock (so it can run beside backups): when the old snapshot is
gone by the time the new one is written (another ``tag`` or a ``forget``), the new pair is taken
back and the call fails; two tags of one snapshot racing through that last check both stay
(``forget`` one).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import replace

from ..errors import IntegrityError, ObjectExistsError, ObjectNotFoundError, SnapshotNotFoundError
from ..interruptions import uninterrupted
from ..repository import Repository
from ..snapshot.manifest import decode_snapshot, encode_snapshot
from ..snapshot.model import Snapshot, format_tags
from .catalog import tree_error


def changed_tags(tags: dict[str, str], add: dict[str, str], remove: list[str]) -> dict[str, str]:
    """``tags`` with ``remove``'s keys taken out and ``add`` put in (a key already there takes the
    new value); the order of the remaining keys is kept."""
    kept = {k: v for k, v in tags.items() if k not in remove}
    return {**kept, **add}


def retag(repo: Repository, snapshot: Snapshot, tags: dict[str, str], before_commit: Callable[[], None]) -> Snapshot:
    """``snapshot`` under a new ID carrying ``tags`` (the same snapshot when they are its tags)."""
    if tags == snapshot.tags:
        return snapshot
    renewed_id = retagged_id(snapshot.id, tags)
    if repo.has_snapshot(bytes.fromhex(renewed_id)):  # a tag killed after writing its copy: finish it
        before_commit()
        return _finish(repo, snapshot, renewed_id)
    try:
        tree = repo.load_tree(bytes.fromhex(snapshot.tree_id))
    except ObjectNotFoundError as exc:
        if repo.has_snapshot(bytes.fromhex(snapshot.id)):
            raise tree_error(snapshot, repo.store.url, exc) from None  # its tree alone is missing: damage
        raise retag_gone(snapshot) from None
    except IntegrityError as exc:
        raise tree_error(snapshot, repo.store.url, exc) from None
    tree_id = repo.save_tree(tree)
    renewed = replace(snapshot, id=renewed_id, tree_id=tree_id.hex(), tags=dict(tags))
    before_commit()  # a lost lock: the tree copy is left for a prune, the old snapshot stays
    with uninterrupted():  # SIGTERM or Ctrl-C between the new snapshot and the old one's removal left both
        try:  # never over another object of that name (hosts cache snapshot objects by name)
            repo.save_snapshot(bytes.fromhex(renewed.id), encode_snapshot(renewed), if_absent=True)
        except ObjectExistsError:  # the same tag, run at once elsewhere, wrote it first
            repo.delete_tree(tree_id)
            return _finish(repo, snapshot, renewed_id)
        if not repo.has_snapshot(bytes.fromhex(snapshot.id)):
            # forgotten or retagged by another process meanwhile (both take a shared lock, like backups):
            # the copy would bring it back, or split it in two
            repo.delete_snapshot(bytes.fromhex(renewed.id), tree_id)
            raise retag_gone(snapshot)
        repo.delete_snapshot(bytes.fromhex(snapshot.id), bytes.fromhex(snapshot.tree_id))
    return renewed


def finish_left_behind(
    repo: Repository, snapshot: Snapshot, every: list[Snapshot], before_commit: Callable[[], None]
) -> Snapshot | None:
    """When ``snapshot`` is the retagged copy of a pair a killed ``tag`` left, the old one of the pair, removed
    now: the same ``tag`` run again may choose the copy rather than the old one (``latest`` between two
    twins of one save takes the higher ID), and would otherwise leave both (until a prune)."""
    by_id = {s.id: s for s in every}
    old_id = next((old for old, new in interrupted_retags(every).items() if new.id == snapshot.id), None)
    if old_id is None:
        return None
    before_commit()
    _finish(repo, by_id[old_id], snapshot.id)
    return by_id[old_id]


def _finish(repo: Repository, snapshot: Snapshot, renewed_id: str) -> Snapshot:
    """The retagged copy of ``snapshot`` found written already: the old pair goes."""
    renewed = decode_snapshot(repo.load_snapshot(bytes.fromhex(renewed_id)))
    with uninterrupted():
        repo.delete_snapshot(bytes.fromhex(snapshot.id), bytes.fromhex(snapshot.tree_id))
    return renewed


def finished_retag(snapshots: list[Snapshot], old_id: str, add: dict[str, str], remove: list[str]) -> Snapshot | None:
    """The copy that a ``tag`` of ``old_id`` (a whole ID: a prefix cannot be hashed) wrote before it removed
    the old snapshot, when that copy carries the tags this change gives already: the same ``tag`` run again
    after a SIGKILL between the old snapshot's removal and the command's end (its tree's, its lock's) is
    done, not a mistyped ID (exit 18 before). None when there is no such copy."""
    copy = retagged_copy(snapshots, old_id)
    return copy if copy is not None and changed_tags(copy.tags, add, remove) == copy.tags else None


def retagged_copy(snapshots: list[Snapshot], old_id: str) -> Snapshot | None:
    """The snapshot that a ``tag`` of the whole ID ``old_id`` made, among ``snapshots``, if any."""
    return next((snap for snap in snapshots if snap.id == retagged_id(old_id, snap.tags)), None)


def retagged_before(old_id: str, copy: Snapshot) -> SnapshotNotFoundError:
    """The error for a whole ID that a ``tag`` replaced by ``copy``: "no snapshot <64 hex digits>" sent the user
    to a listing where nothing says which row it became (a rerun of ``tag`` with another change, a script
    that keeps IDs)."""
    return SnapshotNotFoundError(
        f"snapshot {old_id[:8]} was retagged: it is {copy.short_id} now (tags: {format_tags(copy.tags, ', ')}), as "
        f"a change of tags gives a snapshot a new ID; give {copy.short_id}"
    )


def retagged_id(snapshot_id: str, tags: dict[str, str]) -> str:
    """The ID of snapshot ``snapshot_id`` retagged with ``tags`` (module docstring)."""
    named = json.dumps(tags, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogateescape")
    return hashlib.sha256(b"ckptvault retag\0" + bytes.fromhex(snapshot_id) + named).hexdigest()


def interrupted_retags(snapshots: list[Snapshot]) -> dict[str, Snapshot]:
    """Old snapshot ID -> its retagged copy, for each pair a killed ``tag`` left (both of one save: same
    time and host)."""
    by_save: dict[tuple[object, str], list[Snapshot]] = {}
    for snap in snapshots:
        by_save.setdefault((snap.time, snap.hostname), []).append(snap)
    return {
        old.id: new
        for twins in by_save.values()
        if len(twins) > 1
        for old in twins
        for new in twins
        if new is not old and new.id == retagged_id(old.id, new.tags)
    }


def retag_gone(snapshot: Snapshot) -> SnapshotNotFoundError:
    return SnapshotNotFoundError(
        f"snapshot {snapshot.short_id} was forgotten or retagged by another process meanwhile; nothing "
        "changed: list the snapshots and try again"
    )
