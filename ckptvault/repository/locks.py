"""Repository locks: shared for backup, restore and check; exclusive for prune.

The scheme is restic's. A lock is a small sealed object ``locks/<random id>`` naming its
host, process and time. Taking a lock writes it, then lists the others: a conflicting lock
that is not stale makes the newcomer remove its own and fail. A holder refreshes its lock
(a new object, then the old one deleted) every ``refresh_every``; a lock not refreshed for
``stale_after``, or held by a dead process in this process table (this host's boot and PID
namespace: ``process_table``), is stale and ignored; so is one this machine wrote before its last
restart (a boot ID it listed as its own, ``record_this_boot``, this hostname, last refreshed before this
boot began: a box that lost power mid-prune must not wait half an hour to restore). An exclusive locker (prune,
forget --prune) removes the stale locks it ignores; any locker removes those whose holder is known
dead (no clock judges them), so that a killed backup's lock does not outlive the reboot as one only
age can clear.

Losing a lock. A holder cannot tell from the outside whether another process judged its lock
stale (and an exclusive locker then deletes what it thinks nobody uses), so it keeps score itself:
every successful refresh is timed on a clock that does not jump (``CLOCK_BOOTTIME`` where the
system has it, which also counts while the machine sleeps; else ``time.monotonic``), and the
wall-clock age of the lock document is checked too (the larger wins). A lock is **lost** when

* it went unrefreshed for longer than ``lost_after`` (``stale_after`` less a safety margin of a
  quarter, 22.5 of 30 minutes: room for clock skew between hosts and for the commit that follows
  a check), e.g. the process was suspended (SIGSTOP, a paused VM) or a refresh call hung; or
* a refresh finds that the previous lock object is gone (another process removed it as stale).

A refresh writes the new object first and then checks that the old one still exists and that the
write finished within ``lost_after`` of the previous refresh, so the holder is covered without a
gap. A lost lock is never revived: the refresh thread stops, the newly written object is removed,
and the checks raise ``LockLostError`` from then on. There are two checks:

* ``verify()``, the full one (the lock object still exists, and the lock was refreshed in time): what
  backup calls before committing its snapshot, and garbage collection before each deletion step;
* ``check_age()``, the cheap one without any storage call (the lock is not marked lost, and was
  refreshed in time by the clocks above): what a writer does before and after each index object it
  writes (``Repository.write_index``), which removes the object again and stops when the lock turned
  out lost after the write. Index objects are written every pack batch, so a storage call there would
  stall the backup; whether the lock object still exists is checked by the refresh thread anyway.

A refresh that merely fails (a storage error) is remembered, not fatal: a later successful refresh
within ``lost_after`` clears it, and ``verify()`` retries the refresh once itself; when that fails too
it raises the storage's error (a StorageError, which a caller may retry: the lock is not lost), and
LockLostError only once the lock went unrefreshed too long. A previous lock object that cannot be
deleted after a refresh is logged and retried at the next refresh and at release. After a command that
failed because the storage stopped answering, a shared lock is not deleted (it would only wait out another
deadline): it is left, named in a warning, to go stale.

The locks this process holds are registered per repository, so that code deep inside a command
(garbage collection, writing index objects) can check them: ``repo.locks.held``,
``repo.locks.verify_held()`` and ``repo.locks.check_held_age()``. A released lock is never judged:
``release()`` marks it released first, and both checks (and its refresh thread) skip it from then on,
so that a lock another thread releases while this one checks them all cannot fail the check.

Clock skew. Staleness compares the judge's clock with the holder's lock time, so it is made robust
against the two skews that cheaply can be, using the storage's write time of each lock object
(``ObjectInfo.modified``; a lock object is never rewritten, so that is the holder's last refresh):

* the judge's clock running ahead: when taking a lock (and ``unlock``, with a probe object it removes
  again: ``judging_now``), the judge sees its own new object's storage time; if its own clock was ahead
  of the storage's, "now" is moved back by that much;
* the holder's clock running behind: a readable lock counts from the later of its document time and
  its storage time, as long as the two are at most ``stale_after`` apart. A larger gap is not skew
  any reasonable host has; it is a lock copied with a new modification time (a repository copied by
  a tool that does not keep times) or one written with an injected clock (the tests), and then the
  document's time is believed, as before.

Both only ever make a lock look younger, so a skewed clock can delay the removal of a truly stale
lock (by the skew), never remove a live one earlier than before. Where the storage reports no
modification time, the document's time is used alone.

A lock object that cannot be read (damaged, or of a lock version this ckptvault does not know)
has no time ckptvault can trust, so its age counts from when the storage wrote it (the object's
modification time; a holder writes a new object at every refresh, so that is its last refresh).
Until it is stale it conflicts like a live exclusive lock (a newer ckptvault's lock: with
UnsupportedFormatError, exit 17); once stale, it is ignored, and ``unlock`` and exclusive lockers
remove it like any stale lock. Where the store reports no modification time, or one further in the
future than ``stale_after`` (no clock is that far off; a ``touch`` is), it counts as stale at once: a
live holder writes a fresh, readable lock every ``refresh_every``, so such an object is not how a live
holder is known for long. An empty lock object is stale at once: a sealed lock is
never empty, but a PUT abandoned at its deadline (a hung server) can land as an empty object
(SeaweedFS), and its writer, whose write failed, never counted it as held.

Waiting for a lock (restic's ``--retry-lock``). By default a conflict fails at once. With
``retry_for`` seconds, a command that finds the vault locked (a prune running, a backup beside a
prune, the locks changing while listed) says so once, removes its own lock object and tries again
after 1 s, 2 s, 4 s ... (at most 30 s between tries) until it gets the lock or ``retry_for`` has
passed; then the last conflict is raised, saying how long it waited. Each later try first lists the
locks without writing one, so that the waiter's lock object does not turn other commands away while it
only waits. Not waited for: a lock of a newer ckptvault (exit 17: that ckptvault is needed), and one
this very process holds (a file read part way: it would wait for itself). The async shipper keeps its
own wait, which its close and SIGTERM can end (``acquire(retry=False)``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import logging
import os
import random
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ..blob import Kind
from ..durable import replace_with
from ..errors import (
    CkptVaultError,
    IntegrityError,
    LockLostError,
    ObjectNotFoundError,
    ShortReadError,
    StorageError,
    StorageFullError,
    UnsupportedFormatError,
    VaultLockedError,
    spelled,
    unlock_command,
)
from ..store.base import listed_time
from ..store.failures import Kind as FailureKind
from ..store.failures import classify
from ..units import format_duration
from .format import LOCKS_PREFIX, id_from_key, lock_key, new_object_id

if TYPE_CHECKING:
    from .repository import Repository

log = logging.getLogger("ckptvault")
# a lock object left behind, which the user may have to remove, or a wait for a lock: the CLI shows these
left_behind = logging.getLogger("ckptvault.locks")
STALE_AFTER = timedelta(minutes=30)
REFRESH_EVERY = timedelta(minutes=5)
SAFETY_MARGIN = 0.25  # share of stale_after a holder keeps in hand: its lock is lost after 3/4 of it
LOCK_VERSION = 1
LISTINGS = 10  # tries at a listing of the locks in which none vanished before it was read
RETRY_FIRST_S = 1.0  # with retry_for: the first wait after a conflict, doubled after each
RETRY_MAX_S = 30.0
# A conflicting lock this young may be a newcomer that meets this one's lock and backs off too (a restore and
# a prune started at one instant: each sees the other's new lock, and both were refused): without retry_for,
# one more try follows a random wait of up to NEWCOMER_WAIT_S
NEWCOMER_S = 10.0
NEWCOMER_WAIT_S = 1.0
RELEASE_WAIT_S = 5.0  # how long release() waits for a refresh in progress (it waits no storage budget out)

Clock = Callable[[], datetime]
_Taken = TypeVar("_Taken")


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def ticks() -> float:
    """Seconds on a clock that never jumps (and, on Linux, keeps counting while the machine sleeps)."""
    if _BOOTTIME is not None:
        return time.clock_gettime(_BOOTTIME)
    return time.monotonic()


@dataclass(frozen=True)
class LockInfo:
    lock_id: bytes
    hostname: str
    pid: int
    exclusive: bool
    # Last refresh. For an unreadable lock: when the storage wrote the object (None: unknown).
    time: datetime | None
    problem: str = ""  # why the lock object cannot be read; "" for a readable lock
    newer: bool = False  # it verifies, but a newer ckptvault wrote it (an unknown lock version)
    modified: datetime | None = None  # when the storage wrote the object, where the listing says
    pid_table: str | None = None  # which process table ``pid`` is in (``process_table()``); None: unknown

    @property
    def unreadable(self) -> bool:
        return bool(self.problem)

    def describe(self, refreshed: datetime | None = None) -> str:
        """``refreshed``: when it was last refreshed as staleness goes (``LockManager.lock_time``: the
        storage's time where the holder's clock is behind), else the time the holder wrote in it."""
        if self.problem:
            when = f"written {self.time:%Y-%m-%d %H:%M:%S} UTC" if self.time else "written at an unknown time"
            return f"unreadable lock {self.lock_id.hex()[:12]} ({self.problem}), {when}"
        kind = "exclusive" if self.exclusive else "shared"
        return (
            f"{kind} lock by {self.hostname} pid {self.pid}{self._where()} "
            f"since {refreshed or self.time:%Y-%m-%d %H:%M:%S} UTC"
        )

    def _where(self) -> str:
        """Where a holder of this host's name ran, when not in this process table: its PID means nothing here."""
        if self.hostname != socket.gethostname() or self.pid_table in (None, "", process_table()):
            return ""
        if (self.pid_table or "").partition("/")[0] == process_table().partition("/")[0]:
            return " (in another PID namespace of this host)"
        return " (in another boot: an earlier one of this machine, or another machine of this name)"


