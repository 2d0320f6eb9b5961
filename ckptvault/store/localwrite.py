"""Creating files durably on a local disk; large ones bypass the page cache (``O_DIRECT``).

A pack is written once and read again only by a restore or a check, often much later. Copying it
into the page cache costs the CPU that hashing and compression need (on this project's VM, perf
puts the kernel's page-cache copy at about a third of a local backup's CPU) and pushes the
user's own data out of memory. With ``O_DIRECT`` the disk reads the bytes straight from the pack's
own buffer (page-aligned), or from a small, reused, page-aligned staging buffer. Filesystems
without it (tmpfs, some FUSE mounts) refuse with EINVAL; the ordinary path is used from then on.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading

from ..durable import pwrite_all
from ..memcopy import copy_into

O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux and a few others; elsewhere never used
ALIGN = 4096  # offsets, lengths and addresses of O_DIRECT writes; a multiple of every block size seen
DIRECT_MIN = 4 * 1024 * 1024  # smaller files (index, tree, snapshot objects) go through the page cache
STAGE_SIZE = 4 * 1024 * 1024
_PAD = bytes(ALIGN)


class LocalWriter:
    """Thread-safe: each thread has its own staging buffer."""

    def __init__(self) -> None:
        self.direct = O_DIRECT != 0
        self._local = threading.local()

    def create(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Write a new file at ``path`` (which must not exist) and fsync it."""
        view = memoryview(data).cast("B")
        if self.direct and len(view) >= DIRECT_MIN:
            try:
                self._create_direct(path, view)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False  # this filesystem does not do O_DIRECT
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            pwrite_all(fd, view, 0, path)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _create_direct(self, path: str, view: memoryview) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o644)
        try:
            # A page-aligned buffer (a pack's: pack.new_pack_buffer) goes to the disk as it is, but for
            # its last partial block; anything else passes through the staging buffer.
            pos = len(view) // ALIGN * ALIGN if _address(view) % ALIGN == 0 else 0
            if pos:
                pwrite_all(fd, view[:pos], 0, path)
            if pos < len(view):
                self._write_staged(fd, view, pos, path)
            os.ftruncate(fd, len(view))
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_staged(self, fd: int, view: memoryview, pos: int, path: str) -> None:
        """``view`` from ``pos`` on, through this thread's staging buffer; the tail block is padded with
        zeros (the caller cuts the file to its length)."""
        stage = getattr(self._local, "stage", None)
        if stage is None:
            # page-aligned, as O_DIRECT needs; private, so a forked child never shares it
            stage = self._local.stage = mmap.mmap(-1, STAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        staged = memoryview(stage)
        try:
            while pos < len(view):
                size = min(STAGE_SIZE, len(view) - pos)
                copy_into(stage, 0, view[pos : pos + size])
                padded = -(-size // ALIGN) * ALIGN
                staged[size:padded] = _PAD[: padded - size]
                pwrite_all(fd, staged[:padded], pos, path)
                pos += size
        finally:
            staged.release()


def _address(view: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(view, np.uint8).ctypes.data) if len(view) else 0
