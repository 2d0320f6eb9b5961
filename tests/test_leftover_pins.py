"""Pins a dead process left behind: the next backup_async beside them ships them, under the tags
they were given, unless their owner still runs, they belong to another vault, or they changed."""

from __future__ import annotations

import errno
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
from ckptvault.errors import SourceError
from ckptvault.ops import leftover_pins
from ckptvault.ops.async_backup import make_job
from ckptvault.ops.pin import META, OWNER_LOCK, owner_lock_held
from tests.conftest import tree_digest, write_file

ROOT = Path(__file__).resolve().parents[1]

DYING_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from ckptvault import Vault
    from ckptvault.ops import async_backup

    def hold(*args):
        print("held", flush=True)
        time.sleep(600)

    if sys.argv[3] == "before-commit":  # the packs are uploaded, the snapshot is not written
        async_backup.check_sources_unchanged = hold
    else:  # the snapshot is written, the pin is not released yet
        async_backup.AsyncShipper._release = hold
    vault = Vault.open(sys.argv[1])
    vault.backup_async(sys.argv[2], tags={"run": "r", "step": sys.argv[4]})
    time.sleep(600)
    """
)


def make_checkpoint(path: Path, step: int) -> Path:
    write_file(path / "model.safetensors", os.urandom(300_000))
    write_file(path / "trainer_state.json", json.dumps({"global_step": step}).encode())
    return path


def kill_while_shipping(repo: Path, ckpt: Path, when: str, *, in_a_container: bool = False, step: int = 1) -> None:
    """Run a process that queues ``ckpt`` (tagged run=r and ``step``) and is SIGKILLed at ``when`` of its
    backup; ``in_a_container``: in a PID namespace of its own, as a container's trainer is."""
    wrap = ["unshare", "--pid", "--fork", "--mount-proc"] if in_a_container else []
    proc = subprocess.Popen(
        [*wrap, sys.executable, "-c", DYING_SCRIPT, str(repo), str(ckpt), when, str(step)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        assert proc.stdout.readline().strip() == "held"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # unshare and the trainer it forked
        proc.wait(timeout=60)


def can_unshare() -> bool:
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    except OSError:
        return False
    return done.returncode == 0


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


def a_dead_run_left_step_2_pinned(tmp_path: Path) -> tuple[Path, Path, dict]:
    """A vault holding step 1 of run r; a trainer killed while shipping step 2, whose folder the rotation then
    deleted (its pin is the only copy). Returns the vault, the output folder, and step 2's tree_digest."""
    repo, out = tmp_path / "repo", tmp_path / "out"
    with Vault.init(str(repo)) as vault:
        vault.backup(make_checkpoint(out / "checkpoint-1", 1), tags={"run": "r", "step": "1"})
    second = make_checkpoint(out / "checkpoint-2", 2)
    expected = tree_digest(second)
    kill_while_shipping(repo, second, "before-commit", step=2)
    shutil.rmtree(second)
    return repo, out, expected


def test_a_restart_ships_the_dead_runs_pins_before_it_picks_the_save_to_resume_from(tmp_path):
    """The pins of a killed trainer shipped only at the restarted run's first save, after its resume had
    restored an older step from the vault; they then became `latest` over the resumed run's newer saves,
    mixing two histories (train 37 T2). ``ship_leftover_pins``, called before ``restore_latest``, ships them
    first."""
    repo, out, expected = a_dead_run_left_step_2_pinned(tmp_path)
    with Vault.open(str(repo)) as vault:
        assert vault.latest({"run": "r"}).tags["step"] == "1"
        shipped = vault.ship_leftover_pins(out, timeout=120)
        assert [s.tags for s in shipped] == [{"run": "r", "step": "2"}]
        vault.restore_latest(tmp_path / "resume", run="r")
        assert vault.ship_leftover_pins(out) == []
        with pytest.raises(SourceError, match=r"cannot read .*/no-such: no such directory \(give the folder"):
            vault.ship_leftover_pins(tmp_path / "no-such")
    assert tree_digest(tmp_path / "resume") == expected
    assert pin_roots(out) == []


def test_leftover_pins_are_shipped_when_the_pins_folder_itself_is_given_and_named_when_a_checkpoint_is(
    tmp_path, caplog
):
    """ship_leftover_pins("out/.ckptvault-pins") and ship_leftover_pins("out/checkpoint-3") shipped nothing
    and said nothing while a dead run's pin waited in out/.ckptvault-pins: the resume picked an older step
    (api audit 39 M5)."""
    repo, out = tmp_path / "repo", tmp_path / "out"
    Vault.init(str(repo)).close()
    second = make_checkpoint(out / "checkpoint-2", 2)
    kill_while_shipping(repo, second, "before-commit", step=2)
    third = make_checkpoint(out / "checkpoint-3", 3)  # the restarted run's own save, not yet shipped
    with Vault.open(str(repo)) as vault, caplog.at_level(logging.WARNING, logger="ckptvault"):
        assert vault.ship_leftover_pins(third) == []
        assert [r.getMessage() for r in caplog.records] == [
            f"{third} holds no .ckptvault-pins, but the folder above it does: backup_async pins beside each source, "
            f"so a checkpoint folder's pins are there; to ship them: ship_leftover_pins({str(out)!r})"
        ]
        shipped = vault.ship_leftover_pins(out / ".ckptvault-pins", timeout=120)
        assert [s.tags for s in shipped] == [{"run": "r", "step": "2"}]
    assert pin_roots(out) == []


@pytest.mark.skipif(not can_unshare(), reason="needs unshare(1) and the right to make PID namespaces (root)")
def test_a_pin_of_a_trainer_killed_in_a_container_is_shipped_by_the_restarted_one_at_once(tmp_path, caplog):
    """The OOM killer ends a container's trainer; the container restarts with the same volume, in a new PID
    namespace, where the dead owner's PID cannot be looked up: its pins waited a day, in silence (audit 30
    #1). The owner lock the kernel dropped with it says it is gone. (The test process is the restarted
    container: its PID namespace is not the killed one's.)"""
    Vault.init(str(tmp_path / "repo")).close()
    first = make_checkpoint(tmp_path / "out" / "checkpoint-1", 1)
    kill_while_shipping(tmp_path / "repo", first, "before-commit", in_a_container=True)
    (pin,) = pin_roots(tmp_path / "out")
    assert json.loads((pin / META).read_text())["owner"]["table"] != leftover_pins.process_table()
    shutil.rmtree(first)  # the trainer's rotation: the pin is now the only copy
    deadline = time.monotonic() + 30
    while owner_lock_held(str(pin)):  # the trainer, killed with unshare, may still be exiting
        assert time.monotonic() < deadline, "the killed trainer's owner lock is still held"
        time.sleep(0.01)
    second = make_checkpoint(tmp_path / "out" / "checkpoint-2", 2)
    with caplog.at_level(logging.WARNING, logger="ckptvault"), Vault.open(str(tmp_path / "repo")) as vault:
        vault.backup_async(second, tags={"run": "r", "step": "2"})
        vault.flush(timeout=120)
        assert sorted(s.tags["step"] for s in vault.snapshots()) == ["1", "2"]
    assert pin_roots(tmp_path / "out") == []
    assert not any("cannot check" in r.getMessage() for r in caplog.records)


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
    """Another owner: this process lets go of the pin's owner lock (closing any descriptor of the file
    drops a process's POSIX locks on it), as only another process could hold it."""
    doc = json.loads((root / META).read_text())
    doc["owner"].update(changes)
    (root / META).write_text(json.dumps(doc))
    if changes:
        os.close(os.open(root / OWNER_LOCK, os.O_RDONLY))


@pytest.fixture
def lock_holder():
    """Holds a pin's owner lock from another process, as its live owner in another PID namespace would."""
    procs: list[subprocess.Popen] = []

    def hold(root: Path) -> None:
        code = "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.lockf(fd, fcntl.LOCK_EX)"
        proc = subprocess.Popen(
            [sys.executable, "-c", f"{code}; print('held', flush=True); time.sleep(120)", str(root / OWNER_LOCK)],
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def made_at(root: Path, when_ns: int) -> Path:
    """The pin renamed as if it got its owner at ``when_ns``."""
    return root.rename(root.with_name(f"{when_ns:020d}-{root.name[-6:]}"))


def pin_for(vault: Vault, ckpt: Path | list[Path], step: int) -> list[Path]:
    """Pins as backup_async makes them (never queued), owned by this process until set_owner."""
    sources = [str(c) for c in (ckpt if isinstance(ckpt, list) else [ckpt])]
    job = make_job(
        sources, vault_id=vault.config.repo_id, tags={"step": str(step)}, description="", hostname=None, pin=True
    )
    return [Path(p.root) for p in job.pins]


def take_over(staging: Path, vault: Vault) -> list[leftover_pins.Leftover]:
    warnings: list[str] = []
    taken = leftover_pins.take_over([str(staging)], vault.config.repo_id, warnings.append)
    assert [w for w in warnings if "by a process this one cannot check" not in w] == []
    return taken


@pytest.fixture
def ended_process() -> dict[str, object]:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    record = leftover_pins.this_process() | {"pid": proc.pid}
    proc.wait()
    return record


def started(pid: int) -> int:
    stat = leftover_pins._proc_stat(pid)
    assert stat is not None
    return stat[1]


@pytest.fixture
def running_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield leftover_pins.this_process() | {"pid": proc.pid, "started": started(proc.pid)}
    proc.kill()
    proc.wait()


@pytest.fixture
def zombie_process():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    record = leftover_pins.this_process() | {"pid": proc.pid, "started": started(proc.pid)}
    deadline = time.monotonic() + 30
    while leftover_pins._proc_stat(proc.pid)[0] != "Z":  # exited, not reaped: its PID still answers
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield record
    proc.wait()


def test_whose_pins_are_taken_over(tmp_path, vault, ended_process, running_process, zombie_process, lock_holder):
    live = running_process
    boot, namespace = leftover_pins.process_table().split("/")
    before_boot = leftover_pins._boot_time_ns() - 10**9
    cases = {  # name: (owner, when it got the pin (None: now), taken over)
        "ended": (ended_process, None, True),
        "running": (live, None, False),
        "a zombie": (zombie_process, None, True),
        "pid now another process's": ({**live, "started": live["started"] + 1}, None, True),
        "an earlier boot": ({**live, "table": f"another-boot/{namespace}"}, before_boot, True),
        "another machine of this name": ({**live, "table": f"another-boot/{namespace}"}, None, False),
        # a container sharing the folder, or this one restarted (after the OOM killer): its owner lock says
        "another PID namespace, running": ({**live, "table": f"{boot}/1"}, None, False),
        "another PID namespace, ended": ({**live, "table": f"{boot}/1"}, None, True),
        "another PID namespace, no owner lock": ({**live, "table": f"{boot}/1"}, None, False),  # an older pin
        "another host": ({**live, "host": "elsewhere"}, None, False),
        "this process": ({}, None, False),
    }
    roots = {}
    for i, (name, (owner, when, _)) in enumerate(cases.items()):
        (roots[name],) = pin_for(vault, make_checkpoint(tmp_path / "out" / f"checkpoint-{i}", i), i)
        set_owner(roots[name], **owner)
        if when is not None:
            roots[name] = made_at(roots[name], when)
    lock_holder(roots["another PID namespace, running"])
    (roots["another PID namespace, no owner lock"] / OWNER_LOCK).unlink()
    other_vault = Vault.init(str(tmp_path / "other"))
    (foreign,) = pin_for(other_vault, make_checkpoint(tmp_path / "out" / "checkpoint-x", 99), 99)
    set_owner(foreign, **ended_process)

    taken = take_over(tmp_path / "out" / ".ckptvault-pins", vault)

    expected = {str(i): name for i, (name, (_, _, yes)) in enumerate(cases.items()) if yes}
    assert sorted(left.job.tags["step"] for left in taken) == sorted(expected)
    for left in taken:  # renamed for when it got its new owner: this process
        assert not roots[expected[left.job.tags["step"]]].exists()
        assert json.loads(Path(left.pin.root, META).read_text())["owner"]["pid"] == os.getpid()
        assert int(Path(left.pin.root).name[:20]) > time.time_ns() - 60 * 10**9
    assert foreign.exists() and all(roots[n].exists() for n, (_, _, yes) in cases.items() if not yes)
    assert take_over(tmp_path / "out" / ".ckptvault-pins", vault) == []
    other_vault.close()


def test_a_pin_whose_owner_cannot_be_checked_is_taken_over_a_day_after_it_got_it(tmp_path, vault):
    (root,) = pin_for(vault, make_checkpoint(tmp_path / "out" / "checkpoint-1", 1), 1)
    set_owner(root, host="elsewhere")
    warnings: list[str] = []
    for _ in range(2):  # said once, with when it ships and how to ship it now (it used to wait in silence)
        assert leftover_pins.take_over([str(root.parent)], vault.config.repo_id, warnings.append) == []
    (told,) = warnings
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(int(root.name[:20]) / 1e9 + 24 * 3600))
    assert f"pinned in {root} by a process this one cannot check (on elsewhere), so it ships from {when}" in told
    assert told.endswith(f"vault.backup({str(root / 'data' / 'checkpoint-1')!r}, tags={{'step': '1'}})")
    made_at(root, time.time_ns() - 25 * 3600 * 10**9)
    taken = take_over(root.parent, vault)
    assert [left.owner_host for left in taken] == ["elsewhere"]
    # taken over just now: a third host waits a day from now, not from when it was first pinned
    set_owner(Path(taken[0].pin.root), host="a-third-host")
    assert take_over(root.parent, vault) == []


def test_an_unfinished_pin_folder_is_removed_once_it_is_old(tmp_path, vault):
    staging = tmp_path / "out" / ".ckptvault-pins"
    young = staging / f"{time.time_ns():020d}-aaaaaa"
    old = staging / f"{time.time_ns() - 3600 * 10**9:020d}-bbbbbb"
    for root in (young, old):
        write_file(root / "data" / "checkpoint-1" / "model.safetensors", b"half")  # no pin.json
    assert take_over(staging, vault) == []
    assert young.exists() and not old.exists()


def test_a_leftover_pin_changed_since_it_was_made_is_released_not_shipped(tmp_path, vault, ended_process, caplog):
    ckpt = make_checkpoint(tmp_path / "out" / "checkpoint-1", 1)
    (root,) = pin_for(vault, ckpt, 1)
    set_owner(root, **ended_process)
    with open(ckpt / "model.safetensors", "ab") as f:  # changed in place: the pin shares the inode
        f.write(b"later save")  # (a size that changes: an mtime may be as coarse as a jiffy)
    second = make_checkpoint(tmp_path / "out" / "checkpoint-2", 2)
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        vault.backup_async(second, tags={"step": "2"})
        vault.flush(timeout=60)
    assert [s.tags["step"] for s in vault.snapshots()] == ["2"]
    assert any(
        f"{ckpt}, left by a process that ended before it shipped, was changed since it was pinned; not shipped"
        in r.getMessage()
        for r in caplog.records
    )
    assert pin_roots(tmp_path / "out") == []


def test_a_job_of_several_folders_ships_whole_or_not_at_all(tmp_path, vault, ended_process, caplog):
    whole = [make_checkpoint(tmp_path / d / f"{d}-checkpoint-1", 1) for d in ("a", "b")]
    for root in pin_for(vault, whole, 1):
        set_owner(root, **ended_process)
    torn = [make_checkpoint(tmp_path / d / f"{d}-checkpoint-2", 2) for d in ("a", "b")]
    roots = pin_for(vault, torn, 2)
    for root in roots:
        set_owner(root, **ended_process)
    shutil.rmtree(roots[1])  # as if its process died before it pinned the second folder
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        vault.backup_async(make_checkpoint(tmp_path / "a" / "checkpoint-3", 3), tags={"step": "3"})
        vault.flush(timeout=60)
    snaps = sorted(vault.snapshots(), key=lambda s: s.time)
    assert [(s.tags["step"], sorted(Path(p).name for p in s.paths)) for s in snaps] == [
        ("1", ["a-checkpoint-1", "b-checkpoint-1"]),  # b's pin found through the folder a's pin named
        ("3", ["checkpoint-3"]),
    ]
    assert any("lost part of its pins; not shipped" in r.getMessage() for r in caplog.records)
    assert pin_roots(tmp_path / "a") == pin_roots(tmp_path / "b") == []


def test_a_job_pinned_into_a_folder_that_was_not_locked_is_left_whole_for_the_next_call(
    tmp_path, vault, ended_process, monkeypatch
):
    """A job that names a folder not locked by this look (its pins made after the folders were chosen)
    is left alone: taken over in part, it would be released as a job that lost part of its pins."""
    whole = [make_checkpoint(tmp_path / d / f"{d}-checkpoint-1", 1) for d in ("a", "b")]
    roots = pin_for(vault, whole, 1)
    for root in roots:
        set_owner(root, **ended_process)
    staging = roots[0].parent
    monkeypatch.setattr(leftover_pins, "_folders_of_jobs", lambda stagings, vault_id: list(stagings))
    assert take_over(staging, vault) == []
    assert all(root.exists() for root in roots)
    monkeypatch.undo()
    assert sorted(Path(left.pin.source).name for left in take_over(staging, vault)) == [
        "a-checkpoint-1",
        "b-checkpoint-1",
    ]


def test_leftovers_are_neither_dropped_nor_make_the_callers_backups_be_dropped(tmp_path, ended_process, caplog):
    from tests.test_async_backup import slow_vault, wait_until

    vault = slow_vault(tmp_path, delay=0.05)
    running = vault.backup_async(make_checkpoint(tmp_path / "out" / "checkpoint-1", 1), tags={"step": "1"})
    wait_until(running.running)  # the leftovers go before every job still queued, not the running one
    waiting = vault.backup_async(make_checkpoint(tmp_path / "out" / "checkpoint-2", 2), tags={"step": "2"})
    for step in (10, 11, 12):  # three a dead process left: more than max_pending (2)
        (root,) = pin_for(vault, make_checkpoint(tmp_path / "out" / f"checkpoint-{step}", step), step)
        set_owner(root, **ended_process)
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        newest = vault.backup_async(make_checkpoint(tmp_path / "out" / "checkpoint-3", 3), tags={"step": "3"})
        vault.flush(timeout=120)
    assert all(h.exception() is None for h in (running, waiting, newest))
    order = [s.tags["step"] for s in sorted(vault.snapshots(), key=lambda s: s.time)]
    assert order == ["1", "10", "11", "12", "2", "3"]  # older than anything queued since: first
    assert not [r for r in caplog.records if "dropped" in r.getMessage()]
    vault.close()


def test_what_cannot_be_taken_over_is_a_warning_not_an_error_on_the_training_thread(
    tmp_path, vault, ended_process, monkeypatch, caplog
):
    (root,) = pin_for(vault, make_checkpoint(tmp_path / "out" / "checkpoint-1", 1), 1)
    set_owner(root, **ended_process)

    def disk_full(self, **extra):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched, caplog.at_level(logging.WARNING, logger="ckptvault"):
        patched.setattr(leftover_pins.Pin, "save_meta", disk_full)
        patched.setattr(leftover_pins, "pin_metadata", lambda job: {})
        handle = vault.backup_async(
            make_checkpoint(tmp_path / "out" / "checkpoint-2", 2), tags={"step": "2"}, pin=False
        )
        vault.flush(timeout=60)
    assert handle.result().tags == {"step": "2"}
    assert any(
        f"cannot take over the pin {root} left by a process that ended: No space left on device" in r.getMessage()
        for r in caplog.records
    )
    assert root.exists()  # left for a later try, still naming its dead owner
    vault.backup_async(make_checkpoint(tmp_path / "out" / "checkpoint-3", 3), tags={"step": "3"})
    vault.flush(timeout=60)
    assert sorted(s.tags["step"] for s in vault.snapshots()) == ["1", "2", "3"]


SLOW_CLAIM = textwrap.dedent(
    """
    import sys, time
    from ckptvault.ops import leftover_pins
    real = leftover_pins.pin_metadata

    def slow(job):  # holds the pin between deciding to take it and recording that it did
        print("claiming", flush=True)
        time.sleep(2)
        return real(job)

    leftover_pins.pin_metadata = slow
    taken = leftover_pins.take_over(sys.argv[2:], sys.argv[1], print)
    print("took", len(taken), flush=True)
    time.sleep(5)  # alive while the other process looks
    """
)

TAKE_OVER = textwrap.dedent(
    """
    import sys
    from ckptvault.ops import leftover_pins
    print("took", len(leftover_pins.take_over(sys.argv[2:], sys.argv[1], print)), flush=True)
    """
)


@pytest.mark.parametrize("folders", [1, 2])
def test_of_two_processes_resuming_at_once_one_takes_a_job_over_whole(tmp_path, vault, ended_process, folders):
    # with a job of two folders, each process starts from a different one: neither may take half
    # of the job (each would then find it torn, and release its half: the checkpoint lost)
    ckpts = [make_checkpoint(tmp_path / d / f"shard-{d}", 1) for d in "ab"[:folders]]  # one save, two folders
    roots = pin_for(vault, ckpts, 1)
    for root in roots:
        set_owner(root, **ended_process)

    def start(script: str, staging: Path) -> list[str]:
        return [sys.executable, "-c", script, vault.config.repo_id, str(staging)]

    first = subprocess.Popen(start(SLOW_CLAIM, roots[0].parent), stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert first.stdout.readline().strip() == "claiming"
        second = subprocess.run(
            start(TAKE_OVER, roots[-1].parent), capture_output=True, text=True, cwd=ROOT, timeout=60
        )
        assert second.stdout.strip() == "took 0", second.stdout + second.stderr
        rest = [first.stdout.readline().strip() for _ in range(folders)]  # "claiming" for each other pin
        assert rest[-1] == f"took {folders}", rest
    finally:
        first.kill()
        first.wait()
    taken = take_over(roots[0].parent, vault)  # the first process is gone now: its pins are whole
    assert len(taken) == folders and len({t.job.job_id for t in taken}) == 1


def test_a_leftover_the_queue_refuses_keeps_its_pins(tmp_path, vault, ended_process):
    from ckptvault.errors import UsageError
    from ckptvault.ops.async_backup import AsyncShipper, leftover_jobs, staging_folder

    ckpt = make_checkpoint(tmp_path / "out" / "checkpoint-1", 1)
    (root,) = pin_for(vault, ckpt, 1)
    set_owner(root, **ended_process)
    (job,) = leftover_jobs([staging_folder(str(ckpt))], vault.config.repo_id)
    shipper = AsyncShipper(lambda job: pytest.fail("nothing runs"))
    shipper.close()
    with pytest.raises(UsageError, match="closed"):
        shipper.submit(job)
    assert [Path(p.root).exists() for p in job.pins] == [True]  # for the next process to ship


def test_a_save_offered_again_after_a_restart_is_not_queued_beside_the_dead_runs_pin_of_it(
    tmp_path, ended_process, caplog
):
    """tr43 #9: a resumed Lightning run is offered again the saves its ModelCheckpoint remembers; the dead run's
    pins of them shipped, and the second offer, queued beside them, was dropped for a newer save: "backup of
    epoch=2-step=20.ckpt was dropped for the newer ...", read after a crash as a lost save. The offer is the
    dead run's job (its handle), queued once."""
    from tests.test_async_backup import slow_vault, wait_until

    vault = slow_vault(tmp_path, delay=0.05)
    out = tmp_path / "out"
    running = vault.backup_async(make_checkpoint(out / "checkpoint-1", 1), tags={"step": "1"})
    wait_until(running.running)
    offered = [make_checkpoint(out / f"checkpoint-{step}", step) for step in (20, 24)]
    for ckpt, step in zip(offered, (20, 24), strict=True):
        (root,) = pin_for(vault, ckpt, step)
        set_owner(root, **ended_process)
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        again = [vault.backup_async(c, tags={"step": s}) for c, s in zip(offered, ("20", "24"), strict=True)]
        for step in (28, 32, 36):  # newer saves: more than max_pending (2) wait
            vault.backup_async(make_checkpoint(out / f"checkpoint-{step}", step), tags={"step": str(step)})
        vault.flush(timeout=120)
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert not [m for m in dropped if "checkpoint-20 " in m or "checkpoint-24 " in m], dropped
    steps = sorted(int(s.tags["step"]) for s in vault.snapshots())
    assert steps[:3] == [1, 20, 24] and steps.count(20) == steps.count(24) == 1, steps
    assert [h.result().tags["step"] for h in again] == ["20", "24"]
    vault.close()


def test_a_shell_driven_restart_ships_the_dead_runs_pins_with_ship_pins_before_it_restores(tmp_path, cli):
    """tr43 #10: only the Python API could ship a dead run's pins before a resume; a restart driven from the
    shell (`ckptvault restore latest ... && python train.py`) restored an older save, and the pins shipped at
    the resumed run's first save, over its newer ones. `ckptvault ship-pins FOLDER` does it from the shell."""
    repo, out, expected = a_dead_run_left_step_2_pinned(tmp_path)
    proc = cli("ship-pins", str(out / "checkpoint-1"), "--repo", str(repo))  # a checkpoint's folder: said
    assert f"to ship them: ckptvault ship-pins {out}" in proc.stderr.decode(), proc.stderr
    assert proc.stdout.decode().startswith(f"nothing left pinned in {out / 'checkpoint-1'} (looked in ")
    proc = cli("ship-pins", str(out), "--repo", str(repo), "--json")
    assert [s["tags"] for s in json.loads(proc.stdout)["snapshots"]] == [{"run": "r", "step": "2"}]
    assert "shipped snapshot" in proc.stderr.decode() and "step=2" in proc.stderr.decode(), proc.stderr
    cli("restore", "latest", "--tag", "run=r", str(tmp_path / "resume"), "--repo", str(repo))
    assert tree_digest(tmp_path / "resume") == expected
    again = cli("ship-pins", str(out), "--repo", str(repo))
    assert again.stdout.decode().startswith(f"nothing left pinned in {out} (looked in ")
    bad = cli("ship-pins", str(tmp_path / "no-such"), "--repo", str(repo), check=False)
    assert bad.returncode == 3 and "no such directory (give the folder" in bad.stderr.decode(), bad.stderr
    # ux57: a checkpoint file given for its folder was called "no such directory", though it is there
    bad = cli("ship-pins", str(out / "checkpoint-1" / "model.safetensors"), "--repo", str(repo), check=False)
    assert bad.returncode == 3 and "model.safetensors: a file, not a folder (give the folder" in bad.stderr.decode()


QUEUING_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import ckptvault.vault
    from ckptvault import Vault

    def hold(*args):
        time.sleep(600)

    ckptvault.vault.Vault._run_job = hold  # nothing of them reaches the vault
    vault = Vault.open(sys.argv[1])
    for ckpt in sys.argv[2:]:
        vault.backup_async(ckpt, tags={"run": "r", "step": ckpt.rsplit("-", 1)[1]})
    print("queued", flush=True)
    time.sleep(600)
    """
)


def three_dead_pins_not_uploaded(tmp_path: Path) -> tuple[Path, Path]:
    """A vault, and an output folder whose trainer queued checkpoints 1, 2 and 3 and was killed before
    any of their bytes left: three pins that a ship-pins must upload whole."""
    repo, out = tmp_path / "repo", tmp_path / "out"
    Vault.init(str(repo)).close()
    ckpts = [str(make_checkpoint(out / f"checkpoint-{step}", step)) for step in (1, 2, 3)]
    proc = subprocess.Popen(
        [sys.executable, "-c", QUEUING_SCRIPT, str(repo), *ckpts],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        assert proc.stdout.readline().strip() == "queued"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert len(pin_roots(out)) == 3
    return repo, out


def shipped_steps(repo: Path) -> list[str]:
    with Vault.open(str(repo)) as vault:
        return sorted(s.tags["step"] for s in vault.snapshots())


def test_ship_pins_stops_shipping_at_its_timeout_and_leaves_the_rest_pinned(tmp_path, cli):
    """ux57: `ship-pins --timeout 1` waited until every pinned checkpoint had shipped (9 s here), then failed
    with exit 1 and the API's words ("still running after 0.04 s; wait longer (result(timeout=...)) or check
    done() later"), a failure for a job that was done. At the timeout it now ships no more: the checkpoint
    under way is finished, the others stay pinned, and the message says so and how to ship them."""
    repo, out = three_dead_pins_not_uploaded(tmp_path)
    args = ("ship-pins", str(out), "--repo", str(repo))
    proc = cli(*args, "--timeout", "1", "--limit-upload", "100KB", check=False)  # 300 KB each: ~3 s apiece
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert "result(timeout" not in err and "done()" not in err, err
    assert "not shipped within 1 s (--timeout)" in err and f"run ckptvault ship-pins {out} again" in err, err
    steps = shipped_steps(repo)
    assert len(steps) <= 1 and len(pin_roots(out)) == 3 - len(steps), (steps, pin_roots(out))
    cli(*args)
    assert shipped_steps(repo) == ["1", "2", "3"] and pin_roots(out) == []


def test_ctrl_c_stops_ship_pins_after_the_checkpoint_under_way(tmp_path):
    """ux57: Ctrl-C during `ship-pins` was taken, then the command shipped every pinned checkpoint anyway
    (the vault's close waited for them all) before it said `error: cancelled`. It now ships no more than the
    checkpoint under way; the others stay pinned for the next run."""
    repo, out = three_dead_pins_not_uploaded(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTVAULT_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptvault", "ship-pins", str(out), "--repo", str(repo), "--limit-upload", "100KB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 60
    locks = repo / "locks"
    while not (locks.is_dir() and any(locks.iterdir())) and time.monotonic() < deadline:  # a backup has begun
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert b"run the same command again" in err, err
    steps = shipped_steps(repo)
    assert len(steps) <= 1 and len(pin_roots(out)) == 3 - len(steps), (steps, pin_roots(out))


def test_ship_pins_into_another_vault_names_the_pins_it_leaves(tmp_path, cli):
    """ux57: `ship-pins out` given the wrong vault (the default one, a --repo of another run) said `nothing
    left pinned in out` while out/.ckptvault-pins held a dead run's saves for its own vault: a restart
    script went on to restore an older save. It still ships only its own vault's pins, and names the others."""
    repo, out = three_dead_pins_not_uploaded(tmp_path)
    other = tmp_path / "other"
    cli("init", str(other))
    proc = cli("ship-pins", str(out), "--repo", str(other))
    assert proc.stdout.decode().startswith(f"nothing left pinned in {out} (looked in ")
    with Vault.open(str(repo)) as vault:
        vault_id = vault.config.repo_id
    err = proc.stderr.decode()
    assert f"{out / '.ckptvault-pins'} holds 3 checkpoint(s) left pinned for another vault" in err, err
    assert vault_id[:8] in err and "--repo" in err, err
    assert len(pin_roots(out)) == 3 and shipped_steps(other) == []
    cli("ship-pins", str(out), "--repo", str(repo))
    assert shipped_steps(repo) == ["1", "2", "3"]


def test_a_second_ship_leftover_pins_after_a_cut_short_wait_ships_the_rest_saying_why_they_waited(tmp_path, caplog):
    """A ship_leftover_pins(timeout=...) that ran out left its other checkpoints pinned; the next call in the same
    process shipped them "by this process, which gave it up earlier (a close cut short)", though no close was."""
    import tests.support.slowfs  # noqa: F401  (registers slowfile://)
    from ckptvault.errors import FlushTimeoutError

    repo, out = three_dead_pins_not_uploaded(tmp_path)
    vault = Vault.open(f"slowfile://{repo}", storage_options={"delay": "0.3"})  # each storage call: 0.3 s
    with vault, caplog.at_level(logging.WARNING, logger="ckptvault"):
        with pytest.raises(FlushTimeoutError, match=r"not shipped within 0\.5 s \(timeout\)"):
            vault.ship_leftover_pins(str(out), timeout=0.5)
        caplog.clear()
        vault.ship_leftover_pins(str(out))
    said = [r.getMessage() for r in caplog.records if "which gave it up" in r.getMessage()]
    assert said and all("gave it up when the wait for it ended within 0.5 s (timeout)" in s for s in said), said
    assert shipped_steps(repo) == ["1", "2", "3"] and pin_roots(out) == []
