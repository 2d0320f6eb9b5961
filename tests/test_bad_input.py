"""Awkward local input: what a backup and restore of it must do (table-driven where it can be)."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import SourceError, UsageError
from tests.conftest import one_file_vault

from .conftest import tree_digest


def names_bytes(root: Path) -> list[bytes]:
    return sorted(os.listdir(os.fsencode(root)))


def build_odd_names(src: Path) -> None:
    for raw in (b"with space.bin", b"new\nline.bin", b"latin1-\xe9\xff.bin", b"tab\tand\\back.bin", b"-dash.bin"):
        with open(os.path.join(os.fsencode(src), raw), "wb") as f:
            f.write(raw * 3)


def build_symlink_loops(src: Path) -> None:
    os.symlink("b", src / "a")
    os.symlink("a", src / "b")
    os.symlink("self", src / "self")
    os.symlink("/nonexistent/target", src / "dangling")
    (src / "weights.bin").write_bytes(b"w")  # a folder of only symlinks is refused like an empty one


def build_empty_files(src: Path) -> None:
    (src / "empty.bin").write_bytes(b"")
    (src / "dir-with-empty").mkdir()
    (src / "dir-with-empty" / "zero").write_bytes(b"")
    (src / "empty-dir").mkdir()


ROUND_TRIPS = {"odd names": build_odd_names, "symlink loops": build_symlink_loops, "empty files": build_empty_files}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_round_trips_exactly(vault: Vault, tmp_path: Path, case: str):
    src = tmp_path / "src"
    src.mkdir()
    ROUND_TRIPS[case](src)
    snap = vault.backup(src)
    vault.restore(snap, tmp_path / "out")
    assert names_bytes(tmp_path / "out") == names_bytes(src)
    assert tree_digest(tmp_path / "out") == tree_digest(src)


def test_special_files_are_skipped_with_warnings(vault: Vault, tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "real.bin").write_bytes(b"data")
    os.mkfifo(src / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(src / "sock"))
    expected = 2
    if os.geteuid() == 0:
        os.mknod(src / "chardev", stat.S_IFCHR | 0o600, os.makedev(1, 3))  # like /dev/null
        expected = 3
    warnings: list[str] = []
    snap = vault.backup(src, on_warning=warnings.append)
    sock.close()
    assert [e.path for e in vault.files(snap)] == ["real.bin"]
    assert len(warnings) == expected and all("special file" in w for w in warnings)


def test_path_given_twice_is_backed_up_once(vault: Vault, tmp_path: Path):
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(1000))
    snap = vault.backup([src, str(src) + "/", tmp_path / "." / "ckpt"])
    assert [e.path for e in vault.files(snap)] == ["w.bin"] and snap.paths == [str(src)]


def test_missing_path_fails_before_anything_is_written(vault: Vault, tmp_path: Path):
    (tmp_path / "ok").mkdir()
    with pytest.raises(SourceError, match="missing: no such file"):
        vault.backup([tmp_path / "ok", tmp_path / "missing"])
    assert vault.snapshots() == [] and vault.locks() == []


def data_extents(path: Path) -> list[tuple[int, int]]:
    """Where ``path`` holds data (SEEK_DATA / SEEK_HOLE): everything else reads as zeros."""
    extents = []
    with open(path, "rb") as f:
        fd, at, size = f.fileno(), 0, os.fstat(f.fileno()).st_size
        while at < size:
            try:
                start = os.lseek(fd, at, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after ``at``
                break
            at = os.lseek(fd, start, os.SEEK_HOLE)
            extents.append((start, at))
    return extents


@pytest.mark.slow
def test_sparse_file_past_4gib_restores_and_stays_sparse(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    big = src / "sparse.bin"
    size = (4 << 30) + (512 << 20)  # offsets past 32 bits
    written = {offset: os.urandom(4096) for offset in (0, 3 << 30, size - 4096)}  # real data among the holes
    with open(big, "wb") as f:
        f.truncate(size)
        for offset, data in written.items():
            f.seek(offset)
            f.write(data)
    with Vault.init(str(tmp_path / "vault")) as vault:
        snap = vault.backup(src)
        assert snap.summary.new_bytes <= 5 * (4 << 20)  # the holes are one deduplicated zero chunk
        vault.restore(snap, tmp_path / "out")  # verified: every chunk, and the whole file's hash
    out = tmp_path / "out" / "sparse.bin"
    assert out.stat().st_size == size
    assert out.stat().st_blocks * 512 < 64 << 20, "the restored file is not sparse"
    # the same bytes, without reading GiBs of zeros: a hole reads as zeros, each data extent is compared
    extents = data_extents(out)
    assert sum(end - start for start, end in extents) < 64 << 20
    with open(out, "rb") as f:
        for start, end in extents:
            expected = bytearray(end - start)
            for offset, data in written.items():
                lo, hi = max(start, offset), min(end, offset + len(data))
                if lo < hi:
                    expected[lo - start : hi - start] = data[lo - offset : hi - offset]
            f.seek(start)
            assert f.read(end - start) == expected, (start, end)
    assert all(any(start <= o and o + 4096 <= end for start, end in extents) for o in written)


def test_a_restore_by_an_id_prefix_shorter_than_4_characters_is_refused(cli, tmp_path: Path):
    """odd46 #9: `restore 1 t2` restored snapshot 1078eaae where step 1 was meant; forget and tag refuse it."""
    repo = one_file_vault(cli, tmp_path)
    snap_id = json.loads(cli("snapshots", "--json", "--repo", repo).stdout)[0]["id"]
    refused = cli("restore", snap_id[:1], str(tmp_path / "t2"), "--repo", repo, check=False)
    assert refused.returncode == 2 and "too short an ID prefix to restore a snapshot by" in refused.stderr.decode()
    assert not (tmp_path / "t2").exists()
    cli("restore", snap_id[:4], str(tmp_path / "t4"), "--repo", repo)
    assert (tmp_path / "t4" / "w.bin").read_bytes() == b"w"


