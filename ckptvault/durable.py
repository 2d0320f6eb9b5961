"""Local writes that must be whole, and those that must survive a power loss: the few calls every layer
that writes a local file (keyfiles, packs, restored files) shares. Keyfiles and packs are fsynced; restored
files are not (docs/reliability.md: forcing them out cost a quarter of a restore). It imports nothing of
ckptvault's, so a module loaded first thing by the CLI (the keyfile's) pays nothing for it."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Callable


def fsync_dir(path: str) -> None:
    """Make the names in a folder durable (a rename or a new entry survives a power loss)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_with(path: str, make: Callable[[str], object], prefix: str) -> None:
    """``make(tmp)`` a new file beside ``path`` under a temporary name starting with ``prefix``, then rename
    it over ``path``: a reader finds the old file or the new one, whole. The temporary file goes if anything
    fails (a full disk must not be filled further by each retry). Not synced: for state that may be lost."""
    tmp = os.path.join(os.path.dirname(path), prefix + secrets.token_hex(4))
    try:
        make(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def pwrite_all(fd: int, data: bytes | memoryview, offset: int, what: str) -> None:
    """Write all of ``data`` at ``offset``: a short write is continued, one that makes no progress
    fails (a stalled device must not spin a thread forever)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"write of {what} made no progress")
        view, offset = view[n:], offset + n