@functools.cache
def process_table() -> str:
    """Which process table this process's PID is in: this boot of this machine and this PID
    namespace. Containers that share a hostname (host networking: docker --network host, Kubernetes
    hostNetwork) have PID namespaces of their own, where another container's live holder looks dead.
    "" where there is no /proc (not Linux): the hostname alone names the process table there."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


BOOTS_KEPT = 64  # this machine's boot IDs remembered (boot-ids: one a line, the newest last)


def boot_history_path() -> Path:
    """Where this machine's boot IDs are listed (its local state, not any vault's)."""
    import platformdirs

    return Path(platformdirs.user_state_dir("ckptvault")) / "boot-ids"


@functools.cache
def record_this_boot() -> None:
    """Add this boot's ID to this machine's list, once a process, before it writes a lock: a lock naming an
    earlier boot on that list was written by this machine before it last restarted. Best effort."""
    boot = process_table().partition("/")[0]
    if not boot:
        return
    path = boot_history_path()
    with contextlib.suppress(OSError):
        known = path.read_text().split() if path.exists() else []
        if boot not in known:
            path.parent.mkdir(parents=True, exist_ok=True)
            listed = "\n".join([*known, boot][-BOOTS_KEPT:]) + "\n"
            replace_with(str(path), lambda tmp: Path(tmp).write_text(listed), ".")


def _earlier_boots() -> set[str]:
    """This machine's boots before this one, as far as its list says."""
    try:
        return set(boot_history_path().read_text().split()) - {process_table().partition("/")[0]}
    except OSError:
        return set()


