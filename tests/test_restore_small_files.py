"""A file of one chunk is restored whole by one thread: one file after another from a local disk, several at
once from a remote store (where each one waits a round trip), within the restore's bytes in flight."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ckptvault import Vault
from ckptvault.chunking import ChunkerParams
from ckptvault.errors import RestoreIncompleteError, StorageError
from ckptvault.ops import restore as restore_module
from ckptvault.ops.restore import TEMP_MARK
from ckptvault.repository.format import pack_key

from .conftest import tree_digest
from .test_corruption import flip


class SlowStore:
    """A real store whose pack reads each take ``delay`` seconds, as a round trip would; it records how
    many ran at once, and fails the reads of ``failing`` (a pack key) when told."""

    def __init__(self, inner: Any, delay: float = 0.03) -> None:
        self.inner = inner
        self.url = inner.url
        self.delay = delay
        self.failing: str | None = None
        self.reads = 0
        self.peak = 0
        self._running = 0
        self._lock = threading.Lock()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if not key.startswith("packs/"):
            return self.inner.get_range(key, start, length)
        with self._lock:
            self._running += 1
            self.reads += 1
            self.peak = max(self.peak, self._running)
        try:
            time.sleep(self.delay)
            if key == self.failing:
                raise StorageError("GET", key, self.url, "connection reset by peer")
            return self.inner.get_range(key, start, length)
        finally:
            with self._lock:
                self._running -= 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def small_files(root: Path, count: int = 24) -> Path:
    """Files under the test vault's smallest chunk (16 KiB): one chunk each."""
    for i in range(count):
        folder = root / f"rank{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"shard{i:02d}.pt").write_bytes(os.urandom(1_000 + 601 * i))
    return root


def slowed(vault: Vault, *, remote: bool) -> SlowStore:
    repo = vault._repo
    repo.index  # noqa: B018 - loaded now, through the real store: only the files' reads are slowed
    store = SlowStore(repo.store)
    repo.store = store
    repo.remote = remote
    return store


def temp_files(root: Path) -> list[str]:
    return [name for _, _, names in os.walk(root) for name in names if name.startswith(TEMP_MARK)]


@pytest.mark.parametrize("remote", [False, True])
def test_small_files_from_a_remote_store_are_restored_several_at_once(vault: Vault, tmp_path: Path, remote: bool):
    src = small_files(tmp_path / "src")
    vault.backup(src)
    store = slowed(vault, remote=remote)
    result = vault.restore("latest", tmp_path / "out")
    assert tree_digest(tmp_path / "out") == tree_digest(src)
    assert result.files == 24 and result.bytes_written == sum(p.stat().st_size for p in src.rglob("*.pt"))
    assert store.reads == 24 and all(len(e.chunks) == 1 for e in vault.files("latest") if e.type == "file")
    if remote:  # one round trip per file would make 24 files wait 24 round trips
        assert store.peak >= 4
    else:  # a local disk: written one after another on the calling thread, no hand-offs
        assert store.peak == 1


