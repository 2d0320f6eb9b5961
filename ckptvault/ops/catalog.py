"""Which snapshots a vault holds, and which one a spec (an ID prefix, ``"latest"``) names.

A snapshot object that cannot be decoded (damaged, or written by a newer ckptvault) is left out of
the listing with a warning, once per catalog, and kept as ``unreadable`` with its error: its tags and
step are unknown, so ``"latest"`` refuses while one exists (it may hold the newest save), and so does
garbage collection (it would delete the data the object refers to).

Snapshot objects are immutable (a new ID for new tags): each is read once per catalog, not at every
backup of a training job's long-lived Vault (its 1,000th read 1,000 objects). By ID and listed size,
as the metadata cache keeps them (docs/backends.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from typing import TypeVar

from ..errors import (
    CkptVaultError,
    IntegrityError,
    ObjectNotFoundError,
    SnapshotNotFoundError,
    UnsupportedFormatError,
    check_command,
    forget_command,
)
from ..repository import Repository
from ..snapshot import selection
from ..snapshot.manifest import decode_snapshot, decode_tree
from ..snapshot.model import FileEntry, Snapshot, SnapshotSummary

T = TypeVar("T")
TreeLoader = Callable[[Snapshot], list[FileEntry]]  # a snapshot -> its tree (Vault.files)


class SnapshotCatalog:
    def __init__(self, repo: Repository, warn: Callable[[str], None]) -> None:
        self._repo = repo
        self._warn = warn
        # the latest listing's snapshot objects that cannot be decoded: full ID -> the error, which names it
        self.unreadable: dict[str, CkptVaultError] = {}
        self._warned: set[str] = set()  # each unreadable snapshot, and each passed-over step, is warned about once
        self.retagged: dict[str, str] = {}  # snapshot ID -> the ID a retag through this catalog's Vault gave it
        self._read: dict[tuple[bytes, int | None], Snapshot] = {}

    def listing(self, *, copies: bool = True) -> tuple[list[Snapshot], dict[str, CkptVaultError]]:
        """Every readable snapshot, and the unreadable ones by full ID with their errors (also kept as
        ``unreadable``, for the caller of the API; code uses what is returned, which another thread's
        listing cannot replace meanwhile). ``copies=False``: the kept objects themselves, for code that
        only reads them (a backup looking for its parent: copying 3,000 took 32 ms of each backup's 110)."""

        def load(snapshot_id: bytes) -> Snapshot | CkptVaultError | None:
            try:
                return self.load(snapshot_id)
            except ObjectNotFoundError:
                return None  # forgotten by another process since the listing
            except (IntegrityError, UnsupportedFormatError) as exc:
                return exc

        ids = self._repo.list_snapshot_ids()
        listed = [(i, self._repo.listed_snapshot_size(i)) for i in ids]
        known = self._read
        unread = [i for i, size in listed if (i, size) not in known]
        loaded = list(zip(unread, self._repo.read_each(load, unread), strict=True))
        fresh = {i: s for i, s in loaded if isinstance(s, Snapshot)}
        self._read = {k: s for k in listed if (s := known.get(k) or fresh.get(k[0])) is not None}
        snaps = [handed_out(s) for s in self._read.values()] if copies else list(self._read.values())
        unreadable = {i.hex(): e for i, e in loaded if isinstance(e, CkptVaultError)}
        self.unreadable = unreadable
        for snapshot_id, error in sorted(unreadable.items()):
            if snapshot_id not in self._warned:
                self._warned.add(snapshot_id)
                self._warn(f"{error}; left out of the snapshots ({unreadable_hint(snapshot_id)})")
        return snaps, unreadable

    def load(self, snapshot_id: bytes) -> Snapshot:
        raw = self._repo.load_snapshot(snapshot_id)  # its errors name the object
        return decode_naming(f"snapshot object {snapshot_id.hex()[:12]}", decode_snapshot, raw)

    def find(self, spec: str, tags: dict[str, str] | None, hosts: Sequence[str] | None = None) -> Snapshot:
        """A snapshot by unique ID prefix, or ``"latest"`` (newest step, else time) among those with ``tags``
        and of one of ``hosts``. An ID naming a snapshot object that cannot be decoded raises that object's error."""
        if spec != "latest" and (alone := self._read_alone(spec)) is not None:
            return selection.select([alone], spec, tags, hosts)
        snaps, unreadable = self.listing()
        named = unreadable_named(spec, snaps, unreadable)
        if named is not None:
            error = unreadable[named]
            raise type(error)(f"{error}; {unreadable_hint(named)}")
        chosen = select_snapshot(sorted(snaps, key=lambda s: s.time), spec, tags, unreadable, hosts)
        if spec == "latest":
            note = selection.higher_step_passed_over(selection.matching(snaps, tags, hosts))
            if note is not None and note not in self._warned:
                self._warned.add(note)
                self._warn(note)
        return chosen

    def tree(self, snap: Snapshot, url: str) -> list[FileEntry]:
        """The snapshot's tree (of the vault at ``url``); an error that names the snapshot when it cannot
        be read, or when another process removed the snapshot since it was chosen."""
        try:
            raw = self._repo.load_tree(bytes.fromhex(snap.tree_id))
        except (ObjectNotFoundError, IntegrityError) as exc:
            if isinstance(exc, ObjectNotFoundError) and snap.id not in {s.id for s in self.listing()[0]}:
                raise removed_meanwhile(snap, url, self.retagged.get(snap.id)) from None
            raise tree_error(snap, url, exc) from None
        return decode_naming(f"tree object {snap.tree_id[:12]} (of snapshot {snap.short_id})", decode_tree, raw)

    def _read_alone(self, spec: str) -> Snapshot | None:
        """The snapshot that an ID prefix names, read alone when the listing of IDs (object names) has
        exactly one match: a fresh machine's ``restore <id>`` read every snapshot object of the vault.
        None leaves it to the whole listing: no match or several, not an ID, or an object that cannot
        be read (the listing says why, as it always did)."""
        prefix = spec.lower()
        if not selection.is_id_prefix(prefix):
            return None
        matches = [i for i in self._repo.list_snapshot_ids() if i.hex().startswith(prefix)]
        if len(matches) != 1:
            return None
        known = self._read.get((matches[0], self._repo.listed_snapshot_size(matches[0])))
        if known is not None:
            return handed_out(known)
        try:
            return self.load(matches[0])
        except (ObjectNotFoundError, IntegrityError, UnsupportedFormatError):
            return None


def handed_out(snapshot: Snapshot) -> Snapshot:
    """A copy of a kept snapshot whose tags and lists are its own: the dataclass is frozen, but a caller that
    edited a listed snapshot's tags (to hide some before printing) changed what every later listing, ``latest``
    and ``prune --keep-tag`` saw, and a prune forgot a snapshot whose stored tags said to keep it."""
    return replace(snapshot, tags=dict(snapshot.tags), paths=list(snapshot.paths), excludes=list(snapshot.excludes))


def unreadable_named(spec: str, snaps: list[Snapshot], unreadable_ids: Iterable[str]) -> str | None:
    """The ID of the unreadable snapshot object that ``spec`` (an ID prefix) names, if any."""
    prefix = spec.lower()
    if spec == "latest" or not selection.is_id_prefix(prefix):
        return None  # selection.select reports what is wrong with it
    unreadable = [i for i in unreadable_ids if i.startswith(prefix)]
    if not unreadable:
        return None
    readable = sorted((s for s in snaps if s.id.startswith(prefix)), key=lambda s: s.time)
    if len(unreadable) + len(readable) > 1:
        raise selection.ambiguous_prefix(spec, readable, sorted(unreadable))
    return unreadable[0]


def select_snapshot(
    snaps: list[Snapshot],
    spec: str,
    tags: dict[str, str] | None,
    unreadable: Mapping[str, CkptVaultError],
    hosts: Sequence[str] | None = None,
) -> Snapshot:
    """``selection.select``, but 'latest' while snapshot objects cannot be read raises: their tags and
    steps are unknown, so any of them may be the save a resume needs, and the newest readable one would
    silently be an older step (a resume losing progress, a drill saying all is well, ``forget latest``
    removing the save before). The error of the first one, said so, naming the newest readable one."""
    if spec != "latest" or not unreadable:
        return selection.select(snaps, spec, tags, hosts)
    try:
        readable: Snapshot | None = selection.select(snaps, spec, tags, hosts)
    except SnapshotNotFoundError:
        readable = None
    first = min(unreadable)
    error = unreadable[first]
    what = (
        f"{error}, and it may"
        if len(unreadable) == 1
        else (
            f"{len(unreadable)} snapshot objects cannot be read ({', '.join(i[:12] for i in sorted(unreadable))}; "
            f"{error}), and they may"
        )
    )
    if readable is not None:
        step = f" (step {readable.tags['step']})" if "step" in readable.tags else ""
        instead = f"the newest that can be read is {readable.short_id}{step}: restore it by ID to take it, or"
    elif (tags or hosts) and snaps:  # with none readable, the tags are not why none was found
        instead = f"no snapshot that can be read has those {'tags' if not hosts else 'tags and hosts'};"
    else:
        instead = "no snapshot can be read;"
    raise type(error)(f"'latest' cannot be told: {what} hold the newest save; {instead} {unreadable_hint(first)}")


def unreadable_hint(snapshot_id: str) -> str:
    return f"run: {check_command()}; if it is damaged, remove it with: {forget_command([snapshot_id[:12]])}"


def tree_error(snap: Snapshot, url: str, error: IntegrityError | ObjectNotFoundError) -> IntegrityError:
    """The snapshot's tree object is damaged or missing, said so that a user can act on it (the
    error named only the tree, which nothing else shows a user)."""
    what = (
        f"tree object {snap.tree_id[:12]} of snapshot {snap.short_id} is missing from {url}"
        if isinstance(error, ObjectNotFoundError)
        else f"{error} (the tree of snapshot {snap.short_id})"
    )
    return IntegrityError(
        f"{what}; run: {check_command()}, then remove the snapshot with: {forget_command([snap.short_id])}"
    )


def removed_meanwhile(snap: Snapshot, url: str, retagged_as: str | None = None) -> SnapshotNotFoundError:
    if retagged_as is not None:  # not another process: the user's own tag() call (api49 #5)
        return retagged_here(snap, retagged_as)
    return SnapshotNotFoundError(
        f"snapshot {snap.short_id} is not in {url}: another process removed it meanwhile, "
        "or it is a Snapshot of another vault"
    )


def retagged_here(snap: Snapshot, new_id: str) -> SnapshotNotFoundError:
    return SnapshotNotFoundError(
        f"snapshot {snap.short_id} was retagged by this Vault's tag() as {new_id[:8]}: use the Snapshot tag() "
        "returned (a retag gives a snapshot a new ID)"
    )


def unreadable_stand_in(snapshot_id: str) -> Snapshot:
    """What ``forget`` reports for a snapshot object it removed without decoding it."""
    return Snapshot(
        id=snapshot_id,
        time=datetime.fromtimestamp(0, timezone.utc),  # unknown
        hostname="?",
        paths=[],
        tags={},
        description="(unreadable snapshot object)",
        parent=None,
        tree_id="",
        summary=SnapshotSummary(),
    )


def is_stand_in(snapshot: Snapshot) -> bool:
    """Whether ``snapshot`` is an ``unreadable_stand_in`` (no tree: every snapshot read has one)."""
    return not snapshot.tree_id


def refuse_gc_with_unreadable(
    unreadable: Mapping[str, CkptVaultError], forgotten: frozenset[str] = frozenset()
) -> None:
    """Garbage collection needs every snapshot's tree: a snapshot object that cannot be decoded
    (it may be repaired, or read by a newer ckptvault) would have its data deleted as unused.
    So prune refuses until such objects are forgotten (``forget ID``) or readable again."""
    left = sorted((i, e) for i, e in unreadable.items() if i not in forgotten)
    if not left:
        return
    snapshot_id, error = left[0]
    more = f" (and {len(left) - 1} more unreadable snapshot(s))" if len(left) > 1 else ""
    damaged = any(isinstance(e, IntegrityError) for _, e in left)
    raise (IntegrityError if damaged else UnsupportedFormatError)(
        f"prune refused: {error}{more}; pruning now could delete the data it refers to. "
        f"Run: {check_command()}, then remove it with: {forget_command([snapshot_id[:12]])} if it is damaged"
    )


def decode_naming(what: str, decode: Callable[[bytes], T], raw: bytes) -> T:
    """``decode(raw)``, with a failure's message naming the object (``what``) it came from."""
    try:
        return decode(raw)
    except IntegrityError as exc:
        raise type(exc)(f"{what} is damaged: {exc}") from exc
    except UnsupportedFormatError as exc:
        raise UnsupportedFormatError(f"{what} cannot be read: {exc}") from exc