def boot_time() -> datetime:
    """When this machine's current boot began (the earliest time there is where that is not known)."""
    if _BOOTTIME is None:
        return datetime.min.replace(tzinfo=timezone.utc)
    return utc_now() - timedelta(seconds=ticks())


def _before_this_boot(lock: LockInfo, refreshed: datetime | None) -> bool:
    """Whether ``lock`` was written by this machine before it last restarted, so its holder is gone: a boot
    this machine listed as its own (``record_this_boot``; boot IDs are random, so another machine's, a
    clone's or a sandbox kernel's, are never on the list), this hostname, and a last refresh ``refreshed``
    before this boot began."""
    boot = (lock.pid_table or "").partition("/")[0]
    return (
        not lock.unreadable
        and bool(boot)
        and refreshed is not None
        and lock.hostname == socket.gethostname()
        and refreshed < boot_time()
        and boot in _earlier_boots()
    )


def briefly(store: object) -> contextlib.AbstractContextManager[None]:
    """The store's housekeeping mode (RetryingStore.briefly: few, short tries), where it has one."""
    mode = getattr(store, "briefly", None)
    return mode() if mode is not None else contextlib.nullcontext()


def _in_this_process_table(lock: LockInfo) -> bool:
    """Whether ``lock``'s holder can be looked up from here (None: a lock that does not say)."""
    return not lock.unreadable and lock.hostname == socket.gethostname() and lock.pid_table == process_table()


def running_here(lock: LockInfo) -> bool:
    """Whether ``lock``'s holder is a process running now in this process table (this host)."""
    return _in_this_process_table(lock) and pid_alive(lock.pid)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# The locks this process holds, per repository.
_held_mutex = threading.Lock()
_HELD: weakref.WeakKeyDictionary[Repository, list[HeldLock]] = weakref.WeakKeyDictionary()
# Lock objects this process could not delete (the storage failed or stopped answering). Its PID is
# alive, so no one else may judge them stale before their age: it deletes them at its next lock.
_LEFT_BEHIND: weakref.WeakKeyDictionary[Repository, list[LockInfo]] = weakref.WeakKeyDictionary()


def _forget_held_in_child() -> None:
    """A forked child (a DataLoader worker) holds none of its parent's locks: their refresh threads stay in
    the parent. Counted as its own, a child's prune beside the parent's backup was refused as "locked by
    this process itself", naming the parent's PID and advice about its own files and threads."""
    global _held_mutex
    _held_mutex = threading.Lock()  # a parent thread may have held it at the fork
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_held_in_child)


def _leave_behind(repo: Repository, locks: Sequence[LockInfo]) -> None:
    with _held_mutex:
        _LEFT_BEHIND.setdefault(repo, []).extend(locks)


