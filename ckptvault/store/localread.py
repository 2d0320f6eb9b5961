"""Range reads from a local disk; large ones bypass the page cache (``O_DIRECT``).

A restore reads each chunk of a pack once. Through the page cache every byte is copied twice (the
disk into fresh page-cache pages, then those into the reader's buffer), and on this project's VM
handing out fresh pages is the slow part: a restore of 1 GB read from packs just written (backups
write them with ``O_DIRECT``, so they are not in memory) spent 1.4-5.6 s in the kernel against
~0.5 s with the reads direct (docs/performance.md). The disk reads straight into a buffer instead.

That buffer is the reading thread's own, reused: a private anonymous mapping marked
``MADV_WIPEONFORK`` (Linux 4.14). A ``fork()`` in another thread while the disk fills it (a training
process's DataLoader starting its workers beside ``backup_async``) could otherwise leave it unfilled on
kernels before Linux 5.19 (open(2), "O_DIRECT"): a child gets zeroed pages at the same address, and the
parent's pages stay its own. (``MADV_DONTFORK`` left the child a buffer object over memory it no longer
mapped, where its next mapping could land and a read in the child then write.) Where the kernel refuses
the advice, reads are buffered.

A range read a second time (a chunk that several files share: ``last.ckpt`` beside the epoch's copy)
goes through the page cache, which keeps it for the reads after. A filesystem that refuses
``O_DIRECT`` (EINVAL, EOPNOTSUPP: tmpfs before Linux 6.6, some FUSE mounts) gets buffered reads from
then on; any other failure of a direct read, or a short one, is answered by a buffered read of the
range, which alone decides where the file ends and what is wrong.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import threading
from collections import OrderedDict

from .localwrite import ALIGN, O_DIRECT

DIRECT_READ_MIN = 128 * 1024  # smaller reads (trailers, headers, small chunks) keep the kernel's read-ahead
REMEMBERED_RANGES = 65536  # ranges read direct, remembered to send a second read through the page cache
_NOT_DIRECT = {errno.EINVAL, errno.EOPNOTSUPP}  # ENOTSUP is EOPNOTSUPP on Linux
BUFFER_STEP = 1 << 20  # a thread's buffer grows by whole MiB: chunks vary in size
# Python does not name it; Linux's value. No buffer a fork leaves alone, no direct reads.
MADV_WIPEONFORK = getattr(mmap, "MADV_WIPEONFORK", 18 if sys.platform.startswith("linux") else None)
DIRECT_READS = O_DIRECT != 0 and MADV_WIPEONFORK is not None
_buffers = threading.local()


class LocalReader:
    def __init__(self) -> None:
        self.direct = DIRECT_READS
        self._read_direct: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, path: str, start: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``start``: fewer only where the file ends."""
        if self.direct and length >= DIRECT_READ_MIN and self._first_read(path, start, length):
            try:
                data = _read_direct(path, start, length)
            except OSError as exc:
                if exc.errno in _NOT_DIRECT:
                    self.direct = False  # this filesystem does not do O_DIRECT
            else:
                if data is not None:
                    return data
        return _read_buffered(path, start, length)

    def _first_read(self, path: str, start: int, length: int) -> bool:
        key = (path, start, length)
        with self._lock:
            if key in self._read_direct:
                return False
            self._read_direct[key] = None
            if len(self._read_direct) > REMEMBERED_RANGES:
                self._read_direct.popitem(last=False)
            return True


def _read_buffered(path: str, start: int, length: int) -> bytes:
    # positioned reads and no file object (a restore makes one read per chunk); a short read (legal on
    # FUSE and network mounts) is continued, only the end of the file stops it
    fd = os.open(path, os.O_RDONLY)
    try:
        parts: list[bytes] = []
        got = 0
        while got < length and (more := os.pread(fd, length - got, start + got)):
            parts.append(more)
            got += len(more)
        return parts[0] if len(parts) == 1 else b"".join(parts)
    finally:
        os.close(fd)


def _read_direct(path: str, start: int, length: int) -> bytes | None:
    """The range read into whole aligned blocks of this thread's buffer; None when the read came
    back short (the end of the file, or a filesystem that splits reads)."""
    first = start - start % ALIGN
    end = -(-(start + length) // ALIGN) * ALIGN
    with memoryview(_aligned_buffer(end - first))[: end - first] as blocks:
        fd = os.open(path, os.O_RDONLY | O_DIRECT)
        try:
            got = os.preadv(fd, [blocks], first)
        finally:
            os.close(fd)
        lead = start - first
        if got < lead + length:
            return None
        return bytes(blocks[lead : lead + length])


def _aligned_buffer(size: int) -> mmap.mmap:
    """This thread's page-aligned buffer of at least ``size`` bytes: a mapping a ``fork()`` gives the child
    zeroed, so that the pages the disk is filling stay this process's. OSError (EINVAL: a kernel before
    4.14) when it cannot be had."""
    buffer: mmap.mmap | None = getattr(_buffers, "mapping", None)
    if buffer is None or len(buffer) < size:
        grown = mmap.mmap(-1, -(-size // BUFFER_STEP) * BUFFER_STEP, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            grown.madvise(MADV_WIPEONFORK)  # type: ignore[arg-type]  # only called where it is known
        except OSError:
            grown.close()
            raise
        if buffer is not None:
            buffer.close()
        buffer = _buffers.mapping = grown
    return buffer
