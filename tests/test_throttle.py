"""Bandwidth limits (--limit-upload / --limit-download, CKPTVAULT_LIMIT_*, Vault.open(limit_...)).

The limits are checked the only way that means something: a real backup or restore through them
cannot finish sooner than its bytes divided by the rate (a lower bound on wall time, which a slow
machine cannot break; without the limit the same transfers take a fraction of it)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ckptvault import Vault
from ckptvault.errors import StorageError, UsageError
from ckptvault.store.throttle import RateLimits, ThrottledStore, parse_rate

from .conftest import tree_digest, write_file

MB = 1_000_000


@pytest.mark.parametrize(
    "text, rate",
    [
        ("50MB", 50 * MB),
        ("50 MB/s", 50 * MB),
        ("20MiB", 20 * 2**20),
        ("1.5GiB/s", 1.5 * 2**30),
        ("800kB", 800_000),
        ("800K", 800_000),
        ("400Mbit", 50 * MB),
        ("400 Mbit/s", 50 * MB),
        ("1Gbps", 125 * MB),
        ("50MBps", 50 * MB),
        ("64kbit", 8000),
        ("0", None),
        ("0MB", None),
        (0, None),
        (None, None),
        (5 * MB, 5 * MB),
        (np.int64(5 * MB), 5 * MB),
    ],
)
def test_rates_are_read_with_their_units(text, rate):
    assert parse_rate(text, "--limit-upload") == rate


@pytest.mark.parametrize(
    "text, says",
    [
        ("fast", "is not a rate"),
        ("", "is empty"),
        ("50Mb", "could be bits or bytes; write 50MB or 50Mbit"),
        ("2mb", "could be bits or bytes; write 2MB or 2Mbit"),
        ("8KIB", "is not a rate"),
        ("-5MB", "is not a rate"),
        ("1e3MB", "is not a rate"),
        ("10", "has no unit"),  # restic reads KiB/s, others bytes: asked, not guessed
        ("100B", "under 1 KiB per second"),
        (500, "under 1 KiB per second"),
        (-1, "must be a positive rate"),
        (float("nan"), "must be a positive rate"),
        (float("inf"), "must be a positive rate"),
        (True, "must be a number of bytes per second"),
    ],
)
def test_bad_rates_are_refused_with_examples(text, says):
    with pytest.raises(UsageError, match=says) as raised:
        parse_rate(text, "--limit-upload")
    assert "--limit-upload" in str(raised.value)


def _random_tree(root: Path, mb: int) -> Path:
    for i in range(mb // 4):
        write_file(root / f"shard-{i}.bin", os.urandom(4 * MB))  # incompressible: stored bytes = file bytes
    return root


def test_backup_and_restore_keep_to_the_limits(tmp_path: Path):
    src = _random_tree(tmp_path / "ckpt", 12)
    vault = Vault.init(tmp_path / "repo", pack_size=2 * 2**20, limit_upload="6MB")
    started = time.monotonic()
    vault.backup(src)
    took = time.monotonic() - started
    assert took >= 12 / 6 * 0.98, f"12 MB uploaded in {took:.2f} s at a 6 MB/s limit"
    assert vault._repo.store.uploads.waited > 0.5  # the wait was the limit's, not a slow disk's
    vault.close()

    vault = Vault.open(tmp_path / "repo", limit_download="8MB")
    started = time.monotonic()
    vault.restore("latest", tmp_path / "out")
    took = time.monotonic() - started
    assert took >= 12 / 8 * 0.98, f"12 MB restored in {took:.2f} s at an 8 MB/s limit"
    assert tree_digest(tmp_path / "out") == tree_digest(src)
    assert vault._repo.store.uploads is None  # a download limit leaves uploads alone
    vault.close()


def test_the_environment_sets_the_limits_and_an_explicit_zero_lifts_them(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("CKPTVAULT_LIMIT_UPLOAD", "5MiB")
    vault = Vault.init(tmp_path / "repo")
    assert isinstance(vault._repo.store, ThrottledStore)
    assert vault._repo.store.uploads.rate == 5 * 2**20 and vault._repo.store.downloads is None
    assert vault._repo.store.unlimited == ("locks/",)  # lock objects are never held back
    vault.close()
    vault = Vault.open(tmp_path / "repo", limit_upload=0)
    assert not isinstance(vault._repo.store, ThrottledStore)
    vault.close()
    monkeypatch.setenv("CKPTVAULT_LIMIT_DOWNLOAD", "soon")
    with pytest.raises(UsageError, match="CKPTVAULT_LIMIT_DOWNLOAD 'soon' is not a rate"):
        Vault.open(tmp_path / "repo")


def _in_threads(*jobs) -> list[float]:
    """Run each job in its own thread, all at once; the seconds each took to finish."""
    began = time.monotonic()
    ended: list[float] = [0.0] * len(jobs)

    def run(i, job):
        job()
        ended[i] = time.monotonic() - began

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return ended


class _Instant:
    """A store that moves any number of bytes at once (what the limit alone costs is measured)."""

    url, remote, supports_if_absent = "mem://instant", True, False

    def __init__(self, window_holds: int = 0) -> None:
        self.window_holds = window_holds
        self.fail = False

    def put(self, key, data, *, if_absent=False):
        if self.fail:
            raise StorageError("PUT", key, self.url, "connection reset", retryable=True)

    def get_range(self, key, start, length):
        return bytes(length)

    def read_upto(self, key, start, length):
        return bytes(min(length, self.window_holds))

    def get(self, key):
        return bytes(self.window_holds)


def test_locks_are_never_held_back_and_everything_else_is():
    """A lock's refresh must not queue behind a minute of booked pack uploads; a snapshot must (a
    restore of many small files keeps to the limit too)."""
    store = ThrottledStore(_Instant(), RateLimits(upload=1 * MB), unlimited=("locks/",))
    taken = _in_threads(
        lambda: store.put("data/ab/pack", bytes(2 * MB)),  # books 2 s from now
        lambda: (time.sleep(0.2), store.put("locks/l1", bytes(100))),
        lambda: (time.sleep(0.2), store.put("snapshots/s1", bytes(1000))),
    )
    assert taken[1] < 1.0  # the lock went at once
    assert taken[2] >= 2.0  # the snapshot waited for the pack's time


def test_small_chunks_restored_keep_to_the_download_limit(tmp_path: Path):
    src = tmp_path / "ckpt"
    for i in range(150):
        write_file(src / f"shard-{i:03}.json", os.urandom(20_000))  # 3 MB in chunks of 20 kB
    Vault.init(tmp_path / "repo").backup(src)
    vault = Vault.open(tmp_path / "repo", limit_download="1MB")
    started = time.monotonic()
    vault.restore("latest", tmp_path / "out")
    assert time.monotonic() - started >= 3 * 0.98
    assert tree_digest(tmp_path / "out") == tree_digest(src)


def test_reads_cut_short_hand_back_their_time():
    """Read-ahead windows are booked whole (8 MiB) but a pack may end sooner: only what came is
    paid, also when several windows are read at once."""
    store = ThrottledStore(_Instant(window_holds=1 * MB), RateLimits(download=4 * MB))
    taken = _in_threads(*[lambda i=i: store.read_upto(f"data/{i}", 0, 8 * MB) for i in range(4)])
    assert 1.0 * 0.98 <= max(taken) < 3.0  # 4 MB at 4 MB/s, not 4 windows of 8 MB (8 s)


def test_a_failed_transfer_hands_back_its_time():
    inner = _Instant()
    store = ThrottledStore(inner, RateLimits(upload=1 * MB))
    inner.fail = True
    with pytest.raises(StorageError):
        store.put("data/ab/pack", bytes(4 * MB))
    inner.fail = False
    started = time.monotonic()
    store.put("data/ab/other", bytes(300_000))
    assert time.monotonic() - started < 1.5  # 0.3 s, not 4.3


def test_a_whole_object_read_takes_its_time_once():
    """A GET of unknown size books what it moved when it ends, from when it started: its bytes'
    time, not the download's time plus theirs."""
    store = ThrottledStore(_Instant(window_holds=2 * MB), RateLimits(download=2 * MB))
    started = time.monotonic()
    store.get("data/ab/pack")
    store.get("data/cd/pack")
    assert 2 * 0.98 <= time.monotonic() - started < 3.5


