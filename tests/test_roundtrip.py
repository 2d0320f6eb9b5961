"""Random trees restore bit-exact: content, permission bits, mtimes, symlinks, empty dirs."""

import os
import random
import shutil
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptvault import Vault
from ckptvault.chunking import ChunkerParams

from .conftest import tree_digest

names = st.text(alphabet="abcdefghij_-.é", min_size=1, max_size=8).filter(lambda n: n not in (".", ".."))


@st.composite
def file_contents(draw):
    kind = draw(st.sampled_from(["empty", "tiny", "multi", "repetitive"]))
    if kind == "empty":
        return b""
    if kind == "tiny":
        return draw(st.binary(min_size=1, max_size=100))
    seed = draw(st.integers(0, 2**32))
    size = draw(st.integers(70_000, 400_000))
    if kind == "repetitive":
        return (seed.to_bytes(8, "little") * 3) * (size // 24)
    return random.Random(seed).randbytes(size)


tree_spec = st.dictionaries(
    st.lists(names, min_size=1, max_size=3).map(tuple),
    st.one_of(
        st.tuples(st.just("file"), file_contents(), st.sampled_from([0o644, 0o600, 0o755, 0o400])),
        st.tuples(st.just("link"), names),
        st.tuples(st.just("dir"), st.just(None), st.sampled_from([0o755, 0o700])),
    ),
    min_size=1,
    max_size=8,
)


def build(root: Path, spec) -> None:
    root.mkdir(parents=True)
    for i, (parts, item) in enumerate(sorted(spec.items())):
        path = root.joinpath(*parts)
        if any(p.is_symlink() or (p.exists() and not p.is_dir()) for p in path.parents) or os.path.lexists(path):
            continue  # an earlier entry took this name as a file or link
        path.parent.mkdir(parents=True, exist_ok=True)
        if item[0] == "file":
            path.write_bytes(item[1])
            path.chmod(item[2])
            os.utime(path, ns=(1_600_000_000_000_000_000 + i, 1_600_000_000_123_456_789 + i))
        elif item[0] == "link":
            os.symlink(item[1], path)
        else:
            path.mkdir()
            path.chmod(item[2])
    for dirpath, _, _ in os.walk(root, topdown=False):
        os.utime(dirpath, ns=(1_500_000_000_000_000_000, 1_500_000_000_000_000_000))


@given(spec=tree_spec, use_memory=st.booleans())
def test_random_trees_round_trip(tmp_path_factory, spec, use_memory):
    work = tmp_path_factory.mktemp("rt")
    src = work / "src"
    build(src, spec)
    if not any(p.is_file() and not p.is_symlink() for p in src.rglob("*")):  # backup refuses a tree without files
        (src / next(n for n in ("anchor", "anchor-2") if not (src / n).exists())).write_bytes(b"")
    url = f"memory://rt-{uuid.uuid4().hex}" if use_memory else str(work / "repo")
    small = ChunkerParams(min_size=4096, avg_size=16384, max_size=65536)
    with Vault.init(url, chunker=small, pack_size=1 << 20) as vault:
        snap = vault.backup(src)
        vault.restore(snap.id, work / "out")
    assert tree_digest(work / "out") == tree_digest(src)
    shutil.rmtree(work)


def test_times_past_2262_round_trip(tmp_path: Path, vault):
    """Nanoseconds since 1970 overflow 64 bits in 2262, and Linux stores later times (ext4 to 2446): a
    file dated 2400 was backed up, then its snapshot was refused as damaged (every file in it lost)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "future").write_bytes(b"b")
    (src / "now").write_bytes(b"n")
    year_2400 = 13569465600 * 10**9 + 123
    os.utime(src / "future", ns=(year_2400, year_2400))
    if os.stat(src / "future").st_mtime_ns != year_2400:
        pytest.skip("this filesystem cannot store a time in 2400")
    vault.backup(src)
    vault.restore("latest", tmp_path / "out")
    assert os.stat(tmp_path / "out" / "future").st_mtime_ns == year_2400
    assert tree_digest(tmp_path / "out") == tree_digest(src)


def test_a_rerun_finishes_the_mtime_of_a_link_a_killed_restore_made(tmp_path: Path, vault):
    """A link is made, then given the snapshot's mtime: a restore killed between the two left the link with
    the time of the kill, and every rerun skipped it, as the same link."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"weights")
    (src / "latest").symlink_to("w.bin")
    os.utime(src / "latest", ns=(1_000_000_000, 1_000_000_000), follow_symlinks=False)
    snap = vault.backup(src)
    out = tmp_path / "out"
    vault.restore(snap, out)
    os.utime(out / "latest", follow_symlinks=False)  # now: as the kill left it
    vault.restore(snap, out)
    assert os.lstat(out / "latest").st_mtime_ns == 1_000_000_000


def test_one_worker_at_a_time_writes_a_file(tmp_path: Path, vault, monkeypatch: pytest.MonkeyPatch):
    """A file's chunks are fetched and decoded by several workers at once, but written by one at a time:
    a second buffered writer of the same file spun on its lock in the kernel (ext4), taking a core."""
    import threading
    import time

    from ckptvault.ops import restore

    src = tmp_path / "src"
    src.mkdir()
    data = random.Random(7).randbytes(3 * 1024 * 1024)
    (src / "weights.bin").write_bytes(data)
    vault.backup(src)
    real_pwrite_all = restore.pwrite_all
    writing: dict[int, int] = {}
    most = 0
    mutex = threading.Lock()

    def watched(fd: int, chunk, offset: int, what: str) -> None:
        nonlocal most
        with mutex:
            writing[fd] = writing.get(fd, 0) + 1
            most = max(most, writing[fd])
        time.sleep(0.005)  # a slow page cache: room for another worker to come in
        real_pwrite_all(fd, chunk, offset, what)
        with mutex:
            writing[fd] -= 1

    monkeypatch.setattr(restore, "pwrite_all", watched)
    vault.restore("latest", tmp_path / "out")
    assert (tmp_path / "out" / "weights.bin").read_bytes() == data
    assert most == 1
