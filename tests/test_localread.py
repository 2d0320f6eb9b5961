"""Local range reads: large ones bypass the page cache (O_DIRECT), into a buffer a fork leaves out, and
still return exactly the bytes asked for; a filesystem without O_DIRECT, a direct read that fails or comes
back short, and a range read a second time go through the page cache."""

import errno
import fcntl
import os
from pathlib import Path

import pytest

from ckptvault.store import localread
from ckptvault.store.localread import DIRECT_READ_MIN, LocalReader
from ckptvault.store.localwrite import ALIGN
from tests.support.openflags import open_flags_spy

pytestmark = pytest.mark.skipif(not localread.DIRECT_READS, reason="this platform has no O_DIRECT or MADV_DONTFORK")

SIZE = 3 * DIRECT_READ_MIN + 3 * ALIGN + 123  # a file whose end is not on a block boundary


@pytest.fixture
def packfile(tmp_path: Path) -> tuple[str, bytes]:
    data = os.urandom(SIZE)
    path = tmp_path / "pack"
    path.write_bytes(data)
    return str(path), data


@pytest.mark.parametrize("start", [0, 1, ALIGN - 1, ALIGN, 5 * ALIGN + 17])
@pytest.mark.parametrize("length", [DIRECT_READ_MIN, DIRECT_READ_MIN + 1, 2 * DIRECT_READ_MIN + ALIGN - 3])
def test_large_reads_return_exactly_the_range(packfile, monkeypatch: pytest.MonkeyPatch, start: int, length: int):
    path, data = packfile
    seen = open_flags_spy(monkeypatch)
    reader = LocalReader()
    assert reader.read(path, start, length) == data[start : start + length]
    if not reader.direct:
        pytest.skip(f"the filesystem of {path} has no O_DIRECT")
    assert seen[0] & localread.O_DIRECT and len(seen) == 1  # direct, and no second read


def test_small_reads_keep_the_page_cache(packfile, monkeypatch: pytest.MonkeyPatch):
    path, data = packfile
    seen = open_flags_spy(monkeypatch)
    assert LocalReader().read(path, 100, DIRECT_READ_MIN - 1) == data[100 : 100 + DIRECT_READ_MIN - 1]
    assert not seen[0] & localread.O_DIRECT


@pytest.mark.parametrize("past_the_end", [0, 1, ALIGN, 10 * ALIGN])
def test_a_read_at_the_end_of_the_file_returns_what_is_there(packfile, past_the_end: int):
    path, data = packfile
    start = SIZE - DIRECT_READ_MIN - 77
    assert LocalReader().read(path, start, DIRECT_READ_MIN + 77 + past_the_end) == data[start:]


def test_unwritten_changes_are_read(tmp_path: Path):
    """A direct read of a file whose new bytes are still only in the page cache gets the new bytes."""
    path = tmp_path / "pack"
    path.write_bytes(bytes(SIZE))
    fresh = os.urandom(SIZE)
    with open(path, "r+b") as f:
        f.write(fresh)  # no fsync
    assert LocalReader().read(str(path), 3, 2 * DIRECT_READ_MIN) == fresh[3 : 3 + 2 * DIRECT_READ_MIN]


@pytest.mark.parametrize("answer", [errno.EINVAL, errno.EOPNOTSUPP])
def test_a_filesystem_without_o_direct_falls_back(packfile, monkeypatch: pytest.MonkeyPatch, answer: int):
    """EINVAL is what the kernel's filesystems answer (tmpfs before 6.6); a FUSE server may answer EOPNOTSUPP,
    and every restore then failed (after six retries) while check --read-data, reading buffered, passed."""
    path, data = packfile
    real_open = os.open
    opened: list[int] = []

    def no_direct(path, flags, *args):
        opened.append(flags)
        if flags & localread.O_DIRECT:
            raise OSError(answer, os.strerror(answer))
        return real_open(path, flags, *args)

    monkeypatch.setattr(localread.os, "open", no_direct)
    reader = LocalReader()
    assert reader.read(path, 7, DIRECT_READ_MIN) == data[7 : 7 + DIRECT_READ_MIN]
    assert reader.direct is False
    assert reader.read(path, 9, DIRECT_READ_MIN) == data[9 : 9 + DIRECT_READ_MIN]
    assert [bool(f & localread.O_DIRECT) for f in opened] == [True, False, False]  # remembered: no second try


def test_a_short_direct_read_is_done_again_buffered(packfile, monkeypatch: pytest.MonkeyPatch):
    """A filesystem may split a read: the buffered read, continued to the end of the file, decides."""
    path, data = packfile
    real_preadv = os.preadv

    def one_block(fd, buffers, offset):
        return real_preadv(fd, [memoryview(buffers[0])[:ALIGN]], offset)

    monkeypatch.setattr(localread.os, "preadv", one_block)
    reader = LocalReader()
    assert reader.read(path, 10, 2 * DIRECT_READ_MIN) == data[10 : 10 + 2 * DIRECT_READ_MIN]
    assert reader.direct  # a short read says nothing about O_DIRECT


