"""A backup killed (SIGKILL, real CLI process on a slowed filesystem: tests/support/slowcli.py) while it
writes delta chunks leaves a repository that checks clean, whose earlier snapshots restore bit-exact,
and whose rerun completes without storing a chunk twice. The full run makes
CKPTVAULT_CRASH_TRIALS_DELTA (default 20) trials; the quick subset (-m "not slow") makes 2."""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from ckptvault import CompressionSettings, Vault
from ckptvault.chunking import ChunkerParams

from .test_crash_backup import assert_recovers, kill_after, slow_cli, timed
from .test_delta import write_safetensors

SMALL = ChunkerParams(min_size=16 * 1024, avg_size=64 * 1024, max_size=256 * 1024)


def write_step(root: Path, step: int) -> None:
    """A model whose trained tensors drift a little each step, and a frozen one."""
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(0)
    frozen = rng.normal(0, 0.02, (512, 1024)).astype(np.float32)
    trained = rng.normal(0, 0.02, (3072, 1024)).astype(np.float32)
    for s in range(2, step + 1):
        trained += np.random.default_rng(s).normal(0, 1e-4, trained.shape).astype(np.float32)
    bf16 = (trained[:512].view(np.uint32) >> 16).astype(np.uint16)
    write_safetensors(
        root / "model.safetensors", {"frozen": ("F32", frozen), "w": ("F32", trained), "h": ("BF16", bf16)}
    )
    (root / "optimizer.bin").write_bytes(random.Random(f"optimizer-{step}").randbytes(1 << 20))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    work = tmp_path_factory.mktemp("delta-crash")
    repo = work / "vault"
    with Vault.init(str(repo), chunker=SMALL, pack_size=1 << 20, compression=CompressionSettings(delta=True)) as vault:
        for step in (1, 2):
            write_step(work / f"step-{step}", step)
            snap = vault.backup(work / f"step-{step}", tags={"run": "r", "step": str(step)})
        assert snap.summary.delta_chunks > 20  # step 2 was coded against step 1
    write_step(work / "step-3", 3)
    reference = work / "reference"
    shutil.copytree(repo, reference)
    duration = timed(
        slow_cli("backup", str(work / "step-3"), "--repo", f"slowfile://{reference}", "-t", "run=r", "-t", "step=3")
    )
    with Vault.open(str(reference)) as vault:
        assert vault.latest({"step": "3"}).summary.delta_chunks > 20  # the timed run wrote deltas throughout
    print(f"step-3 backup on the slowed filesystem: {duration:.2f} s")
    return work, repo, duration


def delta_packs(repo: Path) -> set[Path]:
    """Pack files holding delta chunks (a v2 trailer), complete ones only (temp files are skipped)."""
    out = set()
    for p in (repo / "packs").rglob("*"):
        if p.is_file() and not p.name.startswith(".tmp"):
            with open(p, "rb") as f:
                f.seek(-4, os.SEEK_END)
                if f.read() == b"CVP2":
                    out.add(p)
    return out


def kill_after_delta_packs(proc, repo: Path, count: int) -> None:
    """SIGKILL as soon as the run has written ``count`` new packs of deltas: mid-write for certain."""
    before = delta_packs(repo)
    while len(delta_packs(repo) - before) < count:
        assert proc.poll() is None, "the backup ended before it wrote delta packs"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def trial(setup, seed: int, after_packs: int | None = None) -> None:
    work, base, duration = setup
    repo = work / f"trial-{seed}"
    shutil.copytree(base, repo)
    src = work / "step-3"
    proc = slow_cli("backup", str(src), "--repo", f"slowfile://{repo}", "-t", "run=r", "-t", "step=3")
    if after_packs is None:
        kill_after(proc, random.Random(seed).uniform(0.3, duration))
    else:
        kill_after_delta_packs(proc, repo, after_packs)
    assert_recovers(work, repo, src, seed, {"run": "r", "step": "3"})


@pytest.mark.parametrize("after_packs", [1, 4])
def test_killed_delta_backup_quick(setup, after_packs):
    trial(setup, after_packs, after_packs)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(300, 300 + int(os.environ.get("CKPTVAULT_CRASH_TRIALS_DELTA", "20"))))
def test_killed_delta_backup(setup, seed):
    trial(setup, seed)