def test_cancelled_uploads_are_not_sent_nor_waited_out():
    """A failed backup gives up its packs: those waiting for their turn are not sent, and the uploads of
    other keys (a snapshot being retagged meanwhile) go on as booked."""
    inner = _Instant()
    sent: list[str] = []
    inner.put = lambda key, data, *, if_absent=False: sent.append(key)
    store = ThrottledStore(inner, RateLimits(upload=1 * MB))
    errors: list[BaseException] = []

    def upload(key: str, nbytes: int = 3 * MB) -> None:
        try:
            store.put(key, bytes(nbytes))
        except StorageError as exc:
            errors.append(exc)

    def cancel_soon() -> None:
        time.sleep(0.5)
        with store.cancelling_uploads("packs/"):
            time.sleep(0.2)

    taken = _in_threads(
        lambda: upload("packs/1"),
        lambda: (time.sleep(0.1), upload("packs/2")),
        lambda: (time.sleep(0.2), upload("snapshots/s", 100_000)),
        cancel_soon,
    )
    assert sent == ["packs/1", "snapshots/s"]  # the second pack never went; the snapshot did, in its turn
    assert max(taken[0], taken[1]) < 2.0  # no pack waited out the first one's 3 s
    assert taken[2] >= 3.0 * 0.98  # the snapshot kept to the schedule
    assert len(errors) == 1 and "not sent: the write it belonged to failed" in str(errors[0])


