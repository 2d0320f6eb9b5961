"""Content-defined chunking: the only module that imports ``fastcdc``.

Chunk boundaries depend only on the bytes from a chunk's start onward, so a file can be
chunked block by block: every chunk that ends before the end of the block in hand is
final, and the unfinished tail is carried into the next block. The result is identical
to chunking the whole file at once, with memory bounded by the block size.
"""

from __future__ import annotations

import functools
import numbers
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import UsageError
from .memcopy import empty


@functools.cache
def _fastcdc_function() -> Callable[[memoryview | bytes, int, int, int], Iterable[Any]]:
    """fastcdc's chunker, loaded by the first chunking: the fastcdc package loads click as well (~15 ms of
    every command's start on a slow 2-core VM), and only a backup that cuts files by content needs it."""
    try:
        from fastcdc.fastcdc_cy import fastcdc_cy

        return fastcdc_cy  # type: ignore[no-any-return]
    except ImportError:  # pragma: no cover - depends on the installed wheel
        warnings.warn(
            "ckptvault: the compiled FastCDC chunker is missing; falling back to pure Python "
            "(about 100x slower). Reinstall with: pip install --force-reinstall fastcdc",
            RuntimeWarning,
            stacklevel=1,
        )
        print("ckptvault: WARNING: pure-Python FastCDC in use, backups will be very slow", file=sys.stderr)
        from fastcdc.fastcdc_py import fastcdc_py

        return fastcdc_py  # type: ignore[no-any-return]


def _fastcdc(data: memoryview | bytes, min_size: int, avg_size: int, max_size: int) -> Iterable[Any]:
    return _fastcdc_function()(data, min_size, avg_size, max_size)


KiB = 1024
MiB = 1024 * KiB
READ_BLOCK = 8 * MiB  # bytes read at a time (at least two chunks of the maximum size)

# fastcdc's own accepted ranges; it only asserts on them, so they are checked here.
_MIN_RANGE = (64, 64 * MiB)
_AVG_RANGE = (256, 256 * MiB)
_MAX_RANGE = (1 * KiB, 1024 * MiB)


@dataclass(frozen=True)
class ChunkerParams:
    """FastCDC sizes in bytes. Stored in the repository config: changing them for an
    existing repository would stop deduplication against what is already stored."""

    min_size: int = 256 * KiB
    avg_size: int = 1 * MiB
    max_size: int = 4 * MiB

    def __post_init__(self) -> None:
        for name, value, (lo, hi) in (
            ("min_size", self.min_size, _MIN_RANGE),
            ("avg_size", self.avg_size, _AVG_RANGE),
            ("max_size", self.max_size, _MAX_RANGE),
        ):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise UsageError(f"chunker {name} must be a whole number of bytes; got {value!r}")
            if not lo <= value <= hi:
                raise UsageError(f"chunker {name}={value!r} is out of range; use {lo}..{hi} bytes")
            object.__setattr__(self, name, int(value))  # numpy's integers too, stored as JSON numbers
        if not self.min_size <= self.avg_size <= self.max_size:
            raise UsageError(
                f"chunker sizes must satisfy min <= avg <= max, got {self.min_size}/{self.avg_size}/{self.max_size}"
            )

    def to_dict(self) -> dict[str, int | str]:
        # frozen: an encrypted vault of format 3 authenticates this form of its config (docs/format.md)
        return {"algorithm": "fastcdc", "min_size": self.min_size, "avg_size": self.avg_size, "max_size": self.max_size}

    @classmethod
    def from_dict(cls, d: dict) -> ChunkerParams:
        if d.get("algorithm") != "fastcdc":
            raise UsageError(f"unknown chunker {d.get('algorithm')!r}")
        return cls(min_size=d["min_size"], avg_size=d["avg_size"], max_size=d["max_size"])


class Readable(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None: ...


def read_block(params: ChunkerParams, block_size: int = READ_BLOCK) -> int:
    return max(block_size, 2 * params.max_size)


def iter_chunks(
    stream: Readable, params: ChunkerParams, block_size: int = READ_BLOCK, size_hint: int | None = None
) -> Iterator[memoryview]:
    """Yield the chunks of ``stream`` as memoryviews.

    Each block is a fresh buffer, so a yielded view stays valid after the generator moves
    on (worker threads may still hold it); peak memory is what the caller keeps alive
    plus one block. ``size_hint``, the stream's length when known, sizes the first block: a
    fresh 8 MiB block for each small file cost a map, an unmap and page faults.
    """
    block_size = read_block(params, block_size)
    size = block_size if size_hint is None else min(block_size, size_hint + 1)  # +1: the end is seen at once
    carry = b""
    eof = False
    while not eof:
        data, eof = next_block(stream, carry, size)
        size = block_size
        filled = len(data)
        if filled == 0:
            return
        last_start = 0
        for chunk in _fastcdc(data, params.min_size, params.avg_size, params.max_size):
            start, end = chunk.offset, chunk.offset + chunk.length
            if end == filled and not eof:
                # May be cut short by the block end: chunk it again with the next block.
                last_start = start
                break
            yield data[start:end]
            last_start = end
        carry = bytes(data[last_start:filled])


def next_block(stream: Readable, carry: bytes | memoryview, size: int) -> tuple[memoryview, bool]:
    """``carry`` and then up to ``size`` bytes of ``stream``, in a fresh buffer; and whether the stream
    ended."""
    view = empty(len(carry) + size)
    view[: len(carry)] = carry
    filled = len(carry)
    while filled < len(view):
        n = stream.readinto(view[filled:])
        if not n:
            return view[:filled], True
        filled += n
    return view, False


def chunk_lengths(data: memoryview, params: ChunkerParams) -> Iterator[int]:
    """The lengths of the chunks ``data`` is cut into as a whole stream. A cut depends on at most
    ``max_size`` bytes from the cut before it, and one found before the end of ``data`` is one that
    any longer stream with the same bytes there gets too."""
    for chunk in _fastcdc(data, params.min_size, params.avg_size, params.max_size):
        yield chunk.length


def first_cut(window: memoryview, params: ChunkerParams) -> int:
    """Length of the chunk that starts ``window``, given ``max_size`` bytes of it or all that is left
    of the stream: the cut ``iter_chunks`` makes there."""
    return next(chunk_lengths(window, params))
