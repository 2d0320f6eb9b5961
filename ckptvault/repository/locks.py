"""Repository locks: shared for backup, restore and check; exclusive for prune.

The scheme is restic's. A lock is a small sealed object ``locks/<random id>`` naming its
host, process and time. Taking a lock writes it, then lists the others: a conflicting lock
that is not stale makes the newcomer remove its own and fail. A holder refreshes its lock
(a new object, then the old one deleted) every ``refresh_every``; a lock not refreshed for
``stale_after``, or held by a dead process on this host, is stale and ignored. Prune removes
the stale locks it ignores, and every lock holder checks before committing that its lock
is still there and fresh: a backup that was frozen past the stale timeout aborts instead of
writing a snapshot that could point at data a prune removed meanwhile.

A lock object that cannot be read (damaged, or of a lock version this ckptvault does not know)
has no time ckptvault can trust, so its age counts from when the storage wrote it (the object's
modification time; a holder writes a new object at every refresh, so that is its last refresh).
Until it is stale it conflicts like a live exclusive lock (a newer ckptvault's lock: with
UnsupportedFormatError, exit 17); once stale, it is ignored, and ``unlock`` and exclusive lockers
remove it like any stale lock. Where the store reports no modification time it counts as stale at
once: a live holder writes a fresh, readable lock every ``refresh_every``, so such an object is
not how a live holder is known for long.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

from ..blob import Kind
from ..errors import (
    CkptVaultError,
    IntegrityError,
    LockLostError,
    ObjectNotFoundError,
    UnsupportedFormatError,
    VaultLockedError,
)
from ..store.base import listed_time
from .format import LOCKS_PREFIX, id_from_key, lock_key, new_object_id

if TYPE_CHECKING:
    from .repository import Repository

log = logging.getLogger("ckptvault")
STALE_AFTER = timedelta(minutes=30)
REFRESH_EVERY = timedelta(minutes=5)
LOCK_VERSION = 1

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


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

    @property
    def unreadable(self) -> bool:
        return bool(self.problem)

    def describe(self) -> str:
        if self.problem:
            when = f"written {self.time:%Y-%m-%d %H:%M:%S} UTC" if self.time else "written at an unknown time"
            return f"unreadable lock {self.lock_id.hex()[:12]} ({self.problem}), {when}"
        kind = "exclusive" if self.exclusive else "shared"
        return f"{kind} lock by {self.hostname} pid {self.pid} since {self.time:%Y-%m-%d %H:%M:%S} UTC"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LockManager:
    """Lock objects of one repository. ``repo`` provides the codec and the store."""

    def __init__(
        self,
        repo: Repository,
        *,
        clock: Clock = utc_now,
        stale_after: timedelta = STALE_AFTER,
        refresh_every: timedelta = REFRESH_EVERY,
    ) -> None:
        self.repo = repo
        self.clock = clock
        self.stale_after = stale_after
        self.refresh_every = refresh_every

    def is_stale(self, lock: LockInfo) -> bool:
        if lock.time is None:  # an unreadable lock of unknown age (module docstring)
            return True
        if self.clock() - lock.time > self.stale_after:
            return True
        return not lock.unreadable and lock.hostname == socket.gethostname() and not _pid_alive(lock.pid)

    def write(self, exclusive: bool) -> LockInfo:
        now = self.clock()
        info = LockInfo(new_object_id(), socket.gethostname(), os.getpid(), exclusive, now)
        doc = {
            "version": LOCK_VERSION,
            "hostname": info.hostname,
            "pid": info.pid,
            "exclusive": exclusive,
            "time": now.isoformat(),
        }
        self.repo.store.put(
            lock_key(info.lock_id), self.repo.codec.encode(Kind.LOCK, info.lock_id, json.dumps(doc).encode())
        )
        return info

    def remove(self, lock: LockInfo) -> None:
        with contextlib.suppress(ObjectNotFoundError):
            self.repo.store.delete(lock_key(lock.lock_id))

    def list(self) -> list[LockInfo]:
        """Every lock object; one that cannot be read is listed with its ``problem`` (never raises for it)."""
        locks = []
        for obj in self.repo.store.list(LOCKS_PREFIX):
            lock_id = id_from_key(obj.key)
            if lock_id is None:
                continue
            try:
                blob = self.repo.store.get(obj.key)
            except ObjectNotFoundError:
                continue  # released while we listed
            try:
                locks.append(self._decode(lock_id, blob))
            except _NewerLock as newer:
                when = obj.modified or newer.time
                locks.append(LockInfo(lock_id, "?", 0, True, when, str(newer), newer=True))
            except (IntegrityError, UnsupportedFormatError, ValueError, KeyError, TypeError) as exc:
                # a live exclusive lock of unknown origin until it is stale by the object's age
                problem = str(exc) if isinstance(exc, CkptVaultError) else f"malformed lock document: {exc!r}"
                locks.append(LockInfo(lock_id, "?", 0, True, obj.modified, problem))
        return locks

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
        return LockInfo(lock_id, str(doc["hostname"]), int(doc["pid"]), bool(doc["exclusive"]), time)

    def _conflict(self, other: LockInfo) -> CkptVaultError:
        url = self.repo.store.url
        if not other.unreadable:
            return VaultLockedError(
                f"vault {url} is locked: {other.describe()}; "
                "wait for it to finish, or if that process is gone run: ckptvault unlock"
            )
        minutes = round(self.stale_after.total_seconds() / 60)
        until = f" (at {other.time + self.stale_after:%Y-%m-%d %H:%M:%S} UTC)" if other.time else ""
        then = (
            f"ckptvault unlock removes it once it is stale, {minutes} minutes after it was written{until}, "
            "or --remove-all removes it now when no ckptvault process on any host uses this vault"
        )
        if other.newer:
            return UnsupportedFormatError(
                f"vault {url} is locked by a newer ckptvault: {other.describe()}; use that ckptvault, or {then}"
            )
        return VaultLockedError(f"vault {url} is locked: {other.describe()}; {then}")

    def acquire(self, exclusive: bool) -> HeldLock:
        own = self.write(exclusive)
        try:
            stale = []
            for other in self.list():
                if other.lock_id == own.lock_id:
                    continue
                if self.is_stale(other):
                    stale.append(other)
                elif exclusive or other.exclusive:  # an unreadable lock counts as exclusive
                    raise self._conflict(other)
            if exclusive:  # an exclusive holder may delete data: make frozen holders notice
                for lock in stale:
                    self.remove(lock)
        except BaseException:
            self.remove(own)
            raise
        return HeldLock(self, own)


class _NewerLock(Exception):
    """A lock object that verifies but has a lock version above ``LOCK_VERSION``."""

    def __init__(self, version: int, time: object) -> None:
        super().__init__(f"lock version {version} is newer than this ckptvault reads ({LOCK_VERSION})")
        self.time = listed_time(time)


class HeldLock:
    """A lock kept fresh by a background thread until released."""

    def __init__(self, manager: LockManager, info: LockInfo) -> None:
        self.manager = manager
        self.info = info
        self._stop = threading.Event()
        self._mutex = threading.Lock()
        self._refresh_error: BaseException | None = None
        self._thread = threading.Thread(target=self._refresh_loop, name="ckptvault-lock", daemon=True)
        self._thread.start()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.manager.refresh_every.total_seconds()):
            try:
                self.refresh()
            except BaseException as exc:  # reported by verify()
                self._refresh_error = exc

    def refresh(self) -> None:
        with self._mutex:
            new = self.manager.write(self.info.exclusive)
            old, self.info = self.info, new
            self.manager.remove(old)

    def verify(self) -> None:
        """Raise unless the lock still exists and is fresh (call before committing)."""
        problem = None
        if self._refresh_error is not None:
            problem = f"refreshing it failed ({self._refresh_error})"
        elif self.info.time is None or self.manager.clock() - self.info.time > self.manager.stale_after:
            problem = "it was not refreshed in time (was the process suspended?)"
        elif all(lock.lock_id != self.info.lock_id for lock in self.manager.list()):
            problem = "another process removed it as stale"
        if problem:
            raise LockLostError(
                f"lost the lock on {self.manager.repo.store.url}: {problem}; "
                "nothing was committed, run the command again"
            )

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        with self._mutex:
            self.manager.remove(self.info)

    def __enter__(self) -> HeldLock:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.release()
            return
        try:
            self.release()
        except CkptVaultError as error:  # the storage that failed the command often fails this too
            log.warning("could not remove the lock after a failure: %s", error)  # keep the first error
