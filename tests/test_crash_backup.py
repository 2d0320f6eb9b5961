"""Backups and restores killed with SIGKILL at seeded random moments, and a disk that fills up.

The killed commands are real CLI processes on a local filesystem whose calls are slowed
(tests/support/slowcli.py), so kills land between storage calls. The full run makes
CKPTVAULT_CRASH_TRIALS_BACKUP (default 50) backup trials and 10 restore trials; the quick
subset (-m "not slow") makes 3 and 2.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.chunking import ChunkerParams
from ckptvault.errors import StorageFullError

from .conftest import tree_digest
from .support.tmpfs import mounted_tmpfs

SMALL = ChunkerParams(min_size=16 * 1024, avg_size=64 * 1024, max_size=256 * 1024)
ROOT = Path(__file__).parent.parent


def write_step(root: Path, step: int) -> None:
    shutil.rmtree(root, ignore_errors=True)
    (root / "model").mkdir(parents=True)
    (root / "model" / "weights.bin").write_bytes(
        random.Random("frozen").randbytes(3 << 20) + random.Random(step).randbytes(8 << 20)
    )
    (root / "optimizer.bin").write_bytes(random.Random(f"optimizer-{step}").randbytes(8 << 20))
    (root / "state.json").write_text(f'{{"step": {step}}}')


def slow_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.slowcli", *args],
        cwd=ROOT,
        env={**os.environ, "SLOWFS_DELAY": "0.005", "SLOWFS_PUT_DELAY": "0.04"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def timed(proc: subprocess.Popen) -> float:
    started = time.monotonic()
    assert proc.wait(timeout=300) == 0
    return time.monotonic() - started


def kill_after(proc: subprocess.Popen, seconds: float) -> None:
    time.sleep(seconds)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A vault with snapshots of steps 1 and 2, the step-3 source, and how long its backup takes."""
    work = tmp_path_factory.mktemp("crash-backup")
    repo = work / "vault"
    with Vault.init(str(repo), chunker=SMALL, pack_size=1 << 20) as vault:
        for step in (1, 2):
            write_step(work / f"step-{step}", step)
            vault.backup(work / f"step-{step}", tags={"step": str(step)})
    write_step(work / "step-3", 3)
    reference = work / "reference"
    shutil.copytree(repo, reference)
    duration = timed(slow_cli("backup", str(work / "step-3"), "--repo", f"slowfile://{reference}", "-t", "step=3"))
    return work, repo, duration, reference


def duplicated_chunks(vault: Vault) -> int:
    """Chunks stored in more than one pack, read from every pack's own header (indexed or not)."""
    repo = vault._repo
    homes: dict[bytes, set[bytes]] = {}
    for pack_id, size in repo.list_packs().items():
        for e in repo.read_pack_header(pack_id, size):
            homes.setdefault(e.chunk_id, set()).add(pack_id)
    return sum(1 for packs in homes.values() if len(packs) > 1)


def contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def backup_trial(setup, seed: int) -> None:
    work, base, duration, _ = setup
    repo = work / f"trial-{seed}"
    shutil.copytree(base, repo)
    src = work / "step-3"
    kill_after(
        slow_cli("backup", str(src), "--repo", f"slowfile://{repo}", "-t", "step=3"),
        random.Random(seed).uniform(0.3, duration),
    )
    assert_recovers(work, repo, src, seed, {"step": "3"})


def assert_recovers(work: Path, repo: Path, src: Path, seed: int, tags: dict[str, str]) -> None:
    """After a killed backup of ``src``: the repository checks clean, steps 1 and 2 restore
    bit-exact, and a rerun stores nothing twice and restores ``src``. Removes ``repo``."""
    with Vault.open(str(repo)) as vault:
        report = vault.check(read_data=1.0)
        assert report.ok, f"seed {seed}: {report.problems}"
        for step in (1, 2):
            out = work / f"out-{seed}-{step}"
            vault.restore(vault.latest({"step": str(step)}), out)
            assert contents(out) == contents(work / f"step-{step}"), f"seed {seed}: step {step} differs"
            shutil.rmtree(out)
        rerun = vault.backup(src, tags=tags)  # completes, reusing what the killed run stored
        assert duplicated_chunks(vault) == 0, f"seed {seed}: the rerun uploaded chunks that were already stored"
        assert vault.check(read_data=1.0).ok
        out = work / f"out-{seed}-3"
        vault.restore(rerun, out)
        assert tree_digest(out) == tree_digest(src)
    shutil.rmtree(out)
    shutil.rmtree(repo)


@pytest.mark.parametrize("seed", range(3))
def test_killed_backup_quick(setup, seed):
    backup_trial(setup, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 100 + int(os.environ.get("CKPTVAULT_CRASH_TRIALS_BACKUP", "50"))))
def test_killed_backup(setup, seed):
    backup_trial(setup, seed)


def restore_trial(setup, seed: int) -> None:
    work, _, _, reference = setup  # reference holds steps 1-3
    target = work / f"restore-{seed}"
    started = time.monotonic()
    timed_run = slow_cli("restore", "latest", str(target), "--repo", f"slowfile://{reference}", "-t", "step=3")
    kill_after(timed_run, random.Random(seed).uniform(0.2, 1.2))
    killed_at = time.monotonic() - started
    with Vault.open(str(reference)) as vault:
        vault.restore(vault.latest({"step": "3"}), target)  # the rerun finishes the job
    assert tree_digest(target) == tree_digest(work / "step-3"), f"seed {seed} killed at {killed_at:.2f}s"
    shutil.rmtree(target)


@pytest.mark.parametrize("seed", range(2))
def test_killed_restore_quick(setup, seed):
    restore_trial(setup, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(200, 210))
def test_killed_restore(setup, seed):
    restore_trial(setup, seed)


def test_disk_full_is_a_clear_error_and_corrupts_nothing(tmp_path: Path, cli):
    with mounted_tmpfs(tmp_path / "small-disk", "6m", "the disk-full test") as mount:
        repo = mount / "vault"
        src = tmp_path / "src"
        src.mkdir()
        (src / "small.bin").write_bytes(os.urandom(1 << 20))
        cli("init", str(repo), "--pack-size-mib", "1")
        cli("backup", str(src), "--repo", str(repo), "-t", "n=1")
        (src / "big.bin").write_bytes(os.urandom(8 << 20))  # more than the disk has left
        proc = cli("backup", str(src), "--repo", str(repo), "-t", "n=2", check=False)
        assert proc.returncode == 21, proc.stderr
        err = proc.stderr.decode()
        assert err.startswith("error: no space left writing") and "Traceback" not in err
        assert "free space and run the command again" in err
        with Vault.open(str(repo)) as vault, pytest.raises(StorageFullError) as caught:  # the API says its own
            vault.backup(src, tags={"n": "3"})
        assert str(caught.value).endswith("free space and try again"), caught.value
        with Vault.open(str(repo)) as vault:
            assert [s.tags for s in vault.snapshots()] == [{"n": "1"}]  # no snapshot of the failed run
            assert vault.check(read_data=1.0).ok
            vault.restore("latest", tmp_path / "out")
        assert (tmp_path / "out" / "small.bin").read_bytes() == (src / "small.bin").read_bytes()
        assert not [p for p in repo.rglob(".tmp-*")], "a temp file of the failed write was left behind"
