"""Copies of large buffers that let other threads run meanwhile.

A slice assignment (``dst[a:b] = src``) or ``bytearray(n)`` copies or zero-fills while holding
the GIL, so a backup shipping from a training process holds up the training thread for every
byte it moves into a pack. numpy releases the GIL for the copy itself: on this project's 2-core
machine a pure-Python thread kept 0.47x of its speed beside a thread copying 16 MiB slices, and
all of it beside one copying them with numpy (loaded on the first large copy: a command that
moves no data starts without it).
"""

from __future__ import annotations

import mmap

# Below this, numpy's call costs more than the copy it would take off the GIL.
MIN_RELEASED = 64 * 1024


def copy_into(dst: bytearray | mmap.mmap | memoryview, offset: int, src: bytes | bytearray | memoryview) -> None:
    """``dst[offset : offset + len(src)] = src`` for a writable buffer ``dst`` that is long enough."""
    n = memoryview(src).nbytes
    if n < MIN_RELEASED:
        memoryview(dst)[offset : offset + n] = memoryview(src).cast("B")
        return
    import numpy as np

    np.copyto(np.frombuffer(dst, np.uint8, n, offset), np.frombuffer(src, np.uint8))


def empty(n: int) -> memoryview:
    """A fresh writable buffer of ``n`` bytes, not zero-filled when large (``bytearray(n)`` zero-fills
    under the GIL; the pages here are first touched by whatever fills them, a read that releases it).
    A small one is a bytearray: an encrypted vault decrypts its snapshot objects into such buffers, and
    loading numpy for them (~0.1-0.18 s on a slow VM) made `snapshots` wait for it after the key."""
    if n < MIN_RELEASED:
        return memoryview(bytearray(n))
    import numpy as np

    return memoryview(np.empty(n, np.uint8)).cast("B")  # type: ignore[arg-type]


def joined(parts: list[bytes | memoryview]) -> bytes | memoryview:
    """``b"".join(parts)``, the large parts copied off the GIL; a single part is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    out = empty(sum(memoryview(part).nbytes for part in parts))
    pos = 0
    for part in parts:
        copy_into(out, pos, part)
        pos += memoryview(part).nbytes
    return out
