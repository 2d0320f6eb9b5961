"""A killed drill's temporary folder (as big as the snapshot) is removed by the next drill there;
a live drill's folder never is."""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.ops import drill
from ckptvault.ops.drill import LOCK_FILE, sweep_killed_drills

from .conftest import write_file

ROOT = Path(__file__).parent.parent


def checkpoint(root: Path) -> Path:
    for i in range(4):
        write_file(root / f"shard-{i}.bin", random.Random(i).randbytes(2 << 20))
    return root


def stored_bytes(path: Path) -> int:
    try:
        return path.lstat().st_blocks * 512
    except FileNotFoundError:  # renamed meanwhile
        return 0


def kill_mid_drill(repo: str, scratch: Path) -> Path:
    """Start a drill on a slowed copy of the repository and SIGKILL it once it has restored files
    into its folder; returns that folder."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.slowcli",
            "drill",
            "--tmp-dir",
            str(scratch),
            "--repo",
            f"slowfile://{repo}",
        ],
        cwd=ROOT,
        env={**os.environ, "SLOWFS_DELAY": "0.01"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            written = [p for p in scratch.glob("ckptvault-drill-*/restore/*") if stored_bytes(p)]
            if written:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return written[0].parent.parent
            time.sleep(0.002)
        raise AssertionError(f"the drill wrote nothing before it ended (exit {proc.poll()})")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_next_drill_removes_what_a_killed_drill_left(tmp_path, repo_url, vault: Vault, cli):
    vault.backup(checkpoint(tmp_path / "ckpt"), tags={"step": "1"})
    scratch = tmp_path / "scratch"
    left = kill_mid_drill(repo_url, scratch)
    assert left.exists() and any(left.rglob("*")), "the killed drill left nothing to sweep"
    (left / "restore" / "read-only").mkdir(mode=0o500)  # a snapshot's folder may be restored read-only

    proc = cli("drill", "--tmp-dir", str(scratch), "--json", "--repo", repo_url)
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    assert report["swept"] == [str(left)] and report["swept_bytes"] > 0
    assert list(scratch.iterdir()) == [], "the drill left its own folder, or did not remove the killed one's"

    left = kill_mid_drill(repo_url, scratch)
    text = cli("drill", "--tmp-dir", str(scratch), "--repo", repo_url).stdout.decode()
    assert "removed 1 folder(s) left by killed drills" in text and str(left) in text
    assert not left.exists()


def test_a_live_drills_folder_and_one_not_locked_yet_are_left_alone(tmp_path, repo_url, vault: Vault):
    vault.backup(checkpoint(tmp_path / "ckpt"), tags={"step": "1"})
    scratch = tmp_path / "scratch"
    live = scratch / "ckptvault-drill-live"
    write_file(live / "restore" / "shard-0.bin", b"being restored")
    lock = os.open(live / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    # drills between making their folder and locking it: no lock file yet, or nothing but the lock
    write_file(scratch / "ckptvault-drill-new" / LOCK_FILE, b"")
    (scratch / "ckptvault-drill-newer").mkdir()
    write_file(scratch / "ckptvault-drill-older" / "restore" / "x.bin", b"no lock file: not one of ours")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # what a running drill holds
        report = vault.drill(workdir=scratch)
        assert report.swept == [] and report.swept_bytes == 0
        assert (live / "restore" / "shard-0.bin").read_bytes() == b"being restored"
    finally:
        os.close(lock)
    report = vault.drill(workdir=scratch)  # its process is gone now: its lock with it
    assert report.swept == [str(live)]
    assert sorted(p.name for p in scratch.iterdir()) == [
        "ckptvault-drill-new",
        "ckptvault-drill-newer",
        "ckptvault-drill-older",
    ]


def test_a_drill_keeps_its_lock_until_its_folder_is_gone(tmp_path, vault: Vault, monkeypatch):
    """Another drill sweeping while this one deletes its (full) folder must not take it for a dead one's."""
    vault.backup(checkpoint(tmp_path / "ckpt"), tags={"step": "1"})
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    seen: list[tuple[list[str], int]] = []
    real_remove = drill._remove_all_but_the_lock

    def sweep_then_remove(folder: str) -> None:
        if not seen:  # the drill's own cleanup; the sweep below calls this too, for what it removes
            seen.append(sweep_killed_drills(str(scratch)))  # as a drill starting meanwhile does
        real_remove(folder)

    monkeypatch.setattr(drill, "_remove_all_but_the_lock", sweep_then_remove)
    report = vault.drill(workdir=scratch)
    assert report.ok and seen == [([], 0)]
    assert list(scratch.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_another_users_folder_is_never_swept(tmp_path, vault: Vault):
    vault.backup(checkpoint(tmp_path / "ckpt"), tags={"step": "1"})
    scratch = tmp_path / "scratch"
    theirs = scratch / "ckptvault-drill-theirs"
    write_file(theirs / "restore" / "shard-0.bin", b"x" * 4096)
    write_file(theirs / LOCK_FILE, b"")
    for path in [theirs, theirs / "restore", theirs / "restore" / "shard-0.bin", theirs / LOCK_FILE]:
        os.chown(path, 65534, 65534)
    assert vault.drill(workdir=scratch).swept == []
    assert (theirs / "restore" / "shard-0.bin").exists()
