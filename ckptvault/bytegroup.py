"""Byte grouping: the lossless permutation behind codec 2 (``bytegroup``), and its payload framing.

Float weights barely compress as they are: every element mixes a low-entropy sign/exponent byte
with near-random mantissa bytes. Regrouping a run of elements of width w into w streams (byte 0 of
every element, then byte 1, ...) puts the exponents together, where zstd shrinks them ~3x, and
leaves the mantissas as a stream that is stored raw at no cost. numpy does the permutation (a
strided copy, several GB/s).

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

import numpy as np

from .errors import MalformedObjectError

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
    arr = np.frombuffer(data, dtype=np.uint8)
    streams: list[memoryview] = []
    pos = 0
    for width, length in segs:
        piece = arr[pos : pos + length]
        if width == 1:
            streams.append(piece.data)
        else:
            grouped = piece.reshape(-1, width).T.copy()  # one strided copy: row i = byte i of every element
            streams.extend(row.data for row in grouped)
        pos += length
    return streams


def join(segs: Sequence[tuple[int, int]], streams: Sequence[bytes | memoryview]) -> bytes:
    """Inverse of ``split``."""
    out = np.empty(sum(length for _, length in segs), dtype=np.uint8)
    pos = 0
    it = iter(streams)
    for width, length in segs:
        piece = out[pos : pos + length].reshape(-1, width)
        for i in range(width):
            piece[:, i] = np.frombuffer(next(it), dtype=np.uint8)
        pos += length
    return out.tobytes()


def pack(segs: Sequence[tuple[int, int]], coded: Sequence[tuple[int, bytes | memoryview]]) -> bytes:
    parts: list[bytes | memoryview] = [_COUNT.pack(len(segs))]
    parts += [_SEGMENT.pack(w, n) for w, n in segs]
    parts += [_STREAM.pack(mode, len(body)) for mode, body in coded]
    parts += [body for _, body in coded]
    return b"".join(parts)


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


def xor(a: bytes | memoryview, b: bytes | memoryview) -> bytes:
    """Byte-wise XOR of two equally long buffers, for codec 3 (numpy: several GB/s). XOR keeps
    element boundaries, so the XOR of two tensor pieces groups exactly like the pieces do."""
    if len(a) != len(b):
        raise ValueError(f"xor of {len(a)} and {len(b)} bytes")
    return np.bitwise_xor(np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)).tobytes()


def stream_sizes(segs: Sequence[tuple[int, int]]) -> list[int]:
    """Raw size of each stream, in payload order."""
    return [length // width for width, length in segs for _ in range(width)]
