"""Byte grouping: the lossless permutation behind codec 2 (``bytegroup``), and its payload framing.

Float weights barely compress as they are: every element mixes a low-entropy sign/exponent byte
with near-random mantissa bytes. Regrouping a run of elements of width w into w streams (byte 0 of
every element, then byte 1, ...) puts the exponents together, where zstd shrinks them ~3x, and
leaves the mantissas as a stream that is stored raw at no cost. numpy does the permutation
(shifts and casts on whole elements, 10-20 GB/s; a strided copy for other widths); it is loaded on
first use, so that commands that code no data (listings, a backup that finds nothing changed) start
without it (~0.1 s).

A chunk is cut into *segments* that cover it in order: ``(width, length)`` with length a multiple
of width; width 1 means "not grouped" (bytes before the first whole element, tails, gaps between
tensors). Payload layout (all integers little-endian)::

    payload = n_segments:u16 | n_segments x (width:u8 | length:u32)
              | n_streams x (mode:u8 | stored_len:u32) | the streams' stored bytes, in order
    n_streams = sum of the widths; segment k contributes its streams 0..width-1, where stream i
    holds bytes i, i+width, i+2*width, ... of the segment; mode 0 = stored, 1 = one zstd frame
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import MalformedObjectError
from .memcopy import joined as joined_off_the_gil

if TYPE_CHECKING:
    import numpy as np

WIDTHS = (1, 2, 4, 8)
MIN_GROUPED = 256  # shorter element runs are not worth their stream headers: stored as width 1
_COUNT = struct.Struct("<H")
_SEGMENT = struct.Struct("<BI")
_STREAM = struct.Struct("<BI")
MODE_STORED = 0
MODE_ZSTD = 1


@dataclass(frozen=True, slots=True)
class ElementRun:
    """Whole elements of ``width`` bytes in ``[start, end)`` of a chunk (offsets within the chunk)."""

    start: int
    end: int
    width: int


def segments(size: int, runs: Sequence[ElementRun]) -> list[tuple[int, int]]:
    """(width, length) pieces covering ``[0, size)``: the runs, merged where they touch with the
    same width, and width-1 pieces in between. Runs must be sorted and not overlap."""
    out: list[tuple[int, int]] = []
    pos = 0

    def add(width: int, length: int) -> None:
        if length <= 0:
            return
        if out and out[-1][0] == width:
            out[-1] = (width, out[-1][1] + length)
        else:
            out.append((width, length))

    for run in runs:
        if run.width not in WIDTHS or run.start < pos or run.end > size or (run.end - run.start) % run.width:
            raise ValueError(f"bad element run {run} for a {size}-byte chunk")
        add(1, run.start - pos)
        length = run.end - run.start
        add(run.width if length >= MIN_GROUPED else 1, length)
        pos = run.end
    add(1, size - pos)
    return out


def split(data: bytes | memoryview, segs: Sequence[tuple[int, int]]) -> list[memoryview]:
    """The streams of every segment, in payload order."""
    import numpy as np

    arr = np.frombuffer(data, dtype=np.uint8)
    streams: list[memoryview] = []
    pos = 0
    for width, length in segs:
        piece = arr[pos : pos + length]
        if width == 1:
            streams.append(piece.data)
        else:
            streams.extend(row.data for row in _split_elements(piece, width))
        pos += length
    return streams


@dataclass(frozen=True, slots=True)
class Grouped:
    """A codec-2 chunk decoded as far as its streams, not joined. A delta against it is undone stream by
    stream (XOR commutes with the grouping), so a restore joins each changed chunk once, not twice."""

    segs: list[tuple[int, int]]
    streams: list[bytes | memoryview]

    def __len__(self) -> int:
        return sum(length for _, length in self.segs)

    def join(self) -> memoryview:
        return join(self.segs, self.streams)


def joined(data: bytes | memoryview | Grouped) -> bytes | memoryview:
    """The plaintext, whether ``data`` is one already or a chunk's streams."""
    return data.join() if isinstance(data, Grouped) else data


def join(segs: Sequence[tuple[int, int]], streams: Sequence[bytes | memoryview]) -> memoryview:
    """Inverse of ``split``, in a fresh buffer (the shifts and casts run off the GIL; a copy into
    ``bytes`` would hold it, stalling the restore's other threads)."""
    import numpy as np

    out = np.empty(sum(length for _, length in segs), dtype=np.uint8)
    pos = 0
    it = iter(streams)
    for width, length in segs:
        _join_elements(out[pos : pos + length], [np.frombuffer(next(it), dtype=np.uint8) for _ in range(width)])
        pos += length
    return memoryview(out).cast("B").toreadonly()  # type: ignore[arg-type]


