"""Local object writes: large files bypass the page cache (O_DIRECT) and still land byte-exact;
a filesystem without O_DIRECT falls back to ordinary writes."""

import errno
import mmap
import os
from pathlib import Path

import pytest

from ckptvault.store import localwrite
from ckptvault.store.localwrite import ALIGN, DIRECT_MIN, STAGE_SIZE, LocalWriter
from tests.support.openflags import open_flags_spy

SIZES = [0, 1, ALIGN - 1, DIRECT_MIN - 1, DIRECT_MIN, DIRECT_MIN + 1, STAGE_SIZE + ALIGN + 7, 3 * STAGE_SIZE + 12345]


@pytest.mark.parametrize("size", SIZES)
def test_files_of_every_size_are_written_exactly(tmp_path: Path, size: int):
    data = os.urandom(size)
    path = tmp_path / "object"
    LocalWriter().create(str(path), memoryview(bytearray(data)))  # how packs arrive: a view of their buffer
    assert path.read_bytes() == data


def test_an_existing_file_is_never_overwritten(tmp_path: Path):
    path = tmp_path / "object"
    path.write_bytes(b"first")
    with pytest.raises(FileExistsError):
        LocalWriter().create(str(path), os.urandom(DIRECT_MIN))
    assert path.read_bytes() == b"first"


@pytest.mark.skipif(not localwrite.O_DIRECT, reason="this platform has no O_DIRECT")
def test_a_filesystem_without_o_direct_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    real_open = os.open

    def no_direct(path, flags, *args):  # what tmpfs answers
        if flags & localwrite.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(localwrite.os, "open", no_direct)
    writer = LocalWriter()
    data = os.urandom(DIRECT_MIN + 5)
    writer.create(str(tmp_path / "a"), data)
    assert writer.direct is False
    assert (tmp_path / "a").read_bytes() == data
    writer.create(str(tmp_path / "b"), data)  # remembered: no second try
    assert (tmp_path / "b").read_bytes() == data


@pytest.mark.skipif(not localwrite.O_DIRECT, reason="this platform has no O_DIRECT")
def test_large_files_really_take_the_direct_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    flags_seen = open_flags_spy(monkeypatch)
    writer = LocalWriter()
    writer.create(str(tmp_path / "big"), os.urandom(DIRECT_MIN))
    writer.create(str(tmp_path / "small"), b"index")
    if not writer.direct:
        pytest.skip(f"the filesystem of {tmp_path} has no O_DIRECT")
    assert flags_seen[0] & localwrite.O_DIRECT and not flags_seen[-1] & localwrite.O_DIRECT


@pytest.mark.skipif(not localwrite.O_DIRECT, reason="this platform has no O_DIRECT")
def test_short_direct_writes_are_continued_without_rewriting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    real_pwrite = os.pwrite
    written: list[int] = []

    def half_at_most(fd, data, offset):  # a short write of whole blocks, as a busy device may answer
        n = real_pwrite(fd, memoryview(data)[: max(ALIGN, len(data) // 2 // ALIGN * ALIGN)], offset)
        written.append(n)
        return n

    monkeypatch.setattr(localwrite.os, "pwrite", half_at_most)
    writer = LocalWriter()
    data = os.urandom(2 * STAGE_SIZE + 12345)
    writer.create(str(tmp_path / "big"), data)
    if not writer.direct:
        pytest.skip(f"the filesystem of {tmp_path} has no O_DIRECT")
    assert (tmp_path / "big").read_bytes() == data
    assert sum(written) == -(-len(data) // ALIGN) * ALIGN  # every block written once


@pytest.mark.skipif(not localwrite.O_DIRECT, reason="this platform has no O_DIRECT")
@pytest.mark.parametrize("size", [DIRECT_MIN, DIRECT_MIN + 1, 3 * STAGE_SIZE + ALIGN - 1])
def test_a_page_aligned_buffer_is_written_without_staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int):
    """A pack's own buffer (an anonymous mapping) goes to the disk as it is; only its partial last
    block passes through the staging buffer."""
    buffer = mmap.mmap(-1, size + ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data = os.urandom(size)
    buffer[:size] = data
    staged: list[int] = []
    real_copy_into = localwrite.copy_into

    def spy(dst, offset, src):
        staged.append(memoryview(src).nbytes)
        real_copy_into(dst, offset, src)

    monkeypatch.setattr(localwrite, "copy_into", spy)
    writer = LocalWriter()
    writer.create(str(tmp_path / "pack"), memoryview(buffer)[:size])
    if not writer.direct:
        pytest.skip(f"the filesystem of {tmp_path} has no O_DIRECT")
    assert (tmp_path / "pack").read_bytes() == data
    assert staged == ([size % ALIGN] if size % ALIGN else [])