def test_another_failure_of_a_direct_read_is_answered_by_a_buffered_one(packfile, monkeypatch: pytest.MonkeyPatch):
    path, data = packfile
    real_preadv = os.preadv

    def failing(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & localread.O_DIRECT:
            raise OSError(errno.EIO, "Input/output error")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(localread.os, "preadv", failing)
    reader = LocalReader()
    assert reader.read(path, 10, DIRECT_READ_MIN) == data[10 : 10 + DIRECT_READ_MIN]
    assert reader.direct  # one failed read says nothing about the filesystem
    monkeypatch.setattr(localread, "_read_buffered", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    with pytest.raises(OSError, match="EIO"):  # what the buffered read finds is what is raised
        reader.read(path, 20, DIRECT_READ_MIN)


def test_a_missing_file_is_missing(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        LocalReader().read(str(tmp_path / "missing"), 0, DIRECT_READ_MIN)


def test_a_range_read_again_goes_through_the_page_cache(packfile, monkeypatch: pytest.MonkeyPatch):
    """A chunk that several files share (Lightning's last.ckpt beside the epoch's copy) was read from the
    disk once per copy: 150 copies of a 3 MB file restored in 1.5-1.8 s against 0.7-1.0 s buffered."""
    path, data = packfile
    seen = open_flags_spy(monkeypatch)
    reader = LocalReader()
    for _ in range(3):
        assert reader.read(path, 5, DIRECT_READ_MIN) == data[5 : 5 + DIRECT_READ_MIN]
    if not reader.direct:
        pytest.skip(f"the filesystem of {path} has no O_DIRECT")
    assert [bool(f & localread.O_DIRECT) for f in seen] == [True, False, False]


def test_the_buffer_the_disk_fills_is_wiped_in_a_forked_child(packfile):
    """A training process forks (DataLoader workers) while backup_async or a restore reads: on kernels before
    5.19 the child could take the pages of a buffer the disk was filling with O_DIRECT, and the read land in
    the child. The buffer is marked MADV_WIPEONFORK ("wf" in /proc/self/smaps): the child gets it zeroed."""
    import ctypes
    import threading

    path, data = packfile
    flags: list[str] = []

    def read_and_look():  # the buffer is the thread's: gone with it
        assert LocalReader().read(path, 0, 2 * DIRECT_READ_MIN) == data[: 2 * DIRECT_READ_MIN]
        flags.extend(_mapping_flags(ctypes.addressof(ctypes.c_char.from_buffer(localread._buffers.mapping))))

    reader = threading.Thread(target=read_and_look)
    reader.start()
    reader.join()
    assert "wf" in flags, flags


def test_a_forked_child_reads_through_the_buffer_it_inherited_without_touching_its_own_memory(packfile):
    """With MADV_DONTFORK the child kept the buffer object of the thread that forked, over memory it no
    longer mapped: its next mapping landed there, and its next direct read wrote pack bytes into it (rv47 H1)."""
    import mmap

    path, data = packfile
    reader = LocalReader()
    assert reader.read(path, 0, 2 * DIRECT_READ_MIN) == data[: 2 * DIRECT_READ_MIN]  # this thread's buffer made
    pid = os.fork()
    if pid == 0:  # the child: no pytest, only os._exit
        ok = False
        try:
            own = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            own[:8] = b"CHILDOBJ"
            read = LocalReader().read(path, ALIGN, 2 * DIRECT_READ_MIN)
            ok = read == data[ALIGN : ALIGN + 2 * DIRECT_READ_MIN] and own[:8] == b"CHILDOBJ"
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert reader.read(path, 5, 2 * DIRECT_READ_MIN) == data[5 : 5 + 2 * DIRECT_READ_MIN]  # the parent's still good


def _mapping_flags(address: int) -> list[str]:
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for i, line in enumerate(lines):
        low, _, high = line.split(" ", 1)[0].partition("-")
        if high and int(low, 16) <= address < int(high, 16):
            return next(x for x in lines[i + 1 :] if x.startswith("VmFlags:")).split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_api_reads_packs_direct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A restore through the API (a training job resuming) reads the packs with O_DIRECT, as the CLI does."""
    from ckptvault import Vault

    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(3 * 1024 * 1024)
    (src / "w.bin").write_bytes(data)
    vault = Vault.init(str(tmp_path / "v"))
    vault.backup(str(src))
    try:
        os.close(os.open(src / "w.bin", os.O_RDONLY | localread.O_DIRECT))
    except OSError:
        pytest.skip(f"the filesystem of {tmp_path} has no O_DIRECT")
    real_open, direct = os.open, []

    def watched(path, flags, *args):
        if "/packs/" in str(path) and flags & localread.O_DIRECT:
            direct.append(path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", watched)
    vault.restore("latest", str(tmp_path / "out"))
    vault.close()
    assert (tmp_path / "out" / "w.bin").read_bytes() == data
    assert direct
