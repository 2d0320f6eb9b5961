"""Bandwidth limits: a ceiling on the bytes per second a store moves, each way.

A training box shares its network with the job's own traffic (data loading, gradients over
Ethernet, a notebook), so ``--limit-upload 50MB`` keeps ckptvault's uploads to 50 MB per second on
average and ``--limit-download`` does the same for reads (restore, check --read-data, prune's
repacking). ``CKPTVAULT_LIMIT_UPLOAD`` / ``CKPTVAULT_LIMIT_DOWNLOAD`` set them for every command and
for the Python API (the watch sidecar, the framework callbacks), unless given explicitly.

Each transfer books time on one schedule per direction, shared by all threads: ``n`` bytes take
``n / rate`` seconds, starting when the previous booking ends (or now, if that has passed). The
caller sleeps until its booking starts, transfers, and sleeps until the booking ends, so no command
moves its bytes faster than the rate, and over any stretch of time at most one booking's bytes run
ahead of it: an object, once started, goes at the link's speed (a PUT is one atomic request; a
16 MiB pack is the burst). Idle time earns no credit. A whole-object GET of unknown size waits for
the schedule to be free and books its size afterwards. Requests under ``SMALL`` bytes (locks,
snapshots, index pieces) are booked but never wait, so a busy upload cannot delay a lock's refresh.

The limit sits outside the retries (a throttled call is not a slow storage, so no deadline counts
its wait); a retried transfer's bytes are not booked twice.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError, spelled
from .base import ObjectInfo, Store

ENV_UPLOAD = "CKPTVAULT_LIMIT_UPLOAD"
ENV_DOWNLOAD = "CKPTVAULT_LIMIT_DOWNLOAD"
SMALL = 256 * 1024

RateArg = float | str | None  # bytes per second, or text such as "50MB" / "400Mbit"; 0: no limit

_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
_BINARY = {"ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}
_RATE = re.compile(r"(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<prefix>[kmgt]i?)?(?P<unit>b|bytes?|bit|bits|bps)?(?:/s)?")
EXAMPLES = "e.g. 50MB (bytes per second), 20MiB, 400Mbit; 0 for no limit"


def parse_rate(value: RateArg, what: str) -> float | None:
    """Bytes per second from a number or text like ``50MB``, ``1.5GiB/s``, ``400Mbit``; None for no
    limit (None, 0). A plain number in text must be 0: restic reads one as KiB/s, others as bytes, so
    a unit is asked for rather than guessed."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UsageError(f"{what} must be a number of bytes per second or text such as '50MB', not {value!r}")
    if isinstance(value, str):
        text = value.strip()
        match = _RATE.fullmatch(text.lower())
        if match is None:
            raise UsageError(f"{what} {value!r} is not a rate; {EXAMPLES}")
        number = float(match["number"])
        prefix, unit = match["prefix"] or "", match["unit"] or ""
        if number and not prefix and not unit:
            raise UsageError(f"{what} {value!r} has no unit; {EXAMPLES}")
        scale = _BINARY.get(prefix) or _UNITS[prefix]
        rate = number * scale / (8 if unit in ("bit", "bits", "bps") else 1)
    else:
        rate = float(value)
    if rate != rate or rate < 0 or rate == float("inf"):
        raise UsageError(f"{what} {value!r} must be a positive rate; {EXAMPLES}")
    if rate == 0:
        return None
    if rate < 1024:
        raise UsageError(f"{what} {value!r} is under 1 KiB per second; {EXAMPLES}")
    return rate


def describe_rate(rate: float) -> str:
    """``52.4 MB/s``: how a limit is shown back."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if rate >= scale:
            return f"{rate / scale:.3g} {unit}/s"
    return f"{rate:.0f} B/s"


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


@dataclass
class _Booking:
    moved: int  # bytes the transfer moved (as booked, unless it says otherwise)


class Schedule:
    """One direction's booking schedule (see the module docstring); thread-safe."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._free_at = 0.0  # time.monotonic() at which the last booking ends
        self.waited = 0.0  # seconds callers slept, all threads together (for tests and reports)

    @contextmanager
    def transfer(self, nbytes: int) -> Iterator[_Booking]:
        """Around a transfer of up to ``nbytes``: book its time, sleep until the booking starts, and
        after the transfer until it ends (small ones are booked but never wait). A transfer that
        moved fewer bytes says so (``booking.moved``): its unused time is handed back when nothing
        was booked after it."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = end = start + nbytes / self.rate
        small = nbytes < SMALL
        if not small:
            self._sleep_until(start)
        booking = _Booking(nbytes)
        yield booking
        if booking.moved < nbytes:
            unused = (nbytes - booking.moved) / self.rate
            with self._lock:
                if self._free_at == end:
                    self._free_at = end = end - unused
        if not small:
            self._sleep_until(end)

    def wait_free(self) -> None:
        """Sleep until every booking so far has ended (before a transfer of unknown size)."""
        with self._lock:
            free_at = self._free_at
        self._sleep_until(free_at)

    def _sleep_until(self, when: float) -> None:
        delay = when - time.monotonic()
        if delay > 0:
            with self._lock:
                self.waited += delay
            time.sleep(delay)


class ThrottledStore:
    """A Store whose transfers keep to ``limits`` (see the module docstring)."""

    def __init__(self, inner: Store, limits: RateLimits) -> None:
        self.inner = inner
        self.url = inner.url
        self.remote = inner.remote
        self.supports_if_absent = inner.supports_if_absent
        self.limits = limits
        self.uploads = Schedule(limits.upload) if limits.upload else None
        self.downloads = Schedule(limits.download) if limits.download else None

    def __getattr__(self, name: str) -> Any:  # remote, transfers, supports_if_absent, local_folder, ...
        return getattr(self.inner, name)

    def put(self, key: str, data: bytes | bytearray | memoryview, *, if_absent: bool = False) -> None:
        with self._booked(self.uploads, len(data)):
            self.inner.put(key, data, if_absent=if_absent)

    def get(self, key: str) -> bytes:
        if self.downloads is None:
            return self.inner.get(key)
        self.downloads.wait_free()
        data = self.inner.get(key)
        with self.downloads.transfer(len(data)):  # booked after the fact: the next reader waits for it
            return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self._booked(self.downloads, length):
            return self.inner.get_range(key, start, length)

    def read_upto(self, key: str, start: int, length: int) -> bytes:
        """A read-ahead window: booked whole, and what the object's end cut off handed back."""
        if self.downloads is None:
            return self.inner.read_upto(key, start, length)  # type: ignore[attr-defined]
        with self.downloads.transfer(length) as booking:
            data: bytes = self.inner.read_upto(key, start, length)  # type: ignore[attr-defined]
            booking.moved = len(data)
            return data

    @staticmethod
    def _booked(schedule: Schedule | None, nbytes: int) -> AbstractContextManager[object]:
        return schedule.transfer(nbytes) if schedule else nullcontext()

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str) -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def remove_stale_temp_files(self, older_than_s: float) -> int:
        return self.inner.remove_stale_temp_files(older_than_s)
