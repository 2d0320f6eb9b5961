"""Restored files are written range by range: page-aligned middles with O_DIRECT, ragged ends through
the page cache. Whatever the alignment, order or filesystem, the file must end up byte-exact."""

import errno
import itertools
import os
import random
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.ops import filewrite
from ckptvault.ops.filewrite import ALIGN, DIRECT_MIN, RangeWriter, StagingBuffers, align_down, align_up

SIZE = DIRECT_MIN + 3 * ALIGN + 123


def write_in_ranges(path: Path, data: bytes, cuts: list[int], buffers: StagingBuffers, seed: int = 0) -> None:
    """Write ``data`` as the ranges between ``cuts``, in a shuffled order, as a restore does."""
    bounds = [0, *sorted(cuts), len(data)]
    ranges = list(itertools.pairwise(bounds))
    random.Random(seed).shuffle(ranges)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, len(data))
        writer = RangeWriter(str(path), fd, len(data), buffers)
        try:
            for start, end in ranges:
                base = align_down(start)
                staging = buffers.take(align_up(end) - base)
                with memoryview(staging) as view:
                    view[start - base : end - base] = data[start:end]
                    writer.write(view, base, start, end)
                buffers.give(staging)
        finally:
            writer.close()
    finally:
        os.close(fd)


@pytest.mark.parametrize("seed", range(6))
def test_ranges_at_any_alignment_land_byte_exact(tmp_path: Path, seed: int):
    rng = random.Random(seed)
    data = os.urandom(SIZE)
    # cuts on, beside and far from page boundaries, and ranges shorter than a page
    cuts = {ALIGN, ALIGN + 1, 2 * ALIGN - 1, 5 * ALIGN + 17, 5 * ALIGN + 100}
    cuts.update(rng.randrange(1, SIZE) for _ in range(5))
    buffers = StagingBuffers()
    write_in_ranges(tmp_path / "f", data, sorted(cuts), buffers, seed)
    assert (tmp_path / "f").read_bytes() == data


def test_the_direct_path_is_taken_for_large_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    if not filewrite.O_DIRECT:
        pytest.skip("this platform has no O_DIRECT")
    flags_seen: list[int] = []
    real_open = os.open

    def spy(path, flags, *args):
        flags_seen.append(flags)
        return real_open(path, flags, *args)

    monkeypatch.setattr(filewrite.os, "open", spy)
    buffers = StagingBuffers()
    data = os.urandom(SIZE)
    write_in_ranges(tmp_path / "f", data, [ALIGN + 5], buffers)
    if not buffers.direct:
        pytest.skip(f"the filesystem of {tmp_path} has no O_DIRECT")
    assert any(flags & filewrite.O_DIRECT for flags in flags_seen)
    assert (tmp_path / "f").read_bytes() == data


def test_a_filesystem_refusing_o_direct_at_open_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    real_open = os.open

    def no_direct(path, flags, *args):  # what tmpfs answers
        if filewrite.O_DIRECT and flags & filewrite.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(filewrite.os, "open", no_direct)
    buffers = StagingBuffers()
    data = os.urandom(SIZE)
    write_in_ranges(tmp_path / "f", data, [ALIGN + 5, 3 * ALIGN], buffers)
    assert buffers.direct is False
    assert (tmp_path / "f").read_bytes() == data


def test_refused_or_short_direct_writes_are_finished_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    if not filewrite.O_DIRECT:
        pytest.skip("this platform has no O_DIRECT")
    real_pwrite = os.pwrite
    direct_fds: set[int] = set()
    real_open = os.open
    calls = {"n": 0}

    def track_open(path, flags, *args):
        fd = real_open(path, flags, *args)
        if flags & filewrite.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def flaky(fd, data, offset):
        if fd in direct_fds:
            calls["n"] += 1
            if calls["n"] == 1:  # a write that reports stopping mid-block
                real_pwrite(fd, memoryview(data)[:ALIGN], offset)
                return 7
            raise OSError(errno.EINVAL, "Invalid argument")  # then a refusal
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(filewrite.os, "open", track_open)
    monkeypatch.setattr(filewrite.os, "pwrite", flaky)
    buffers = StagingBuffers()
    data = os.urandom(SIZE)
    write_in_ranges(tmp_path / "f", data, [2 * ALIGN, DIRECT_MIN // 2 + 3], buffers)
    if not direct_fds:
        pytest.skip(f"the filesystem of {tmp_path} has no O_DIRECT")
    assert calls["n"] >= 2 and buffers.direct is False
    assert (tmp_path / "f").read_bytes() == data


def test_zero_chunks_between_data_chunks_stay_holes_and_the_file_is_exact(tmp_path: Path):
    """Zero chunks inside one restore range are skipped (holes), the data chunks around them written."""
    src = tmp_path / "src"
    src.mkdir()
    mib = 1 << 20
    # the chunker cuts runs of zeros at its 4 MiB maximum: each 12 MiB run holds two whole zero chunks
    pieces = [os.urandom(mib), bytes(12 * mib), os.urandom(mib + 5), bytes(12 * mib), os.urandom(3 * mib + 1)]
    data = b"".join(pieces)
    (src / "model.bin").write_bytes(data)
    vault = Vault.init(str(tmp_path / "repo"))
    vault.backup(src)
    out = tmp_path / "out"
    vault.restore("latest", out)
    restored = out / "model.bin"
    assert restored.read_bytes() == data
    assert restored.stat().st_blocks * 512 < len(data) - 15 * mib, "the zero chunks were written, not left as holes"
