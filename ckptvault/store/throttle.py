"""Bandwidth limits: a ceiling on the bytes per second a store moves, each way.

A training box shares its network with the job's own traffic (data loading, gradients over
Ethernet, a notebook), so ``--limit-upload 50MB`` keeps ckptvault's uploads to 50 MB per second on
average and ``--limit-download`` does the same for reads (restore, check --read-data, prune's
repacking). ``CKPTVAULT_LIMIT_UPLOAD`` / ``CKPTVAULT_LIMIT_DOWNLOAD`` set them for every command and
for the Python API (the watch sidecar, the framework callbacks), unless given explicitly.

Each direction keeps one schedule, shared by the Vault's threads. A transfer starts only when the
schedule is free (every byte moved before it has had its ``bytes / rate`` seconds), then books its
own bytes, goes at the link's speed (a PUT is one atomic request), and its caller sleeps until the
booking ends. So a command never moves its bytes faster than the rate, and at any moment at most one
object's bytes run ahead of it; idle time earns no credit. A transfer that moved less than it booked
(a read-ahead window cut short by the pack's end, a failed call) hands the rest back; one of unknown
size (a whole-object GET) books what it moved when it ends. Keys under ``unlimited`` prefixes (the
locks) are never held back: a saturated upload must not delay a lock's refresh.

The limit sits outside the retries (a throttled call is not a slow storage, so no deadline counts
its wait); a retried transfer's bytes are not booked twice. ``Schedule.cancelling`` gives up the
transfers of keys under a prefix (a failed or interrupted write's packs) while it lasts, so that write
does not wait out uploads it abandons.
"""

from __future__ import annotations

import numbers
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from ..errors import StorageError, UsageError, spelled
from .base import ObjectInfo, Store

ENV_UPLOAD = "CKPTVAULT_LIMIT_UPLOAD"
ENV_DOWNLOAD = "CKPTVAULT_LIMIT_DOWNLOAD"

RateArg = float | str | None  # bytes per second, or text such as "50MB" / "400Mbit"; 0: no limit

# A prefix (k, M, G, T: powers of 1000; Ki, Mi, Gi, Ti: of 1024), then a unit whose case matters:
# B, Bps, byte(s) are bytes; bit(s), bps are bits; a lone lowercase b (Mb, mb) is refused as ambiguous.
_RATE = re.compile(
    r"(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<prefix>[kKmMgGtT]i?)?\s*"
    r"(?P<unit>B|Bps|bytes?|bits?|bps|b)?(?:/s)?"
)
_BITS = ("bit", "bits", "bps")
EXAMPLES = "e.g. 50MB (bytes per second), 20MiB, 400Mbit; 0 for no limit"


def _canonical(prefix: str) -> str:
    """``m`` -> ``M``, ``K`` -> ``k``: how a prefix is written back in a message."""
    return ("k" if prefix[:1] in "kK" else prefix[:1].upper()) + prefix[1:] if prefix else ""


