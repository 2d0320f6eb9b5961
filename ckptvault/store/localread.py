"""Range reads from a local disk; large ones bypass the page cache (``O_DIRECT``).

A restore reads each chunk of a pack once. Through the page cache every byte is copied twice (the
disk into fresh page-cache pages, then those into the reader's buffer), and on this project's VM
handing out fresh pages is the slow part: a restore of 1 GB read from packs just written (backups
write them with ``O_DIRECT``, so they are not in memory) spent 1.4-5.6 s in the kernel against
~0.5 s with the reads direct (docs/performance.md). The disk reads straight into a buffer of the
process's reused heap instead. Filesystems without it (tmpfs before Linux 6.6, some FUSE mounts)
refuse with EINVAL; buffered reads are used from then on. A direct read that comes back short is done again
buffered, which alone decides where the file ends.
"""

from __future__ import annotations

import errno
import os

from .localwrite import ALIGN, O_DIRECT

DIRECT_READ_MIN = 128 * 1024  # smaller reads (trailers, headers, small chunks) keep the kernel's read-ahead


class LocalReader:
    def __init__(self) -> None:
        self.direct = O_DIRECT != 0

    def read(self, path: str, start: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``start``: fewer only where the file ends."""
        if self.direct and length >= DIRECT_READ_MIN:
            try:
                data = _read_direct(path, start, length)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False  # this filesystem does not do O_DIRECT
            else:
                if data is not None:
                    return data
        return _read_buffered(path, start, length)


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
    """The range read into whole aligned blocks of a page-aligned buffer; None when the read came
    back short (the end of the file, or a filesystem that splits reads)."""
    import numpy as np

    first = start - start % ALIGN
    end = -(-(start + length) // ALIGN) * ALIGN
    buffer = np.empty(end - first + ALIGN, np.uint8)  # from the heap, not zero-filled
    skip = -buffer.ctypes.data % ALIGN
    blocks = memoryview(buffer)[skip : skip + end - first]
    fd = os.open(path, os.O_RDONLY | O_DIRECT)
    try:
        got = os.preadv(fd, [blocks], first)
    finally:
        os.close(fd)
    lead = start - first
    if got < lead + length:
        return None
    return bytes(blocks[lead : lead + length])