class LockManager:
    """Lock objects of one repository. ``repo`` provides the codec and the store."""

    def __init__(
        self,
        repo: Repository,
        *,
        clock: Clock = utc_now,
        stale_after: timedelta = STALE_AFTER,
        refresh_every: timedelta = REFRESH_EVERY,
        retry_for: float = 0.0,
    ) -> None:
        """``retry_for``: seconds to keep trying when the vault is locked (module docstring)."""
        self.repo = repo
        self.clock = clock
        self.stale_after = stale_after
        self.refresh_every = refresh_every
        self.retry_for = retry_for
        self._said_lockless = False  # the warning of acquire_to_read, once (an API reading file after file)

    @property
    def lost_after(self) -> timedelta:
        """A holder whose lock went unrefreshed this long counts it as lost (module docstring)."""
        return self.stale_after * (1 - SAFETY_MARGIN)

    def lock_time(self, lock: LockInfo) -> datetime | None:
        """When ``lock`` was last refreshed, as far as staleness goes (module docstring, "Clock skew")."""
        if lock.unreadable or lock.time is None or lock.modified is None:
            return lock.time
        if timedelta(0) < lock.modified - lock.time <= self.stale_after:  # the holder's clock is behind
            return lock.modified
        return lock.time

    def is_stale(self, lock: LockInfo, *, now: datetime | None = None) -> bool:
        """``now``: the judge's time (default ``clock()``), corrected for its own skew by ``acquire``."""
        when = self.lock_time(lock)
        if when is None:  # an unreadable lock of unknown age (module docstring)
            return True
        now = now or self.clock()
        if now - when > self.stale_after:
            return True
        if lock.unreadable and when - now > self.stale_after:  # "written" in the future: of unknown age too
            return True
        return self.holder_gone(lock)

    def holder_gone(self, lock: LockInfo) -> bool:
        """Whether ``lock``'s holder is known to be dead, whatever its age: a dead process of this process
        table, or one this machine ran before it last restarted."""
        return (_in_this_process_table(lock) and not pid_alive(lock.pid)) or _before_this_boot(
            lock, self.lock_time(lock)
        )

    def new_info(self, exclusive: bool) -> LockInfo:
        return LockInfo(
            new_object_id(), socket.gethostname(), os.getpid(), exclusive, self.clock(), pid_table=process_table()
        )

    def put(self, info: LockInfo) -> None:
        assert info.time is not None
        doc = {
            "version": LOCK_VERSION,
            "hostname": info.hostname,
            "pid": info.pid,
            "exclusive": info.exclusive,
            "time": info.time.isoformat(),
            "pid_table": info.pid_table,
        }
        self.repo.store.put(
            lock_key(info.lock_id), self.repo.codec.encode(Kind.LOCK, info.lock_id, json.dumps(doc).encode())
        )

    def write(self, exclusive: bool) -> LockInfo:
        self.repo.refuse_if_downgraded_before_writing()  # a lock names this host: never in the clear by mistake
        record_this_boot()
        info = self.new_info(exclusive)
        self.put(info)
        return info

    def remove(self, lock: LockInfo) -> None:
        with contextlib.suppress(ObjectNotFoundError):
            self.repo.store.delete(lock_key(lock.lock_id))

    def exists(self, lock: LockInfo) -> bool:
        return self.repo.store.exists(lock_key(lock.lock_id))

    def _list(self, own: LockInfo | None = None) -> tuple[list[LockInfo], set[bytes]]:
        """``list``, and the listed objects that were gone when read: released, or refreshed (a holder
        writes its new lock object, then deletes the old one). ``own``, the lock this process just
        wrote, is not read back (a round trip on remote storage): only its listing's time is taken."""
        locks = []
        vanished: set[bytes] = set()
        for obj in self.repo.store.list(LOCKS_PREFIX):
            lock_id = id_from_key(obj.key)
            if lock_id is None:
                continue
            if own is not None and lock_id == own.lock_id:
                locks.append(dataclasses.replace(own, modified=obj.modified))
                continue
            try:
                blob = self.repo.store.get(obj.key)
            except ObjectNotFoundError:
                vanished.add(lock_id)
                continue
            if not blob:  # what a PUT abandoned at its deadline left on some servers: never a held lock
                locks.append(LockInfo(lock_id, "?", 0, True, None, "empty: a write that never finished"))
                continue
            try:
                locks.append(dataclasses.replace(self._decode(lock_id, blob), modified=obj.modified))
            except _NewerLock as newer:
                when = obj.modified or newer.time
                locks.append(LockInfo(lock_id, "?", 0, True, when, str(newer), newer=True, modified=obj.modified))
            except (IntegrityError, UnsupportedFormatError, ValueError, KeyError, TypeError) as exc:
                # a live exclusive lock of unknown origin until it is stale by the object's age
                problem = str(exc) if isinstance(exc, CkptVaultError) else f"malformed lock document: {exc!r}"
                locks.append(LockInfo(lock_id, "?", 0, True, obj.modified, problem, modified=obj.modified))
        return locks, vanished

    def _list_settled(self, own: LockInfo | None = None) -> list[LockInfo]:
        """The locks, from a listing in which no object vanished before it was read that had not
        vanished from the one before. A lock object gone between the listing and its read may be a
        live holder's that was just refreshed, whose new object that listing missed: taking it as
        released let a prune run beside a live backup (and a backup beside a live prune). The new
        object is written before the old one goes, so the next listing has it. (One that keeps being
        listed while it cannot be read is a listing that lags the deletes: not waited for.)"""
        before: set[bytes] = set()
        for _ in range(LISTINGS):
            locks, vanished = self._list(own)
            if vanished <= before:
                return locks
            before = vanished
        raise VaultLockedError(
            f"the locks of vault {self.repo.store.url} kept changing while they were read ({LISTINGS} listings); "
            "other processes are starting and ending: run the command again"
        )

    def list(self) -> list[LockInfo]:
        """Every lock object; one that cannot be read is listed with its ``problem`` (never raises for it)."""
        return self._list()[0]

    def _decode(self, lock_id: bytes, blob: bytes) -> LockInfo:
        doc = json.loads(self.repo.codec.decode(Kind.LOCK, lock_id, blob))
        if not isinstance(doc, dict):
            raise TypeError("the lock document is not an object")
        version = doc.get("version")
        if version != LOCK_VERSION:
            if isinstance(version, int) and not isinstance(version, bool) and version > LOCK_VERSION:
                raise _NewerLock(version, doc.get("time"))
            raise ValueError(f"lock version {version!r} is not valid")
        time = datetime.fromisoformat(doc["time"])
        if time.tzinfo is None:
            raise ValueError(f"lock time {doc['time']!r} has no time zone")
        pid_table = doc.get("pid_table")  # locks written before 2026-12-01 do not say
        return LockInfo(
            lock_id,
            str(doc["hostname"]),
            int(doc["pid"]),
            bool(doc["exclusive"]),
            time,
            pid_table=pid_table if isinstance(pid_table, str) else None,
        )

    def _own_lock_ids(self) -> set[bytes]:
        return {held.info.lock_id for held in self.held}

    def _conflict(self, other: LockInfo, *, own_locks: set[bytes] | None = None) -> CkptVaultError:
        url = self.repo.store.url
        if own_locks and other.lock_id in own_locks:  # this very process: waiting for it could wait for itself
            return _HeldHere(
                f"vault {url} is locked by this process itself ({other.describe()}): a file still being read "
                "(close it, or close the Vault that reads it) or a backup on another thread; let it finish first"
            )
        minutes = round(self.stale_after.total_seconds() / 60)
        refreshed = self.lock_time(other)  # the storage's time where the holder's clock is behind
        until = f" (at {refreshed + self.stale_after:%Y-%m-%d %H:%M:%S} UTC)" if refreshed else ""
        remove_all = spelled("ckptvault unlock --remove-all", "Vault.unlock(remove_all=True)")
        wait = (
            f"wait for it to finish (with {spelled('--retry-lock 30m', 'Vault.open(retry_lock=1800)')} a command "
            "waits for it by itself)"
        )
        if not other.unreadable:
            if running_here(other):  # alive: unlock cannot apply to it, only staleness to a stopped one (Ctrl-Z)
                after = f"; if it is stopped, its lock goes stale {minutes} minutes after its last refresh{until}"
                advice = f", a process running on this host; {wait}{after}"
            else:  # a spot instance reclaimed mid-prune: its replacement must not wait half an hour to restore
                advice = (
                    f"; {wait}. If that process is gone, its lock goes stale {minutes} minutes after its last "
                    f"refresh{until} (at once if it ran on this host, outside any container of its own, or before "
                    f"this machine last restarted) and {unlock_command()} removes it then; if its machine is gone "
                    f"for good (a reclaimed instance), {remove_all} removes it now, when no ckptvault process on "
                    "any host uses this vault"
                )
            locked = VaultLockedError(f"vault {url} is locked: {other.describe(refreshed)}{advice}")
            locked.held_since = refreshed
            return locked
        then = (
            f"{unlock_command()} removes it once it is stale, {minutes} minutes after "
            f"it was written{until}, or {remove_all} removes it now when no ckptvault process on any host uses "
            "this vault"
        )
        if other.newer:
            return UnsupportedFormatError(
                f"vault {url} is locked by a newer ckptvault: {other.describe()}; use that ckptvault, or {then}"
            )
        return VaultLockedError(f"vault {url} is locked: {other.describe()}; {then}")

    def judging_now(self) -> datetime:
        """``clock()``, corrected as ``acquire`` corrects it (module docstring, "Clock skew"): a probe lock
        object is written, its listed time read, and it is removed. Without it, a host whose clock runs
        ahead would take live locks for stale ones (``unlock``). The uncorrected clock where nothing can be
        written (a read-only vault, where no lock can be removed either)."""
        probe = self.new_info(exclusive=False)
        try:
            self.put(probe)
        except CkptVaultError:
            return self.clock()
        try:
            return self._judging_now(probe, self._list(probe)[0])
        finally:
            with contextlib.suppress(CkptVaultError):
                self.remove(probe)

    def _judging_now(self, own: LockInfo, listed: Sequence[LockInfo]) -> datetime:
        """``clock()``, moved back by how far it ran ahead of the storage's clock when ``own`` was written."""
        now = self.clock()
        mine = next((lock for lock in listed if lock.lock_id == own.lock_id), None)
        if mine is None or mine.modified is None or own.time is None:
            return now
        ahead = own.time - mine.modified
        return now - ahead if ahead > timedelta(0) else now

    def _retrying(self, take: Callable[[bool], _Taken]) -> _Taken:
        """``take(probe)``, tried again while it finds the vault locked, for up to ``retry_for`` seconds.
        A try after the first probes first (``probe=True``: looks for a conflict without writing a lock
        object), so that a waiter's own lock object, written and removed at every try, does not make other
        commands fail meanwhile as if it held the vault."""
        deadline = None
        delay = RETRY_FIRST_S
        looked_again = False
        while True:
            try:
                return take(deadline is not None)
            except (LockLostError, _HeldHere):
                raise
            except VaultLockedError as exc:
                if self.retry_for <= 0:
                    if looked_again or not self._newcomer(exc):
                        raise
                    looked_again = True
                    time.sleep(random.uniform(0.1, NEWCOMER_WAIT_S))
                    continue
                now = time.monotonic()
                waiting = f"{spelled('--retry-lock', 'retry_lock')} {format_duration(self.retry_for)}"
                if deadline is None:
                    deadline = now + self.retry_for
                    what = str(exc).split("; ", 1)[0]  # "vault X is locked: <holder>", without the advice
                    left_behind.warning("%s; waiting for it (%s)", what, waiting)
                elif now >= deadline:
                    raise VaultLockedError(f"{exc}; gave up waiting ({waiting}): a longer one waits it out") from None
                time.sleep(min(delay, max(deadline - now, 0.0)))
                delay = min(delay * 2, RETRY_MAX_S)

    def _newcomer(self, exc: VaultLockedError) -> bool:
        """Whether the lock ``exc`` met was written moments ago (it may be backing off from this one's)."""
        since = exc.held_since
        return since is not None and abs((self.clock() - since).total_seconds()) < NEWCOMER_S

    def acquire(self, exclusive: bool, *, retry: bool = True) -> HeldLock:
        """Take a lock; with ``retry`` (and ``retry_for``) wait for a conflicting one to go. Code that
        waits for the vault in its own, cancellable way (the async shipper) passes ``retry=False``. Only writers
        take it (readers: ``acquire_to_read``): refused where a keyfile was given for a vault that is not encrypted."""
        self.repo.refuse_unused_keyfile()
        if not retry:
            return self._acquire(exclusive)
        return self._retrying(lambda probe: self._acquire(exclusive, probe=probe))

    def _refuse_conflicts(self, exclusive: bool) -> None:
        """Raise the conflict a lock taken now would meet, without writing one."""
        for other in self._list_settled():
            if (exclusive or other.exclusive) and not self.is_stale(other):
                raise self._conflict(other, own_locks=self._own_lock_ids())

    def _acquire(self, exclusive: bool, *, probe: bool = False) -> HeldLock:
        if probe:
            self._refuse_conflicts(exclusive)
        started = ticks()
        try:
            own = self.write(exclusive)
        except StorageFullError as exc:
            if not exclusive:
                raise
            # prune is how a full vault gets room back, and it cannot start without its lock
            raise StorageFullError(
                exc.op,
                exc.key,
                exc.url,
                exc.reason,
                hint="this command needs room for its lock (a few KB) before it can delete anything: free a little "
                "space on that disk outside the vault (never delete files inside it), then run it again",
            ) from None
        try:
            self._remove_left_behind()  # the storage answers again
            with _held_mutex:  # still there (a delete failed): this process knows they are dead
                dead = {lock.lock_id for lock in _LEFT_BEHIND.get(self.repo, ())}
            stale = []
            listed = self._list_settled(own)
            now = self._judging_now(own, listed)
            for other in listed:
                if other.lock_id == own.lock_id:
                    continue
                if other.lock_id in dead or self.is_stale(other, now=now):
                    stale.append(other)
                elif exclusive or other.exclusive:  # an unreadable lock counts as exclusive
                    raise self._conflict(other, own_locks=self._own_lock_ids())
            for lock in stale:
                if exclusive:  # an exclusive holder may delete data: make frozen holders notice
                    self.remove(lock)
                elif self.holder_gone(lock):  # a killed process's, not to outlive a restart (best effort)
                    with contextlib.suppress(CkptVaultError), briefly(self.repo.store):
                        self.remove(lock)
        except BaseException:
            try:
                self.remove(own)
            except CkptVaultError as error:  # the storage that stopped it (or Ctrl-C) is what to report
                _leave_behind(self.repo, [own])
                left_behind.warning("could not remove the lock after a failure: %s", error)
            raise
        return HeldLock(self, own, refreshed=started)

    def _remove_left_behind(self) -> None:
        with _held_mutex:
            left = _LEFT_BEHIND.pop(self.repo, [])
        for n, lock in enumerate(left):
            try:
                self.remove(lock)
            except BaseException as exc:  # kept for the next try (Ctrl-C too)
                _leave_behind(self.repo, left[n:])
                if isinstance(exc, CkptVaultError):
                    return
                raise

    def acquire_to_read(self) -> HeldLock | LocklessRead:
        """A shared lock for a command that only reads (restore, check, status, drill). Where the
        store refuses to write it (read-only credentials or mount: a node given read access to
        resume from), the command reads without one once no live exclusive lock (a prune) is
        listed, and a warning says so (``LocklessRead``)."""
        return self._retrying(self._acquire_to_read)

    def _acquire_to_read(self, probe: bool) -> HeldLock | LocklessRead:
        try:
            return self._acquire(exclusive=False, probe=probe)
        except StorageError as exc:
            if not _write_refused(exc):
                raise
            refused = exc.reason
        if (prune := self.live_exclusive()) is not None:
            raise self._conflict(prune)
        if not self._said_lockless:
            self._said_lockless = True
            left_behind.warning(
                "cannot write a lock to %s (%s): reading without one; a prune started meanwhile could make "
                "this command fail",
                self.repo.store.url,
                refused,
            )
        return LocklessRead(self)

    def live_exclusive(self) -> LockInfo | None:
        """A live exclusive lock (a running prune), or an unreadable one, if one is listed."""
        return next((lock for lock in self._list_settled() if lock.exclusive and not self.is_stale(lock)), None)

    @property
    def held(self) -> tuple[HeldLock, ...]:
        """The locks this process holds on this repository (acquired and not yet released)."""
        with _held_mutex:
            return tuple(_HELD.get(self.repo, ()))

    def verify_held(self, *, exclusive: bool = True) -> int:
        """``verify()`` every lock this process holds on this repository (only the exclusive ones when
        ``exclusive``); raises LockLostError for a lost one. Returns how many were verified."""
        locks = [lock for lock in self.held if lock.exclusive or not exclusive]
        for lock in locks:
            lock.verify()
        return len(locks)

    def check_held_age(self, *, exclusive: bool = True) -> int:
        """``check_age()`` (no storage call) every lock this process holds on this repository (only the
        exclusive ones when ``exclusive``); raises LockLostError for a lost one. Returns how many."""
        locks = [lock for lock in self.held if lock.exclusive or not exclusive]
        for lock in locks:
            lock.check_age()
        return len(locks)