def parse_rate(value: RateArg, what: str) -> float | None:
    """Bytes per second from a number or text like ``50MB``, ``1.5GiB/s``, ``400Mbit``; None for no
    limit (None, 0). A plain number in text must be 0: restic reads one as KiB/s, others as bytes, so
    a unit is asked for rather than guessed."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise UsageError(f"{what} must be a number of bytes per second or text such as '50MB', not {value!r}")
    if isinstance(value, str):
        if not value.strip():
            raise UsageError(f"{what} is empty; give a rate ({EXAMPLES}), or leave it out")
        match = _RATE.fullmatch(value.strip())
        if match is None:
            raise UsageError(f"{what} {value!r} is not a rate; {EXAMPLES}")
        number = float(match["number"])
        prefix, unit = match["prefix"] or "", match["unit"] or ""
        if unit == "b":
            raise UsageError(
                f"{what} {value!r} could be bits or bytes; write {number:g}{_canonical(prefix)}B or "
                f"{number:g}{_canonical(prefix)}bit"
            )
        if number and not prefix and not unit:
            raise UsageError(f"{what} {value!r} has no unit; {EXAMPLES}")
        power = "_kmgt".index(prefix[0].lower()) if prefix else 0
        rate = number * (1024 if prefix.endswith("i") else 1000) ** power / (8 if unit in _BITS else 1)
    else:
        rate = float(value)
    if rate != rate or rate < 0 or rate == float("inf"):
        raise UsageError(f"{what} {value!r} must be a positive rate; {EXAMPLES}")
    if rate == 0:
        return None
    if rate < 1024:
        raise UsageError(f"{what} {value!r} is under 1 KiB per second; {EXAMPLES}")
    return rate


@dataclass(frozen=True)
class RateLimits:
    """Bytes per second each way; None: no limit."""

    upload: float | None = None
    download: float | None = None

    @classmethod
    def resolve(cls, upload: RateArg = None, download: RateArg = None) -> RateLimits:
        """The limits given, each falling back to its environment variable when None."""
        up = os.environ.get(ENV_UPLOAD) if upload is None else upload
        down = os.environ.get(ENV_DOWNLOAD) if download is None else download
        return cls(
            parse_rate(up, spelled("--limit-upload", "limit_upload") if upload is not None else ENV_UPLOAD),
            parse_rate(down, spelled("--limit-download", "limit_download") if download is not None else ENV_DOWNLOAD),
        )

    def __bool__(self) -> bool:
        return self.upload is not None or self.download is not None


class TransferCancelled(Exception):
    """Raised inside a caller that was waiting for its turn when ``Schedule.cancel`` ran."""


@dataclass
class _Booking:
    moved: int  # bytes the transfer moved (as booked, unless it says otherwise)


class Schedule:
    """One direction's schedule (see the module docstring); thread-safe."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._cond = threading.Condition()
        self._free_at = 0.0  # time.monotonic() when every byte booked so far has had its time
        self._active: dict[int, str] = {}  # each transfer under way (waiting, moving, paying) -> its key
        self._cancelled: set[int] = set()  # transfers told to give up
        self._refused: set[str] = set()  # key prefixes whose new transfers give up at once
        self.waited = 0.0  # seconds callers slept, all threads together (for tests and reports)

    @contextmanager
    def transfer(self, nbytes: int | None, key: str = "") -> Iterator[_Booking]:
        """Around one transfer of ``nbytes`` of ``key`` (None: not known before it ends; the body then
        sets ``booking.moved``, as does a transfer that moved less than it asked for)."""
        booking = _Booking(nbytes or 0)
        with self._cond:
            if key.startswith(tuple(self._refused)):
                raise TransferCancelled()
            self._active[id(booking)] = key
        try:
            with self._cond:
                if not self._sleep_until(lambda: self._free_at, booking):
                    raise TransferCancelled()
                start = time.monotonic()
                booked_end = self._free_at = start + (nbytes or 0) / self.rate
            try:
                yield booking
            except BaseException:
                booking.moved = 0
                raise
            finally:
                with self._cond:
                    end = start + booking.moved / self.rate
                    if self._free_at == booked_end:  # nothing started since: hand back what it did not move
                        self._free_at = end
                    elif booking.moved > (nbytes or 0):  # others started meanwhile: its extra bytes go after theirs
                        self._free_at = end = self._free_at + (booking.moved - (nbytes or 0)) / self.rate
                    self._cond.notify_all()
            with self._cond:
                self._sleep_until(lambda: end, booking)
        finally:
            with self._cond:
                del self._active[id(booking)]
                self._cancelled.discard(id(booking))

    @contextmanager
    def cancelling(self, prefix: str) -> Iterator[None]:
        """While it lasts, transfers of keys under ``prefix`` give up: one waiting for its turn, or
        starting, raises ``TransferCancelled``; one that has moved its bytes returns without paying for
        them. Others keep to the schedule."""
        with self._cond:
            self._refused.add(prefix)
            self._cancelled.update(i for i, key in self._active.items() if key.startswith(prefix))
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._refused.discard(prefix)

    def _sleep_until(self, when: Callable[[], float], booking: _Booking) -> bool:
        """Wait (holding the condition) until ``when()``, read again at every wake-up (a transfer that
        ended hands time back); False if cancelled meanwhile."""
        began = time.monotonic()
        try:
            while id(booking) not in self._cancelled:
                delay = when() - time.monotonic()
                if delay <= 0:
                    return True
                self._cond.wait(delay)
            return False
        finally:
            self.waited += time.monotonic() - began


class ThrottledStore:
    """A Store whose transfers keep to ``limits`` (see the module docstring)."""

    def __init__(self, inner: Store, limits: RateLimits, unlimited: tuple[str, ...] = ()) -> None:
        self.inner = inner
        self.url = inner.url
        self.remote = inner.remote
        self.supports_if_absent = inner.supports_if_absent
        self.limits = limits
        self.unlimited = unlimited
        self.uploads = Schedule(limits.upload) if limits.upload else None
        self.downloads = Schedule(limits.download) if limits.download else None

    def __getattr__(self, name: str) -> Any:  # transfers, local_folder, unanswered, ...
        return getattr(self.inner, name)

    def cancelling_uploads(self, prefix: str) -> AbstractContextManager[None]:
        """While it lasts, uploads of keys under ``prefix`` held back by the limit fail with a
        StorageError instead of being sent, and those sent return at once (a write that failed or was
        interrupted gives them up: ``Schedule.cancelling``)."""
        return self.uploads.cancelling(prefix) if self.uploads else nullcontext()

    def put(self, key: str, data: bytes | bytearray | memoryview, *, if_absent: bool = False) -> None:
        with self._cancelled_as_error("PUT", key), self._booked(self.uploads, key, len(data)):
            self.inner.put(key, data, if_absent=if_absent)

    def get(self, key: str) -> bytes:
        with self._cancelled_as_error("GET", key), self._booked(self.downloads, key, None) as booking:
            data = self.inner.get(key)
            booking.moved = len(data)
            return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self._cancelled_as_error("GET", key), self._booked(self.downloads, key, length):
            return self.inner.get_range(key, start, length)

    def read_upto(self, key: str, start: int, length: int) -> bytes:
        """A read-ahead window: booked whole, and what the object's end cut off handed back."""
        with self._cancelled_as_error("GET", key), self._booked(self.downloads, key, length) as booking:
            data: bytes = self.inner.read_upto(key, start, length)  # type: ignore[attr-defined]
            booking.moved = len(data)
            return data

    def _booked(self, schedule: Schedule | None, key: str, nbytes: int | None) -> AbstractContextManager[_Booking]:
        if schedule is None or key.startswith(self.unlimited):
            return nullcontext(_Booking(0))
        return schedule.transfer(nbytes, key)

    @contextmanager
    def _cancelled_as_error(self, op: str, key: str) -> Iterator[None]:
        try:
            yield
        except TransferCancelled:
            raise StorageError(op, key, self.url, "not sent: the write it belonged to failed or was stopped") from None

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str) -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def remove_stale_temp_files(self, older_than_s: float) -> int:
        return self.inner.remove_stale_temp_files(older_than_s)
