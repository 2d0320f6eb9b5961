import io
import os
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptvault.chunking import ChunkerParams, _fastcdc, _fastcdc_function, iter_chunks
from ckptvault.errors import UsageError

SMALL = ChunkerParams(min_size=256, avg_size=1024, max_size=4096)


def whole_buffer_cuts(data: bytes, p: ChunkerParams) -> list[bytes]:
    return [data[c.offset : c.offset + c.length] for c in _fastcdc(data, p.min_size, p.avg_size, p.max_size)]


def test_compiled_chunker_is_in_use():
    loaded = _fastcdc_function().__module__
    assert loaded == "fastcdc.fastcdc_cy", "the Cython FastCDC extension did not load; backups would run at ~10 MB/s"


@given(data=st.binary(min_size=0, max_size=40_000), block=st.integers(min_value=1, max_value=20_000))
def test_streaming_cuts_equal_whole_buffer_cuts(data: bytes, block: int):
    if not data:
        assert list(iter_chunks(io.BytesIO(data), SMALL, block_size=block)) == []
        return
    streamed = [bytes(c) for c in iter_chunks(io.BytesIO(data), SMALL, block_size=block)]
    assert streamed == whole_buffer_cuts(data, SMALL)


class _ShortReads:
    """A stream that hands out at most ``step`` bytes per read, as a pipe or a network mount may."""

    def __init__(self, data: bytes, step: int) -> None:
        self.data, self.step, self.pos = data, step, 0

    def readinto(self, buffer: memoryview) -> int:
        n = min(len(buffer), self.step, len(self.data) - self.pos)
        buffer[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


@pytest.mark.parametrize("block", [2 * SMALL.max_size, 10_000, 50_001])
@pytest.mark.parametrize("step", [3, 4095, 1 << 20])
def test_streaming_across_many_blocks_with_short_reads(block: int, step: int):
    rng = random.Random(block * step)
    data = rng.randbytes(150_000) + bytes(30_000) + rng.randbytes(20_000) * 3 + rng.randbytes(1)
    streamed = [bytes(c) for c in iter_chunks(_ShortReads(data, step), SMALL, block_size=block)]
    assert streamed == whole_buffer_cuts(data, SMALL)


def test_chunks_respect_bounds_on_random_data():
    data = os.urandom(3 * 1024 * 1024)
    p = ChunkerParams()
    chunks = [bytes(c) for c in iter_chunks(io.BytesIO(data), p, block_size=1 << 20)]
    assert b"".join(chunks) == data
    assert all(len(c) <= p.max_size for c in chunks)
    assert all(len(c) >= p.min_size for c in chunks[:-1])


def test_insertion_only_changes_nearby_chunks():
    data = os.urandom(8 * 1024 * 1024)
    p = ChunkerParams(min_size=16 * 1024, avg_size=64 * 1024, max_size=256 * 1024)
    before = {bytes(c) for c in iter_chunks(io.BytesIO(data), p)}
    shifted = data[:1000] + b"inserted" + data[1000:]
    after = [bytes(c) for c in iter_chunks(io.BytesIO(shifted), p)]
    assert sum(c not in before for c in after) <= 3


@pytest.mark.parametrize(
    "kwargs",
    [dict(min_size=1), dict(avg_size=10), dict(max_size=10**10), dict(min_size=4096, avg_size=2048, max_size=8192)],
)
def test_bad_params_are_usage_errors(kwargs):
    with pytest.raises(UsageError):
        ChunkerParams(**kwargs)


class _Recording(io.BytesIO):
    """A stream that records the size of each buffer it is asked to fill."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.asked: list[int] = []

    def readinto(self, buffer) -> int:  # type: ignore[override]
        self.asked.append(len(buffer))
        return super().readinto(buffer)


@given(data=st.binary(min_size=0, max_size=40_000), hint=st.integers(min_value=0, max_value=50_000))
def test_a_size_hint_right_or_wrong_changes_no_cut(data: bytes, hint: int):
    """A file's size from its stat sizes the first block; a file that grew or shrank since still yields all
    its bytes, cut as without the hint (0: a file empty at its stat, written to since)."""
    streamed = [bytes(c) for c in iter_chunks(io.BytesIO(data), SMALL, block_size=8192, size_hint=hint)]
    assert streamed == (whole_buffer_cuts(data, SMALL) if data else [])


@pytest.mark.parametrize("size", [1, 1000, 100_000, 3 << 20])
def test_a_right_size_hint_reads_the_file_into_one_block_of_its_size(size: int):
    """A small file is read into a block of its size (+1: its end is seen at once), not a fresh 8 MiB one,
    and no second block follows."""
    data = os.urandom(size)
    stream = _Recording(data)
    assert b"".join(bytes(c) for c in iter_chunks(stream, ChunkerParams(), size_hint=size)) == data
    assert max(stream.asked) <= size + 1 and len(stream.asked) <= 2, stream.asked


def test_a_size_hint_short_of_the_stream_sizes_the_first_block_only():
    """A file grown since its stat: after the first block, blocks of the usual size (not thousands of reads
    of the hint's size)."""
    data = os.urandom(3 << 20)
    stream = _Recording(data)
    assert [bytes(c) for c in iter_chunks(stream, SMALL, size_hint=1000)] == whole_buffer_cuts(data, SMALL)
    assert len(stream.asked) <= 3, len(stream.asked)