def test_an_interrupted_backup_does_not_wait_out_its_uploads(tmp_path: Path):
    """Ctrl-C: the packs held back or paying for their time are given up at once (it took the uploads'
    booked time before: 3-5 s here, at 1 MB/s and 2 MiB packs)."""
    src = _random_tree(tmp_path / "ckpt", 16)
    vault = Vault.init(tmp_path / "repo", pack_size=2 * 2**20, limit_upload="1MB")
    raised: list[float] = []

    class Interrupt:
        def start(self, total_bytes, total_files):
            pass

        def advance(self, nbytes):
            if vault._repo.store.uploads.waited > 0.5:
                raised.append(time.monotonic())
                raise KeyboardInterrupt

        def finish(self):
            pass

    with pytest.raises(KeyboardInterrupt):
        vault.backup(src, on_progress=Interrupt())
    assert time.monotonic() - raised[0] < 1.5
    assert vault.snapshots() == []


def test_cli_refuses_a_bad_limit_before_touching_anything(cli, tmp_path: Path):
    src = write_file(tmp_path / "ckpt" / "w.bin", b"x" * 1000).parent
    proc = cli("backup", str(src), "--limit-upload", "100", check=False)
    assert proc.returncode == 2
    assert proc.stderr.decode().strip().splitlines() == [
        "error: --limit-upload '100' has no unit; e.g. 50MB (bytes per second), 20MiB, 400Mbit; 0 for no limit"
    ]
    assert not (tmp_path / "xdg-data").exists()  # the default vault was not created
    proc = cli("restore", "latest", str(tmp_path / "out"), check=False, CKPTVAULT_LIMIT_DOWNLOAD="fast")
    assert proc.returncode == 2 and "CKPTVAULT_LIMIT_DOWNLOAD 'fast' is not a rate" in proc.stderr.decode()
    assert "Traceback" not in proc.stderr.decode()


def test_cli_backup_with_a_limit(cli, tmp_path: Path):
    src = _random_tree(tmp_path / "ckpt", 8)
    repo = str(tmp_path / "repo")
    cli("init", repo)
    started = time.monotonic()
    cli("backup", str(src), "-r", repo, "--limit-upload", "32Mbit", "-q")  # 4 MB/s
    took = time.monotonic() - started
    assert took >= 8 / 4 * 0.98, f"8 MB uploaded in {took:.2f} s at a 4 MB/s limit"
    cli("restore", "latest", str(tmp_path / "out"), "-r", repo, "-q")
    assert tree_digest(tmp_path / "out") == tree_digest(src)