class LocklessRead:
    """Reading without a lock (``LockManager.acquire_to_read``). A prune that starts meanwhile can
    make the read fail (a pack it needs is gone), never return wrong bytes, since everything read
    is verified; such a failure is reported as the prune's doing (VaultLockedError: run again when
    it is done), not as damage."""

    def __init__(self, manager: LockManager) -> None:
        self.manager = manager

    def prune_started(self) -> VaultLockedError | None:
        """The error to raise instead of reporting damage, when a prune holds the vault now."""
        prune = self.manager.live_exclusive()
        if prune is None:
            return None
        return VaultLockedError(
            f"{prune.describe()} began while this command read {self.manager.repo.store.url} without a lock "
            "(it may write none there): what looked missing may be what the prune removed; run the command "
            "again when the prune is done"
        )

    def __enter__(self) -> LocklessRead:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, (IntegrityError, StorageError)) and (instead := self.prune_started()) is not None:
            raise instead from exc


class _HeldHere(VaultLockedError):
    """A conflict with a lock this process holds itself: never waited for."""


class _NewerLock(Exception):
    """A lock object that verifies but has a lock version above ``LOCK_VERSION``."""

    def __init__(self, version: int, time: object) -> None:
        super().__init__(f"lock version {version} is newer than this ckptvault reads ({LOCK_VERSION})")
        self.time = listed_time(time)