def test_every_command_and_method_that_takes_an_id_prefix_wants_4_characters(cli, tmp_path: Path):
    """cli49 #4, api49 #12: ls, cat, show, snapshots, diff and drill (and ``Vault.snapshot``) took a 1-character
    prefix that restore, forget and tag refuse: a script that worked with `ls 1` failed with `restore 1`, and
    ``v.restore(v.snapshot("1"), ...)`` got around restore's guard."""
    repo = one_file_vault(cli, tmp_path)
    snap_id = json.loads(cli("snapshots", "--json", "--repo", repo).stdout)[0]["id"]
    for short in (snap_id[:1], snap_id[:3]):
        for args in (
            ["ls", short],
            ["cat", short, "w.bin"],
            ["show", short, "w.bin"],
            ["snapshots", short],
            ["diff", short, snap_id],
            ["diff", snap_id, short],
            ["drill", short],
        ):
            refused = cli(*args, "--repo", repo, check=False)
            err = refused.stderr.decode()
            assert refused.returncode == 2, (args, err)
            assert f"{short!r} is too short an ID prefix to name a snapshot by: give at least 4 characters" in err
    assert cli("cat", snap_id[:4], "w.bin", "--repo", repo).stdout == b"w"
    with Vault.open(repo) as vault:
        for call in (
            lambda: vault.snapshot(snap_id[:2]),
            lambda: vault.files(snap_id[:2]),
            lambda: vault.open_file(snap_id[:2], "w.bin"),
            lambda: vault.diff(snap_id[:2], "latest"),
            lambda: vault.drill(snap_id[:2]),
        ):
            with pytest.raises(UsageError, match="too short an ID prefix to name a snapshot by"):
                call()
        assert vault.snapshot(snap_id[:4]).id == snap_id
