"""Writing a restored file's byte ranges: the page-aligned middle of each range with ``O_DIRECT``,
its ragged ends through the page cache.

A restore writes every byte it restores, usually far more than the page cache has free. Copying
them into fresh page-cache pages was the largest and least predictable cost of a local restore on
this project's VM (system time 0.9-1.3 s per GB, and over 4 s when memory had just been freed);
written straight from page-aligned staging buffers, the same restore spends ~0.35 s of system time
and finishes 15-20 % sooner (docs/performance.md). The ends of a range are not whole pages, and
``O_DIRECT`` writes only whole, aligned blocks: they go through the page cache. The two kinds of
write never touch the same page (a direct write covers only whole pages inside its range, and
ranges do not overlap), so neither can undo the other. Filesystems without ``O_DIRECT`` (tmpfs,
some FUSE mounts) refuse it with EINVAL: everything then goes through the page cache.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading

from ..store.localwrite import ALIGN, O_DIRECT

DIRECT_MIN = 1024 * 1024  # smaller files are written through the page cache alone (one open, not two)


def align_down(offset: int) -> int:
    return offset - offset % ALIGN


def align_up(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "a write made no progress")
        view, offset = view[n:], offset + n


class StagingBuffers:
    """Page-aligned buffers for ranges on their way to disk, recycled across a restore's files.
    Thread-safe; a caller holds at most as many as it has ranges in flight."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.direct = O_DIRECT != 0  # cleared for good the first time a filesystem refuses O_DIRECT

    def take(self, size: int) -> mmap.mmap:
        with self._lock:
            buffer = self._free.pop() if self._free else None
        if buffer is None or len(buffer) < size:
            # private, so a forked child never shares it; mmap memory is page-aligned
            buffer = mmap.mmap(-1, align_up(size), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return buffer

    def give(self, buffer: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buffer)


class RangeWriter:
    """Positioned writes into one file, each range given in a page-aligned buffer whose first byte
    sits at a page-aligned file offset (``base``). Thread-safe."""

    def __init__(self, path: str, fd: int, size: int, buffers: StagingBuffers) -> None:
        self.fd = fd
        self.buffers = buffers
        self.direct_fd = -1
        if buffers.direct and size >= DIRECT_MIN:
            try:
                self.direct_fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                buffers.direct = False

    def write(self, buffer: memoryview, base: int, start: int, end: int) -> None:
        """Write file bytes ``[start, end)``, held at ``buffer[start - base : end - base]``."""
        first, last = align_up(start), align_down(end)
        if self.direct_fd < 0 or first >= last:
            pwrite_all(self.fd, buffer[start - base : end - base], start)
            return
        if start < first:
            pwrite_all(self.fd, buffer[start - base : first - base], start)
        self._write_direct(buffer[first - base : last - base], first)
        if last < end:
            pwrite_all(self.fd, buffer[last - base : end - base], last)

    def _write_direct(self, view: memoryview, offset: int) -> None:
        while view:
            try:
                n = os.pwrite(self.direct_fd, view, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.buffers.direct = False  # refused after the open succeeded: the page cache from now on
                n = 0
            if n <= 0 or n % ALIGN:
                # refused, stalled or cut mid-block: the rest through the page cache, which takes any size
                pwrite_all(self.fd, view[n:] if n > 0 else view, offset + max(n, 0))
                return
            view, offset = view[n:], offset + n

    def close(self) -> None:
        if self.direct_fd >= 0:
            os.close(self.direct_fd)
            self.direct_fd = -1
