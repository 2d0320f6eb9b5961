"""A prune killed with SIGKILL at random moments never costs a kept snapshot, and the next prune finishes.

The prune runs as a real CLI process on a local filesystem slowed down per call
(tests/support/slowfs.py), so kills land between its storage calls, not only before or after.
The full run makes CKPTVAULT_CRASH_TRIALS (default 20) seeded trials; the quick subset
(-m "not slow") makes 3.
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
from ckptvault.store.base import TEMP_PREFIX

STEPS = 12
KEEP = 3
SMALL = ChunkerParams(min_size=16 * 1024, avg_size=64 * 1024, max_size=256 * 1024)


def checkpoint(step: int) -> dict[str, bytes]:
    """Step N's files: a frozen part, a changing part, and one small log per step so far (these stay
    live in later snapshots, so forgetting old snapshots leaves partly-live packs to repack)."""
    files = {
        "model.bin": random.Random("frozen").randbytes(1 << 20) + random.Random(step).randbytes(1 << 20),
        "optimizer.bin": random.Random(-step).randbytes(1 << 19),
    }
    for k in range(1, step + 1):
        files[f"logs/{k}.bin"] = random.Random(f"log{k}").randbytes(100_000)
    return files


def write_checkpoint(root: Path, step: int) -> None:
    shutil.rmtree(root, ignore_errors=True)
    for name, data in checkpoint(step).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


@pytest.fixture(scope="module")
def base_repo(tmp_path_factory) -> tuple[Path, float, int]:
    """A repository with STEPS snapshots; the duration and final size of an uninterrupted prune."""
    work = tmp_path_factory.mktemp("crash-base")
    repo = work / "vault"
    src = work / "ckpt"
    with Vault.init(str(repo), chunker=SMALL, pack_size=1 << 20) as vault:
        for step in range(1, STEPS + 1):
            write_checkpoint(src, step)
            vault.backup(src, tags={"run": "crash", "step": str(step)})
    reference = work / "reference"
    shutil.copytree(repo, reference)
    started = time.monotonic()
    run_prune(reference).wait()
    duration = time.monotonic() - started
    size = sum(p.stat().st_size for p in reference.rglob("*") if p.is_file())
    return repo, duration, size


def run_prune(repo: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.slowfs",
            "prune",
            "--repo",
            f"slowfile://{repo}",
            "--keep-latest",
            str(KEEP),
            "--quiet",
        ],
        cwd=Path(__file__).parent.parent,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def crash_trial(base: tuple[Path, float, int], work: Path, seed: int) -> None:
    repo_base, duration, final_size = base
    repo = work / f"trial-{seed}"
    shutil.copytree(repo_base, repo)
    delay = random.Random(seed).uniform(0.05, duration * 1.1)
    proc = run_prune(repo)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    with Vault.open(str(repo)) as vault:  # the dead prune's lock is stale: its pid is gone
        steps = {s.step for s in vault.snapshots()}
        kept = set(range(STEPS - KEEP + 1, STEPS + 1))
        assert kept <= steps, f"seed {seed}: lost a kept snapshot: {sorted(steps)}"
        report = vault.check(read_data=1.0)
        assert report.ok, f"seed {seed} (killed after {delay:.2f}s): {report.problems}"
        for step in kept:
            out = work / f"out-{seed}-{step}"
            vault.restore(vault.latest({"step": str(step)}), out)
            for name, data in checkpoint(step).items():
                assert (out / name).read_bytes() == data, f"seed {seed}: step {step} {name} differs"
            shutil.rmtree(out)
        vault.prune(keep_latest=KEEP)  # the next prune finishes the job
        report = vault.check(read_data=1.0)
        assert report.ok and not report.warnings, f"seed {seed}: {report.problems} {report.warnings}"
        assert {s.step for s in vault.snapshots()} == kept
    # A pack the killed prune was writing stays as a temp file until a prune finds it an hour old
    # (STALE_TEMP_AGE_S: younger, it may be a live writer's): up to a pack's size beside the objects.
    files = [p for p in repo.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files if not p.name.startswith(TEMP_PREFIX))
    assert size <= final_size * 1.05, f"seed {seed}: {size} bytes left vs {final_size} after a clean prune"
    shutil.rmtree(repo)


@pytest.mark.parametrize("seed", range(3))
def test_killed_prune_quick(base_repo, tmp_path: Path, seed: int):
    crash_trial(base_repo, tmp_path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 100 + int(os.environ.get("CKPTVAULT_CRASH_TRIALS", "20"))))
def test_killed_prune(base_repo, tmp_path: Path, seed: int):
    crash_trial(base_repo, tmp_path, seed)