# Widths 2 and 4 are regrouped with shifts and narrowing or widening casts on whole elements, which
# numpy runs with SIMD: on 4 MiB here, split 20 / 10 GB/s and join 12 / 8 GB/s for widths 2 / 4, where
# a strided transpose does 4 GB/s either way. Elements are viewed as little-endian integers (numpy
# swaps bytes on a big-endian host), so byte i of the data stays byte i of the element; the ufuncs
# compute in native integers (their ``dtype`` selects no byte order).
_ELEMENT = {2: "<u2", 4: "<u4"}


def _split_elements(piece: np.ndarray, width: int) -> list[np.ndarray]:
    """Byte 0 of every element, byte 1 of every element, ...: ``width`` arrays."""
    import numpy as np

    if width not in _ELEMENT:
        return list(piece.reshape(-1, width).T.copy())  # one strided copy: row i = byte i of every element
    if piece.ctypes.data % width:
        piece = piece.copy()  # numpy reads misaligned elements on a slow path: realign once
    elements = piece.view(_ELEMENT[width])
    if width == 2:
        return [elements.astype(np.uint8), (elements >> 8).astype(np.uint8)]
    low, high = elements.astype(np.uint16), (elements >> 16).astype(np.uint16)
    return [low.astype(np.uint8), (low >> 8).astype(np.uint8), high.astype(np.uint8), (high >> 8).astype(np.uint8)]


def _join_elements(out: np.ndarray, streams: list[np.ndarray]) -> None:
    """Write the elements whose bytes ``streams`` hold (byte 0 of each, byte 1, ...) into ``out``."""
    import numpy as np

    width = len(streams)
    if width == 1:
        out[:] = streams[0]
        return
    if width not in _ELEMENT:
        grid = out.reshape(-1, width)
        for i, stream in enumerate(streams):
            grid[:, i] = stream
        return
    aligned = out.ctypes.data % width == 0
    elements = out.view(_ELEMENT[width]) if aligned else np.empty(len(out) // width, _ELEMENT[width])
    if width == 2:
        np.left_shift(streams[1], 8, out=elements, dtype=np.uint16)
        elements |= streams[0]
    else:
        low = np.left_shift(streams[1], 8, dtype=np.uint16)
        low |= streams[0]
        high = np.left_shift(streams[3], 8, dtype=np.uint16)
        high |= streams[2]
        elements[:] = high
        elements <<= 16
        elements |= low
    if not aligned:
        out[:] = elements.view(np.uint8)


def pack(segs: Sequence[tuple[int, int]], coded: Sequence[tuple[int, bytes | memoryview]]) -> bytes | memoryview:
    head = b"".join(
        [_COUNT.pack(len(segs)), *(_SEGMENT.pack(w, n) for w, n in segs), *(_STREAM.pack(m, len(b)) for m, b in coded)]
    )
    return joined_off_the_gil([head, *(body for _, body in coded)])  # the bodies, most of a chunk, off the GIL


def unpack(payload: bytes | memoryview) -> tuple[list[tuple[int, int]], list[tuple[int, memoryview]]]:
    """Segments and (mode, stored bytes) per stream; raises MalformedObjectError on any inconsistency."""
    view = memoryview(payload)
    try:
        (n,) = _COUNT.unpack_from(view, 0)
        pos = _COUNT.size
        segs = []
        for _ in range(n):
            width, length = _SEGMENT.unpack_from(view, pos)
            pos += _SEGMENT.size
            if width not in WIDTHS or length % width:
                raise MalformedObjectError(f"bytegroup segment of {length} bytes with width {width}")
            segs.append((width, length))
        heads = []
        for _ in range(sum(w for w, _ in segs)):
            heads.append(_STREAM.unpack_from(view, pos))
            pos += _STREAM.size
    except struct.error as exc:
        raise MalformedObjectError(f"bytegroup payload is truncated ({exc})") from None
    streams = []
    for mode, stored in heads:
        if mode not in (MODE_STORED, MODE_ZSTD) or pos + stored > len(view):
            raise MalformedObjectError("bytegroup stream table is inconsistent")
        streams.append((mode, view[pos : pos + stored]))
        pos += stored
    if pos != len(view):
        raise MalformedObjectError("bytegroup payload has trailing bytes")
    return segs, streams


def xor(a: bytes | memoryview, b: bytes | memoryview) -> memoryview:
    """Byte-wise XOR of two equally long buffers, for codec 3 (numpy: several GB/s), in a fresh buffer
    (not copied into ``bytes``: that copy holds the GIL). XOR keeps element boundaries, so the XOR of
    two tensor pieces groups exactly like the pieces do."""
    if len(a) != len(b):
        raise ValueError(f"xor of {len(a)} and {len(b)} bytes")
    import numpy as np

    out = np.bitwise_xor(np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8))
    return memoryview(out).cast("B").toreadonly()  # type: ignore[arg-type]


def stream_sizes(segs: Sequence[tuple[int, int]]) -> list[int]:
    """Raw size of each stream, in payload order."""
    return [length // width for width, length in segs for _ in range(width)]
