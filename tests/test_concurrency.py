"""Several backup processes and a prune process at once on one repository.

Each writer backs up its own checkpoint series (sharing a frozen part with the others) through
the real CLI; a pruner keeps the newest 2 per run. Lock conflicts (exit 11) are retried after
a seeded pause, as a user's job scheduler would. Afterwards every snapshot restores bit-exact
and check --read-data passes.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckptvault import Vault

DEADLINE_S = 120


def content(writer: int, step: int) -> dict[str, bytes]:
    return {
        "model.bin": random.Random("shared-frozen").randbytes(600_000)
        + random.Random(f"{writer}-{step}").randbytes(400_000),
        "state.json": f'{{"writer": {writer}, "step": {step}}}'.encode(),
    }


def cli(*args: str) -> subprocess.CompletedProcess:
    """The real CLI on a slowed filesystem (tests/support/slowfs.py), so that runs overlap."""
    return subprocess.run(
        [sys.executable, "-m", "tests.support.slowfs", *args],
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "SLOWFS_DELAY": "0.01"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
    )


def retrying(args: list[str], rng: random.Random, deadline: float, log: list) -> None:
    while time.monotonic() < deadline:
        proc = cli(*args)
        rc = proc.returncode
        log.append((args[0], rc))
        if rc == 0:
            return
        assert rc == 11, f"{args[0]} failed with exit {rc}: {proc.stderr.decode()}"  # only lock conflicts expected
        time.sleep(rng.uniform(0.05, 0.3))
    raise AssertionError(f"{args[0]} never got the lock")


def run_scenario(tmp_path: Path, writers: int, steps: int, prunes: int, seed: int) -> None:
    Vault.init(str(tmp_path / "vault"), pack_size=1 << 20).close()
    repo = f"slowfile://{tmp_path / 'vault'}"
    deadline = time.monotonic() + DEADLINE_S
    log: list = []
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        rng = random.Random(seed * 100 + w)
        try:
            for step in range(1, steps + 1):
                src = tmp_path / f"w{w}" / f"step-{step}"
                src.mkdir(parents=True)
                for name, data in content(w, step).items():
                    (src / name).write_bytes(data)
                retrying(
                    ["backup", str(src), "--repo", repo, "--tag", f"run=w{w}", "--tag", f"step={step}", "-q"],
                    rng,
                    deadline,
                    log,
                )
        except BaseException as exc:
            errors.append(exc)

    def pruner() -> None:
        rng = random.Random(seed)
        try:
            for _ in range(prunes):
                time.sleep(rng.uniform(0.1, 0.6))
                retrying(["prune", "--repo", repo, "--keep-latest", "2", "--group-by", "run", "-q"], rng, deadline, log)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    threads.append(threading.Thread(target=pruner))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sum(1 for cmd, rc in log if cmd == "prune" and rc == 0) == prunes
    print(f"{len(log)} commands, {sum(rc == 11 for _, rc in log)} lock conflicts retried")

    with Vault.open(str(tmp_path / "vault")) as vault:
        report = vault.check(read_data=1.0)
        assert report.ok, report.problems
        snaps = vault.snapshots()
        for w in range(writers):
            steps_left = sorted(s.step for s in snaps if s.tags["run"] == f"w{w}")
            assert steps_left[-1] == steps and len(steps_left) >= 2
        for snap in snaps:
            out = tmp_path / "restore" / snap.id
            vault.restore(snap, out)
            w, step = int(snap.tags["run"][1:]), snap.step
            for name, data in content(w, step).items():
                assert (out / name).read_bytes() == data, (snap.tags, name)


def test_backups_and_prune_at_once_quick(tmp_path: Path):
    run_scenario(tmp_path, writers=2, steps=2, prunes=1, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [7, 8])
def test_backups_and_prune_at_once(tmp_path: Path, seed: int):
    run_scenario(tmp_path, writers=3, steps=5, prunes=4, seed=seed)
