"""Pins a dead process left behind: the next backup_async beside them ships them, under the tags
they were given, unless their owner still runs, they belong to another vault, or they changed."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.ops import leftover_pins
from ckptvault.ops.async_backup import make_job
from ckptvault.ops.pin import META
from tests.conftest import tree_digest, write_file

ROOT = Path(__file__).resolve().parents[1]

DYING_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import ckptvault.vault
    from ckptvault import Vault
    from ckptvault.ops import async_backup

    def hold(*args):
        print("held", flush=True)
        time.sleep(600)

    if sys.argv[3] == "before-commit":  # the packs are uploaded, the snapshot is not written
        ckptvault.vault.check_pins_unchanged = hold
    else:  # the snapshot is written, the pin is not released yet
        async_backup.AsyncShipper._release = hold
    vault = Vault.open(sys.argv[1])
    vault.backup_async(sys.argv[2], tags={"run": "r", "step": "1"})
    time.sleep(600)
    """
)


def make_checkpoint(path: Path, step: int) -> Path:
    write_file(path / "model.safetensors", os.urandom(300_000))
    write_file(path / "trainer_state.json", json.dumps({"global_step": step}).encode())
    return path


def kill_while_shipping(repo: Path, ckpt: Path, when: str) -> None:
    """Run a process that queues ``ckpt`` and is SIGKILLed at ``when`` of its backup."""
    proc = subprocess.Popen(
        [sys.executable, "-c", DYING_SCRIPT, str(repo), str(ckpt), when],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout.readline().strip() == "held"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)


def pin_roots(ckpt_parent: Path) -> list[Path]:
    staging = ckpt_parent / ".ckptvault-pins"
    return sorted(staging.iterdir()) if staging.exists() else []


def test_a_checkpoint_pinned_by_a_killed_process_is_shipped_by_the_next_one(tmp_path, caplog):
    Vault.init(str(tmp_path / "repo")).close()
    first = make_checkpoint(tmp_path / "out" / "checkpoint-1", 1)
    expected = tree_digest(first)
    kill_while_shipping(tmp_path / "repo", first, "before-commit")
    shutil.rmtree(first)  # the trainer's rotation: the pin is now the only copy
    assert len(pin_roots(tmp_path / "out")) == 1

    second = make_checkpoint(tmp_path / "out" / "checkpoint-2", 2)
    with caplog.at_level(logging.WARNING, logger="ckptvault"), Vault.open(str(tmp_path / "repo")) as vault:
        handle = vault.backup_async(second, tags={"run": "r", "step": "2"})
        vault.flush(timeout=120)
        snaps = sorted(vault.snapshots(), key=lambda s: s.time)
        assert [s.tags for s in snaps] == [{"run": "r", "step": "1"}, {"run": "r", "step": "2"}]
        assert snaps[0].description == f"ckptvault backup_async: {first}"
        assert handle.result().id == snaps[1].id
        vault.restore(snaps[0], tmp_path / "restored")
    assert tree_digest(tmp_path / "restored") == expected
    assert any(
        f"shipping {first} (step 1), left pinned in {tmp_path / 'out' / '.ckptvault-pins'}" in r.getMessage()
        for r in caplog.records
    )
    assert pin_roots(tmp_path / "out") == []


def test_a_pin_whose_snapshot_was_written_before_its_process_died_is_not_stored_twice(tmp_path):
    Vault.init(str(tmp_path / "repo")).close()
    first = make_checkpoint(tmp_path / "out" / "checkpoint-1", 1)
    kill_while_shipping(tmp_path / "repo", first, "after-commit")
    assert len(pin_roots(tmp_path / "out")) == 1
    second = make_checkpoint(tmp_path / "out" / "checkpoint-2", 2)
    with Vault.open(str(tmp_path / "repo")) as vault:
        assert len(vault.snapshots()) == 1
        vault.backup_async(second, tags={"run": "r", "step": "2"})
        vault.flush(timeout=120)
        assert sorted(s.tags["step"] for s in vault.snapshots()) == ["1", "2"]
    assert pin_roots(tmp_path / "out") == []


def set_owner(root: Path, **changes: object) -> None:
    doc = json.loads((root / META).read_text())
    doc["owner"].update(changes)
    (root / META).write_text(json.dumps(doc))


def pin_for(vault: Vault, ckpt: Path, step: int) -> Path:
    """A pin as backup_async makes it (never queued): owned by this process until set_owner."""
    job = make_job(
        [str(ckpt)], vault_id=vault.config.repo_id, tags={"step": str(step)}, description="", hostname=None, pin=True
    )
    return Path(job.pins[0].root)


@pytest.fixture
def ended_process() -> dict[str, object]:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    record = leftover_pins.this_process() | {"pid": proc.pid}
    proc.wait()
    return record


@pytest.fixture
def running_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    deadline = time.monotonic() + 30
    while leftover_pins._start_ticks(proc.pid) is None:  # until /proc has it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield proc
    proc.kill()
    proc.wait()


