"""Read-ahead for sequential range reads on remote stores: one request for many small ones.

A restore reads a file's chunks in order, and a backup wrote them one after another into the same
packs, so consecutive ``get_range`` calls on a pack usually ask for adjacent byte ranges (about 1 MiB
each). On an object store every request costs a round trip and a slice of CPU on both ends
(signing, parsing, the server's bookkeeping), so when a read starts where the previous one on the
same object ended, ``ReadAheadStore`` fetches a whole window (``window`` bytes) in one GET and serves
the following reads from it. Reads that are not sequential go straight through.

Every byte range is served from a window at most once: a caller that reads the same range again
(the repository does, after bytes failed verification) gets a fresh read from the store, never
the same possibly-damaged copy. Windows are immutable snapshots of immutable objects; at most
``max_windows`` are kept, the oldest dropped first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..errors import StorageError
from .base import ObjectInfo, Store
from .failures import unreachable

DEFAULT_WINDOW = 8 * 1024 * 1024
DEFAULT_MAX_WINDOWS = 8


@dataclass
class _Window:
    start: int
    data: Future[bytes] = field(default_factory=Future)
    served: set[tuple[int, int]] = field(default_factory=set)  # (start, length) already handed out

    def covers(self, start: int, length: int, size: int) -> bool:
        return self.start <= start and start + length <= self.start + size


class ReadAheadStore:
    def __init__(self, inner: Store, window: int = DEFAULT_WINDOW, max_windows: int = DEFAULT_MAX_WINDOWS) -> None:
        self.inner = inner
        self.url = inner.url
        self.window = window
        self.max_windows = max_windows
        self._lock = threading.Lock()
        self._windows: OrderedDict[tuple[str, int], _Window] = OrderedDict()
        self._last_end: dict[str, int] = {}  # key -> end of the latest read (sequential detection)

    def __getattr__(self, name: str) -> Any:  # remote, transfers, supports_if_absent, retried, ...
        return getattr(self.inner, name)

    # ---- range reads -------------------------------------------------------------------

    def get_range(self, key: str, start: int, length: int) -> bytes:
        window, fetch = self._plan(key, start, length)
        if window is None:
            return self.inner.get_range(key, start, length)
        if fetch:
            self._fill(key, window)
        try:
            data = window.data.result()
        except StorageError as exc:
            if unreachable(exc):  # the storage stopped answering: an exact read would only wait again
                raise
            return self.inner.get_range(key, start, length)
        offset = start - window.start
        if offset + length > len(data):  # the object ended inside the window: not ours to judge
            return self.inner.get_range(key, start, length)
        return data[offset : offset + length]

    def _plan(self, key: str, start: int, length: int) -> tuple[_Window | None, bool]:
        """The window serving this read (and whether this caller must fetch it), or None."""
        with self._lock:
            for (wkey, _), window in reversed(self._windows.items()):
                if wkey == key and window.covers(start, length, self.window) and (start, length) not in window.served:
                    window.served.add((start, length))
                    self._last_end[key] = max(self._last_end.get(key, 0), start + length)
                    return window, False
            sequential = self._last_end.get(key) == start
            self._last_end[key] = start + length
            if not sequential or length >= self.window:
                return None, False
            window = _Window(start)
            window.served.add((start, length))
            self._windows[(key, start)] = window
            while len(self._windows) > self.max_windows:
                self._windows.popitem(last=False)
            return window, True

    def _fill(self, key: str, window: _Window) -> None:
        try:
            data = self.inner.read_upto(key, window.start, self.window)  # type: ignore[attr-defined]
        except BaseException as exc:
            with self._lock:
                self._windows.pop((key, window.start), None)
            window.data.set_exception(exc)
            if not isinstance(exc, StorageError):
                raise
            return
        window.data.set_result(data)

    # ---- everything else goes straight through -------------------------------------------

    def put(self, key: str, data: bytes | bytearray | memoryview, *, if_absent: bool = False) -> None:
        self.inner.put(key, data, if_absent=if_absent)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str) -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        with self._lock:
            for wkey in [k for k in self._windows if k[0] == key]:
                del self._windows[wkey]
            self._last_end.pop(key, None)
        self.inner.delete(key)

    def remove_stale_temp_files(self, older_than_s: float) -> int:
        return self.inner.remove_stale_temp_files(older_than_s)