def test_a_damaged_small_file_fails_alone_while_others_are_written_at_once(vault: Vault, repo_url: str, tmp_path: Path):
    src = small_files(tmp_path / "src")
    vault.backup(src)
    victim = vault.files("latest")[5]
    assert victim.type == "file" and len(victim.chunks) == 1
    stored = vault._repo.index.get(victim.chunks[0])
    flip(Path(repo_url) / pack_key(stored.pack_id), stored.offset + stored.stored_len // 2)
    slowed(vault, remote=True)
    with pytest.raises(RestoreIncompleteError) as info:
        vault.restore("latest", tmp_path / "out")
    assert victim.path in str(info.value) and info.value.result.files == 23
    assert not (tmp_path / "out" / victim.path).exists() and not temp_files(tmp_path / "out")
    for path in src.rglob("*.pt"):  # every other file, whole
        rel = path.relative_to(src).as_posix()
        assert rel == victim.path or (tmp_path / "out" / rel).read_bytes() == path.read_bytes()


def test_a_storage_failure_stops_the_small_files_in_flight_and_leaves_no_temporary_file(vault: Vault, tmp_path: Path):
    src = small_files(tmp_path / "src")
    vault.backup(src)
    store = slowed(vault, remote=True)
    entries = [e for e in vault.files("latest") if e.type == "file"]
    store.failing = pack_key(vault._repo.index.get(entries[3].chunks[0]).pack_id)
    with pytest.raises(StorageError, match="connection reset"):
        vault.restore("latest", tmp_path / "out")
    reads = store.reads
    time.sleep(0.2)
    assert store.reads == reads  # nothing goes on reading after the restore raised
    assert not temp_files(tmp_path / "out")
    # what was written is whole, and a rerun completes the rest
    store.failing = None
    vault.restore("latest", tmp_path / "out")
    assert tree_digest(tmp_path / "out") == tree_digest(src)


def small_and_big(src: Path) -> Path:
    src.mkdir()
    (src / "a_small").write_bytes(os.urandom(10_000))
    (src / "b_big").write_bytes(os.urandom(3 << 20))
    return src


def test_a_small_file_failing_on_a_remote_store_ends_the_restore_before_the_next_big_file(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """(Found in review: a small file's failure was looked at only when the next small file needed its slot,
    so the many gigabytes of shards after a failed config.json were written first.)"""
    vault.backup(small_and_big(tmp_path / "src"))
    slowed(vault, remote=True)
    real = restore_module._restore_file

    def failing(repo, pool, entry, dest, *args):
        if entry.path == "a_small":
            raise StorageError("GET", "packs/x", "test://", "connection reset by peer")
        return real(repo, pool, entry, dest, *args)

    monkeypatch.setattr(restore_module, "_restore_file", failing)
    with pytest.raises(StorageError):
        vault.restore("latest", tmp_path / "out")
    assert not (tmp_path / "out" / "b_big").exists()


def test_files_failing_verification_are_named_in_the_snapshots_order(vault: Vault, repo_url: str, tmp_path: Path):
    vault.backup(small_and_big(tmp_path / "src"))
    for entry in vault.files("latest"):
        stored = vault._repo.index.get(entry.chunks[0])
        flip(Path(repo_url) / pack_key(stored.pack_id), stored.offset + stored.stored_len // 2)
    slowed(vault, remote=True)
    with pytest.raises(RestoreIncompleteError) as info:
        vault.restore("latest", tmp_path / "out")
    assert list(info.value.failed) == ["a_small", "b_big"]
    assert "were not written: a_small: chunk" in str(info.value)


@pytest.mark.parametrize("chunks_per_file", [1, 2])
def test_the_bytes_in_flight_from_a_remote_store_stay_within_the_restores_budget(
    repo_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunks_per_file: int
):
    """INFLIGHT_BYTES bounds a restore's memory whatever the download concurrency: scaled down here to a
    4 MiB budget, 1 MiB chunks and 16 downloads (found in review: 16 small files at once read 16 MiB)."""
    monkeypatch.setattr(restore_module, "INFLIGHT_BYTES", 4 << 20)
    vault = Vault.init(repo_url, chunker=ChunkerParams(1 << 20, 1 << 20, 1 << 20), pack_size=8 << 20)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(24):
        (src / f"f{i:02d}").write_bytes(os.urandom(chunks_per_file << 20))
    vault.backup(src)
    store = slowed(vault, remote=True)
    vault._repo.download_concurrency = 16
    held, peak, lock = [0], [0], threading.Lock()
    read = store.get_range

    def counted(key: str, start: int, length: int) -> bytes:
        with lock:
            held[0] += length
            peak[0] = max(peak[0], held[0])
        try:
            return read(key, start, length)
        finally:
            with lock:
                held[0] -= length

    store.get_range = counted  # type: ignore[method-assign]
    vault.restore("latest", tmp_path / "out")
    assert store.peak > 1 and peak[0] <= (4 << 20) + (1 << 20), f"{peak[0] / (1 << 20):.1f} MiB read at once"
    assert all((tmp_path / "out" / p.name).read_bytes() == p.read_bytes() for p in src.iterdir())


class CountingProgress:
    def __init__(self) -> None:
        self.total: int | None = None
        self.advanced: list[int] = []
        self.finished = False

    def start(self, total_bytes: int, total_files: int) -> None:
        self.total = total_bytes

    def advance(self, nbytes: int) -> None:
        self.advanced.append(nbytes)

    def finish(self) -> None:
        self.finished = True


@pytest.mark.parametrize("remote", [False, True])
def test_the_progress_counts_every_restored_byte_once(vault: Vault, tmp_path: Path, remote: bool):
    """Small files and a file of several chunks, from a local disk (the small ones written inline) and from a
    remote store (several at once, counted as each one is finished): the bar ends at its total, not short
    of it or past it."""
    src = small_files(tmp_path / "src")
    (src / "big.pt").write_bytes(os.urandom(1 << 20))  # several of the test vault's chunks: on the pool
    vault.backup(src)
    slowed(vault, remote=remote)
    progress = CountingProgress()
    result = vault.restore("latest", tmp_path / "out", on_progress=progress)
    total = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert progress.total == total == result.bytes_written
    assert sum(progress.advanced) == total and progress.finished


def test_several_small_files_failing_on_a_remote_store_are_named_in_the_snapshots_order(
    vault: Vault, repo_url: str, tmp_path: Path
):
    """Several at once, but their failures are taken oldest first: the snapshot's order."""
    src = small_files(tmp_path / "src")
    vault.backup(src)
    entries = [e for e in vault.files("latest") if e.type == "file"]
    victims = [entries[i] for i in (2, 5, 9, 17)]
    for victim in victims:
        stored = vault._repo.index.get(victim.chunks[0])
        flip(Path(repo_url) / pack_key(stored.pack_id), stored.offset + stored.stored_len // 2)
    slowed(vault, remote=True)
    with pytest.raises(RestoreIncompleteError) as info:
        vault.restore("latest", tmp_path / "out")
    assert list(info.value.failed) == [v.path for v in victims]
    result = info.value.result
    assert result.files == 20  # and the failed files' bytes are not counted as written
    assert result.bytes_written == sum(e.size for e in entries) - sum(v.size for v in victims)


def one_mib_chunks(repo_url: str) -> Vault:
    return Vault.init(repo_url, chunker=ChunkerParams(1 << 20, 1 << 20, 1 << 20), pack_size=8 << 20)


def test_a_finished_small_files_bytes_go_back_to_the_budget(
    repo_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Within a 4 MiB budget, four files of 1 MiB are read at once (four fit it exactly), and go on being read
    four at once to the end: a finished file's bytes are given back."""
    monkeypatch.setattr(restore_module, "INFLIGHT_BYTES", 4 << 20)
    vault = one_mib_chunks(repo_url)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(24):
        (src / f"f{i:02d}").write_bytes(os.urandom(1 << 20))
    vault.backup(src)
    store = slowed(vault, remote=True)
    vault._repo.download_concurrency = 16
    at_start: list[int] = []
    lock = threading.Lock()
    read = store.get_range

    def counted(key: str, start: int, length: int) -> bytes:
        if key.startswith("packs/"):
            with lock:
                at_start.append(store._running + 1)  # this read and those running
        return read(key, start, length)

    store.get_range = counted  # type: ignore[method-assign]
    vault.restore("latest", tmp_path / "out")
    assert len(at_start) == 24 and max(at_start) == 4, at_start
    assert max(at_start[12:]) >= 2, at_start  # the last files too, not one at a time
    assert all((tmp_path / "out" / p.name).read_bytes() == p.read_bytes() for p in src.iterdir())


@pytest.mark.parametrize("remote", [False, True])
def test_the_chunks_of_a_file_of_two_are_fetched_side_by_side(repo_url: str, tmp_path: Path, remote: bool):
    """Only a file of one chunk is written by one thread: a file of two has its chunks fetched by the pool, at
    once, from a local disk as from a remote store."""
    vault = one_mib_chunks(repo_url)
    src = tmp_path / "src"
    src.mkdir()
    (src / "two").write_bytes(os.urandom(2 << 20))
    vault.backup(src)
    assert [len(e.chunks) for e in vault.files("latest")] == [2]
    store = slowed(vault, remote=remote)
    store.delay = 0.2
    vault.restore("latest", tmp_path / "out")
    assert store.reads == 2 and store.peak == 2
    assert (tmp_path / "out" / "two").read_bytes() == (src / "two").read_bytes()


def test_small_files_from_a_local_disk_are_written_by_the_calling_thread(vault: Vault, tmp_path: Path):
    """No hand-off to a worker per file: waiting for it was most of a small file's time."""
    src = small_files(tmp_path / "src")
    vault.backup(src)
    store = slowed(vault, remote=False)
    store.delay = 0
    threads: set[str] = set()
    read = store.get_range

    def recording(key: str, start: int, length: int) -> bytes:
        if key.startswith("packs/"):
            threads.add(threading.current_thread().name)
        return read(key, start, length)

    store.get_range = recording  # type: ignore[method-assign]
    vault.restore("latest", tmp_path / "out")
    assert threads == {threading.current_thread().name}
    assert tree_digest(tmp_path / "out") == tree_digest(src)


def test_a_restore_into_a_new_folder_looks_up_nothing_below_a_folder_it_found_missing(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    src = small_files(tmp_path / "src")
    (src / "rank1" / "deeper").mkdir()
    (src / "rank1" / "deeper" / "x.pt").write_bytes(b"x" * 100)
    vault.backup(src)
    out = tmp_path / "out"
    (out / "rank0").mkdir(parents=True)  # one folder there already: its files are looked up
    looked_up: list[str] = []
    real_lstat = os.lstat

    def lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        looked_up.append(str(path))
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(restore_module.os, "lstat", lstat)
    vault.restore("latest", out)
    assert tree_digest(out) == tree_digest(src)
    # the files of the folder that was there are looked up (each may hold the same file already), and no
    # file below a folder found missing; the writes' own checks of their temporary files are not counted
    looked_up_files = sorted(p for p in looked_up if p.endswith(".pt") and TEMP_MARK not in p)
    assert looked_up_files == [f"{out}/rank0/shard{i:02d}.pt" for i in range(0, 24, 3)]