def test_whose_pins_are_taken_over(tmp_path, vault, ended_process, running_process):
    live = leftover_pins.this_process() | {
        "pid": running_process.pid,
        "started": leftover_pins._start_ticks(running_process.pid),
    }
    boot, namespace = leftover_pins.process_table().split("/")
    cases = {
        "ended": (ended_process, True),
        "running": (live, False),
        "pid now another process's": ({**live, "started": live["started"] + 1}, True),
        "an earlier boot": ({**live, "table": f"another-boot/{namespace}"}, True),
        "another PID namespace": ({**live, "table": f"{boot}/1"}, False),
        "another host": ({**live, "host": "elsewhere"}, False),
        "this process": ({}, False),
    }
    roots = {}
    for i, (name, (owner, _)) in enumerate(cases.items()):
        roots[name] = pin_for(vault, make_checkpoint(tmp_path / "out" / f"checkpoint-{i}", i), i)
        set_owner(roots[name], **owner)
    other_vault = Vault.init(str(tmp_path / "other"))
    foreign = pin_for(other_vault, make_checkpoint(tmp_path / "out" / "checkpoint-x", 99), 99)
    set_owner(foreign, **ended_process)

    taken = leftover_pins.take_over(str(tmp_path / "out" / ".ckptvault-pins"), vault.config.repo_id)

    assert sorted(left.job.tags["step"] for left in taken) == sorted(
        str(i) for i, (owner, expected) in enumerate(cases.values()) if expected
    )
    by_step = {str(i): roots[name] for i, name in enumerate(cases)}
    for left in taken:  # renamed, in its place in the order, now this process's
        before = by_step[left.job.tags["step"]]
        assert not before.exists() and Path(left.pin.root).name[:20] == before.name[:20]
        assert json.loads(Path(left.pin.root, META).read_text())["owner"]["pid"] == os.getpid()
    assert foreign.exists() and all(roots[n].exists() for n, (_, expected) in cases.items() if not expected)
    assert leftover_pins.take_over(str(tmp_path / "out" / ".ckptvault-pins"), vault.config.repo_id) == []
    other_vault.close()


def test_a_pin_whose_owner_cannot_be_checked_is_taken_over_after_a_day(tmp_path, vault):
    root = pin_for(vault, make_checkpoint(tmp_path / "out" / "checkpoint-1", 1), 1)
    set_owner(root, host="elsewhere")
    staging = str(root.parent)
    assert leftover_pins.take_over(staging, vault.config.repo_id) == []
    day_old = root.with_name(f"{time.time_ns() - 25 * 3600 * 10**9:020d}-{root.name[-6:]}")
    root.rename(day_old)
    taken = leftover_pins.take_over(staging, vault.config.repo_id)
    assert [left.owner_host for left in taken] == ["elsewhere"]
    assert Path(taken[0].pin.root).name[:20] == day_old.name[:20]


def test_an_unfinished_pin_folder_is_removed_once_it_is_old(tmp_path, vault):
    staging = tmp_path / "out" / ".ckptvault-pins"
    young = staging / f"{time.time_ns():020d}-aaaaaa"
    old = staging / f"{time.time_ns() - 3600 * 10**9:020d}-bbbbbb"
    for root in (young, old):
        write_file(root / "data" / "checkpoint-1" / "model.safetensors", b"half")  # no pin.json
    assert leftover_pins.take_over(str(staging), vault.config.repo_id) == []
    assert young.exists() and not old.exists()


def test_a_leftover_pin_changed_since_it_was_made_is_released_not_shipped(tmp_path, vault, ended_process, caplog):
    ckpt = make_checkpoint(tmp_path / "out" / "checkpoint-1", 1)
    root = pin_for(vault, ckpt, 1)
    set_owner(root, **ended_process)
    with open(ckpt / "model.safetensors", "r+b") as f:  # rewritten in place: the pin shares the inode
        f.write(b"later save")
    second = make_checkpoint(tmp_path / "out" / "checkpoint-2", 2)
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        vault.backup_async(second, tags={"step": "2"})
        vault.flush(timeout=60)
    assert [s.tags["step"] for s in vault.snapshots()] == ["2"]
    assert any(
        f"{ckpt}, pinned by a process that ended before it shipped, was changed" in r.getMessage()
        for r in caplog.records
    )
    assert pin_roots(tmp_path / "out") == []


def test_claiming_a_pin_twice_succeeds_once(tmp_path, vault, ended_process):
    root = pin_for(vault, make_checkpoint(tmp_path / "out" / "checkpoint-1", 1), 1)
    set_owner(root, **ended_process)
    from ckptvault.ops.pin import read

    pin_a, doc = read(str(root))
    pin_b, _ = read(str(root))
    job = leftover_pins.JobRecord.from_doc(doc["job"])
    assert leftover_pins._claim(pin_a, job) is True
    assert leftover_pins._claim(pin_b, job) is False  # another process's rename won
