"""Tensor-aligned pieces: how a backup with delta coding cuts a tensor file into chunks.

Content-defined cut points buy nothing inside a densely changing tensor, and they give a changed
piece no natural partner in the previous save. With delta coding on, each tensor of at least the
chunker's minimum size is cut into pieces of ``piece_size`` bytes counted from its first byte, so
piece k of tensor T lies exactly where piece k of T lay in the previous save (its delta base,
ops/deltabase.py), and a frozen tensor yields the very same chunks again, wherever the header
moved it to. The bytes outside such tensors (the header, small tensors, gaps between torch
records) are still cut by content, region by region, as the whole file is without delta coding.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from ..bytegroup import ElementRun
from ..chunking import ChunkerParams, Readable, iter_chunks
from ..codec import Compressor
from ..formats import FileLayout, ReadAt, TensorInfo
from .elements import ElementMap, map_from_layout


@dataclass(frozen=True, slots=True)
class Segment:
    """File bytes ``[start, end)``: one piece of ``tensor``, or (``tensor`` None) a loose region
    that is cut by content."""

    start: int
    end: int
    tensor: TensorInfo | None

    @property
    def length(self) -> int:
        return self.end - self.start


def piece_size(params: ChunkerParams) -> int:
    """The repository's average chunk size, in whole 64-byte units (every element width divides
    it), so aligned pieces are as many and as large as content-defined chunks would be."""
    return max(64, params.avg_size // 64 * 64)


def tensor_pieces(start: int, end: int, params: ChunkerParams) -> list[tuple[int, int]]:
    """``[start, end)`` cut every ``piece_size`` bytes; a remainder shorter than the chunker's minimum
    joins the last piece when that stays within the maximum (no tiny chunks). A pure function of the
    tensor's size, so the same tensor is cut the same way in every save."""
    size = piece_size(params)
    cuts = list(range(start, end, size))
    pieces = [(a, min(a + size, end)) for a in cuts]
    if len(pieces) > 1:
        last = pieces[-1][1] - pieces[-1][0]
        if last < params.min_size and size + last <= params.max_size:
            pieces[-2:] = [(pieces[-2][0], end)]
    return pieces


def plan_segments(layout: FileLayout | None, size: int, params: ChunkerParams) -> list[Segment]:
    """Segments covering ``[0, size)`` in order: aligned pieces of every tensor of at least
    ``params.min_size`` bytes, loose regions around them."""
    out: list[Segment] = []
    pos = 0
    for t in sorted(layout.tensors if layout else (), key=lambda t: t.start):
        if t.nbytes < params.min_size or t.start < pos or t.end > size:
            continue  # small, overlapping or past the end: left to the content-defined cuts
        if t.start > pos:
            out.append(Segment(pos, t.start, None))
        out.extend(Segment(a, b, t) for a, b in tensor_pieces(t.start, t.end, params))
        pos = t.end
    if pos < size:
        out.append(Segment(pos, size, None))
    return out


def tensor_widths(layout: FileLayout | None, read_at: ReadAt, compressor: Compressor) -> ElementMap | None:
    """What codec 2 needs (ops/elements.py), from a layout already parsed: each tensor's element
    width, measured on a sample where the header gives no dtype."""
    if not compressor.groups:
        return None
    return map_from_layout(layout, read_at, compressor)


class _Limited:
    """At most ``left`` bytes of ``stream``: one loose region for the content-defined chunker."""

    def __init__(self, stream: Readable, left: int) -> None:
        self.stream = stream
        self.left = left

    def readinto(self, buffer: memoryview, /) -> int:
        if self.left <= 0:
            return 0
        n = self.stream.readinto(buffer[: self.left]) or 0
        self.left -= n
        return n


class ReadableFile(Readable, Protocol):
    def read(self, size: int, /) -> bytes | None: ...


def _read_exact(stream: ReadableFile, length: int) -> memoryview:
    """``length`` bytes (fewer only at the end of the file), in a fresh buffer that workers may keep.
    ``read`` allocates it without zero-filling it first, as ``bytearray(length)`` would: every byte
    of a backup comes through here."""
    parts: list[bytes] = []
    got = 0
    while got < length and (more := stream.read(length - got)):
        parts.append(more)
        got += len(more)
    return memoryview(parts[0] if len(parts) == 1 else b"".join(parts))


def iter_segments(
    stream: ReadableFile, segments: list[Segment], params: ChunkerParams
) -> Iterator[tuple[memoryview, Segment | None]]:
    """The file's chunks, each with the tensor piece it is (None for content-defined chunks of a
    loose region). A file that ends early stops the iteration (the caller notices the size change);
    bytes past the plan (the file grew meanwhile) are cut by content."""
    for seg in segments:
        if seg.tensor is not None:
            data = _read_exact(stream, seg.length)
            if data:
                yield data, seg
            if len(data) < seg.length:
                return
            continue
        got = 0
        if seg.length <= params.min_size:  # the chunker would not cut it: skip its block buffer
            data = _read_exact(stream, seg.length)
            if data:
                yield data, None
            got = len(data)
        else:
            for data in iter_chunks(_Limited(stream, seg.length), params, size_hint=seg.length):
                got += len(data)
                yield data, None
        if got < seg.length:
            return
    for data in iter_chunks(stream, params, size_hint=0):  # what the file gained since its stat: nothing, mostly
        yield data, None


def clip_runs(runs: tuple[ElementRun, ...], start: int, end: int) -> tuple[ElementRun, ...]:
    """The element runs of a chunk restricted to its bytes ``[start, end)``, relative to ``start``
    (whole elements only), for coding a sample of it."""
    out = []
    for run in runs:
        lo, hi = max(run.start, start), min(run.end, end)
        lo = run.start + -(-(lo - run.start) // run.width) * run.width
        hi = lo + (hi - lo) // run.width * run.width if hi > lo else lo
        if hi - lo >= run.width:
            out.append(ElementRun(lo - start, hi - start, run.width))
    return tuple(out)