class HeldLock:
    """A lock kept fresh by a background thread until released; lost for good once it may have
    looked stale to another process (module docstring)."""

    def __init__(self, manager: LockManager, info: LockInfo, *, refreshed: float | None = None) -> None:
        self.manager = manager
        self.info = info
        # ticks() taken before the current lock object's write began: its document time is no earlier
        self._refreshed = ticks() if refreshed is None else refreshed
        self._lost: str | None = None  # why, once lost (never cleared)
        self._released = False  # set by release(): a released lock is never judged
        self._refresh_error: BaseException | None = None  # the last refresh's failure, until one succeeds
        self._orphans: list[LockInfo] = []  # our lock objects a delete failed for: retried
        self._writing: LockInfo | None = None  # the lock object a refresh is writing
        self._stop = threading.Event()
        self._mutex = threading.Lock()
        self._pid = os.getpid()  # a forked child's copy is not its to release (``release``)
        with _held_mutex:
            _HELD.setdefault(manager.repo, []).append(self)
        self._thread = threading.Thread(target=self._refresh_loop, name="ckptvault-lock", daemon=True)
        self._thread.start()

    @property
    def exclusive(self) -> bool:
        return self.info.exclusive

    @property
    def lost(self) -> bool:
        return self._lost is not None

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.manager.refresh_every.total_seconds()):
            try:
                self.refresh()
            except BaseException as exc:  # refresh() keeps it for verify()
                log.debug("refreshing the lock on %s failed: %s", self.manager.repo.store.url, exc)
            if self._lost is not None:
                return

    def _age(self, now: float) -> float:
        """Seconds since the last successful refresh: the larger of the steady and the wall clock."""
        steady = now - self._refreshed
        if self.info.time is None:
            return steady
        return max(steady, (self.manager.clock() - self.info.time).total_seconds())

    def _lose(self, problem: str) -> None:
        if self._lost is None and not self._released:  # a refresh that ends after release() removed the lock
            self._lost = problem
            log.warning(
                "lost the lock on %s: %s; the command stops at its next check", self.manager.repo.store.url, problem
            )

    def _check_age(self, now: float) -> None:
        age, limit = self._age(now), self.manager.lost_after.total_seconds()
        if age > limit:
            self._lose(
                f"it went {age:.1f} s without a refresh, more than the {limit:g} s after which another "
                "host may judge it stale (was the process suspended, or a storage call stuck?)"
            )

    def _discard(self, lock: LockInfo) -> None:
        try:
            self.manager.remove(lock)
        except StorageError as exc:  # not a signal handler's error raised inside it: that one goes on
            self._orphans.append(lock)
            log.warning("could not remove the old lock object %s (retried later): %s", lock.lock_id.hex()[:12], exc)

    def _remove_orphans(self) -> None:
        orphans, self._orphans = self._orphans, []
        for lock in orphans:
            self._discard(lock)

    def refresh(self) -> None:
        """Replace the lock object by a fresh one; marks the lock lost instead when it may have looked
        stale meanwhile. Raises the storage's error when a call fails (the lock is then not lost)."""
        with self._mutex:
            try:
                self._refresh()
            except BaseException as exc:  # kept until a refresh succeeds; verify() retries once
                self._refresh_error = exc
                raise

    def _refresh(self) -> None:
        if self._lost is not None or self._released:
            return
        started = ticks()
        self._check_age(started)
        if self._lost is not None:
            return
        new = self._writing = self.manager.new_info(self.info.exclusive)
        try:
            self.manager.put(new)
            finished = ticks()
            if self._released:  # released while this write was stuck: nothing holds the new object
                self._discard(new)
                return
            present = self.manager.exists(self.info)
        except BaseException:
            self._orphans.append(new)  # a failed PUT may still land: removed at the next refresh
            raise
        finally:
            self._writing = None
        if not present:
            self._lose("another process removed it as stale")
        else:
            self._check_age(finished)  # the new object appeared in time: no gap without a fresh lock
        if self._lost is not None:
            self._discard(new)
            return
        old, self.info, self._refreshed = self.info, new, started
        self._refresh_error = None
        self._remove_orphans()  # after the refresh: a slow delete must not make it late
        self._discard(old)
        if self._released:  # release() did not wait for this slow refresh, and may have removed ``old``
            self._discard(new)

    def verify(self) -> None:
        """Raise LockLostError unless the lock still exists and was refreshed in time (call it before
        committing, and before each step that deletes data). When the last refresh failed, it is retried
        first; if that fails too, its error (a StorageError) is raised as it is while the lock is not
        lost. Does nothing once the lock is released."""
        with self._mutex:
            if self._released:
                return
            if self._lost is None and self._refresh_error is not None:
                try:
                    self._refresh()  # a transient failure is forgiven by a later successful refresh
                except BaseException as exc:
                    self._refresh_error = exc
                    self._check_age(ticks())
                    if self._lost is None:
                        raise  # the storage failed, the lock is not lost: the caller may retry
                    raise self._lost_error() from exc
            if self._lost is None:
                self._check_age(ticks())
                if self._lost is None and not self.manager.exists(self.info):
                    self._lose("another process removed it as stale")
                self._check_age(ticks())  # the check itself may have been slow
                if self._lost is None:
                    return
        raise self._lost_error()

    def check_age(self) -> None:
        """The cheap part of ``verify()``, without any storage call and without waiting for a refresh in
        progress: raise LockLostError when the lock is marked lost or went unrefreshed longer than
        ``lost_after``. Does nothing once the lock is released."""
        if self._released:
            return
        if self._lost is None:
            self._check_age(ticks())
        if self._lost is not None and not self._released:
            raise self._lost_error()

    def _lost_error(self) -> LockLostError:
        then = (
            "it stopped before deleting anything more; run it again"
            if self.info.exclusive
            else "nothing was committed, and what looked missing may be what a prune removed meanwhile; run the "
            "command again"
        )
        return LockLostError(f"lost the lock on {self.manager.repo.store.url}: {self._lost}; {then}")

    def release(self, *, remove: bool = True) -> None:
        """Stop refreshing and delete the lock object (``remove=False``: leave it, to go stale). A shared
        lock's removal is housekeeping (it blocks only a prune, and goes stale by itself): it gets a
        brief try, not the storage's whole budget, so a finished command ends on a dead link. In a forked
        child it does nothing: the lock is the parent's (a copy of a read part way, closed or collected in
        the child, deleted the parent's lock object, and a prune elsewhere could then run under its read)."""
        if os.getpid() != self._pid:
            self._released = True  # none judges it here; the parent refreshes and removes it
            return
        try:
            self._stop.set()
            # a refresh stuck on a storage that stopped answering is not waited for (its retries ran minutes
            # after a failed restore had its answer): it removes the object it writes once that lands
            refreshing = not self._mutex.acquire(timeout=RELEASE_WAIT_S)
            self._released = True  # none judges it from now on
            if not refreshing:
                self._mutex.release()
                self._thread.join()
        finally:  # also when interrupted (Ctrl-C) while waiting for the refresh thread
            with _held_mutex:
                held = _HELD.get(self.manager.repo, [])
                if self in held:
                    held.remove(self)
                if not held:  # no reference to a closed Repository is kept
                    _HELD.pop(self.manager.repo, None)
        if refreshing and (writing := self._writing) is not None:
            _leave_behind(self.manager.repo, [writing])
            left_behind.warning(
                "lock object %s is left behind if its write lands: %s removes it",
                writing.lock_id.hex()[:12],
                unlock_command(),
            )
        if not remove:
            return
        with contextlib.nullcontext() if refreshing else self._mutex, self._housekeeping():
            self._remove_orphans()
            for lock in self._orphans:
                left_behind.warning(
                    "lock object %s is left behind: %s removes it", lock.lock_id.hex()[:12], unlock_command()
                )
            _leave_behind(self.manager.repo, list(self._orphans))
            try:
                self.manager.remove(self.info)
            except BaseException:
                _leave_behind(self.manager.repo, [self.info])
                raise

    def _who_removes(self) -> str:
        """Who removes this process's shared lock left behind, and when: a later command of this process
        table at once (this process is dead by then: ``holder_gone``), this process's own next lock on the
        vault (``_LEFT_BEHIND``); elsewhere it must go stale first. It said "it goes stale after 30 minutes"
        alone, and the next command here removed it without a word (nf54 #4)."""
        # one wording for the CLI and the API: a CLI watch goes on after a backup, as an API process does
        here = (
            "this process removes it with its next lock on the vault (if it goes on, as a watch does), and the next "
            "backup, restore, check or prune on this machine once this process has ended"
        )
        minutes = round(self.manager.stale_after.total_seconds() / 60)
        return (
            f"{here}; on other machines it counts as stale {minutes} minutes after its last refresh (a prune there "
            f"waits until then, or until {unlock_command()} removes it)"
        )

    def _housekeeping(self) -> contextlib.AbstractContextManager[None]:
        """Where a shared lock's removal is done: briefly (``release``)."""
        return contextlib.nullcontext() if self.exclusive else briefly(self.manager.repo.store)

    def __enter__(self) -> HeldLock:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc_type is None:
            try:
                self.release()
            # The work is done: a lock left behind must not replace its result. Only the storage's errors: a
            # removal raises no other, and any other is a signal handler's, run inside it (a SIGTERM handler
            # whose close() was refused): that became this warning, and the command went on as if no signal came.
            # A storage error about another object is a handler's too (its flush() failing an upload).
            except StorageError as error:
                if not error.key.startswith(LOCKS_PREFIX):
                    raise
                left_behind.warning(
                    "lock %s is left behind (%s); %s", self.info.lock_id.hex()[:12], error, self._who_removes()
                )
            return
        if not self.exclusive and getattr(self.manager.repo.store, "unanswered", False):
            # the command failed because the storage stopped answering: a delete would only wait out
            # another deadline, and a shared lock blocks no backup (an exclusive one would block them
            # all, so its removal is tried); it is stale after stale_after and `unlock` removes it
            self.release(remove=False)
            _leave_behind(self.manager.repo, [self.info, *self._orphans])  # a refresh's PUT may still land
            left_behind.warning(
                "lock %s is left behind (the storage is not answering); %s",
                self.info.lock_id.hex()[:12],
                self._who_removes(),
            )
            return
        # a reader whose data went missing or failed to verify while its lock was lost (it was stopped
        # past the staleness, and a prune took the lock for a dead process's): that is the cause, not damage
        prunable = isinstance(exc, (IntegrityError, ObjectNotFoundError, ShortReadError))  # what a prune can cause
        lost = self.lost_meanwhile() if not self.exclusive and prunable else None
        try:
            self.release()
        except StorageError as error:  # the storage that failed the command often fails this too: keep its error
            if self.exclusive:  # it blocks every backup: say for how long, and the way out
                left_behind.warning(
                    "exclusive lock %s is left behind (%s): backups from other machines wait for it until it goes "
                    "stale, %d minutes after its last refresh; %s removes it once the storage answers",
                    self.info.lock_id.hex()[:12],
                    error,
                    round(self.manager.stale_after.total_seconds() / 60),
                    unlock_command(),
                )
            else:
                left_behind.warning("could not remove the lock after a failure: %s", error)
        if lost is not None:
            raise lost from exc

    def lost_meanwhile(self) -> LockLostError | None:
        """The error saying another process removed this lock (a prune that took it for a dead
        process's, or `unlock --remove-all`), so that what it then deleted explains a reader's failure;
        None otherwise, also for a lock only late to refresh (a full disk): the failure stands."""
        if getattr(self.manager.repo.store, "unanswered", False):
            return None
        try:
            self.verify()
        except LockLostError as lost:
            with contextlib.suppress(CkptVaultError):
                if not self.manager.exists(self.info):
                    return lost
        except CkptVaultError:
            pass
        return None


def _write_refused(exc: StorageError) -> bool:
    """The store refused a write for good: no permission, a read-only filesystem, or no space left
    (a full vault disk must not keep a restore from getting the checkpoints out)."""
    if isinstance(exc, StorageFullError):
        return True
    cause = exc.__cause__
    if isinstance(cause, OSError) and cause.errno == errno.EROFS:
        return True
    return cause is not None and classify(cause).kind is FailureKind.DENIED
