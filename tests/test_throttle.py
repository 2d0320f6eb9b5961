"""Bandwidth limits (--limit-upload / --limit-download, CKPTVAULT_LIMIT_*, Vault.open(limit_...)).

The limits are checked the only way that means something: a real backup or restore through them
cannot finish sooner than its bytes divided by the rate (a lower bound on wall time, which a slow
machine cannot break; without the limit the same transfers take a fraction of it)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import UsageError
from ckptvault.store.throttle import SMALL, Schedule, ThrottledStore, parse_rate

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
        ("1Gbps", 125 * MB),
        ("2mb", 2 * MB),
        ("0", None),
        ("0MB", None),
        (0, None),
        (None, None),
        (5 * MB, 5 * MB),
    ],
)
def test_rates_are_read_with_their_units(text, rate):
    assert parse_rate(text, "--limit-upload") == rate


@pytest.mark.parametrize(
    "text, says",
    [
        ("fast", "is not a rate"),
        ("", "is not a rate"),
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
    vault.close()
    vault = Vault.open(tmp_path / "repo", limit_upload=0)
    assert not isinstance(vault._repo.store, ThrottledStore)
    vault.close()
    monkeypatch.setenv("CKPTVAULT_LIMIT_DOWNLOAD", "soon")
    with pytest.raises(UsageError, match="CKPTVAULT_LIMIT_DOWNLOAD 'soon' is not a rate"):
        Vault.open(tmp_path / "repo")


def test_small_requests_never_wait_behind_big_ones():
    """A lock's refresh must not queue behind a minute of booked pack uploads; a pack must."""
    schedule = Schedule(rate=1 * MB)

    def transfer(nbytes: int, started: threading.Event) -> None:
        with schedule.transfer(nbytes):
            started.set()

    def start(nbytes: int) -> threading.Event:
        started = threading.Event()
        threading.Thread(target=transfer, args=(nbytes, started), daemon=True).start()
        return started

    assert start(60 * MB).wait(5)  # nothing booked before it: starts at once, then holds a minute
    assert start(SMALL - 1).wait(5)  # a lock object: booked, not held back
    assert not start(SMALL).wait(0.5)  # a pack: waits for the minute booked before it


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


def test_a_read_cut_short_by_the_objects_end_hands_back_its_time():
    """A read-ahead window is booked whole (8 MiB) but a pack may end sooner: only what came is paid."""
    schedule = Schedule(rate=4 * MB)
    started = time.monotonic()
    with schedule.transfer(8 * MB) as booking:  # 2 s booked
        booking.moved = 1 * MB  # 0.25 s used
    with schedule.transfer(SMALL):  # starts when the 0.25 s end
        pass
    assert 0.3 <= time.monotonic() - started < 1.5
