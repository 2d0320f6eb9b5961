"""--retry-lock / Vault.open(retry_lock=...): a command that finds the vault locked keeps trying for
a while instead of failing at once (restic's --retry-lock). The holders here are real locks of this
test process (alive, on this host: never stale); the waiters are real CLI processes."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.cli.params import parse_duration
from ckptvault.errors import UsageError, VaultLockedError
from tests.conftest import CKPTVAULT_ENV, write_file


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg-data"), "COLUMNS": "200"}
    for var in CKPTVAULT_ENV:
        env.pop(var, None)
    return env


def _start(env: dict[str, str], stderr: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ckptvault", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr.open("wb"),
        env=env,
    )


def _wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text(errors="replace"):
        assert proc.poll() is None, f"exited {proc.returncode} first: {path.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} in: {path.read_text()}"
        time.sleep(0.05)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    write_file(tmp_path / "src" / "model.bin", os.urandom(300_000))
    return tmp_path / "src"


def test_backup_waits_for_a_prune_and_then_runs(vault: Vault, source: Path, env, tmp_path: Path):
    err = tmp_path / "err"
    with vault._repo.locks.acquire(exclusive=True):  # a prune running
        proc = _start(env, err, "backup", str(source), "-r", vault.url, "--retry-lock", "2m", "--json")
        _wait_for_text(err, "waiting for it", proc)
        time.sleep(1.5)  # it keeps waiting while the lock is held
        assert proc.poll() is None
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.read_text()
    assert json.loads(out)["id"] == vault.snapshots()[0].id
    said = err.read_text()
    assert "warning: vault" in said and "is locked: exclusive lock by" in said
    assert "waiting for it (--retry-lock 2m)" in said
    assert said.count("waiting for it") == 1  # said once, not at every try
    assert len(vault.snapshots()) == 1
    assert vault.locks() == []


def test_prune_waits_for_a_backup_and_then_runs(vault: Vault, source: Path, env, tmp_path: Path):
    vault.backup(source)
    vault.backup(source, tags={"n": "2"})
    err = tmp_path / "err"
    with vault._repo.locks.acquire(exclusive=False):  # a backup running
        proc = _start(env, err, "prune", "-r", vault.url, "--keep-latest", "1", "--retry-lock", "90s")
        _wait_for_text(err, "is locked: shared lock by", proc)
    proc.communicate(timeout=120)
    assert proc.returncode == 0, err.read_text()
    assert "(--retry-lock 1m30s)" in err.read_text()
    assert len(vault.snapshots()) == 1


def test_it_gives_up_after_the_duration_and_leaves_no_lock(vault: Vault, source: Path, env, tmp_path: Path):
    err = tmp_path / "err"
    with vault._repo.locks.acquire(exclusive=True) as held:
        started = time.monotonic()
        proc = _start(env, err, "backup", str(source), "-r", vault.url, "--retry-lock", "3s")
        proc.communicate(timeout=120)
        waited = time.monotonic() - started
        assert [lock.lock_id for lock in vault.locks()] == [held.info.lock_id]  # its own lock object went
    assert proc.returncode == 11
    lines = err.read_text().strip().splitlines()
    assert lines[-1].startswith("error: vault")
    assert lines[-1].endswith("; gave up waiting (--retry-lock 3s): a longer one waits it out")
    # its holder (this test) runs on this host: no word of staleness or unlock, which cannot apply to it
    assert f"pid {os.getpid()} since " in lines[-1] and ", a process running on this host; wait for it" in lines[-1]
    assert "unlock" not in lines[-1] and "; if it is stopped, its lock goes stale 30 minutes after" in lines[-1]
    assert waited >= 3
    assert vault.snapshots() == []


def test_without_it_a_locked_vault_fails_at_once(vault: Vault, source: Path, env, tmp_path: Path):
    err = tmp_path / "err"
    with vault._repo.locks.acquire(exclusive=True):
        proc = _start(env, err, "backup", str(source), "-r", vault.url)
        proc.communicate(timeout=120)
    assert proc.returncode == 11
    assert "waiting" not in err.read_text() and "gave up" not in err.read_text()


def test_the_environment_sets_it(vault: Vault, source: Path, env, tmp_path: Path):
    err = tmp_path / "err"
    with vault._repo.locks.acquire(exclusive=True):
        proc = _start({**env, "CKPTVAULT_RETRY_LOCK": "1s"}, err, "backup", str(source), "-r", vault.url)
        proc.communicate(timeout=120)
    assert proc.returncode == 11
    assert "gave up waiting (--retry-lock 1s)" in err.read_text()


def test_ctrl_c_while_waiting_leaves_no_lock(vault: Vault, source: Path, env, tmp_path: Path):
    err = tmp_path / "err"
    with vault._repo.locks.acquire(exclusive=True) as held:
        proc = _start(env, err, "backup", str(source), "-r", vault.url, "--retry-lock", "10m")
        _wait_for_text(err, "waiting for it", proc)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
        assert proc.returncode == 130, err.read_text()
        assert [lock.lock_id for lock in vault.locks()] == [held.info.lock_id]
    assert vault.snapshots() == []


@pytest.mark.parametrize("value", ["5", "5x", "m", "1h 30m", "-5m", "", "400d", "1.5.2h", "5M"])
@pytest.mark.parametrize("given", ["--retry-lock", "CKPTVAULT_RETRY_LOCK"])
def test_a_bad_duration_is_refused_before_anything_runs(cli, tmp_path: Path, source: Path, value: str, given: str):
    args, env = (("--retry-lock", value), {}) if given.startswith("--") else ((), {given: value})
    proc = cli("backup", str(source), "-r", str(tmp_path / "v"), *args, check=False, **env)
    assert proc.returncode == 2
    message = proc.stderr.decode().strip()
    assert message.startswith(f"error: {given}") and ("e.g. 30s" in message or "is empty" in message)
    assert len(message.splitlines()) == 1
    assert not (tmp_path / "v").exists()


def test_durations_are_read_like_restic_ones():
    assert parse_duration("0", "--retry-lock") == 0
    assert parse_duration("30s", "--retry-lock") == 30
    assert parse_duration("5m", "--retry-lock") == 300
    assert parse_duration("1h30m", "--retry-lock") == 5400
    assert parse_duration("1.5h", "--retry-lock") == 5400
    assert parse_duration(" 2d ", "--retry-lock") == 2 * 86400
    assert parse_duration("1w", "--retry-lock") == 7 * 86400
    assert parse_duration("30min", "--retry-lock") == parse_duration("30m", "--retry-lock") == 1800
    with pytest.raises(UsageError, match="more than a year"):
        parse_duration("367d", "--retry-lock")


def test_api_waits_for_the_lock(vault: Vault, repo_url: str, source: Path):
    waiter = Vault.open(repo_url, retry_lock=timedelta(minutes=1))
    held = vault._repo.locks.acquire(exclusive=True)
    releaser = threading.Timer(1.5, held.release)
    started = time.monotonic()  # before the timer starts: the lock goes no sooner than 1.5 s after this
    releaser.start()
    try:
        snapshot = waiter.backup(source)
        assert time.monotonic() - started >= 1.4
    finally:
        releaser.join()
        waiter.close()
    assert [s.id for s in vault.snapshots()] == [snapshot.id]


def test_api_gives_up(vault: Vault, repo_url: str, source: Path):
    waiter = Vault.open(repo_url, retry_lock=0.5)
    try:
        with vault._repo.locks.acquire(exclusive=True):
            with pytest.raises(VaultLockedError, match=r"gave up waiting \(retry_lock 0.5s\)"):
                waiter.backup(source)
            with pytest.raises(VaultLockedError, match="gave up waiting"):  # a read waits too
                waiter.check()
    finally:
        waiter.close()


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "5m", True, timedelta(seconds=-1)])
def test_api_refuses_a_bad_retry_lock(repo_url: str, vault: Vault, value):
    with pytest.raises(UsageError, match="retry_lock"):
        Vault.open(repo_url, retry_lock=value)


def test_a_waiting_prune_makes_no_other_command_fail_meanwhile(vault: Vault, repo_url: str, source: Path):
    """Each try used to write its exclusive lock object and list the others (slow on an object store)
    before removing it again: a backup or check starting in that window failed as if a prune ran."""
    vault.backup(source)
    pruner = Vault.open(repo_url, retry_lock=60)
    store = pruner._repo.store
    real_list = store.list

    def slow_list(prefix: str):  # an object store's listing latency
        time.sleep(0.3)
        return real_list(prefix)

    store.list = slow_list
    held = vault._repo.locks.acquire(exclusive=False)  # a backup running
    pruned: list[object] = []
    waiting = threading.Event()  # said once its first try failed and its lock object went

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for it" in record.getMessage():
                waiting.set()

    said = Said()
    logging.getLogger("ckptvault.locks").addHandler(said)
    prune = threading.Thread(target=lambda: pruned.append(pruner.prune(keep_latest=1)))
    prune.start()
    failures, checks = [], 0
    other = Vault.open(repo_url)
    try:
        assert waiting.wait(60)
        until = time.monotonic() + 4  # its tries at about 1 and 3 s later
        while time.monotonic() < until:
            try:
                other.check()
            except VaultLockedError as exc:
                failures.append(str(exc))
            checks += 1
            time.sleep(0.02)
    finally:
        logging.getLogger("ckptvault.locks").removeHandler(said)
        held.release()
        prune.join(60)
        other.close()
        pruner.close()
    assert checks > 5 and failures == []
    assert len(pruned) == 1  # and the prune ran once the backup was done


def test_a_lock_of_this_very_process_is_not_waited_for(vault: Vault, repo_url: str, source: Path):
    waiter = Vault.open(repo_url, retry_lock=60)
    try:
        waiter.backup(source)
        reading = waiter.read_file("latest", "model.bin")
        next(reading)  # a file read part way holds a shared lock
        started = time.monotonic()
        with pytest.raises(VaultLockedError, match="is locked by this process itself"):
            waiter.prune(keep_latest=1)
        assert time.monotonic() - started < 30
        reading.close()
        waiter.prune(keep_latest=1)
    finally:
        waiter.close()


def test_watch_with_a_retry_lock_still_stops_at_sigterm(vault: Vault, env, tmp_path: Path):
    """The sidecar waits for a prune in its own way, which SIGTERM ends; a retry_lock wait inside its
    backups could not be ended (it went on for the whole duration)."""
    ckpts = tmp_path / "ckpts"
    write_file(ckpts / "step-1" / "model.pt", os.urandom(10_000))
    err = tmp_path / "err"
    with vault._repo.locks.acquire(exclusive=True):  # a prune running
        proc = _start(
            {**env, "CKPTVAULT_RETRY_LOCK": "10m"}, err, "watch", str(ckpts), "-r", vault.url, "--settle", "0.2"
        )
        _wait_for_text(err, "is locked", proc)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode != 0 and "SIGTERM" in err.read_text(), err.read_text()
