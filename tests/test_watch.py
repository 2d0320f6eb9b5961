"""``ckptvault watch``: real processes, real files, real signals.

The writer (tests/support/rotating_writer.py) publishes a checkpoint every 100 ms (or --period) and deletes
every older one before the next; the watcher must still ship each one, exactly once, across
SIGTERM, SIGKILL and restarts."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest

from ckptvault import Vault
from ckptvault.cli.cmd_watch import SAME_SIGNAL_S
from ckptvault.errors import UsageError
from ckptvault.ops.names import PIN_FOLDER
from tests.conftest import DEEP, deep_tree
from tests.support.races import at_file_linked
from tests.support.rotating_writer import expected_files, publish
from tests.support.tmpfs import mounted_tmpfs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_watcher_left_running():
    """A failed test's watcher would go on polling (and loading the 2 cores) for the rest of the run."""
    yield
    for proc in WatchProcess.running:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    WatchProcess.running.clear()


class WatchProcess:
    """``python -m tests.support.slowfs watch ...`` (the real CLI, with slowfile:// available),
    its stdout lines collected as they come. One a test leaves running (it failed) is killed after it."""

    running: ClassVar[list[subprocess.Popen[str]]] = []

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.slowfs", "watch", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
        )
        WatchProcess.running.append(self.proc)
        self.lines: list[str] = []
        self.err: list[str] = []
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self._threads:
            t.start()
        self.wait_for(lambda: any("watching" in line for line in self.err), what="the watcher to start")

    @staticmethod
    def _pump(stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line.rstrip("\n"))

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.lines if line.startswith("{")]

    def shipped(self) -> list[dict]:
        return [event for event in self.events() if event["event"] == "shipped"]

    def wait_for(self, predicate, timeout: float = 90.0, what: str = "it") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None and not predicate():
                time.sleep(0.2)  # let the pumps drain
                if predicate():
                    return
                raise AssertionError(f"watch exited ({self.proc.returncode}) before {what}: {self.err}")
            assert time.monotonic() < deadline, (
                f"timed out waiting for {what}; stdout: {self.lines}; stderr: {self.err}"
            )
            time.sleep(0.02)

    def finish(self, sig: int = signal.SIGTERM, timeout: float = 90.0) -> int:
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        for t in self._threads:
            t.join(5)
        return rc


def run_writer(directory: Path, count: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.support.rotating_writer", str(directory), str(count), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def watch_once(ckpts: Path, repo: str, run: str) -> subprocess.CompletedProcess:
    """A restart: ``watch --once`` with the real CLI, shipping what an earlier watcher left."""
    return subprocess.run(
        [sys.executable, "-m", "ckptvault", "watch", str(ckpts), "--repo", repo, "--tag", f"run={run}", "--once"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_each_shipped_once(repo: str, steps: list[int], run: str) -> None:
    """One snapshot per checkpoint written, each with the writer's exact bytes."""
    with Vault.open(repo) as vault:
        snaps = vault.snapshots({"run": run})
        got = sorted(int(s.tags["step"]) for s in snaps)
        assert got == sorted(steps), f"shipped steps {got}, written {sorted(steps)}"
        for snap in snaps:
            for name, data in expected_files(int(snap.tags["step"])).items():
                assert b"".join(vault.read_file(snap, name)) == data, f"{snap.tags['checkpoint']}/{name}"


@pytest.fixture
def repo(tmp_path: Path) -> str:
    url = str(tmp_path / "repo")
    Vault.init(url).close()
    return url


def test_watch_ships_every_checkpoint_of_a_fast_rotation(tmp_path, repo):
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=rot", "--settle", "0.5", "--json")
    # each checkpoint lives 0.25-0.5 s, under --settle: it ships from its pin (0.1 s lives were seen to be
    # missed by a watcher stalled on a loaded machine; what is tested is the pin, not the poll)
    writer = run_writer(ckpts, 20, "--period", "0.25")
    steps = [int(s) for s in writer.stdout.split()]
    assert len(steps) == 20
    watch.wait_for(lambda: len(watch.shipped()) >= 20, timeout=120, what="20 shipped checkpoints")
    assert watch.finish() == 0, watch.err
    assert sorted(e["step"] for e in watch.shipped()) == steps
    assert_each_shipped_once(repo, steps, "rot")
    assert sorted(os.listdir(ckpts)) == [".ckptvault-watch", f"step_{steps[-1]}"]
    assert os.listdir(ckpts / ".ckptvault-watch" / "pins") == [], "every pin is released once shipped"


def test_sigterm_finishes_the_upload_in_flight_and_a_restart_ships_the_rest(tmp_path, repo):
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    slow = f"slowfile://{repo}"
    watch = WatchProcess(str(ckpts), "--repo", slow, "-o", "delay=0.3", "--tag", "run=t", "--settle", "0.2", "--json")
    steps = [int(s) for s in run_writer(ckpts, 4).stdout.split()]
    locks = Path(repo) / "locks"
    watch.wait_for(lambda: locks.exists() and any(locks.iterdir()), what="the first upload to start")
    started = time.monotonic()
    assert watch.finish(signal.SIGTERM) == 0, watch.err
    print(f"SIGTERM to exit: {time.monotonic() - started:.1f} s")
    assert any("stopping after the upload in flight" in line for line in watch.err)
    first = watch.shipped()
    assert len(first) == 1, f"exactly the upload in flight completes: {first}"
    assert len(os.listdir(ckpts / ".ckptvault-watch" / "pins")) == len(steps) - 1, "the rest stay pinned"
    with Vault.open(repo) as vault:
        assert len(vault.snapshots()) == 1
    again = watch_once(ckpts, repo, "t")
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("shipped ") == len(steps) - 1, again.stdout
    assert_each_shipped_once(repo, steps, "t")


def test_with_a_grace_sigterm_ships_what_is_pinned_and_the_save_made_after_it(tmp_path, repo):
    """A preemption: the trainer and the sidecar get SIGTERM together, and the trainer writes one last
    save. Without a grace the watcher ships only the upload in flight and leaves the rest pinned on a
    disk that may never come back; with --grace it goes on until all of it, that save too, is shipped.
    That save ships next, ahead of the older ones waiting (they went first, and a grace shorter than
    their uploads left it on the lost disk)."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    slow = f"slowfile://{repo}"
    args = ["--repo", slow, "-o", "delay=0.3", "--tag", "run=g", "--settle", "0.2", "--grace", "20", "--json"]
    # 32 KB/s for 64 KiB saves: the first upload is still in flight when the last save is written
    watch = WatchProcess(str(ckpts), *args, env={"CKPTVAULT_LIMIT_UPLOAD": "32KB"})
    steps = [int(s) for s in run_writer(ckpts, 3, "--period", "0.25").stdout.split()]
    locks = Path(repo) / "locks"
    watch.wait_for(lambda: locks.exists() and any(locks.iterdir()), what="the first upload to start")
    watch.proc.send_signal(signal.SIGTERM)
    watch.wait_for(lambda: any("SIGTERM: shipping what is pinned" in line for line in watch.err), what="the stop")
    written = publish_checkpoint(ckpts, "step_999", 999)  # the trainer's save on preemption, after the signal
    assert watch.proc.wait(90) == 0, watch.err
    order = [e["step"] for e in watch.shipped()]
    assert sorted(order) == [*steps, 999], watch.err
    assert order.index(999) < order.index(steps[1]), order  # ahead of the oldest one waiting
    assert not pin_count(ckpts / ".ckptvault-watch" / "pins")
    with Vault.open(repo) as vault:
        latest = vault.latest({"run": "g"})
        assert latest.tags["step"] == "999"
        assert restored_files(vault, latest) == written
        by_time = [int(s.tags["step"]) for s in sorted(vault.snapshots({"run": "g"}), key=lambda s: s.time)]
        assert by_time == [*steps, 999]
        for snap in vault.snapshots({"run": "g"}):
            if snap.tags["step"] != "999":
                assert restored_files(vault, snap) == expected_files(int(snap.tags["step"]))


def test_grace_is_refused_with_once_and_out_of_range(tmp_path, repo, cli):
    refused = [
        (["--once", "--grace", "5"], "--grace is for a watch that is stopped"),
        (["--grace", "-1"], "--grace -1 must be"),
    ]
    for extra, says in refused:
        proc = cli("watch", str(tmp_path), "--repo", repo, *extra, check=False)
        assert proc.returncode == 2, proc.stderr
        assert says in proc.stderr.decode()


def test_one_sigterm_delivered_twice_stops_the_watcher_as_one(tmp_path, repo):
    # `timeout` signals its child, then the child's process group: the second copy is no "abort"
    (tmp_path / "ckpts").mkdir()
    rounds = 0
    while rounds < 3:
        watch = WatchProcess(str(tmp_path / "ckpts"), "--repo", repo)
        sent = time.monotonic()
        watch.proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)  # the first copy's handler has run (delivered at once, Python runs it once)
        watch.proc.send_signal(signal.SIGTERM)
        if time.monotonic() - sent >= SAME_SIGNAL_S / 2:  # this test stalled between them: a round that tells nothing
            watch.finish(signal.SIGKILL)
            continue
        assert watch.finish(0) == 0, watch.err
        assert not any("aborted" in line for line in watch.err), watch.err
        rounds += 1


def test_a_second_signal_abandons_the_upload_at_once_and_a_restart_ships_everything(tmp_path, repo):
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    # a slow link (16 KB/s for a 64 KiB save) keeps the upload in flight through both signals: the lock is
    # taken before it, and what follows it no longer waits on slow reads (its own lock is not read back)
    watch = WatchProcess(
        str(ckpts),
        "--repo",
        f"slowfile://{repo}",
        "-o",
        "delay=1.0",
        "--tag",
        "run=t",
        "--settle",
        "0.2",
        env={"CKPTVAULT_LIMIT_UPLOAD": "16KB"},
    )
    steps = [int(s) for s in run_writer(ckpts, 2, "--period", "0.5").stdout.split()]
    locks = Path(repo) / "locks"
    watch.wait_for(lambda: locks.exists() and any(locks.iterdir()), what="the first upload to start")
    watch.proc.send_signal(signal.SIGTERM)
    watch.wait_for(lambda: any("again to abort" in line for line in watch.err), what="the first signal's notice")
    time.sleep(SAME_SIGNAL_S)  # sooner, the same signal again is taken for the first one delivered twice
    started = time.monotonic()
    assert watch.finish(signal.SIGTERM) == 143, watch.err  # SIGTERM's code, not Ctrl-C's (cli49 #7)
    assert time.monotonic() - started < 3, "the second signal waited for the upload"
    assert "Traceback" not in "\n".join(watch.err)
    assert any(line.startswith("error: aborted during an upload") for line in watch.err), watch.err
    again = watch_once(ckpts, repo, "t")  # the dead watcher's lock is stale at once on this host
    assert again.returncode == 0, again.stderr
    assert_each_shipped_once(repo, steps, "t")


def test_a_second_signal_during_an_idle_grace_says_no_upload_was_abandoned(tmp_path, repo):
    # nothing to ship: the grace only waits for a last save; "aborted during an upload" sent users looking for one
    (tmp_path / "ckpts").mkdir()
    watch = WatchProcess(str(tmp_path / "ckpts"), "--repo", repo, "--grace", "60")
    watch.proc.send_signal(signal.SIGTERM)
    watch.wait_for(lambda: any("again to abort" in line for line in watch.err), what="the first signal's notice")
    time.sleep(SAME_SIGNAL_S)  # sooner, the same signal again is taken for the first one delivered twice
    assert watch.finish(signal.SIGTERM) == 143, watch.err
    aborted = [line for line in watch.err if line.startswith("error: ")]
    assert aborted == [
        "error: aborted by a second SIGTERM during the grace, with no upload in flight; "
        "the checkpoints still pinned ship at the next start"
    ], watch.err


@pytest.mark.parametrize(("retry_lock", "patience"), [("5m", "1h"), ("2h", "2h"), ("1h30s", "1h30s")])
def test_a_watch_stopped_while_waiting_for_a_prune_says_how_long_it_waited_not_a_commands_advice(
    tmp_path, repo, retry_lock, patience
):
    """It said "for up to 60 min" with --retry-lock 2h (and gave up after an hour; "60 min" for 1h30s), and once
    stopped told the user to give --retry-lock 30m, which it had been given, or which a watch ignored."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    with Vault.open(repo) as prune, prune._repo.locks.acquire(exclusive=True):  # a prune's lock, held here
        watch = WatchProcess(str(ckpts), "--repo", repo, "--settle", "0.2", "--retry-lock", retry_lock)
        publish(str(ckpts), 1, 4096)
        watch.wait_for(lambda: any(" waits: " in line for line in watch.err), what="the wait for the lock")
        assert watch.finish(signal.SIGTERM) == 11, watch.err
    err = "\n".join(watch.err)
    assert f"trying again in 2 s, for up to {patience}" in err, err
    assert "--retry-lock 30m" not in err, err
    assert re.search(
        rf"error: vault .* is locked: .*; stopped after waiting [0-9.]+ s for it \(of up to {patience}\)$", err
    )


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["after-commit", "mid-upload"])
def test_sigkill_at_any_moment_then_restart_gives_no_duplicate_and_no_gap(tmp_path, repo, kill_at):
    """Killed just after a snapshot is committed (before its pin is released), or in the middle of
    an upload: the restarted watcher ships each written checkpoint exactly once."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    slow = f"slowfile://{repo}"
    watch = WatchProcess(str(ckpts), "--repo", slow, "-o", "delay=0.3", "--tag", "run=k", "--settle", "0.2", "--json")
    steps = [int(s) for s in run_writer(ckpts, 6, "--period", "0.25").stdout.split()]
    snapshots_dir = Path(repo) / "snapshots"

    def committed() -> int:
        return sum(1 for p in snapshots_dir.rglob("*") if p.is_file()) if snapshots_dir.exists() else 0

    if kill_at == "after-commit":
        # a snapshot object exists, the watcher is still releasing its lock (slow) and its pin
        watch.wait_for(lambda: committed() >= 1, what="the first commit")
    else:
        watch.wait_for(lambda: committed() >= 1 and len(watch.shipped()) >= 1, what="one shipped")
        time.sleep(0.5)
    watch.proc.kill()
    watch.proc.wait(30)
    pinned = len(os.listdir(ckpts / ".ckptvault-watch" / "pins"))
    print(f"killed {kill_at}: {committed()} committed, {pinned} pinned, {len(watch.shipped())} printed")
    assert committed() + pinned >= len(steps), "every checkpoint was either shipped or pinned before the kill"
    again = watch_once(ckpts, repo, "k")
    assert again.returncode == 0, again.stderr
    assert_each_shipped_once(repo, steps, "k")


def test_once_ships_what_is_complete_ignores_temporary_names_and_never_twice(tmp_path, repo, cli):
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    publish(str(ckpts), 100, 4096)
    publish(str(ckpts), 200, 4096)
    (ckpts / "latest.pt").write_bytes(b"v1" * 1000)
    (ckpts / "tmp-step_300").mkdir()
    (ckpts / "tmp-step_300" / "model.bin").write_bytes(b"partial")
    (ckpts / "latest.pt.tmp").write_bytes(b"half")
    (ckpts / ".hidden").write_bytes(b"x")
    args = ("watch", str(ckpts), "--repo", repo, "--tag", "run=o", "--once", "--settle", "0.3")
    first = cli(*args)
    lines = first.stdout.decode().splitlines()
    assert len(lines) == 3, lines
    assert any(line.startswith("shipped step_100 step 100 as snapshot") for line in lines), lines
    assert any(line.startswith("shipped latest.pt as snapshot") for line in lines), lines
    assert cli(*args).stdout.decode() == "", "a second run finds everything shipped"
    # latest.pt rewritten by atomic rename: a new checkpoint under the same name
    (ckpts / "latest.pt.tmp").write_bytes(b"v2" * 1000)
    os.replace(ckpts / "latest.pt.tmp", ckpts / "latest.pt")
    third = cli(*args).stdout.decode().splitlines()
    assert len(third) == 1 and third[0].startswith("shipped latest.pt"), third
    with Vault.open(repo) as vault:
        snaps = vault.snapshots({"checkpoint": "latest.pt"})
        assert [b"".join(vault.read_file(s, "latest.pt"))[:2] for s in snaps] == [b"v1", b"v2"]
        by_name = {s.tags["checkpoint"]: s for s in vault.snapshots({"run": "o"})}
        assert set(by_name) == {"step_100", "step_200", "latest.pt"}
        assert by_name["step_200"].tags["step"] == "200"
        assert "step" not in by_name["latest.pt"].tags


def test_watch_records_the_host_it_is_given(tmp_path, repo, cli):
    """h5 #2: only backup and backup_async took a hostname; a sidecar on a spot instance that came back under a
    new machine name shipped snapshots `--host nodeB` could not find."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    publish(str(ckpts), 100, 4096)
    cli("watch", str(ckpts), "--repo", repo, "--tag", "run=h", "--once", "--settle", "0.2", "--host", "nodeB")
    publish(str(ckpts), 200, 4096)
    with Vault.open(repo) as vault:
        result = vault.watch(ckpts, tags={"run": "h"}, hostname="nodeC", once=True, settle=0.2, interval=0.05)
        assert [s.snapshot.hostname for s in result.shipped] == ["nodeC"]
        assert {s.tags["step"]: s.hostname for s in vault.snapshots({"run": "h"})} == {"100": "nodeB", "200": "nodeC"}
        with pytest.raises(UsageError, match="has spaces at its ends"):
            vault.watch(ckpts, hostname=" nodeC", once=True)


def test_a_checkpoint_deeper_than_pythons_recursion_ships(tmp_path, repo, cli):
    """Pinning it and looking for files still being written in it each recursed per folder level:
    an internal error, RecursionError."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    with deep_tree(ckpts / "checkpoint-5") as deepest:
        (deepest.parent / "w.bin.tmp").write_bytes(b"half")  # a name still being written: not shipped
        out = cli("watch", str(ckpts), "--repo", repo, "--once", "--settle", "0.2").stdout.decode()
        assert out.startswith("shipped checkpoint-5 step 5 as snapshot"), out
    with Vault.open(repo) as vault:
        (snap,) = vault.snapshots()
        files = [e.path for e in vault.files(snap) if e.type == "file"]
        assert files == ["/".join(["d"] * DEEP + ["w.bin"])]


def test_a_checkpoint_still_being_written_in_place_is_shipped_once_it_settles(tmp_path, repo):
    ckpts = tmp_path / "ckpts"
    (ckpts / "checkpoint-50").mkdir(parents=True)
    watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=p", "--settle", "2", "--json")
    # written in place, like a trainer without a temporary name: a file at a time, with pauses (far
    # shorter than --settle: a loaded machine may stretch one)
    with open(ckpts / "checkpoint-50" / "model.bin", "wb") as f:
        for _ in range(5):
            f.write(os.urandom(20_000))
            f.flush()
            time.sleep(0.2)
    (ckpts / "checkpoint-50" / "optimizer.bin").write_bytes(os.urandom(10_000))
    expected = {p.name: p.read_bytes() for p in (ckpts / "checkpoint-50").iterdir()}
    watch.wait_for(lambda: len(watch.shipped()) >= 1, what="the checkpoint to ship")
    time.sleep(1.0)
    assert watch.finish() == 0
    assert len(watch.shipped()) == 1, watch.shipped()
    with Vault.open(repo) as vault:
        snap = vault.latest({"run": "p"})
        assert snap.tags["step"] == "50"
        assert {e.path: b"".join(vault.read_file(snap, e.path)) for e in vault.files(snap)} == expected


def test_hard_links_impossible_falls_back_to_copies(tmp_path, repo):
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs a second filesystem (/dev/shm) for the staging folder")
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    publish(str(ckpts), 100, 4096)
    state = shm / f"ckptvault-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        args = ["watch", str(ckpts), "--repo", repo, "--once", "--settle", "0.2", "--state-dir", str(state), "--json"]
        proc = subprocess.run(
            [sys.executable, "-m", "ckptvault", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert "pinned by copying" in proc.stderr
        (event,) = [json.loads(line) for line in proc.stdout.splitlines()]
        assert event["copied"] is True and event["step"] == 100
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_a_watched_folder_deleted_and_made_again_is_still_watched_by_one_watcher(tmp_path, repo, cli):
    """`rm -rf DIR; mkdir DIR` (a launcher wiping the output folder after the sidecar started) took the
    lock's files with it: a second watcher started, and every checkpoint shipped twice (wt47 F3)."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=w", "--settle", "0.2", "--json")
    lock = ckpts / ".ckptvault-watch" / "lock"
    holds = lambda: lock.exists() and lock.read_text().startswith(f"pid {watch.proc.pid}")  # noqa: E731
    watch.wait_for(holds, what="the lock")
    shutil.rmtree(ckpts)
    ckpts.mkdir()
    watch.wait_for(holds, what="the lock taken again")
    second = cli("watch", str(ckpts), "--repo", repo, "--once", check=False)
    assert second.returncode == 11, second.stderr
    publish_checkpoint(ckpts, "step_7", 7)
    watch.wait_for(lambda: watch.shipped(), what="the checkpoint shipped")
    assert watch.finish() == 0, watch.err
    with Vault.open(repo) as vault:
        assert [s.tags["step"] for s in vault.snapshots()] == ["7"]
    # a watcher that looks seldom finds another one holding the folder made again: it stops, saying so,
    # exit 11 (the lock's descriptors closed twice made it an internal error, rv47 M1)
    slow = WatchProcess(str(ckpts), "--repo", repo, "--interval", "3", "--json")
    holds_slow = lambda: lock.exists() and lock.read_text().startswith(f"pid {slow.proc.pid}")  # noqa: E731
    slow.wait_for(holds_slow, what="the lock")
    shutil.rmtree(ckpts)
    ckpts.mkdir()
    other = WatchProcess(str(ckpts), "--repo", repo, "--json")
    other.wait_for(lambda: lock.exists() and lock.read_text().startswith(f"pid {other.proc.pid}"), what="its lock")
    assert slow.proc.wait(30) == 11, slow.err
    assert any(f"(pid {other.proc.pid}) is already watching {ckpts}" in line for line in slow.err), slow.err
    assert not any("internal error" in line for line in slow.err), slow.err
    assert other.finish() == 0


def test_a_run_folder_holding_another_watchs_state_is_no_checkpoint(tmp_path, repo):
    """Watching ./runs, where ./runs/old_run was watched before and holds only its .ckptvault-watch: old_run
    was pinned, its backup found nothing to take, and every --once run failed with exit 3 (wt47 F5)."""
    runs = tmp_path / "runs"
    (runs / "old_run" / ".ckptvault-watch" / "pins").mkdir(parents=True)
    (runs / "async_run" / ".ckptvault-pins").mkdir(parents=True)
    publish_checkpoint(runs, "step_1", 1)
    for _ in range(2):
        once = watch_once(runs, repo, "r")
        assert once.returncode == 0, once.stderr
        assert "old_run holds only .ckptvault-watch (the watch sidecar's state): no checkpoint" in once.stderr
        assert "async_run holds only .ckptvault-pins (backup_async's pins)" in once.stderr
    with Vault.open(repo) as vault:
        assert [s.tags["checkpoint"] for s in vault.snapshots()] == ["step_1"]


def test_a_pin_of_an_untagged_run_ships_untagged_after_a_restart_under_tags(tmp_path, repo):
    """A pin records the tags it was pinned under, none included: a restart with --tag run=c shipped an
    untagged run's pin as run=c (rv47 M5)."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    watch = WatchProcess(str(ckpts), "--repo", repo, "--settle", "30", "--json")
    publish_checkpoint(ckpts, "step_3", 3)
    watch.wait_for(lambda: "step_3" in pinned_names(ckpts / ".ckptvault-watch" / "pins"), what="the pin")
    watch.proc.kill()
    watch.proc.wait(30)
    again = watch_once(ckpts, repo, "c")
    assert again.returncode == 0, again.stderr
    with Vault.open(repo) as vault:
        (shipped,) = vault.snapshots()
        assert "run" not in shipped.tags and shipped.tags["step"] == "3", shipped.tags


def test_ship_pins_names_a_dead_watchers_pins_not_a_live_ones(tmp_path, repo, cli):
    """`ship-pins DIR` warns of pins a dead watcher left (wt47 F6), not of a running watcher's, whose
    `watch --once` it would suggest in vain (exit 11) (rv47 L5)."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    watch = WatchProcess(str(ckpts), "--repo", repo, "--settle", "30", "--json")
    publish_checkpoint(ckpts, "step_3", 3)
    watch.wait_for(lambda: "step_3" in pinned_names(ckpts / ".ckptvault-watch" / "pins"), what="the pin")
    live = cli("ship-pins", str(ckpts), "--repo", repo)
    assert "a watch sidecar pinned" not in live.stderr.decode(), live.stderr
    watch.proc.kill()
    watch.proc.wait(30)
    dead = cli("ship-pins", str(ckpts), "--repo", repo, check=False)
    assert "holds 1 checkpoint a watch sidecar pinned" in dead.stderr.decode(), dead.stderr
    # not "nothing left pinned" and exit 0: a restart script would resume from an older save (rv61)
    assert dead.returncode == 40 and b"nothing left pinned" not in dead.stdout, (dead.stdout, dead.stderr)
    assert dead.stderr.decode().splitlines()[-1] == (
        "error: 1 checkpoint a watch sidecar that stopped pinned is not shipped (ship-pins ships backup_async's "
        f"pins): run ckptvault watch --repo {repo} {ckpts} --once before resuming from the vault"
    ), dead.stderr


def test_ship_pins_state_dir_names_a_dead_watchers_pins_kept_outside_the_folder(tmp_path, repo, cli):
    """A watch given --state-dir, SIGKILLed while it held a pin: `ship-pins DIR` said "nothing left pinned
    in DIR" (exit 0), and a restart script following training.md resumed without that save (sp60). It now
    says where it looked and to give the watch's --state-dir; given it, it names the pin and the command
    that ships it, and so does the API's ship_leftover_pins(state_dir=...)."""
    ckpts, state = tmp_path / "ckpts", tmp_path / "watch-state"
    ckpts.mkdir()
    watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=s", "--settle", "30", "--state-dir", str(state))
    publish_checkpoint(ckpts, "step_4", 4)
    watch.wait_for(lambda: "step_4" in pinned_names(state / "pins"), what="the pin")
    watch.proc.send_signal(signal.SIGKILL)
    watch.proc.wait(30)
    plain = cli("ship-pins", str(ckpts), "--repo", repo)
    assert plain.returncode == 0, plain.stderr
    assert "a watch started with --state-dir keeps its pins there: give ship-pins the same --state-dir" in (
        plain.stdout.decode()
    ), plain.stdout
    given = cli("ship-pins", str(ckpts), "--repo", repo, "--state-dir", str(state), check=False)
    assert given.returncode == 40, given.stderr
    said = f"{state} holds 1 checkpoint a watch sidecar pinned; ship them with: ckptvault watch --repo {repo} "
    assert said + f"{ckpts} --once --state-dir {state}" in given.stderr.decode(), given.stderr
    with Vault.open(repo) as vault:
        warned: list[str] = []
        vault.on_warning = warned.append
        assert vault.ship_leftover_pins(ckpts, state_dir=state) == []
        assert any(f"vault.watch({str(ckpts)!r}, once=True, state_dir={str(state)!r})" in w for w in warned), warned
    missing = cli("ship-pins", str(ckpts), "--repo", repo, "--state-dir", str(tmp_path / "typo"), check=False)
    assert missing.returncode == 3, missing.stderr
    assert "no such directory (give the --state-dir the watch sidecar was started with)" in missing.stderr.decode()
    # the command named ships it, under the tags it was pinned with
    shipped = subprocess.run(
        [sys.executable, "-m", "ckptvault", "watch", str(ckpts), "--repo", repo, "--once", "--state-dir", str(state)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert shipped.returncode == 0, shipped.stderr
    with Vault.open(repo) as vault:
        (snap,) = vault.snapshots({"run": "s"})
        assert snap.tags["step"] == "4"


def test_ship_pins_given_the_pins_folder_itself_names_a_dead_watchers_pins_too(tmp_path, repo, cli):
    """ship-pins takes FOLDER or its .ckptvault-pins; given the latter, the dead watcher's pins (in --state-dir,
    or in FOLDER's .ckptvault-watch) were looked for under .ckptvault-pins and never found: "nothing left
    pinned" without a warning, and the resume went on from an older save (rv61)."""
    ckpts, state = tmp_path / "ckpts", tmp_path / "watch-state"
    ckpts.mkdir()
    watch = WatchProcess(str(ckpts), "--repo", repo, "--settle", "30", "--state-dir", str(state))
    publish_checkpoint(ckpts, "step_4", 4)
    watch.wait_for(lambda: "step_4" in pinned_names(state / "pins"), what="the pin")
    watch.proc.send_signal(signal.SIGKILL)
    watch.proc.wait(30)
    (ckpts / PIN_FOLDER).mkdir()  # a backup_async run beside it left its (empty) pins folder
    given = cli("ship-pins", str(ckpts / PIN_FOLDER), "--repo", repo, "--state-dir", str(state), check=False)
    assert given.returncode == 40, given.stderr
    said = f"{state} holds 1 checkpoint a watch sidecar pinned; ship them with: ckptvault watch --repo {repo} "
    assert said + f"{ckpts} --once --state-dir {state}" in given.stderr.decode(), given.stderr


def test_a_pin_record_the_disk_refuses_to_update_does_not_stop_the_watch(tmp_path, repo, monkeypatch):
    """Recording that a pin settled raised ENOSPC out of the look, and the sidecar died with an internal
    error on the full disk it is built to survive (rv47 H2)."""
    from ckptvault.ops import pin as pins

    def full(pin, **fields):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pins, "update_meta", full)
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    publish_checkpoint(ckpts, "step_4", 4)
    with Vault.open(repo) as vault:
        result = vault.watch(ckpts, once=True, settle=0.2, interval=0.05)
        assert [s.step for s in result.shipped] == [4] and not result.errors
        assert [s.tags["step"] for s in vault.snapshots()] == ["4"]


def test_one_watcher_per_folder_and_bad_input_is_one_line(tmp_path, repo, cli):
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    watch = WatchProcess(str(ckpts), "--repo", repo)
    second = cli("watch", str(ckpts), "--repo", repo, "--once", check=False)
    assert second.returncode == 11
    err = second.stderr.decode().strip().splitlines()
    assert len(err) == 1 and f"(pid {watch.proc.pid}) is already watching" in err[0], err
    # its own state folder does not make a second watcher of the folder: it would ship everything twice; its
    # lock file holds the pid of a watcher long gone, which is not the one watching (review 40 A4)
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "lock").write_text("pid 999999")
    elsewhere = cli("watch", str(ckpts), "--repo", repo, "--once", "--state-dir", str(tmp_path / "st"), check=False)
    said = elsewhere.stderr.decode()
    assert elsewhere.returncode == 11 and "(with another --state-dir) is already watching" in said, said
    assert "999999" not in said
    # one state folder given to watches of two folders: the holder is named with the folder it watches (L1)
    other = tmp_path / "other"
    other.mkdir()
    state = str(ckpts / ".ckptvault-watch")
    shared = cli("watch", str(other), "--repo", repo, "--once", "--state-dir", state, check=False)
    said = shared.stderr.decode()
    assert shared.returncode == 11 and f"(pid {watch.proc.pid}) keeps its state in" in said, said
    assert f"watching {ckpts}; give this one another --state-dir" in said, said
    assert watch.finish() == 0
    for args in ([str(tmp_path / "nope" / "ckpts")], [str(tmp_path / "nope"), "--once"]):
        missing = cli("watch", *args, "--repo", repo, check=False)
        assert missing.returncode == 3 and "Traceback" not in missing.stderr.decode(), args
    reserved = cli("watch", str(ckpts), "--repo", repo, "--tag", "step=5", check=False)
    assert reserved.returncode == 2 and "set by watch itself" in reserved.stderr.decode()
    no_vault = str(tmp_path / "no-vault")  # refused before a vault is made
    for blank in ("", " "):  # as restore and --exclude call them: ' ' was taken for a folder's name
        empty = cli("watch", str(ckpts), "--once", "--include", blank, "--repo", no_vault, check=False)
        said = empty.stderr.decode()
        assert empty.returncode == 2 and f"--include pattern {blank!r} is empty (is a variable unset?)" in said, said
    assert not os.path.exists(no_vault)
    # the watched folder as its own state folder shipped its lock file, then pinned its pins into themselves
    # until the names grew too long; one in the vault mixed with it (wt47 F4)
    for state, said in ((ckpts, "is the watched folder"), (Path(repo) / "state", f"is in the vault at {repo}")):
        refused = cli("watch", str(ckpts), "--once", "--repo", repo, "--state-dir", str(state), check=False)
        line = refused.stderr.decode().strip()
        assert refused.returncode == 2 and said in line and "\n" not in line, line
    assert not (ckpts / "pins").exists() and not (Path(repo) / "state").exists()


def test_a_failed_backup_keeps_its_pin_exits_non_zero_and_ships_next_time(tmp_path, repo, cli):
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    publish(str(ckpts), 100, 64 * 1024)
    args = ("watch", str(ckpts), "--repo", repo, "--tag", "run=f", "--once", "--settle", "0.2")
    index = Path(repo) / "index"  # a file where the index objects go: the backup cannot commit
    shutil.rmtree(index, ignore_errors=True)
    index.write_bytes(b"")
    failed = cli(*args, check=False)
    index.unlink()
    assert failed.returncode == 20, failed.stderr
    assert "backup failed" in failed.stderr.decode() and "stays pinned" in failed.stderr.decode()
    assert len(os.listdir(ckpts / ".ckptvault-watch" / "pins")) == 1
    shutil.rmtree(ckpts / "step_100")  # rotated away meanwhile: the pin still has it
    shipped = cli(*args).stdout.decode().splitlines()
    assert len(shipped) == 1 and shipped[0].startswith("shipped step_100 step 100"), shipped
    assert_each_shipped_once(repo, [100], "f")


def test_a_checkpoint_that_cannot_be_pinned_on_a_full_disk_ships_in_place(tmp_path, repo, cli):
    """The checkpoint disk full (of checkpoints): no pin can be made, which is when shipping matters most.
    It used to ship nothing (exit 0, later exit 21); now it is read where it is, as a pin would hold it."""
    with mounted_tmpfs(tmp_path / "mnt", "4m", "the full checkpoint disk test") as mount:
        ckpts = mount / "ckpts"
        ckpts.mkdir()
        publish(str(ckpts), 100, 64 * 1024)
        for name in ("shard.tmp", "SHARD2.TMP"):  # Windows-style tools write upper case
            (ckpts / "step_100" / name).write_bytes(b"a save still being written: a pin leaves it out")
        fill(mount)
        args = ("watch", str(ckpts), "--repo", repo, "--tag", "run=full", "--once", "--settle", "0.2", "--json")
        proc = cli(*args)
        err = proc.stderr.decode()
        assert "step_100: cannot pin: No space left on device; it ships in place" in err and "--state-dir" in err
        (event,) = [json.loads(line) for line in proc.stdout.decode().splitlines()]
        assert event["checkpoint"] == "step_100" and event["in_place"] is True and event["copied"] is False
        assert not any((ckpts / ".ckptvault-watch" / "pins").iterdir())  # nothing was left half-made
        again = cli(*args)  # shipped already: recognised by its digest, not read again nor warned about
        assert again.stdout == b"" and b"ships in place" not in again.stderr, again.stderr
    assert_each_shipped_once(repo, [100], "full")
    with Vault.open(repo) as vault:
        (snap,) = vault.snapshots()
        paths = {entry.path.lower() for entry in vault.files(snap)}
        assert paths and not any(path.endswith(".tmp") for path in paths), paths
        assert snap.excludes == [], "names left out as a pin would were recorded as the user's --exclude"


@pytest.mark.parametrize("rotation", ["folder", "one file"])
def test_a_checkpoint_shipping_in_place_from_a_full_disk_deleted_first_is_an_error_of_the_run(tmp_path, repo, rotation):
    """In place, nothing keeps a checkpoint from the trainer's rotation: one deleted before it shipped is
    lost, said at once, and the watcher's exit says so (3) when it ends; what is left of it is not taken
    for a new checkpoint (the deleted file made room for a pin of the rest)."""
    with mounted_tmpfs(tmp_path / "mnt", "4m", "the full checkpoint disk test") as mount:
        ckpts = mount / "ckpts"
        ckpts.mkdir()
        watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=lost", "--settle", "600", "--json")
        written = Path(publish(str(mount), 100, 64 * 1024))  # outside the watched folder
        fill(mount)
        written.rename(ckpts / "step_100")  # published once the disk is full
        watch.wait_for(lambda: any("ships in place" in line for line in watch.err), what="the in-place warning")
        # the rotation, long before --settle 600 would ship it
        if rotation == "folder":
            (ckpts / "step_100").rename(mount / "deleted")  # at once, whatever the moment of the next look
        else:
            next((ckpts / "step_100").iterdir()).unlink()
        watch.wait_for(lambda: any("not in the vault" in line for line in watch.err), what="the lost warning")
        time.sleep(1.0)  # ten looks
        assert not any((ckpts / ".ckptvault-watch" / "pins").iterdir()), "what is left was pinned as new"
        assert watch.finish() == 3, watch.err
    what = "it was deleted" if rotation == "folder" else "files of it were deleted"
    assert f"step_100: {what} before it shipped; it was shipping in place" in "\n".join(watch.err), watch.err
    (lost,) = watch.events()
    assert (lost["event"], lost["checkpoint"], lost["step"], lost["reason"]) == ("lost", "step_100", 100, "deleted")
    assert what in lost["message"], lost
    with Vault.open(repo) as vault:
        assert vault.snapshots() == []


def test_a_checkpoint_shipping_in_place_whose_folder_gets_a_new_save_is_said_replaced_not_deleted(tmp_path, repo):
    """The trainer saves anew into the folder of the same name (a file of the old save deleted, one of the new
    save in it) before the old save shipped in place: the old save is lost, but it was replaced, not deleted,
    and the message and the event said "deleted"."""
    with mounted_tmpfs(tmp_path / "mnt", "4m", "the full checkpoint disk test") as mount:
        ckpts = mount / "ckpts"
        ckpts.mkdir()
        watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=new", "--settle", "600", "--json")
        written = mount / "step_100"
        written.mkdir()
        for name in ("model.bin", "optim-1.bin"):
            (written / name).write_bytes(os.urandom(64 * 1024))
        (mount / "optim-2.bin").write_bytes(os.urandom(64 * 1024))  # the new save's, written before the disk filled
        fill(mount)
        written.rename(ckpts / "step_100")
        watch.wait_for(lambda: any("ships in place" in line for line in watch.err), what="the in-place warning")
        (mount / "optim-2.bin").rename(ckpts / "step_100" / "optim-2.bin")  # the new save comes in first,
        (ckpts / "step_100" / "optim-1.bin").unlink()  # then the old save's file goes: no look sees only a deletion
        watch.wait_for(lambda: any("not in the vault" in line for line in watch.err), what="the lost warning")
        assert watch.finish() == 3, watch.err
    err = "\n".join(watch.err)
    assert "step_100: it was replaced by a new save in its folder before it shipped" in err, err
    lost = [event for event in watch.events() if event["event"] == "lost"]
    assert [(e["checkpoint"], e["reason"]) for e in lost] == [("step_100", "replaced")], lost


def test_a_trainer_checkpoint_shipping_in_place_deleted_before_its_trainer_state_is_lost_not_incomplete(tmp_path, repo):
    """Pinned, a ``checkpoint-N`` deleted before its trainer_state.json was seen was seen only in part and is
    dropped. In place nothing held it: its last file may have come and gone between two looks, so it is a
    loss, said as one, and the run exits 3 (it used to be dropped as incomplete, exit 0)."""
    with mounted_tmpfs(tmp_path / "mnt", "4m", "the full checkpoint disk test") as mount:
        ckpts = mount / "ckpts"
        ckpts.mkdir()
        watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=hf", "--settle", "600")
        written = mount / "checkpoint-100"
        written.mkdir()
        (written / "model.safetensors").write_bytes(os.urandom(64 * 1024))
        fill(mount)
        written.rename(ckpts / "checkpoint-100")
        watch.wait_for(lambda: any("ships in place" in line for line in watch.err), what="the in-place warning")
        shutil.rmtree(ckpts / "checkpoint-100")
        watch.wait_for(lambda: any("not in the vault" in line for line in watch.err), what="the lost warning")
        assert watch.finish() == 3, watch.err
    err = "\n".join(watch.err)
    # rmtree removes the file, then the folder: a look between the two sees files of it deleted
    said = r"checkpoint-100: (it was|files of it were) deleted before it shipped; it was shipping in place"
    assert re.search(said, err), err
    assert "before it was complete" not in err, err


def test_a_once_run_stops_at_sigterm_while_the_shipped_list_loads(tmp_path, repo):
    """``--once`` lists what was shipped before its one look; on a slow or retrying store that can take
    minutes, and a SIGTERM (cron's timeout, a shutdown) used to wait for it."""
    with Vault.open(repo) as vault:  # a snapshot to read: the list's slow part
        vault.backup(publish(str(tmp_path), 50, 1024), tags={"run": "slow"})
    delay = 4.0  # per read: the list takes two of them (its LIST and the snapshot's GET)
    for attempt in range(3):
        ckpts = tmp_path / f"ckpts{attempt}"
        publish(str(ckpts.mkdir() or ckpts), 100, 64 * 1024)
        args = ["watch", str(ckpts), "--repo", f"slowfile://{repo}", "-o", f"delay={delay}", "--tag", "run=slow"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.slowfs", *args, "--once", "--settle", "0"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            lock = ckpts / ".ckptvault-watch" / "lock"
            deadline = time.monotonic() + 120
            while not lock.exists():  # the vault is open: the list is loading now
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            late = time.time() - lock.stat().st_mtime  # a loaded machine stalled this test past the list
            out, err = proc.communicate(timeout=120)
            waited = time.monotonic() - stopped
        finally:
            proc.kill()
        # a loaded machine stalled this test past the list, or the watcher read the list before the signal
        # (it then ships, and the stop waits for that upload): a round that tells nothing; a watcher that
        # never stops while the list loads fails all three
        if late < delay and "watch ended: 0 checkpoint(s) shipped" in err:
            break
    assert "Traceback" not in err, err
    # the read in flight ends first (the interpreter's exit joins its thread); the rest of the list does not
    assert waited < 2 * delay, f"the stop waited {waited:.1f} s for the list ({late:.1f} s after it began); {err}"
    # nothing shipped, nor pinned blind (not knowing what was shipped): the next run looks again
    assert out == "" and "watch ended: 0 checkpoint(s) shipped\n" in err, (out, err)
    assert not any((ckpts / ".ckptvault-watch" / "pins").iterdir())


def test_a_checkpoint_changed_while_it_ships_in_place_is_not_committed_torn(tmp_path):
    """Read in place, a folder saved again in place during its upload would commit files of two saves
    under the first save's tags: that backup is not committed, and the new save ships once settled."""
    repo = str(tmp_path / "repo")
    Vault.init(repo).close()
    with mounted_tmpfs(tmp_path / "mnt", "4m", "the full checkpoint disk test") as mount:
        ckpts = mount / "ckpts"
        ckpts.mkdir()
        (mount / "new" / "step_100").mkdir(parents=True)
        for name in ("a.bin", "b.bin"):
            (mount / "new" / "step_100" / name).write_bytes(name.encode() * 30_000)
        fill(mount)
        slow = ("--repo", f"slowfile://{repo}", "-o", "delay=1.0")
        watch = WatchProcess(str(ckpts), *slow, "--tag", "run=torn", "--settle", "0.2", "--json")
        (mount / "new" / "step_100").rename(ckpts / "step_100")
        locks = Path(repo) / "locks"
        watch.wait_for(lambda: locks.exists() and any(locks.iterdir()), what="the upload to start")
        with open(ckpts / "step_100" / "b.bin", "r+b") as f:  # saved again, in place, mid-upload
            f.write(b"B" * 60_000)
        watch.wait_for(lambda: len(watch.shipped()) == 1, timeout=120, what="the new save to ship")
        assert watch.finish() == 0, watch.err
    assert any("it changed or went while it shipped in place" in line for line in watch.err), watch.err
    with Vault.open(repo) as vault:
        (snap,) = vault.snapshots()
        assert b"".join(vault.read_file(snap, "b.bin")) == b"B" * 60_000 + (b"b.bin" * 30_000)[60_000:]
        assert b"".join(vault.read_file(snap, "a.bin")) == b"a.bin" * 30_000


def test_a_checkpoint_shipping_in_place_is_pinned_once_there_is_room(tmp_path, repo):
    """Room again (the trainer's rotation freed some): it is pinned after all, so the rotation can no
    longer take it, and a deletion is no loss."""
    with mounted_tmpfs(tmp_path / "mnt", "4m", "the full checkpoint disk test") as mount:
        ckpts = mount / "ckpts"
        ckpts.mkdir()
        watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=room", "--settle", "600")
        written = Path(publish(str(mount), 100, 64 * 1024))
        fill(mount)
        written.rename(ckpts / "step_100")
        watch.wait_for(lambda: any("ships in place" in line for line in watch.err), what="the in-place warning")
        (mount / "filler").unlink()
        pins_dir = ckpts / ".ckptvault-watch" / "pins"
        watch.wait_for(lambda: any(pins_dir.glob("*/pin.json")), timeout=30, what="the pin")
        shutil.rmtree(ckpts / "step_100")
        time.sleep(0.5)
        assert watch.finish() == 0, watch.err
        assert not any("not in the vault" in line for line in watch.err), watch.err
        # pinned, then deleted: settled at once (nothing more can come into its pin), it ships
        assert "watch ended: 1 checkpoint(s) shipped" in watch.err, watch.err


@pytest.mark.parametrize("trainer", ["keeps it", "deletes it"])
def test_a_pin_that_cannot_take_in_a_later_file_on_a_full_state_disk_never_ships_torn(tmp_path, repo, trainer):
    """--state-dir on a small disk (pins are copies there): a checkpoint pinned with its first file, whose
    second file the pin cannot take in (the disk filled up), used to settle on the pin as it was and ship
    one file of two under its step, exit 0 (and when the trainer deleted it, that torn save was all the
    vault held of it). Now it ships in place, whole; deleted first, it is lost and said so (exit 3)."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    with mounted_tmpfs(tmp_path / "state", "5m", "the full state disk test") as mount:
        watch = WatchProcess(
            str(ckpts), "--repo", repo, "--tag", "run=torn", "--settle", "1", "--state-dir", str(mount / "w"), "--json"
        )
        step = ckpts / "step_100"
        step.mkdir()
        (step / "a.bin").write_bytes(os.urandom(3 << 20))
        watch.wait_for(lambda: any((mount / "w" / "pins").glob("*/pin.json")), what="the pin")
        (step / "b.bin.tmp").write_bytes(os.urandom(3 << 20))
        (step / "b.bin.tmp").rename(step / "b.bin")  # the pin's copy of it cannot fit
        watch.wait_for(lambda: any("No space left" in line for line in watch.err), what="the pin failure")
        if trainer == "deletes it":
            shutil.rmtree(step)
            watch.wait_for(lambda: any("not in the vault" in line for line in watch.err), what="the lost warning")
        else:
            watch.wait_for(lambda: len(watch.shipped()) == 1, what="the checkpoint to ship")
        time.sleep(1.5)  # a second settle: a torn pin would ship by now
        code = watch.finish()
    with Vault.open(repo) as vault:
        shipped = [sorted(entry.path for entry in vault.files(snap)) for snap in vault.snapshots()]
    if trainer == "deletes it":
        assert code == 3 and shipped == [], (shipped, watch.err)
    else:
        assert code == 0 and shipped == [["a.bin", "b.bin"]], (shipped, watch.err)


def test_an_adopted_pin_that_ships_in_place_keeps_the_tags_it_was_pinned_under(tmp_path, repo):
    """A pin left by a killed watcher ships under the tags it was pinned under (run=first), not the restart's.
    Its pin could not take in a file written later (a full --state-dir disk), so it switched to shipping in
    place: that switch made a new candidate without the adopted pin's tags, and it shipped under run=second."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    with mounted_tmpfs(tmp_path / "state", "5m", "the full state disk test") as mount:
        state = ("--state-dir", str(mount / "w"))
        first = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=first", "--settle", "600", *state)
        step = ckpts / "step_100"
        step.mkdir()
        (step / "a.bin").write_bytes(os.urandom(3 << 20))
        first.wait_for(lambda: any((mount / "w" / "pins").glob("*/pin.json")), what="the pin")
        first.proc.kill()
        first.proc.wait(30)
        (step / "b.bin.tmp").write_bytes(os.urandom(3 << 20))
        (step / "b.bin.tmp").rename(step / "b.bin")  # the adopted pin's copy of it cannot fit
        second = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=second", "--settle", "0.5", *state, "--json")
        second.wait_for(lambda: len(second.shipped()) == 1, what="the checkpoint to ship")
        assert second.finish() == 0, second.err
    assert second.shipped()[0]["in_place"] is True, second.lines
    with Vault.open(repo) as vault:
        (snap,) = vault.snapshots()
        assert sorted(entry.path for entry in vault.files(snap)) == ["a.bin", "b.bin"]
        assert snap.tags["run"] == "first", snap.tags


def test_an_adopted_pin_shipping_in_place_pinned_again_keeps_its_tags_across_another_restart(tmp_path, repo, cli):
    """The same switch to shipping in place, then room again (a filler on the state disk deleted): it is pinned
    after all, and that pin's pin.json recorded the restart's tags (run=second), so the next restart shipped
    it under those. Now the pin records the tags it ships under."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    with mounted_tmpfs(tmp_path / "state", "8m", "the full state disk test") as mount:
        state = ("--state-dir", str(mount / "w"))
        pins_dir = mount / "w" / "pins"
        (mount / "filler").write_bytes(b"\0" * (3 << 20))
        first = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=first", "--settle", "600", *state)
        step = ckpts / "step_100"
        step.mkdir()
        (step / "a.bin").write_bytes(os.urandom(3 << 20))
        first.wait_for(lambda: any(pins_dir.glob("*/pin.json")), what="the pin")
        first.proc.kill()
        first.proc.wait(30)
        (step / "b.bin.tmp").write_bytes(os.urandom(3 << 20))
        (step / "b.bin.tmp").rename(step / "b.bin")  # the adopted pin's copy of it cannot fit
        second = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=second", "--settle", "600", *state)
        second.wait_for(lambda: any("ships in place" in line for line in second.err), what="the in-place warning")
        (mount / "filler").unlink()  # room for a pin of both files
        second.wait_for(lambda: any(pins_dir.glob("*/pin.json")), timeout=30, what="the pin after all")
        second.proc.kill()
        second.proc.wait(30)
        cli("watch", str(ckpts), "--repo", repo, "--tag", "run=third", "--once", *state)
    with Vault.open(repo) as vault:
        (snap,) = vault.snapshots()
        assert sorted(entry.path for entry in vault.files(snap)) == ["a.bin", "b.bin"]
        assert snap.tags["run"] == "first", snap.tags


def exchange(a: Path, b: Path) -> None:
    """Swap two folders at once (renameat2's RENAME_EXCHANGE): no look sees either name missing."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@pytest.mark.parametrize("trainer", ["deletes it", "replaces it"])
def test_a_pin_lacking_part_of_its_checkpoint_lost_says_whether_it_was_deleted_or_replaced(tmp_path, repo, trainer):
    """A pin that cannot take in a file written later (a full --state-dir disk) and holds a file its folder
    lost does not ship; its folder then goes: deleted, or replaced by a new save under the same name. The loss
    said "it was deleted" both times; now it says which."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    with mounted_tmpfs(tmp_path / "state", "5m", "the full state disk test") as mount:
        watch = WatchProcess(
            str(ckpts), "--repo", repo, "--tag", "run=r", "--settle", "600", "--state-dir", str(mount / "w"), "--json"
        )
        step = ckpts / "step_100"
        step.mkdir()
        (step / "a.bin").write_bytes(os.urandom(3 << 20))
        watch.wait_for(lambda: any((mount / "w" / "pins").glob("*/pin.json")), what="the pin")
        (step / "a.bin").unlink()  # the pin keeps it: the only copy now
        (step / "b.bin.tmp").write_bytes(os.urandom(3 << 20))
        (step / "b.bin.tmp").rename(step / "b.bin")  # the pin's copy of it cannot fit
        watch.wait_for(lambda: any("No space left" in line for line in watch.err), what="the pin failure")
        if trainer == "deletes it":
            shutil.rmtree(step)
        else:
            new = tmp_path / "new"
            new.mkdir()
            (new / "c.bin").write_bytes(os.urandom(1024))
            exchange(new, step)
        watch.wait_for(lambda: any("not in the vault" in line for line in watch.err), what="the lost warning")
        assert watch.finish() == 3, watch.err
    err = "\n".join(watch.err)
    what = "deleted" if trainer == "deletes it" else "replaced by another save of the same name"
    assert f"step_100: it was {what} before it shipped, while its pin lacked part of it" in err, err
    lost = [event for event in watch.events() if event["event"] == "lost"]
    assert [e["reason"] for e in lost] == ["deleted" if trainer == "deletes it" else "replaced"], lost


def test_a_backup_that_fails_on_a_full_vault_is_reported_once_with_what_comes_next(tmp_path, cli):
    """The shipping thread's own "error: async backup of ... failed" line came beside watch's warning,
    which says what happens next (retrying, or the next run)."""
    with mounted_tmpfs(tmp_path / "mnt", "8m", "the full vault disk test") as mount:
        repo = str(mount / "vault")
        Vault.init(repo).close()
        (tmp_path / "ckpts" / "step_1").mkdir(parents=True)
        (tmp_path / "ckpts" / "step_1" / "model.bin").write_bytes(os.urandom(10 << 20))
        proc = cli("watch", str(tmp_path / "ckpts"), "--once", "--settle", "0.2", "--repo", repo, check=False)
    lines = proc.stderr.decode().splitlines()
    assert proc.returncode == 21, lines
    warning, error = [line for line in lines if "no space left" in line]
    assert warning.startswith("warning: step_1: backup failed: no space left"), lines
    assert warning.endswith("it stays pinned for the next run"), lines
    assert error == lines[-1] and error.startswith("error: no space left"), lines  # the run's, once it ends


def fill(mount: Path) -> None:
    """Fill a small tmpfs to the last byte (unbuffered writes, so the last short one fails)."""
    with open(mount / "filler", "wb", buffering=0) as filler, pytest.raises(OSError):
        while True:
            filler.write(b"\0" * (16 << 10))


def test_a_local_error_while_pinning_is_warned_once_and_the_checkpoint_ships_once_it_is_gone(tmp_path, repo):
    """EIO, EACCES while pinning are local and pass: the sidecar must outlive them. Here a file stands
    where the pins folder must go (making a pin fails); as root, permissions would not do. (A full disk
    ships in place: the tests below.)"""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    pins_dir = ckpts / ".ckptvault-watch" / "pins"
    watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=e", "--settle", "1.0", "--json")
    pins_dir.rmdir()
    pins_dir.write_bytes(b"")
    publish(str(ckpts), 100, 64 * 1024)
    watch.wait_for(lambda: any("cannot pin" in line for line in watch.err), what="the pin failure warning")
    time.sleep(0.5)  # five more polls, each failing again
    assert watch.proc.poll() is None, watch.err
    assert sum("step_100: cannot pin" in line for line in watch.err) == 1, watch.err

    pins_dir.unlink()
    watch.wait_for(lambda: len(watch.shipped()) == 1, what="the checkpoint to ship")
    assert watch.finish() == 0, watch.err
    assert_each_shipped_once(repo, [100], "e")


def _a_vault_whose_listing_fails_at_first(tmp_path: Path, monkeypatch, name: str) -> tuple[str, Path]:
    """A vault on the faulty store whose snapshot listing fails for its first two loads (an outage), the
    watch's retries 0.3 s apart, and a folder with one checkpoint to ship."""
    from ckptvault.ops import watch as watch_module
    from tests.support import faultyfs

    monkeypatch.setenv("CKPTVAULT_RETRIES", "1")
    monkeypatch.setenv("CKPTVAULT_RETRY_DELAY", "0.01")
    monkeypatch.setattr(watch_module, "RETRY_AFTER", (0.3, 0.3, 0.3, 0.3))
    url = f"faulty://{name}-{os.getpid()}-{time.monotonic_ns()}"
    Vault.init(url).close()
    ckpts = tmp_path / "ckpts"
    (ckpts / "step_1").mkdir(parents=True)
    (ckpts / "step_1" / "model.pt").write_bytes(b"weights" * 1000)
    monkeypatch.setitem(faultyfs.FAULTS, "list:/snapshots", list("TTTT"))  # two loads fail, the third works
    return url, ckpts


def test_a_storage_outage_at_start_is_waited_out_while_checkpoints_are_pinned(tmp_path, monkeypatch):
    # the list of what was shipped could not load: the sidecar died, and rotation then deleted checkpoints
    import threading

    from tests.support import faultyfs

    url, ckpts = _a_vault_whose_listing_fails_at_first(tmp_path, monkeypatch, "outage")
    stop, shipped, warnings = threading.Event(), [], []
    with Vault.open(url) as vault:
        kwargs = dict(interval=0.05, settle=0.2, stop=stop, on_shipped=shipped.append, on_warning=warnings.append)
        runner = threading.Thread(target=lambda: vault.watch(str(ckpts), **kwargs))
        runner.start()
        deadline = time.monotonic() + 30
        while not shipped and runner.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        runner.join(30)
        assert [s.name for s in shipped] == ["step_1"], warnings
        assert sum("cannot list what was shipped yet" in w for w in warnings) == 1, warnings
        assert not faultyfs.FAULTS["list:/snapshots"], "the outage was not waited out"


def test_a_once_run_fails_on_a_storage_outage_at_start_instead_of_waiting_it_out(tmp_path, monkeypatch):
    """``once``: one look, now; the list of what was shipped cannot load (the storage is down), so it fails
    with the storage's error (cron tries again later) instead of waiting for the storage to answer."""
    from ckptvault.errors import StorageError

    url, ckpts = _a_vault_whose_listing_fails_at_first(tmp_path, monkeypatch, "once-outage")
    shipped: list = []
    with Vault.open(url) as vault:
        with pytest.raises(StorageError) as raised:
            vault.watch(str(ckpts), once=True, settle=0.2, interval=0.05, on_shipped=shipped.append)
        assert raised.value.retryable and shipped == []


def test_a_state_folder_that_cannot_be_made_is_a_one_line_error(cli, tmp_path: Path):
    from tests.test_cli import one_line_error

    ckpts, repo = tmp_path / "ckpts", str(tmp_path / "repo")
    ckpts.mkdir()
    (tmp_path / "a-file").write_text("not a folder")
    cli("init", repo)
    for state in (tmp_path / "a-file", tmp_path / "a-file" / "below", Path("/proc/ckptvault-state")):
        proc = cli("watch", str(ckpts), "--once", "--repo", repo, "--state-dir", str(state), check=False)
        message = one_line_error(proc)
        assert proc.returncode == 2 and f"cannot keep the watch's state in {state}" in message, message


def test_a_pins_folder_that_refuses_the_pin_is_said_as_that_not_as_an_unreadable_checkpoint(tmp_path, repo):
    """The run's error (exit 3) said "cannot read CHECKPOINT: cannot pin it: ..." though the checkpoint reads
    fine: the write into the pins folder failed. Here a file stands where the pins folder must go (as root,
    permissions would not do)."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    pins_dir = ckpts / ".ckptvault-watch" / "pins"
    watch = WatchProcess(str(ckpts), "--repo", repo, "--settle", "0.5")
    pins_dir.rmdir()
    pins_dir.write_bytes(b"")
    publish(str(ckpts), 100, 64 * 1024)
    watch.wait_for(lambda: any("cannot pin" in line for line in watch.err), what="the pin failure warning")
    assert watch.finish() == 3, watch.err
    error = watch.err[-1]
    assert error.startswith(f"error: cannot pin {ckpts / 'step_100'}: writing {pins_dir}"), watch.err
    assert "cannot read" not in error and f"make {pins_dir} writable" in error and "--state-dir" in error, error


def test_a_state_folder_on_a_full_disk_is_exit_21_saying_to_free_space_not_a_bad_argument(cli, tmp_path: Path, repo):
    """A watcher first started once the checkpoint disk is full (no room for its state folder) was exit 2,
    "it must be a writable folder": it is writable, and freeing a few KB (or another --state-dir) is the
    way out. A disk out of inodes here (the root and the checkpoint folder take the only two)."""
    from tests.test_cli import one_line_error

    with mounted_tmpfs(tmp_path / "mnt", "1m,nr_inodes=2", "the full checkpoint disk test") as mount:
        (mount / "ckpts").mkdir()
        proc = cli("watch", str(mount / "ckpts"), "--once", "--repo", repo, check=False)
    message = one_line_error(proc)
    assert proc.returncode == 21 and "no space left" in message and "free a few KB" in message, message
    assert "--state-dir" in message, message


def test_a_backup_of_a_watched_folder_leaves_out_the_sidecars_state_and_async_pins(cli, tmp_path: Path, repo):
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    publish(str(ckpts), 100, 64 * 1024)
    (ckpts / ".ckptvault-watch" / "pins" / "pin-1").mkdir(parents=True)  # as a watcher leaves it mid-shipment
    (ckpts / ".ckptvault-watch" / "pins" / "pin-1" / "model.bin").write_bytes(b"a hard-linked copy")
    (ckpts / ".ckptvault-watch" / "lock").write_text("pid 1")
    (ckpts / ".ckptvault-pins" / "p1" / "data").mkdir(parents=True)  # backup_async's, beside its source
    (ckpts / ".ckptvault-pins" / "p1" / "data" / "model.bin").write_bytes(b"a hard-linked copy")
    proc = cli("backup", str(ckpts), "--repo", repo)
    err = proc.stderr.decode()
    assert "the watch sidecar's state" in err and "backup_async's pins" in err, err
    with Vault.open(repo) as vault:
        paths = [e.path for e in vault.files("latest")]
    assert paths and not [p for p in paths if ".ckptvault-" in p]


WATCH = [sys.executable, "-m", "ckptvault", "watch"]


def test_a_sidecar_started_before_the_trainer_made_its_folder_ships_from_it(tmp_path, repo):
    ckpts = tmp_path / "run" / "ckpts"  # its parent exists; the trainer makes the folder later
    (tmp_path / "run").mkdir()
    watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=late", "--settle", "0.2", "--json")
    assert any("did not exist" in line for line in watch.err), watch.err
    os.makedirs(ckpts, exist_ok=True)  # as trainers do
    publish(str(ckpts), 100, 64 * 1024)
    watch.wait_for(lambda: len(watch.shipped()) == 1, what="the checkpoint to ship")
    assert watch.finish() == 0, watch.err
    assert_each_shipped_once(repo, [100], "late")


def test_a_full_disk_under_stdout_is_warned_once_and_every_checkpoint_still_ships(tmp_path, repo):
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    for step in (100, 200):
        publish(str(ckpts), step, 64 * 1024)
    with open("/dev/full", "w") as full:  # every write to it fails with ENOSPC
        proc = subprocess.run(
            [*WATCH, str(ckpts), "--repo", repo, "--tag", "run=full", "--once", "--settle", "0.2", "--json"],
            cwd=ROOT,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 21, proc.stderr
    assert proc.stderr.count("no longer printed") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert_each_shipped_once(repo, [100, 200], "full")


@pytest.mark.parametrize("stderr_too", [False, True], ids=["stdout", "stdout-and-stderr"])
def test_a_closed_stdout_does_not_stop_the_sidecar(tmp_path, repo, stderr_too: bool):
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader of the event lines is gone (a log shipper that died)
    proc = subprocess.Popen(
        [*WATCH, str(ckpts), "--repo", repo, "--tag", "run=pipe", "--settle", "0.2"],
        cwd=ROOT,
        stdout=write_end,
        stderr=write_end if stderr_too else subprocess.PIPE,  # watch ... 2>&1 | reader
        text=True,
    )
    os.close(write_end)
    try:
        for step in (100, 200, 300):
            publish(str(ckpts), step, 64 * 1024)
            deadline = time.monotonic() + 60
            while True:
                with Vault.open(repo) as vault:
                    if any(s.tags.get("step") == str(step) for s in vault.snapshots()):
                        break
                assert proc.poll() is None, f"watch ended ({proc.returncode})"
                assert time.monotonic() < deadline, f"step {step} was not shipped"
                time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    err = "" if stderr_too else proc.stderr.read()
    assert rc == 141 and (stderr_too or err.count("standard output was closed") == 1), (rc, err)
    assert "Traceback" not in err and "internal error" not in err, err
    assert_each_shipped_once(repo, [100, 200, 300], "pipe")


def test_a_signal_never_hangs_the_sidecar_whatever_its_main_thread_was_doing(tmp_path, repo):
    """The handler sets the stop event; an event's lock is not reentrant, so the handler must never
    run on a thread inside that event's wait (it did: 1 SIGTERM in ~70 hung watch for good)."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    args = ["watch", str(ckpts), "--repo", repo, "--interval", "0.01"]
    for trial in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.holding_event", *args],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert "watching" in proc.stderr.readline()
        time.sleep(0.3 + 0.07 * trial)  # the loop is then almost always inside a stretched wait
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"trial {trial}: watch hung after SIGTERM")
        assert rc == 0, proc.stderr.read()


def test_watching_one_checkpoint_instead_of_its_folder_is_warned_about(tmp_path, repo, cli):
    run = tmp_path / "run-3"
    ckpt = run / "checkpoint-1200"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"w" * 4096)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 1200}))
    args = ("--once", "--settle", "0.2", "--repo", repo)
    wrong = cli("watch", str(ckpt), *args).stderr.decode()
    assert f"{ckpt} looks like one checkpoint (step 1200, it holds trainer_state.json)" in wrong, wrong
    assert f"watch the folder the trainer saves checkpoints into ({run})" in wrong
    # the run's own folder: a trainer_state.json of the last step there at the end of training is no checkpoint
    (run / "trainer_state.json").write_text(json.dumps({"global_step": 5000}))
    right = cli("watch", str(run), *args)
    assert "looks like one checkpoint" not in right.stderr.decode()
    assert "shipped checkpoint-1200 step 1200" in right.stdout.decode()


def test_watching_a_folder_saved_as_one_checkpoint_is_warned_about(tmp_path, repo, cli):
    """README's own example once backed up ./checkpoints as one checkpoint and then watched it: model/,
    optimizer.pt and wandb/ each shipped as a snapshot of the run, and `restore latest` gave wandb/."""
    ckpt = tmp_path / "checkpoints"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "model" / "model.safetensors").write_bytes(b"w" * 4096)
    (ckpt / "optimizer.pt").write_bytes(b"o" * 4096)
    (ckpt / "wandb").mkdir()
    args = ("--once", "--settle", "0.2", "--repo", repo)
    wrong = cli("watch", str(ckpt), *args).stderr.decode()
    assert (
        f"{ckpt} looks like one checkpoint (it holds optimizer.pt, and nothing in it is named by a step), and watch "
        "ships each entry of the folder it watches as a checkpoint of its own"
    ) in wrong, wrong
    assert f"ckptvault backup --repo {repo} {ckpt}" in wrong
    # a folder of step-named checkpoints, each with its optimizer.pt inside: no warning
    out = tmp_path / "out"
    for step in (100, 200):
        (out / f"step-{step}").mkdir(parents=True)
        (out / f"step-{step}" / "optimizer.pt").write_bytes(b"o")
    (out / "optimizer.pt").write_bytes(b"o")  # even one left at the top
    assert "looks like one checkpoint" not in cli("watch", str(out), *args).stderr.decode()


def test_a_trainer_output_folder_ships_its_checkpoints_only_and_latest_resumes_from_the_last(tmp_path, repo, cli):
    """A Hugging Face Trainer's output folder also holds runs/ (TensorBoard logs) and, at the end, the
    final model's files: each shipped as a stepless snapshot, and `latest` of the run then went by
    time and restored the logs."""
    out = tmp_path / "out"
    for step in (500, 1000):
        ckpt = out / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        (ckpt / "model.safetensors").write_bytes(str(step).encode() * 1000)
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (out / "runs").mkdir()
    (out / "runs" / "events.out.tfevents.1").write_bytes(b"logs")
    (out / "config.json").write_text("{}")
    proc = cli("watch", str(out), "--once", "--settle", "0.2", "--tag", "run=hf", "--repo", repo)
    err, shipped = proc.stderr.decode(), proc.stdout.decode()
    assert "shipped checkpoint-500 step 500" in shipped and "shipped checkpoint-1000 step 1000" in shipped
    assert "runs" not in shipped and "config.json" not in shipped
    for name in ("runs", "config.json"):
        assert f"{name}: left out from now on: {out} is a Hugging Face Trainer's output folder" in err, err
    cli("restore", "latest", "--tag", "run=hf", str(tmp_path / "resume"), "--repo", repo, "-q")
    assert (tmp_path / "resume" / "model.safetensors").read_bytes() == b"1000" * 1000

    # asked for by name, the logs ship too
    proc = cli(
        "watch",
        str(out),
        "--once",
        "--settle",
        "0.2",
        "--include",
        "checkpoint-*",
        "--include",
        "runs",
        "--tag",
        "run=hf",
        "--repo",
        repo,
    )
    assert "shipped runs" in proc.stdout.decode() and "left out" not in proc.stderr.decode()


@pytest.mark.parametrize(
    ("framework", "folder", "pointer", "text"),
    [
        ("DeepSpeed", "global_step{}", "latest", "global_step{}"),
        ("Megatron-LM", "iter_{:07d}", "latest_checkpointed_iteration.txt", "{}"),
    ],
)
def test_a_save_folder_with_a_pointer_file_ships_its_step_folders_only(
    tmp_path, repo, cli, framework, folder, pointer, text
):
    """DeepSpeed (and Megatron-LM) save each step into a folder and then name it in a pointer file beside
    it: the pointer and the scripts beside it shipped as stepless snapshots, and `latest` of the run went
    by time and restored the pointer file instead of the newest step."""
    out = tmp_path / "out"
    out.mkdir()
    args = ("watch", str(out), "--once", "--settle", "0.2", "--tag", "run=ds", "--repo", repo)
    err = ""  # each entry left out is named once, in whichever run first saw it
    for step in (100, 200):
        (out / folder.format(step)).mkdir()
        (out / folder.format(step) / "mp_rank_00_model_states.pt").write_bytes(str(step).encode() * 1000)
        (out / pointer).write_text(text.format(step))  # written after the step folder, as the trainers do
        (out / "zero_to_fp32.py").write_text("# copied beside the checkpoints by DeepSpeed\n")
        proc = cli(*args)
        shipped, err = proc.stdout.decode(), err + proc.stderr.decode()
        assert f"shipped {folder.format(step)} step {step}" in shipped and shipped.count("shipped") == 1, shipped
    for name in (pointer, "zero_to_fp32.py"):
        assert f"{name}: left out from now on: {out} is {framework}'s save folder" in err, err
    cli("restore", "latest", "--tag", "run=ds", str(tmp_path / "resume"), "--repo", repo, "-q")
    assert (tmp_path / "resume" / "mp_rank_00_model_states.pt").read_bytes() == b"200" * 1000

    # a file named like a pointer that names no step folder is a checkpoint like any other
    other = tmp_path / "other"
    (other / "step_300").mkdir(parents=True)
    (other / "step_300" / "model.pt").write_bytes(b"300")
    (other / "latest").write_bytes(b"\x80not a pointer")
    shipped = cli("watch", str(other), "--once", "--settle", "0.2", "--tag", "run=o", "--repo", repo).stdout.decode()
    assert "shipped latest" in shipped and "shipped step_300 step 300" in shipped, shipped


@pytest.mark.parametrize(
    ("folder", "pointer", "text"),
    [("global_step{}", "latest", "global_step{}"), ("iter_{:07d}", "latest_checkpointed_iteration.txt", "{}")],
)
def test_a_step_folder_its_pointer_file_does_not_name_yet_waits_for_it(tmp_path, repo, cli, folder, pointer, text):
    """DeepSpeed and Megatron-LM name a step folder in their pointer file once every shard is written: a
    pause between shards longer than --settle shipped the step without its optimizer shard, as the run's
    newest (and `drill --load` passed: each file loads alone) (tr43)."""
    out = tmp_path / "out"
    (out / folder.format(100)).mkdir(parents=True)
    (out / folder.format(100) / "model_states.pt").write_bytes(b"100" * 1000)
    (out / pointer).write_text(text.format(100))
    (out / folder.format(200)).mkdir()
    (out / folder.format(200) / "model_states.pt").write_bytes(b"200" * 1000)  # its optimizer shard to come
    args = ("watch", str(out), "--once", "--settle", "0.2", "--tag", "run=ds", "--repo", repo)
    first = cli(*args)
    assert f"shipped {folder.format(100)} step 100" in first.stdout.decode(), first.stdout
    assert folder.format(200) not in first.stdout.decode(), first.stdout
    assert [s["tags"]["step"] for s in json.loads(cli("snapshots", "--json", "--repo", repo).stdout)] == ["100"]
    (out / folder.format(200) / "optim_states.pt").write_bytes(b"opt" * 1000)
    (out / pointer).write_text(text.format(200))  # last, as the trainers write it
    second = cli(*args).stdout.decode()
    assert f"shipped {folder.format(200)} step 200 as snapshot" in second and "2 files" in second, second
    cli("restore", "latest", "--tag", "run=ds", str(tmp_path / "resume"), "--repo", repo, "-q")
    assert sorted(p.name for p in (tmp_path / "resume").iterdir()) == ["model_states.pt", "optim_states.pt"]


def test_logs_and_configs_beside_the_checkpoints_do_not_ship_and_checkpoints_ship_newest_first(tmp_path, repo, cli):
    """A hand-written loop's folder: checkpoints named by step, and a config and a log beside them. The
    config and the log shipped as snapshots without a step (in the folder's order, the log again at every
    change), so `restore latest` went by time and restored config.yaml, and `prune --keep-latest 1` would
    have removed every checkpoint. The checkpoints ship newest first (a run killed half way has shipped
    what a resume needs), and their snapshot times follow the steps."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    steps = list(range(100, 900, 100))
    random.Random(7).shuffle(steps)  # made in no order: the folder's listing is not step order either
    for step in steps:
        (ckpts / f"ckpt_{step}.pt").write_bytes(str(step).encode())
    (ckpts / "config.yaml").write_bytes(b"lr: 1")
    (ckpts / "train.log").write_bytes(b"")
    assert [e.name for e in os.scandir(ckpts) if e.name.startswith("ckpt")] != sorted(
        (e.name for e in os.scandir(ckpts) if e.name.startswith("ckpt")), key=lambda n: int(n[5:-3])
    ), "the listing happens to be in step order: the order test would prove nothing"
    args = ("watch", str(ckpts), "--once", "--settle", "0", "--tag", "run=p", "--repo", repo)
    proc = cli(*args)
    shipped = [line.split()[1] for line in proc.stdout.decode().splitlines()]
    assert shipped == [f"ckpt_{step}.pt" for step in sorted(steps, reverse=True)], proc.stdout.decode()
    with Vault.open(repo) as vault:  # a snapshot's time is its pin's: pinned in step order too
        by_time = [int(s.tags["step"]) for s in sorted(vault.snapshots(), key=lambda s: s.time)]
    assert by_time == sorted(steps)
    for name in ("config.yaml", "train.log"):
        assert f"{name}: left out: a log, config, script or image by its name" in proc.stderr.decode()
    cli("restore", "latest", "--tag", "run=p", str(tmp_path / "resume"), "--repo", repo, "-q")
    assert (tmp_path / "resume" / "ckpt_800.pt").read_bytes() == b"800"
    # the table shows the tags a user reads; the sidecar's digest (16 hex digits a row) only in --json
    table = cli("snapshots", "--repo", repo).stdout.decode()
    assert "checkpoint=ckpt_800.pt" in table and "watch-sig" not in table, table
    for listing in (("stats",), ("prune", "--keep-latest", "1", "--dry-run")):  # nor in the other tables (cli49 #5)
        table = cli(*listing, "--repo", repo).stdout.decode()
        assert "checkpoint=ckpt_" in table and "watch-sig" not in table, table
    assert all("watch-sig" in s["tags"] for s in json.loads(cli("snapshots", "--json", "--repo", repo).stdout))
    (ckpts / "train.log").write_bytes(b"step 800 done\n")
    assert cli(*args).stdout == b""  # not shipped at its change either
    # --include ships what it names, as the user chose
    shipped_too = cli(*args, "--include", "config.yaml", "--include", "ckpt_*").stdout.decode()
    assert "shipped config.yaml" in shipped_too and "train.log" not in shipped_too, shipped_too


@pytest.mark.parametrize(
    ("files", "ships"),
    [
        (["model_100.json", "model_200.json", "model.txt"], ["model_100.json", "model_200.json"]),  # XGBoost
        (["model.txt", "train.log"], ["model.txt"]),  # LightGBM: the only candidate, so it is the checkpoint
    ],
    ids=["xgboost", "lightgbm"],
)
def test_checkpoints_saved_as_text_still_ship(tmp_path, repo, cli, files, ships):
    """Models saved as text (XGBoost's model_<round>.json, LightGBM's model.txt) are checkpoints: named
    with a step, or with nothing else beside them to ship, they ship; logs never do."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    for name in files:
        (ckpts / name).write_text(f"{name} contents")
    proc = cli("watch", str(ckpts), "--once", "--settle", "0", "--tag", "run=t", "--repo", repo)
    shipped = sorted(line.split()[1] for line in proc.stdout.decode().splitlines())
    assert shipped == ships, (proc.stdout.decode(), proc.stderr.decode())


def test_a_step_folder_that_holds_tensorboard_logs_too_is_a_checkpoint(tmp_path, repo, cli):
    """Only a folder without a step in its name is taken for logs (runs/, lightning_logs/): a checkpoint
    folder named by its step that also holds the run's event files ships, or that save is lost."""
    ckpts = tmp_path / "ckpts"
    for step in (100, 200):
        (ckpts / f"step_{step}").mkdir(parents=True)
        (ckpts / f"step_{step}" / "model.pt").write_bytes(str(step).encode())
        (ckpts / f"step_{step}" / "events.out.tfevents.1733.host").write_bytes(b"loss")
    (ckpts / "runs").mkdir()
    (ckpts / "runs" / "events.out.tfevents.1733.host").write_bytes(b"loss")
    proc = cli("watch", str(ckpts), "--once", "--settle", "0", "--tag", "run=tb", "--repo", repo)
    shipped = sorted(line.split()[1] for line in proc.stdout.decode().splitlines())
    assert shipped == ["step_100", "step_200"], (proc.stdout.decode(), proc.stderr.decode())
    assert "runs: not shipped: it holds TensorBoard logs" in proc.stderr.decode()


def test_once_ends_when_its_uploads_are_done_whatever_the_interval(tmp_path, repo, cli):
    """--once waited --interval twice over after shipping (41 s for a 5-byte file at --interval 20)."""
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "ckpts" / "ckpt-79.pt").write_bytes(b"new3\n")
    started = time.monotonic()
    proc = cli("watch", str(tmp_path / "ckpts"), "--once", "--interval", "20", "--settle", "0", "--repo", repo)
    assert "shipped ckpt-79.pt step 79" in proc.stdout.decode()
    assert time.monotonic() - started < 15


def test_a_checkpoint_whose_name_holds_a_control_character_ships(tmp_path, repo, cli):
    """watch's own checkpoint=<name> tag is escaped: the rules for tags users give must not stop a
    checkpoint the user did not name for a tag."""
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "ckpts" / "step\t100.pt").write_bytes(b"x")
    proc = cli("watch", str(tmp_path / "ckpts"), "--once", "--settle", "0", "--repo", repo, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    listing = json.loads(cli("snapshots", "--json", "--repo", repo).stdout)
    assert listing[0]["tags"]["checkpoint"] == "step\\t100.pt"


def test_a_live_trainer_output_folder_never_ships_its_logs(tmp_path, repo, cli):
    """The sidecar starts with the trainer: runs/ (TensorBoard logs) appears at step 0 and settles long
    before the first checkpoint is complete; it shipped first, as a snapshot without a step."""
    out = tmp_path / "out"
    out.mkdir()
    watch = WatchProcess(str(out), "--repo", repo, "--tag", "run=hf", "--settle", "0.2", "--json")
    (out / "runs" / "Dec02_host").mkdir(parents=True)
    (out / "runs" / "Dec02_host" / "events.out.tfevents.1733.host").write_bytes(b"step 0 loss")
    watch.wait_for(lambda: any("TensorBoard logs" in line for line in watch.err), what="the logs to be told apart")
    ckpt = out / "checkpoint-500"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"w" * 4096)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 500}))
    watch.wait_for(lambda: len(watch.shipped()) == 1, what="the checkpoint to ship")
    assert watch.finish() == 0, watch.err
    assert [s["checkpoint"] for s in watch.shipped()] == ["checkpoint-500"]
    cli("restore", "latest", "--tag", "run=hf", str(tmp_path / "resume"), "--repo", repo, "-q")
    assert (tmp_path / "resume" / "model.safetensors").read_bytes() == b"w" * 4096


def test_a_trainer_checkpoint_deleted_before_its_last_file_was_seen_is_not_shipped(tmp_path, repo):
    """A Hugging Face Trainer writes trainer_state.json last: in its output folder, a checkpoint-N
    deleted before it settled whose pin never got that file was seen in part only, and shipped it
    would be the run's newest step (restore latest would give a torn checkpoint). One deleted as
    quickly but seen whole still ships."""
    ckpts = tmp_path / "ckpts"
    pins_dir = ckpts / ".ckptvault-watch" / "pins"
    ckpts.mkdir()
    (ckpts / "checkpoint-0").mkdir()  # the run's earlier save, complete: this is a Trainer's output folder
    (ckpts / "checkpoint-0" / "model.safetensors").write_bytes(os.urandom(1000))
    (ckpts / "checkpoint-0" / "trainer_state.json").write_text(json.dumps({"global_step": 0}))
    watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=hf", "--settle", "1", "--json")
    watch.wait_for(lambda: len(watch.shipped()) == 1, what="checkpoint-0 to ship")
    shutil.rmtree(ckpts / "checkpoint-0")
    watch.wait_for(lambda: not pin_count(pins_dir), what="checkpoint-0's pin to go")
    for step, last_files_seen in ((1, False), (2, True)):
        folder = ckpts / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(os.urandom(100_000))
        if last_files_seen:
            (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        held = {"model.safetensors", "trainer_state.json"} if last_files_seen else {"model.safetensors"}
        watch.wait_for(lambda h=held, n=folder.name: h <= pinned_files(pins_dir, n), what=f"checkpoint-{step}'s pin")
        if not last_files_seen:  # the rest is written, and the folder deleted, within one poll: the
            watch.proc.send_signal(signal.SIGSTOP)  # watcher is held meanwhile (a poll could land between)
            (folder / "optimizer.pt").write_bytes(os.urandom(100_000))
            (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        shutil.rmtree(folder)
        watch.proc.send_signal(signal.SIGCONT)
        watch.wait_for(lambda: not pin_count(pins_dir), what=f"checkpoint-{step}'s pin to go")
    watch.wait_for(lambda: len(watch.shipped()) == 2, what="checkpoint-2 to ship")
    assert watch.finish() == 0, watch.err
    assert [e["step"] for e in watch.shipped()] == [0, 2]
    assert any("checkpoint-1 was deleted before it was complete" in line for line in watch.err), watch.err
    with Vault.open(repo) as vault:
        assert [s.tags["step"] for s in vault.snapshots({"run": "hf"})] == ["0", "2"]


def pin_count(pins_dir: Path) -> int:
    """Pins in the watcher's staging folder, which goes with its last pin (and comes back at once)."""
    try:
        return len(os.listdir(pins_dir))
    except FileNotFoundError:
        return 0


def pinned_files(pins_dir: Path, name: str) -> set[str]:
    """The files the pins of checkpoint ``name`` hold (top level)."""
    files: set[str] = set()
    for data in pins_dir.glob(f"*/data/{name}"):
        with contextlib.suppress(OSError):  # being removed
            files |= {p.name for p in data.iterdir()}
    return files


def pinned_names(pins_dir: Path) -> set[str]:
    names = set()
    for meta in pins_dir.glob("*/pin.json"):
        with contextlib.suppress(OSError, ValueError):  # being written or removed
            names.add(json.loads(meta.read_text())["name"])
    return names


def publish_checkpoint(ckpts: Path, name: str, step: int) -> dict[str, bytes]:
    """A save published whole by a rename (as most trainers do), without a trainer_state.json."""
    files = {"model.pt": os.urandom(200_000), "meta.json": json.dumps({"step": step}).encode()}
    tmp = ckpts / f"tmp-{name}"
    tmp.mkdir()
    for file, data in files.items():
        (tmp / file).write_bytes(data)
    os.rename(tmp, ckpts / name)
    return files


def test_checkpoint_n_folders_of_other_trainers_deleted_before_they_settle_still_ship(tmp_path, repo):
    """``checkpoint-N`` is a common name outside Hugging Face (custom loops, accelerate): without a
    trainer_state.json anywhere, a save deleted by a keep-last-1 rotation before --settle ran out
    ships as it was pinned, like a ``step_N`` folder."""
    ckpts = tmp_path / "ckpts"
    pins_dir = ckpts / ".ckptvault-watch" / "pins"
    ckpts.mkdir()
    watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=c", "--settle", "2", "--json")
    written = {}
    for step in (1, 2, 3):
        written[step] = publish_checkpoint(ckpts, f"checkpoint-{step}", step)
        name = f"checkpoint-{step}"
        watch.wait_for(lambda n=name, f=written[step]: set(f) <= pinned_files(pins_dir, n), what=f"{name}'s pin")
        shutil.rmtree(ckpts / f"checkpoint-{step}")  # the rotation, well before it settled
    watch.wait_for(lambda: len(watch.shipped()) == 3, what="every checkpoint to ship")
    assert watch.finish() == 0, watch.err
    assert not any("deleted before it was complete" in line for line in watch.err), watch.err
    with Vault.open(repo) as vault:
        snaps = vault.snapshots({"run": "c"})
        assert sorted(int(s.tags["step"]) for s in snaps) == [1, 2, 3]
        for snap in snaps:
            for file, data in written[int(snap.tags["step"])].items():
                assert b"".join(vault.read_file(snap, file)) == data


def test_pins_of_checkpoint_n_folders_deleted_while_no_watcher_ran_ship_after_a_restart(tmp_path, repo):
    """A watcher killed while it held pins of two ``checkpoint-N`` saves (not a Hugging Face Trainer's);
    the trainer's rotation deletes both folders before the watcher is back: the pins are the only
    copies left, and the restarted watcher ships them."""
    ckpts = tmp_path / "ckpts"
    pins_dir = ckpts / ".ckptvault-watch" / "pins"
    ckpts.mkdir()
    watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=r", "--settle", "30", "--json")
    written = {step: publish_checkpoint(ckpts, f"checkpoint-{step}", step) for step in (10, 20)}
    for step, files in written.items():  # pinned: its files linked, and its pin.json (written last) there
        watch.wait_for(
            lambda n=f"checkpoint-{step}", f=files: set(f) <= pinned_files(pins_dir, n) and n in pinned_names(pins_dir),
            what="both pins",
        )
    watch.proc.kill()
    watch.proc.wait(30)
    for step in written:
        shutil.rmtree(ckpts / f"checkpoint-{step}")
    # the restart recipe's `ship-pins` ships backup_async's pins; it said "nothing left pinned" (wt47 F6), then
    # exited 0 after naming these, and the recipe's restore went on without them (rv61)
    told = subprocess.run(
        [sys.executable, "-m", "ckptvault", "ship-pins", str(ckpts), "--repo", repo], capture_output=True, text=True
    )
    assert told.returncode == 40, told.stderr
    said = f"holds 2 checkpoints a watch sidecar pinned; ship them with: ckptvault watch --repo {repo} {ckpts} --once"
    assert said in told.stderr, told.stderr
    again = watch_once(ckpts, repo, "r")
    assert again.returncode == 0, again.stderr
    assert "deleted before it was complete" not in again.stderr, again.stderr
    # never seen settled (--settle 30), so possibly part of a save written in place: said (wt47 F1), in one
    # line for both (a line each was noise: sp54)
    said = [line for line in again.stderr.splitlines() if "pinned by a watcher that stopped" in line]
    assert len(said) == 1, again.stderr
    assert said[0].startswith("warning: adopting 2 checkpoints (checkpoint-10, checkpoint-20) pinned by a watcher")
    assert "they ship now as pinned then" in said[0] and "checkpoint=NAME" in said[0], said
    assert not pin_count(pins_dir)
    with Vault.open(repo) as vault:
        snaps = vault.snapshots({"run": "r"})
        assert sorted(int(s.tags["step"]) for s in snaps) == [10, 20]
        for snap in snaps:
            for file, data in written[int(snap.tags["step"])].items():
                assert b"".join(vault.read_file(snap, file)) == data


def test_a_pin_that_settled_before_the_kill_ships_after_a_restart_without_a_word(tmp_path, repo):
    """The warning of a pin never seen settled is not said of one that had (its pin.json says so)."""
    ckpts = tmp_path / "ckpts"
    pins_dir = ckpts / ".ckptvault-watch" / "pins"
    ckpts.mkdir()
    slow = f"slowfile://{repo}"
    watch = WatchProcess(str(ckpts), "--repo", slow, "-o", "delay=2", "--tag", "run=r", "--settle", "0.2", "--json")
    for step in (10, 20):
        publish_checkpoint(ckpts, f"checkpoint-{step}", step)
    settled = lambda: [json.loads(m.read_text()).get("settled") for m in pins_dir.glob("*/pin.json")]  # noqa: E731
    watch.wait_for(lambda: settled() == [True, True], what="both pins settled")  # one ships, one waits
    watch.proc.kill()
    watch.proc.wait(30)
    for step in (10, 20):
        shutil.rmtree(ckpts / f"checkpoint-{step}")
    again = watch_once(ckpts, repo, "r")
    assert again.returncode == 0, again.stderr
    assert "pinned by a watcher that stopped" not in again.stderr, again.stderr
    with Vault.open(repo) as vault:
        assert sorted(int(s.tags["step"]) for s in vault.snapshots({"run": "r"})) == [10, 20]


def test_pins_in_a_shared_state_folder_ship_only_with_their_own_folder_and_tags(tmp_path, repo):
    """A watch of folder B using the state folder a killed watch of folder A left shipped A's pins under B's
    tags: `restore latest --tag run=b` then took run A's step (wt47 F2). A pin ships with the tags it was
    pinned under, and only from a watch of its own folder."""
    state = tmp_path / "state"
    folders = {run: tmp_path / run for run in ("a", "b")}
    for folder in folders.values():
        folder.mkdir()
    written_a = publish_checkpoint(folders["a"], "step_100", 100)
    watch = WatchProcess(str(folders["a"]), "--repo", repo, "--tag", "run=a", "--settle", "30", "--state-dir",
                         str(state), "--json")  # fmt: skip
    watch.wait_for(lambda: "step_100" in pinned_names(state / "pins"), what="the pin")
    watch.proc.kill()
    watch.proc.wait(30)
    publish_checkpoint(folders["b"], "step_5", 5)
    run_b = [sys.executable, "-m", "ckptvault", "watch", "--repo", repo, "--once", "--settle", "0.2"]
    other = subprocess.run(
        [*run_b, str(folders["b"]), "--tag", "run=b", "--state-dir", str(state)], capture_output=True, text=True
    )
    assert other.returncode == 0, other.stderr
    assert f"holds a pin of {folders['a'] / 'step_100'}, which a watch of another folder left" in other.stderr
    with Vault.open(repo) as vault:
        assert [s.tags["step"] for s in vault.snapshots()] == ["5"]
    # the same folder watched again under another run's tag: its pin ships as run=a, as it was pinned
    again = subprocess.run(
        [*run_b, str(folders["a"]), "--tag", "run=c", "--state-dir", str(state)], capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr
    with Vault.open(repo) as vault:
        (shipped,) = vault.snapshots({"step": "100"})
        assert shipped.tags["run"] == "a"
        assert b"".join(vault.read_file(shipped, "model.pt")) == written_a["model.pt"]


def test_an_unfinished_pin_left_by_a_killed_watcher_is_removed_with_a_warning(tmp_path, repo):
    """A watcher killed while it pinned a checkpoint (or released one) leaves a pin without pin.json,
    written last: never complete, never promised. The next watcher removes it and says so, naming the
    checkpoint: if the trainer deleted it meanwhile, it was never backed up."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    publish_checkpoint(ckpts, "checkpoint-10", 10)
    unfinished = ckpts / ".ckptvault-watch" / "pins" / f"{time.time_ns():020d}-abcdef" / "data" / "checkpoint-5"
    unfinished.mkdir(parents=True)
    (unfinished / "model.pt").write_bytes(b"linked before the kill")
    again = watch_once(ckpts, repo, "r")
    assert again.returncode == 0, again.stderr
    assert "stopped while pinning or releasing checkpoint-5: its unfinished pin was removed" in again.stderr
    assert not pin_count(ckpts / ".ckptvault-watch" / "pins")
    with Vault.open(repo) as vault:
        assert [s.tags["step"] for s in vault.snapshots({"run": "r"})] == ["10"]


def test_a_folder_made_before_its_files_ships_once_they_are_written(tmp_path, repo):
    """A trainer that makes its checkpoint folder, then gathers state from its GPUs for longer than
    --settle: the empty folder is no checkpoint yet; the pin follows it until the files are there."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=e", "--settle", "0.3", "--json")
    (ckpts / "step_100").mkdir()
    time.sleep(1.5)  # settled, and still empty
    data = os.urandom(50_000)
    (ckpts / "step_100" / "model.pt").write_bytes(data)
    watch.wait_for(lambda: len(watch.shipped()) == 1, what="step_100 to ship")
    assert watch.finish() == 0, watch.err
    assert not any("failed" in line for line in watch.err), watch.err
    with Vault.open(repo) as vault:
        snap = vault.latest({"run": "e"})
        assert snap.tags["step"] == "100" and b"".join(vault.read_file(snap, "model.pt")) == data


def test_a_file_rewritten_in_place_or_added_below_a_shipped_folder_ships_a_new_version(tmp_path, repo):
    """Neither changes the mtime of the checkpoint folder itself (``torch.save`` over ``last/model.pt``
    rewrites the same inode; DeepSpeed adds files to ``global_stepN/``)."""
    ckpts = tmp_path / "ckpts"
    (ckpts / "last" / "global_step1").mkdir(parents=True)
    model = ckpts / "last" / "model.pt"
    model.write_bytes(b"1" * 50_000)
    watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=r", "--settle", "0.3", "--json")
    watch.wait_for(lambda: len(watch.shipped()) == 1, what="the first save to ship")
    folder_mtime = os.stat(ckpts / "last").st_mtime_ns
    with open(model, "r+b") as f:
        f.write(b"2" * 50_000)
    watch.wait_for(lambda: len(watch.shipped()) == 2, what="the file rewritten in place to ship")
    (ckpts / "last" / "global_step1" / "optim_states.pt").write_bytes(b"3" * 1000)
    assert os.stat(ckpts / "last").st_mtime_ns == folder_mtime
    watch.wait_for(lambda: len(watch.shipped()) == 3, what="the file added below to ship")
    assert watch.finish() == 0, watch.err
    with Vault.open(repo) as vault:
        snap = vault.latest({"run": "r"})
        assert b"".join(vault.read_file(snap, "model.pt")) == b"2" * 50_000
        assert b"".join(vault.read_file(snap, "global_step1/optim_states.pt")) == b"3" * 1000


def test_a_file_rewritten_in_place_during_its_upload_is_not_committed_and_ships_again(tmp_path, repo):
    """The pin is a hard link: the rewrite (the next save copied into the old file) shows in it too.
    That backup is not committed (it could hold a torn file under the older save's tags) and does not
    count as shipped; the new bytes settle and ship."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    last = ckpts / "last.pt"
    last.write_bytes(os.urandom(6_000_000))
    watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=u", "--settle", "0.2", "--limit-upload", "1MB")
    locks = Path(repo) / "locks"
    watch.wait_for(lambda: locks.exists() and any(locks.iterdir()), what="the upload to start")  # it takes ~6 s
    time.sleep(0.5)
    new = os.urandom(6_000_000)
    with open(last, "r+b") as f:
        f.write(new)
    watch.wait_for(lambda: any(x.startswith("shipped") for x in watch.lines), what="the new save")
    assert watch.finish() == 0, watch.err
    assert sum("rewritten in place while it shipped" in line for line in watch.err) == 1, watch.err
    assert not any(line.startswith("error") for line in watch.err), watch.err  # it did ship: nothing is lost
    with Vault.open(repo) as vault:
        assert [restored_files(vault, s) for s in vault.snapshots({"run": "u"})] == [{"last.pt": new}]


def test_a_trainer_checkpoint_without_its_trainer_state_waits_for_it(tmp_path, repo, cli):
    """A trainer killed while saving leaves checkpoint-N without trainer_state.json (written last):
    shipped, it would be the run's newest step, which cannot resume. It waits, pinned, and ships once
    the file is there; deleted meanwhile, it is dropped."""
    ckpts = tmp_path / "ckpts"
    for step, complete in ((100, True), (200, False)):
        folder = ckpts / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(os.urandom(10_000))
        if complete:
            (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    args = ("watch", str(ckpts), "--repo", repo, "--tag", "run=t", "--once", "--settle", "0.2")
    first = cli(*args)
    assert first.stdout.decode().count("shipped ") == 1 and "shipped checkpoint-100" in first.stdout.decode()
    err = first.stderr.decode()
    assert "checkpoint-200 holds no trainer_state.json" in err and "1 pinned checkpoint(s)" in err, err
    (ckpts / "checkpoint-200" / "trainer_state.json").write_text(json.dumps({"global_step": 200}))
    assert "shipped checkpoint-200 step 200" in cli(*args).stdout.decode()

    (ckpts / "checkpoint-300").mkdir()
    (ckpts / "checkpoint-300" / "model.safetensors").write_bytes(os.urandom(10_000))
    assert "shipped" not in cli(*args).stdout.decode()
    shutil.rmtree(ckpts / "checkpoint-300")
    last = cli(*args)
    assert "shipped" not in last.stdout.decode() and "checkpoint-300 was deleted" in last.stderr.decode()
    assert not os.listdir(ckpts / ".ckptvault-watch" / "pins")
    with Vault.open(repo) as vault:
        assert sorted(s.tags["step"] for s in vault.snapshots({"run": "t"})) == ["100", "200"]


def test_a_trainer_checkpoint_whose_trainer_state_the_patterns_leave_out_ships_without_it(tmp_path, repo, cli):
    """A checkpoint-N waits for its trainer_state.json, but not one the user's --exclude leaves out: that
    file is never coming, and waiting for it would ship nothing, ever."""
    ckpts = tmp_path / "ckpts"
    for step in (100, 200):
        folder = ckpts / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(os.urandom(10_000))
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    args = ("watch", str(ckpts), "--repo", repo, "--tag", "run=x", "--once", "--settle", "0.2")
    out = cli(*args, "--exclude", "trainer_state.json").stdout.decode()
    assert "shipped checkpoint-100" in out and "shipped checkpoint-200" in out, out
    with Vault.open(repo) as vault:
        for snap in vault.snapshots({"run": "x"}):
            assert [e.path for e in vault.files(snap) if e.type == "file"] == ["model.safetensors"]


def test_a_file_checkpoint_cut_short_by_a_killed_trainer_waits_and_never_becomes_latest(tmp_path, repo, cli):
    """``torch.save`` straight to ``step_N.pt``, killed mid-save: the cut file settled and shipped as the
    run's newest step, and ``restore latest`` gave a checkpoint that does not load, exit 0 (train 37 T1).
    A zip without its directory (torch.save writes it last) or a safetensors file shorter than its header
    says waits, pinned; written whole it ships; deleted, it is dropped and said so."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    torch.save({"w": torch.randn(300, 300)}, ckpts / "step_00001.pt")
    torch.save({"w": torch.randn(300, 300)}, tmp_path / "whole.pt")
    whole = (tmp_path / "whole.pt").read_bytes()
    (ckpts / "step_00002.pt").write_bytes(whole[: len(whole) // 2])
    save_file({"w": torch.randn(100, 100)}, tmp_path / "whole.safetensors")
    (ckpts / "step_00003.safetensors").write_bytes((tmp_path / "whole.safetensors").read_bytes()[:-1])
    args = ("watch", str(ckpts), "--repo", repo, "--tag", "run=z", "--once", "--settle", "0.2")

    first = cli(*args)
    assert first.stdout.decode().splitlines() == [first.stdout.decode().splitlines()[0]], first.stdout
    assert "shipped step_00001.pt step 1" in first.stdout.decode()
    assert "2 pinned checkpoint(s)" in first.stderr.decode(), first.stderr
    held = cli("restore", "latest", str(tmp_path / "resume"), "--repo", repo, "--tag", "run=z")
    assert held.returncode == 0 and os.listdir(tmp_path / "resume") == ["step_00001.pt"]

    (ckpts / "step_00002.pt").write_bytes(whole)  # saved again, whole (a resumed run, the same step)
    (ckpts / "step_00003.safetensors").unlink()  # rotated away by the resumed run
    second = cli(*args)
    assert "shipped step_00002.pt step 2" in second.stdout.decode(), second.stdout
    assert (
        "step_00003.safetensors was deleted while it held a file that is not whole (tensor 'w' has data_offsets "
        "0..40000 outside the file): it was never complete; not shipped"
    ) in second.stderr.decode(), second.stderr
    assert not os.listdir(ckpts / ".ckptvault-watch" / "pins")
    with Vault.open(repo) as vault:
        assert sorted(s.tags["step"] for s in vault.snapshots({"run": "z"})) == ["1", "2"]
        assert restored_files(vault, vault.latest({"run": "z"})) == {"step_00002.pt": whole}


def test_a_copy_of_a_shipped_checkpoint_ships_under_its_own_name(tmp_path, repo, cli):
    """``cp -a checkpoint-100 best`` keeps every name, size and mtime inside: the same signature, but
    another checkpoint (``restore latest --tag checkpoint=best``)."""
    ckpts = tmp_path / "ckpts"
    (ckpts / "checkpoint-100").mkdir(parents=True)
    (ckpts / "checkpoint-100" / "model.bin").write_bytes(os.urandom(10_000))
    args = ("watch", str(ckpts), "--repo", repo, "--tag", "run=c", "--once", "--settle", "0.2")
    cli(*args)
    shutil.copytree(ckpts / "checkpoint-100", ckpts / "best")  # copy2: mtimes kept
    assert "shipped best" in cli(*args).stdout.decode()
    assert cli(*args).stdout.decode() == "", "each shipped once"
    with Vault.open(repo) as vault:
        assert sorted(s.tags["checkpoint"] for s in vault.snapshots({"run": "c"})) == ["best", "checkpoint-100"]


def test_shipped_folders_are_looked_into_within_a_share_of_the_time(tmp_path, monkeypatch):
    """A shipped folder is looked into again (a file rewritten in place changes no folder mtime), but
    all of them together at most LOOK_INSIDE_SHARE of the time: many shipped checkpoints of many files
    must not keep a core of the training machine busy."""
    from ckptvault.ops import pin as pins
    from ckptvault.ops import watch as watching
    from ckptvault.ops import watch_candidate

    ckpts = tmp_path / "ckpts"
    for n in range(20):
        (ckpts / f"ck-{n}").mkdir(parents=True)
        (ckpts / f"ck-{n}" / "model.pt").write_bytes(b"x")
    watcher = watching.Watcher(
        str(ckpts),
        tags={"run": "r"},
        ship=lambda job: pytest.fail("nothing changed: nothing ships"),
        shipped_digests=lambda: (),
        options=watching.WatchOptions(),
    )
    for n in range(20):
        path = str(ckpts / f"ck-{n}")
        st = os.stat(path)
        watcher._done[f"ck-{n}"] = watch_candidate.Done(st.st_ino, st.st_size, st.st_mtime_ns, pins.signature(path))
    real_signature = pins.signature
    looks: list[float] = []

    def costly_signature(path, excluded=None):  # 20 ms a look: 0.4 s for all 20 folders
        looks.append(now)
        time.sleep(0.02)
        return real_signature(path, excluded)

    monkeypatch.setattr(pins, "signature", costly_signature)
    for now in range(2, 30):  # a poll each second of a made-up clock
        watcher._scan(float(now))
    assert looks[:20] == [2.0] * 20  # the first look finds what they cost
    every = 0.4 / watching.LOOK_INSIDE_SHARE  # then 8 s apart (20 ms x 20 is 5 % of 8 s)
    assert len(looks) <= 4 * 20  # at most at 2, 10, 18 and 26 (every second: 28 looks each)
    assert all(b - a >= every or b == a for a, b in zip(sorted(set(looks)), sorted(set(looks))[1:], strict=False))
    assert not watcher._candidates
    for n in range(1, 20):  # the trainer's rotation: one is left, and only it costs a look now
        shutil.rmtree(ckpts / f"ck-{n}")
    looks.clear()
    for now in range(30, 36):
        watcher._scan(float(now))
    assert len(looks) >= 2  # every second again (20 ms is 5 % of 0.4 s), not every 8 s: at most once


def replace_folder(folder: Path, files: dict[str, bytes]) -> int:
    """A trainer that replaces its ``best/`` folder: rmtree, then makedirs (ext4 hands the new folder
    the freed inode number at once). Its inode number."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder.stat().st_ino


def restored_files(vault: Vault, snap) -> dict[str, bytes]:
    return {e.path: b"".join(vault.read_file(snap, e.path)) for e in vault.files(snap) if e.type == "file"}


@pytest.mark.parametrize("names", ["same", "other"])
def test_a_folder_replaced_under_its_name_while_its_pin_settles_ships_both_saves_unmixed(tmp_path, repo, names):
    """The new folder may get the old one's inode number: it must not pass for the pinned checkpoint
    (whose pin would then take its files beside the old ones): each save ships as it was written,
    whether the new save's files have the old names or others."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=b", "--settle", "1.5", "--json")
    a = {"model.bin": os.urandom(100_000), "optimizer_a.bin": os.urandom(50_000), "step.txt": b"100"}
    b = {"model.bin": os.urandom(100_000), "step.txt": b"200"}
    if names == "other":
        b = {"model-200.bin": os.urandom(100_000)}
    replace_folder(ckpts / "best", a)
    watch.wait_for(lambda: set(a) <= pinned_files(ckpts / ".ckptvault-watch" / "pins", "best"), what="best's pin")
    replace_folder(ckpts / "best", b)
    watch.wait_for(lambda: len(watch.shipped()) == 2, what="both saves to ship")
    assert watch.finish() == 0, watch.err
    with Vault.open(repo) as vault:
        got = [restored_files(vault, s) for s in vault.snapshots({"run": "b"})]
    assert got == [a, b]


def test_a_pinned_folder_replaced_while_no_watcher_ran_ships_from_its_pin_and_the_new_one_too(tmp_path, repo):
    """The pin's folder was deleted and a new one made under its name, with its inode number, while
    no watcher held it: none of the pin's files is a file of the new folder, so it is another save."""
    ckpts = tmp_path / "ckpts"
    pins_dir = ckpts / ".ckptvault-watch" / "pins"
    ckpts.mkdir()
    a = {"model.bin": os.urandom(100_000), "optimizer_a.bin": os.urandom(50_000)}
    b = {"model.bin": os.urandom(100_000)}
    replace_folder(ckpts / "best", a)
    watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=b", "--settle", "30", "--json")
    watch.wait_for(lambda: "best" in pinned_names(pins_dir), what="best's pin")
    time.sleep(0.3)
    watch.proc.kill()
    watch.proc.wait(30)
    new_ino = replace_folder(ckpts / "best", b)  # while no watcher runs
    for meta in pins_dir.glob("*/pin.json"):  # as when the new folder gets the old one's inode number
        doc = json.loads(meta.read_text())
        meta.write_text(json.dumps({**doc, "source_ino": new_ino}))
    again = watch_once(ckpts, repo, "b")
    assert again.returncode == 0, again.stderr
    with Vault.open(repo) as vault:
        got = [restored_files(vault, s) for s in vault.snapshots({"run": "b"})]
    assert got == [a, b]


def test_the_first_checkpoint_of_a_trainer_run_waits_for_its_trainer_state(tmp_path, repo):
    """A fresh Trainer output folder: no checkpoint-N holds trainer_state.json yet, but the first one
    holds the training_args.bin the Trainer writes with the model; a pause longer than --settle before
    trainer_state.json (gathering the optimizer state) must not ship it without that file."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    watch = WatchProcess(str(ckpts), "--repo", repo, "--tag", "run=hf", "--settle", "0.3", "--json")
    folder = ckpts / "checkpoint-10"
    folder.mkdir()
    for name in ("model.safetensors", "training_args.bin", "optimizer.pt"):
        (folder / name).write_bytes(os.urandom(20_000))
    time.sleep(1.5)  # settled several times over
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    watch.wait_for(lambda: len(watch.shipped()) == 1, what="checkpoint-10 to ship")
    time.sleep(0.5)
    assert watch.finish() == 0, watch.err
    with Vault.open(repo) as vault:
        snaps = vault.snapshots({"run": "hf"})
        assert len(snaps) == 1 and "trainer_state.json" in {e.path for e in vault.files(snaps[0])}


def test_a_long_watch_keeps_no_record_of_checkpoints_rotated_away(tmp_path, vault, monkeypatch):
    """A sidecar beside a weeks-long run: what it remembers of shipped checkpoints (their files, to
    notice a new version) stays with those still in the folder, not with every one ever shipped."""
    from ckptvault.ops import watch as watch_module

    watchers = []
    run = watch_module.Watcher.run
    monkeypatch.setattr(watch_module.Watcher, "run", lambda self: (watchers.append(self), run(self))[1])
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    stop = threading.Event()
    worker = threading.Thread(target=lambda: vault.watch(ckpts, settle=0.05, interval=0.05, stop=stop))
    worker.start()
    for step in range(12):
        tmp = ckpts / f"tmp-{step}"
        tmp.mkdir()
        (tmp / "model.bin").write_bytes(b"%d" % step)
        os.rename(tmp, ckpts / f"step_{step}")
        if step >= 2:
            shutil.rmtree(ckpts / f"step_{step - 2}")  # keep the last two
        deadline = time.monotonic() + 30
        while len(vault.snapshots()) < step + 1:
            assert time.monotonic() < deadline, "step did not ship"
            time.sleep(0.05)
    time.sleep(0.3)  # a few polls after the last rotation
    stop.set()
    worker.join(30)
    assert sorted(watchers[0]._done) == ["step_10", "step_11"]


def test_more_checkpoints_waiting_than_open_files_allowed_all_ship(tmp_path, repo):
    """A watcher started on a run folder holding many unshipped checkpoints keeps no descriptor per
    checkpoint: with a low limit on open files, every one is pinned and ships."""
    import resource

    ckpts = tmp_path / "ckpts"
    for step in range(60):
        (ckpts / f"step_{step}").mkdir(parents=True)
        (ckpts / f"step_{step}" / "model.bin").write_bytes(b"%d" % step)

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    done = subprocess.run(
        [sys.executable, "-m", "ckptvault", "watch", str(ckpts), "--repo", repo, "--tag", "run=n", "--once"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=low_limit,
    )
    assert done.returncode == 0, done.stderr
    with Vault.open(repo) as vault:
        assert len(vault.snapshots({"run": "n"})) == 60


def test_a_pin_whose_files_were_copied_after_it_was_made_is_not_taken_for_a_replaced_folder(tmp_path, repo):
    """--state-dir on another filesystem: pins are copies. A folder pinned while still empty, whose
    files were copied in later, then a watcher killed: the restart must take the folder for the same
    checkpoint (copies share no inode with it) and ship it once, whole."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the tests' folder")
    state = shm / f"ckptvault-test-{os.getpid()}-{time.monotonic_ns()}"
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    try:
        watch = WatchProcess(
            str(ckpts), "--repo", repo, "--tag", "run=s", "--settle", "30", "--state-dir", str(state), "--json"
        )
        folder = ckpts / "step_100"
        folder.mkdir()  # the trainer makes the folder, then writes into it
        watch.wait_for(lambda: "step_100" in pinned_names(state / "pins"), what="the empty folder's pin")
        model = os.urandom(100_000)
        (folder / "model.bin").write_bytes(model)
        watch.wait_for(lambda: any((state / "pins").glob("*/data/step_100/model.bin")), what="model.bin copied")
        watch.proc.kill()
        watch.proc.wait(30)
        optimizer = os.urandom(50_000)
        (folder / "optimizer.bin").write_bytes(optimizer)  # the save goes on while no watcher runs
        args = ["watch", str(ckpts), "--repo", repo, "--tag", "run=s", "--once", "--settle", "0.2"]
        again = subprocess.run(
            [sys.executable, "-m", "ckptvault", *args, "--state-dir", str(state)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert again.returncode == 0, again.stderr
        with Vault.open(repo) as vault:
            got = [restored_files(vault, s) for s in vault.snapshots({"run": "s"})]
        assert got == [{"model.bin": model, "optimizer.bin": optimizer}]
    finally:
        shutil.rmtree(state, ignore_errors=True)


def _hand_driven_watcher(ckpts: Path, settle: float, on_warning=None):
    """A Watcher driven by hand (``_scan``, ``_settle``, ``_promote``): it ships nothing by itself."""
    from ckptvault.ops import watch as watching

    watcher = watching.Watcher(
        str(ckpts),
        tags={"run": "r"},
        ship=lambda job: pytest.fail("driven by hand"),
        shipped_digests=lambda: (),
        options=watching.WatchOptions(interval=0.1, settle=settle),
        on_warning=on_warning,
    )
    os.makedirs(watcher.pins_dir)
    return watcher


def _looking_watcher(ckpts: Path, on_warning=None):
    """A hand-driven Watcher after its first look; nothing settles (60 s)."""
    watcher = _hand_driven_watcher(ckpts, 60, on_warning)
    watcher._scan(time.monotonic())
    return watcher


def _watcher_thread(vault: Vault, ckpts: Path, ship=None, **options):
    """``Vault.watch``'s Watcher on a thread, shipping through ``ship`` (default: the vault's own),
    its warnings collected."""
    from ckptvault.ops import watch as watching

    warnings: list[str] = []
    stop = threading.Event()
    watcher = watching.Watcher(
        str(ckpts),
        tags={"run": "r"},
        ship=ship or vault._run_job,
        shipped_digests=lambda: (),
        options=watching.WatchOptions(**options),
        stop=stop,
        on_warning=warnings.append,
    )
    thread = threading.Thread(target=watcher.run, daemon=True)
    thread.start()
    return watcher, stop, thread, warnings


def _wait(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _head(vault: Vault, snapshot, path: str) -> bytes:
    return b"".join(vault.read_file(snapshot, path))[:6]


def test_saves_of_one_name_commit_in_the_order_they_were_saved_after_an_outage(tmp_path, vault, monkeypatch):
    """``ckpt.pt`` saved again and again (no step in its name: 'latest' goes by snapshot time) while
    the storage was down: the saves that failed were retried on their own delays and committed after
    a save made once the storage was back, so `restore latest` gave an old one. A snapshot's time is
    now when its checkpoint was pinned."""
    from ckptvault.errors import StorageError
    from ckptvault.ops import watch as watching

    monkeypatch.setattr(watching, "RETRY_AFTER", (1.5, 3.0, 6.0, 6.0))
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    down = threading.Event()
    down.set()
    tried: list[bytes] = []

    def ship(job):
        tried.append((Path(job.sources[0])).read_bytes()[:6])
        if down.is_set():
            raise StorageError("the storage is down (a test's outage)")
        return vault._run_job(job)

    def save(step: int) -> None:
        (ckpts / "ckpt.pt.tmp").write_bytes(b"step%02d" % step + os.urandom(1000))
        os.replace(ckpts / "ckpt.pt.tmp", ckpts / "ckpt.pt")

    _, stop, thread, _ = _watcher_thread(vault, ckpts, ship=ship, interval=0.02, settle=0.2)
    try:
        save(1)
        _wait(lambda: tried, "save 1 tried")  # and failed: tried again in 1.5 s
        save(2)
        _wait(lambda: len(tried) == 2, "save 2 tried")  # and failed
        down.clear()
        save(3)  # the storage is back: 3 is ready long before save 1 is tried again
        _wait(lambda: len(vault.snapshots()) == 3, "three snapshots")
    finally:
        stop.set()
        thread.join(30)
    assert tried[2] == b"step03", tried  # committed first: 1 and 2 waited out their retry delay
    by_time = [_head(vault, s, "ckpt.pt") for s in sorted(vault.snapshots(), key=lambda s: s.time)]
    assert by_time == [b"step01", b"step02", b"step03"]
    assert _head(vault, vault.latest({"run": "r"}), "ckpt.pt") == b"step03"


def test_a_file_saved_in_place_more_often_than_settle_is_said_never_to_ship(tmp_path, vault):
    """``torch.save`` over the same ``last.ckpt`` (or a copy into it) every 0.2 s with --settle 0.5: it
    never stays unchanged for --settle, so it never shipped, and nothing said so. (Said after 5 s.)"""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    _, stop, thread, warnings = _watcher_thread(vault, ckpts, interval=0.02, settle=0.5)
    try:
        for step in range(35):
            with open(ckpts / "last.ckpt", "wb") as f:  # in place: the same inode
                f.write(b"step%02d" % step + os.urandom(100_000))
            time.sleep(0.2)
        _wait(lambda: any("saved again in place" in w for w in warnings), "the warning")
        growing = ckpts / "growing.bin"  # a slow writer only adds: never taken for a save in place
        for _ in range(8):
            with open(growing, "ab") as f:
                f.write(os.urandom(10_000))
            time.sleep(0.2)
        _wait(lambda: len(vault.snapshots()) == 2, "both shipped once they settled")
    finally:
        stop.set()
        thread.join(30)
    told = [w for w in warnings if "saved again in place" in w]
    assert len(told) == 1 and told[0].startswith("last.ckpt was saved again in place"), warnings
    assert "lower settle" in told[0]


def test_new_checkpoints_are_seen_while_slow_pins_are_looked_at(tmp_path, monkeypatch):
    """Each look at a settling pin walks it (a sync, a signature): with pins of thousands of files the
    loop took 1.4 s against --interval 0.1, and a checkpoint that lived 0.7 s was never seen. New names
    are now looked for between pins; and a pin whose folder went is not walked again."""
    from ckptvault.ops import pin as pins

    ckpts = tmp_path / "ckpts"
    for n in range(3):
        (ckpts / f"step_{n}").mkdir(parents=True)
        (ckpts / f"step_{n}" / "model.pt").write_bytes(b"x")
    watcher = _looking_watcher(ckpts)
    assert len(watcher._candidates) == 3
    real_sync, synced = pins.sync, []

    def slow_sync(pin, **kwargs):  # a pin of thousands of files
        synced.append(pin.name)
        time.sleep(0.15)
        return real_sync(pin, **kwargs)

    monkeypatch.setattr(pins, "sync", slow_sync)
    (ckpts / "step_3").mkdir()
    (ckpts / "step_3" / "model.pt").write_bytes(b"y")
    watcher._settle(time.monotonic())
    assert "step_3" in {c.pin.name for c in watcher._candidates.values()}, "seen during the slow look"
    shutil.rmtree(ckpts / "step_0")
    synced.clear()
    for _ in range(3):
        watcher._settle(time.monotonic())
    assert synced.count("step_0") == 1 and synced.count("step_1") == 3  # one last look at the pin, then none
    assert "step_0" in {c.pin.name for c in watcher._candidates.values()}  # still to ship


def test_pinning_by_copying_is_said_once(tmp_path, vault):
    """Hard links refused (the state folder on another filesystem): said once per run, not per
    checkpoint."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a second filesystem (/dev/shm) for the staging folder")
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    state = shm / f"ckptvault-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        watcher, stop, thread, warnings = _watcher_thread(vault, ckpts, interval=0.02, settle=0.2, state_dir=str(state))
        try:
            for n, step in enumerate((100, 200, 300), start=1):
                publish(str(ckpts), step, 4096)
                _wait(lambda n=n: len(watcher.result.shipped) == n, f"step {step} shipped")
        finally:
            stop.set()
            thread.join(30)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    assert sum("pinned by copying" in w for w in warnings) == 1, warnings


def test_a_backlog_of_pins_on_another_disk_filling_it_is_said(tmp_path, vault):
    """Uploads slower than saves: every checkpoint waits, pinned (copies on the --state-dir disk), until
    that disk is full and pins fail. Nothing said so; nothing is dropped there (no save needs that room)."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    with mounted_tmpfs(tmp_path / "mnt", "4m", "the backlog disk test") as mount:
        release = threading.Event()

        def slow_ship(job):
            release.wait(60)
            return vault._run_job(job)

        _, stop, thread, warnings = _watcher_thread(
            vault, ckpts, ship=slow_ship, interval=0.02, settle=0.1, state_dir=str(mount / "state")
        )
        try:
            step = 0
            while os.statvfs(mount).f_bavail > 0.08 * os.statvfs(mount).f_blocks:  # pins would fail soon
                step += 1  # 0.25 MB each, the one before deleted: the pins keep them all
                (ckpts / "next.tmp").write_bytes(os.urandom(250_000))
                os.replace(ckpts / "next.tmp", ckpts / f"step_{step}.pt")
                with contextlib.suppress(FileNotFoundError):
                    (ckpts / f"step_{step - 1}.pt").unlink()
                time.sleep(0.15)
            _wait(lambda: any("wait to ship" in w for w in warnings), "the warning")
            release.set()
            _wait(lambda: len(vault.snapshots()) == step, "every save shipped")
        finally:
            release.set()
            stop.set()
            thread.join(60)
    told = [w for w in warnings if "wait to ship" in w]
    assert len(told) == 1 and "free, room for" in told[0] and "state_dir" in told[0], warnings
    assert not [w for w in warnings if "dropped" in w]


def test_the_backlog_warning_counts_saves_the_disk_has_room_for_not_a_share_of_it(tmp_path, vault, monkeypatch):
    """A 10 % floor warned "90% full" on a volume with 25 GB free for checkpoints of 650 MB (and its
    share was not df's); a small disk with checkpoints larger than a tenth of it was never warned of."""
    ckpts, state = tmp_path / "ckpts", tmp_path / "state"
    ckpts.mkdir()
    free = [50 << 30]  # of 1 TiB: 5 %, and room for 200,000 saves of 250 kB
    real_statvfs = os.statvfs

    def statvfs(path):
        if not str(path).startswith(str(state)):
            return real_statvfs(path)
        return os.statvfs_result((4096, 4096, (1 << 40) // 4096, free[0] // 4096, free[0] // 4096, 0, 0, 0, 0, 255))

    monkeypatch.setattr(os, "statvfs", statvfs)
    release = threading.Event()

    def slow_ship(job):
        release.wait(60)
        return vault._run_job(job)

    watcher, stop, thread, warnings = _watcher_thread(
        vault, ckpts, ship=slow_ship, interval=0.02, settle=0.1, state_dir=str(state)
    )
    try:
        for step in (1, 2, 3):
            (ckpts / f"step_{step}.pt").write_bytes(os.urandom(250_000))
        _wait(lambda: len(watcher._candidates) == 3, "three checkpoints pinned")
        time.sleep(0.5)  # many looks at the disk
        assert not [w for w in warnings if "wait to ship" in w], warnings
        free[0] = 245 * 4096  # 1 MB: room for 4 saves of 250 kB
        _wait(lambda: any("wait to ship" in w for w in warnings), "the warning")
    finally:
        release.set()
        stop.set()
        thread.join(60)
    told = [w for w in warnings if "wait to ship" in w]
    assert len(told) == 1 and "has 1.00 MB free, room for 4 more save(s) of 250.00 KB" in told[0], told


def test_a_backlog_of_pins_never_fills_the_trainers_disk(tmp_path, vault):
    """Uploads slower than saves, pins beside the checkpoints: they kept every file the trainer's rotation
    deleted until the disk was full and the trainer's next save failed (ENOSPC ends training). The oldest
    waiting ones are dropped, unshipped, to keep room for a save; the newest and the one shipping ship."""
    with mounted_tmpfs(tmp_path / "mnt", "4m", "the backlog disk test") as mount:
        ckpts = mount / "ckpts"
        ckpts.mkdir()
        release = threading.Event()

        def slow_ship(job):
            release.wait(60)
            return vault._run_job(job)

        watcher, stop, thread, warnings = _watcher_thread(vault, ckpts, ship=slow_ship, interval=0.02, settle=0.1)
        try:
            for step in range(1, 41):  # 10 MB of saves through a 4 MiB disk, 0.25 MB each
                (ckpts / "next.tmp").write_bytes(os.urandom(250_000))  # ENOSPC here fails the test
                os.replace(ckpts / "next.tmp", ckpts / f"step_{step}.pt")
                with contextlib.suppress(FileNotFoundError):
                    (ckpts / f"step_{step - 1}.pt").unlink()
                time.sleep(0.15)
            _wait(lambda: any("step_40.pt" in c.pin.name for c in watcher._candidates.values()), "the last pin")
            release.set()
            _wait(lambda: not watcher._candidates, "what is left shipped")
        finally:
            release.set()
            stop.set()
            thread.join(60)
    dropped = [w for w in warnings if "dropped without shipping it" in w]
    shipped = {s.tags["checkpoint"] for s in vault.snapshots()}
    assert dropped and "state_dir" in dropped[0], warnings
    assert {"step_1.pt", "step_40.pt"} <= shipped  # the one shipping when the disk filled, and the newest
    assert len(shipped) + len(dropped) == 40 and len(watcher.result.dropped) == len(dropped)
    assert len(watcher.result.errors) == len(dropped)  # each an error of the run (exit 3)
    assert vault.latest({"run": "r"}).tags["step"] == "40"


def test_checkpoints_deleted_before_they_settle_ship_while_training_runs_on_a_tight_disk(tmp_path, vault):
    """tr43 #5: saves closer than --settle on a disk that holds the trainer's saves and few pins: each
    checkpoint was deleted by the rotation before it settled, so the room-maker dropped every one (none was
    ever complete) and nothing shipped while training ran. A deleted checkpoint's pin can change no more, so
    it is settled at once; and while one ships, the newest complete one is dropped too when room is short
    (keeping it beside the one shipping failed the trainer's next save)."""
    with mounted_tmpfs(tmp_path / "mnt", "4m", "the tight disk test") as mount:
        ckpts = mount / "ckpts"
        ckpts.mkdir()
        training = threading.Event()
        training.set()
        shipped_while_training: list[str] = []

        def slow_ship(job):
            time.sleep(0.3)
            if training.is_set():
                shipped_while_training.append(job.tags["checkpoint"])
            return vault._run_job(job)

        watcher, stop, thread, warnings = _watcher_thread(vault, ckpts, ship=slow_ship, interval=0.02, settle=2.0)
        try:
            for step in range(1, 61):  # 0.6 MB saves every ~0.1 s, two kept: each deleted 0.2 s after it is saved
                (ckpts / "next.tmp").write_bytes(os.urandom(600_000))  # ENOSPC here fails the test
                os.replace(ckpts / "next.tmp", ckpts / f"step_{step}.pt")
                with contextlib.suppress(FileNotFoundError):
                    (ckpts / f"step_{step - 2}.pt").unlink()
                time.sleep(0.1)
            training.clear()
            _wait(lambda: not watcher._candidates, "what is left shipped")
        finally:
            stop.set()
            thread.join(60)
    dropped = [w for w in warnings if "dropped without shipping it" in w]
    assert dropped, warnings  # the disk was tight: it holds 6 saves
    assert len(shipped_while_training) >= 4, (shipped_while_training, len(dropped))
    assert vault.latest({"run": "r"}).tags["step"] == "60"


def test_a_candidate_dropped_by_a_look_between_pins_is_not_pinned_again(tmp_path):
    """The look for new names between slow pins may drop a candidate (a Hugging Face Trainer's output
    folder found: its `runs/` logs are not a checkpoint); the settling went on with it, and the sync
    made its released pin again, without metadata, holding the logs' files until a restart."""

    ckpts = tmp_path / "out"
    (ckpts / "runs").mkdir(parents=True)
    (ckpts / "runs" / "events.out.tfevents.1").write_bytes(b"x" * 1000)
    (ckpts / "checkpoint-10").mkdir()
    (ckpts / "checkpoint-10" / "model.safetensors").write_bytes(b"m" * 1000)
    watcher = _looking_watcher(ckpts)
    assert sorted(c.pin.name for c in watcher._candidates.values()) == ["checkpoint-10", "runs"]
    (ckpts / "checkpoint-10" / "trainer_state.json").write_text('{"global_step": 10}')  # the Trainer's last file
    time.sleep(0.15)  # an interval since the last look: the settling looks for new names first
    watcher._settle(time.monotonic())
    assert [c.pin.name for c in watcher._candidates.values()] == ["checkpoint-10"]
    roots = sorted(Path(watcher.pins_dir).iterdir())
    assert [(root / "pin.json").exists() for root in roots] == [True], [list(r.rglob("*")) for r in roots]


def test_what_was_pinned_before_a_pointer_file_showed_a_save_folder_is_dropped(tmp_path):
    """DeepSpeed writes zero_to_fp32.py into its save folder before the first step folder and its `latest`
    pointer: once they show the folder's kind, the script pinned before is dropped, not shipped as a
    snapshot without a step (which `latest` of the run would then go by time for)."""
    ckpts = tmp_path / "out"
    ckpts.mkdir()
    (ckpts / "zero_to_fp32.py").write_text("# the script DeepSpeed writes beside its step folders")
    watcher = _looking_watcher(ckpts)
    assert [c.pin.name for c in watcher._candidates.values()] == ["zero_to_fp32.py"]
    (ckpts / "global_step10").mkdir()
    (ckpts / "global_step10" / "mp_rank_00_model_states.pt").write_bytes(b"m" * 1000)
    (ckpts / "latest").write_text("global_step10")
    time.sleep(0.15)  # an interval since the last look: the settling looks for new names first
    watcher._settle(time.monotonic())
    assert [c.pin.name for c in watcher._candidates.values()] == ["global_step10"]


def test_a_pin_is_synced_again_when_its_folder_comes_back(tmp_path):
    """A folder moved aside and back while it is written (same inode): its pin stops being looked at
    while it is away, and is synced again once it is back, not shipped without the files written after."""

    ckpts = tmp_path / "ckpts"
    (ckpts / "step_1").mkdir(parents=True)
    (ckpts / "step_1" / "model.pt").write_bytes(b"m" * 1000)
    watcher = _looking_watcher(ckpts)
    (cand,) = watcher._candidates.values()
    os.rename(ckpts / "step_1", tmp_path / "aside")
    watcher._settle(time.monotonic())
    assert cand.frozen
    os.rename(tmp_path / "aside", ckpts / "step_1")
    (ckpts / "step_1" / "optimizer.pt").write_bytes(b"o" * 1000)
    watcher._settle(time.monotonic())
    assert not cand.frozen and sorted(os.listdir(cand.pin.data)) == ["model.pt", "optimizer.pt"]


def test_a_checkpoint_deleted_while_it_is_pinned_is_said_to_be_lost(tmp_path, monkeypatch):
    """A rotation that deletes a checkpoint while its pin is being made (many files, a slow machine):
    the part-made pin is refused, and that was silent: a checkpoint lost, exit 0, nothing said."""
    ckpts = tmp_path / "ckpts"
    (ckpts / "global_step10").mkdir(parents=True)
    for i in range(6):
        (ckpts / "global_step10" / f"part_{i}.pt").write_bytes(b"x" * 100)
    at_file_linked(monkeypatch, 3, lambda: shutil.rmtree(ckpts / "global_step10"))
    warnings: list[str] = []
    watcher = _looking_watcher(ckpts, warnings.append)  # its first look pins it, and it goes meanwhile
    assert not watcher._candidates and not os.listdir(watcher.pins_dir)
    assert [w for w in warnings if "deleted while it was being pinned" in w] == [
        "global_step10 was deleted while it was being pinned: part of it was gone, so it is not shipped (a "
        "checkpoint must stay at least one interval after it is written, and pinning one of many files takes longer)"
    ]


def test_a_backlog_of_checkpoints_ships_the_newest_next(tmp_path, vault):
    """Uploads slower than saves: the checkpoints waiting were all queued, oldest first, so the newest
    (a preemption's last save) waited behind the whole backlog and went with the machine. The newest
    ready one now ships as soon as the running upload ends, then the others (every other one the oldest:
    see the next test); snapshot times still follow the steps."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    slow = threading.Event()
    started: list[str] = []

    def ship(job):
        started.append(job.label)
        if len(started) == 1:
            assert slow.wait(60), "never let go"
        return vault._run_job(job)

    watcher, stop, thread, _ = _watcher_thread(vault, ckpts, ship=ship, interval=0.02, settle=0.2)

    def all_ready() -> bool:
        now = time.monotonic()
        pinned = list(watcher._candidates.values())
        return len(pinned) == 4 and all(c.state == "queued" or now - c.last_change >= 0.2 for c in pinned)

    try:
        for step in (100, 200, 300, 400):
            (ckpts / f"step_{step}").mkdir()
            (ckpts / f"step_{step}" / "model.pt").write_bytes(b"%d" % step + os.urandom(1000))
            if step == 100:
                _wait(lambda: started, "the first upload")
        _wait(all_ready, "three checkpoints ready behind the upload")
        assert started == ["step_100"]
        slow.set()
        _wait(lambda: len(vault.snapshots()) == 4, "all four shipped")
    finally:
        slow.set()
        stop.set()
        thread.join(30)
    assert started == ["step_100", "step_400", "step_200", "step_300"]  # then every other one the oldest
    by_time = [s.tags["step"] for s in sorted(vault.snapshots(), key=lambda s: s.time)]
    assert by_time == ["100", "200", "300", "400"]
    assert vault.latest({"run": "r"}).tags["step"] == "400"
    assert pin_count(ckpts / ".ckptvault-watch" / "pins") == 0


@pytest.mark.parametrize("stopping", [False, True])
def test_a_backlog_behind_a_save_made_again_and_again_still_ships(tmp_path, stopping):
    """Uploads slower than saves, and `last.ckpt` saved again every epoch: it is always the newest ready
    checkpoint, so with newest first alone the step-named ones (and the disk their pins hold) waited for
    as long as training ran. Every other upload now goes to the oldest waiting; once stopped (the grace
    after a preemption) the newest goes first, always."""
    from ckptvault.ops import pin as pins
    from ckptvault.ops import watch_candidate

    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    watcher = _hand_driven_watcher(ckpts, 0)
    watcher._shipped.loaded.set()
    if stopping:
        watcher._stop.set()
    submitted: list[str] = []

    class Shipper:
        def submit(self, job, on_full):
            submitted.append(job.label)

    def save(name: str) -> None:
        (ckpts / name).write_bytes(os.urandom(100))
        pin = pins.create(str(ckpts / name), watcher.pins_dir)
        watcher._candidates[pin.pin_id] = watch_candidate.Candidate(pin=pin, seen=0.0, last_change=0.0)

    save("step_100.ckpt")
    for _epoch in range(4):
        save("last.ckpt")  # each upload takes longer than an epoch: a new save is pinned meanwhile
        watcher._promote(Shipper(), time.monotonic())
        watcher._release(next(c for c in watcher._candidates.values() if c.state == "queued"))
    if stopping:
        assert submitted == ["last.ckpt"] * 4
    else:
        assert submitted == ["last.ckpt", "step_100.ckpt", "last.ckpt", "last.ckpt"]


def test_once_tries_a_checkpoint_saved_in_place_during_its_upload_once(tmp_path, vault, monkeypatch):
    """`watch --once --settle 0` on a file saved again in place during each upload: each superseded
    backup was promoted again in the same run, so the cron job never ended while the saves went on.
    It is left for the next run, as before one backup at a time."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    (ckpts / "last.ckpt").write_bytes(b"0" * 10_000)
    stop = threading.Event()
    tries: list[int] = []
    real = vault._run_job

    def run_job(job):
        tries.append(1)
        if len(tries) >= 5:
            stop.set()  # what a user's Ctrl-C would do
        with open(ckpts / "last.ckpt", "r+b") as f:  # the trainer saves in place meanwhile
            f.write(b"%d" % len(tries))
        return real(job)

    monkeypatch.setattr(vault, "_run_job", run_job)
    warnings: list[str] = []
    result = vault.watch(ckpts, once=True, settle=0, stop=stop, on_warning=warnings.append)
    assert len(tries) == 1 and not result.shipped, (tries, warnings)
    assert any("last.ckpt" in w for w in warnings), warnings


def test_a_checkpoint_shipping_in_place_goes_before_newer_pinned_ones(tmp_path):
    """On a full disk a checkpoint ships in place: nothing pins it, so the trainer's rotation (oldest
    first) may delete it at any moment, while pinned ones wait safely. Newest first made it wait behind
    every newer pinned checkpoint (more of them lost); it now goes first."""
    from ckptvault.ops import pin as pins
    from ckptvault.ops import watch_candidate

    ckpts = tmp_path / "ckpts"
    for step in (100, 200):
        (ckpts / f"step_{step}").mkdir(parents=True)
        (ckpts / f"step_{step}" / "model.pt").write_bytes(b"%d" % step)
    watcher = _hand_driven_watcher(ckpts, 0)
    watcher._shipped.loaded.set()
    in_place = pins.stand_in(str(ckpts / "step_100"), watcher.pins_dir)  # its disk was full then
    pinned = pins.create(str(ckpts / "step_200"), watcher.pins_dir)  # room again for the newer one
    for pin in (in_place, pinned):
        watcher._candidates[pin.pin_id] = watch_candidate.Candidate(pin=pin, seen=0.0, last_change=0.0)
    submitted: list[str] = []

    class Shipper:
        def submit(self, job, on_full):
            submitted.append(job.label)

    watcher._promote(Shipper(), time.monotonic())
    assert submitted == ["step_100"]
    pinned.release()


def test_looks_for_new_checkpoints_later_than_the_interval_are_said_once(tmp_path):
    """A checkpoint must exist for one look's gap to be seen: looks far later than --interval (a busy
    machine, a slow folder) silently widened that window; the first such gap is now said, with its length."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    warnings: list[str] = []
    watcher = _hand_driven_watcher(ckpts, 0, warnings.append)
    for pause in (0, 0.3, 0.6, 1.3, 1.3, 0):
        time.sleep(pause)
        watcher._scan(time.monotonic())
    (told,) = warnings
    assert float(told.split()[0]) >= 1.3 and " s passed between two looks" in told and "interval is 0.1 s" in told


def test_a_settled_pin_waiting_behind_an_upload_is_looked_at_once_a_second(tmp_path, monkeypatch):
    """Every settled pin waiting behind an upload was walked at every look (--interval 0.1 s): a backlog of
    four DeepSpeed-like pins of 1,000 files each kept a quarter of a core busy, beside the trainer. It is now
    looked at once a second while an upload runs; a file added meanwhile still unsettles it."""
    from ckptvault.ops import pin as pins
    from ckptvault.ops import watch as watching
    from ckptvault.ops import watch_candidate

    ckpts = tmp_path / "ckpts"
    for step in (100, 200):
        (ckpts / f"step_{step}").mkdir(parents=True)
        for i in range(20):
            (ckpts / f"step_{step}" / f"shard_{i}.pt").write_bytes(b"%d" % step)
    watcher = _hand_driven_watcher(ckpts, 0)
    watcher._scan(time.monotonic())
    by_name = {c.pin.name: c for c in watcher._candidates.values()}
    uploading, waiting = by_name["step_100"], by_name["step_200"]
    walks: list[str] = []
    real = pins.signature
    monkeypatch.setattr(pins, "signature", lambda path, *a, **k: walks.append(path) or real(path, *a, **k))

    def looks(seconds: float) -> int:
        walks.clear()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            watcher._settle(time.monotonic())
            time.sleep(0.02)
        return sum(1 for path in walks if path.startswith(waiting.pin.root))

    assert looks(0.3) >= 5  # nothing uploading: every look
    assert waiting.steady and waiting.state == "settling"
    uploading.state = "queued"
    assert looks(0.5) <= 1  # settled, behind an upload: at most once a second
    assert 1 <= looks(0.8) <= 2
    (ckpts / "step_200" / "late.pt").write_bytes(b"written after it settled")
    written = time.monotonic()
    time.sleep(watching.LOOK_INSIDE_S)
    looks(0.1)
    assert "late.pt" in os.listdir(waiting.pin.data)  # pinned
    assert "late.pt" in watch_candidate.file_paths(waiting.sig) and waiting.last_change > written  # it settled again
    for cand in list(watcher._candidates.values()):
        cand.pin.release()


@pytest.mark.parametrize(
    "case", ["plenty_free", "freed_late", "short_of_half_a_save", "newest_being_written", "while_one_ships"]
)
def test_making_room_drops_only_what_a_save_needs(tmp_path, monkeypatch, case):
    """Review of the first version: a 10 % floor dropped every deleted checkpoint on a big volume 91 % full of
    other data with hundreds of GB free; re-reading statvfs after each drop dropped them all where space is
    freed late (Lustre, ZFS, btrfs); and the newest waiting one, a save still being written, was kept while
    the complete save before it went."""
    import collections

    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    watcher = _hand_driven_watcher(ckpts, 0.5)
    watcher._room._beside_checkpoints = True
    for step in (1, 2, 3, 4):
        (ckpts / f"step_{step}.pt").write_bytes(os.urandom(1_000_000))
        watcher._scan(time.monotonic())
        time.sleep(0.01)
    for step in (1, 2, 3):
        (ckpts / f"step_{step}.pt").unlink()  # the trainer's rotation
    watcher._settle(time.monotonic())
    now = time.monotonic() + 60  # all settled
    if case in ("newest_being_written", "while_one_ships"):  # step_4 grows to 3 MB: a save needs 4.5 MB of room
        with open(ckpts / "step_4.pt", "ab") as f:
            f.write(os.urandom(2_000_000))
        watcher._settle(time.monotonic())
        max(watcher._candidates.values(), key=lambda c: c.pin.pin_id).last_change = now  # still growing
    if case == "while_one_ships":
        min(watcher._candidates.values(), key=lambda c: c.pin.pin_id).state = "queued"  # step_1 ships
    vfs = collections.namedtuple("vfs", "f_frsize f_blocks f_bavail")
    blocks = {"plenty_free": 90_000_000, "freed_late": 244, "short_of_half_a_save": 300}
    free_blocks = blocks.get(case, 0)
    real = os.statvfs
    monkeypatch.setattr(
        os, "statvfs", lambda p: vfs(4096, 1_000_000_000, free_blocks) if str(ckpts) in str(p) else real(p)
    )
    watcher._room.make_room(now)
    dropped = watcher.result.dropped
    if case == "plenty_free":
        assert dropped == []  # 368 GB free: room for any save of 1 MB
    elif case == "freed_late":
        assert dropped == ["step_1.pt"]  # 1 MB freed (counted at once) + 1 MB free >= 1.5 MB
    elif case == "short_of_half_a_save":
        assert dropped == ["step_1.pt"]  # 1.2 MB free: room for the save itself, not for 1.5 times it
    elif case == "newest_being_written":
        assert dropped == ["step_1.pt", "step_2.pt"], dropped  # step_3, the newest complete save, is kept
    else:  # step_1 ships: step_3, the newest complete one, goes too (kept, the trainer's next save would fail)
        assert dropped == ["step_2.pt", "step_3.pt"], dropped
    for cand in list(watcher._candidates.values()):
        cand.pin.release()


@pytest.mark.parametrize("case", ["only_two_waiting", "older_still_in_the_folder"])
def test_making_room_keeps_what_dropping_would_not_help(tmp_path, monkeypatch, case):
    """On a disk with no room at all: with only two checkpoints waiting, neither is dropped (the newest, and
    the newest complete one, may be a save being written and the one a resume needs); and a checkpoint still
    in the folder is never dropped, even one whose pin holds a file the trainer replaced there (its pin
    would free that file, but the checkpoint would be pinned again and never ship)."""
    import collections

    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    watcher = _hand_driven_watcher(ckpts, 0.5)
    watcher._room._beside_checkpoints = True
    steps = (1, 2) if case == "only_two_waiting" else (1, 2, 3, 4)
    for step in steps:
        (ckpts / f"step_{step}").mkdir()
        (ckpts / f"step_{step}" / "model.pt").write_bytes(os.urandom(1_000_000))
        watcher._scan(time.monotonic())
        time.sleep(0.01)
    watcher._settle(time.monotonic())  # what each holds: the largest says what a save needs
    if case == "only_two_waiting":
        shutil.rmtree(ckpts / "step_1")
    else:  # step_1's file is saved again by a rename: the folder is still there, its pin holds the old file
        (ckpts / "step_1" / "new.tmp").write_bytes(os.urandom(1_000_000))
        os.replace(ckpts / "step_1" / "new.tmp", ckpts / "step_1" / "model.pt")
        for step in (2, 3):
            shutil.rmtree(ckpts / f"step_{step}")
    vfs = collections.namedtuple("vfs", "f_frsize f_blocks f_bavail")
    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: vfs(4096, 1_000_000_000, 0) if str(ckpts) in str(p) else real(p))
    watcher._room.make_room(time.monotonic() + 60)  # all settled
    assert watcher.result.dropped == ([] if case == "only_two_waiting" else ["step_2", "step_3"])
    for cand in list(watcher._candidates.values()):
        cand.pin.release()


def test_making_room_releases_a_pin_an_earlier_run_shipped_without_calling_it_lost(tmp_path, monkeypatch):
    """A pin adopted from an earlier run whose snapshot the vault already holds is released to make room:
    nothing is lost, so it is neither counted as dropped nor said as lost."""
    import collections

    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    warnings: list[str] = []
    watcher = _hand_driven_watcher(ckpts, 0.5, warnings.append)
    watcher._room._beside_checkpoints = True
    for step in (1, 2, 3, 4):
        (ckpts / f"step_{step}.pt").write_bytes(os.urandom(1_000_000))
        watcher._scan(time.monotonic())
        time.sleep(0.01)
    watcher._settle(time.monotonic())
    first = min(watcher._candidates.values(), key=lambda c: c.pin.pin_id)
    watcher._shipped.add(first.pin.name, watcher._digest(watcher._signature(first.pin)))  # shipped before
    for step in (1, 2, 3):
        (ckpts / f"step_{step}.pt").unlink()
    vfs = collections.namedtuple("vfs", "f_frsize f_blocks f_bavail")
    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: vfs(4096, 1_000_000_000, 244) if str(ckpts) in str(p) else real(p))
    watcher._room.make_room(time.monotonic() + 60)
    assert watcher.result.dropped == [] and not any("step_1" in w for w in warnings), warnings
    assert sorted(c.pin.name for c in watcher._candidates.values()) == ["step_2.pt", "step_3.pt", "step_4.pt"]
    for cand in list(watcher._candidates.values()):
        cand.pin.release()


def test_a_checkpoint_pinned_after_shipping_in_place_is_known_by_its_pin(tmp_path, monkeypatch):
    """Shipping in place, a checkpoint is pinned once the disk has room again: from then on the watcher knows
    it by that pin alone (its stand-in is forgotten), so shipping or dropping it forgets it for good."""
    from ckptvault.ops import pin as pins

    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    (ckpts / "step_100.pt").write_bytes(os.urandom(100_000))
    watcher = _hand_driven_watcher(ckpts, 60)
    watcher._shipped.start_loading()
    assert watcher._shipped.loaded.wait(10)
    real = pins.create

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pins, "create", disk_full)
    watcher._scan(time.monotonic())
    (cand,) = watcher._candidates.values()
    assert cand.pin.in_place
    monkeypatch.setattr(pins, "create", real)  # room again
    watcher._settle(cand.pin_retry_at)
    assert not cand.pin.in_place and list(watcher._candidates) == [cand.pin.pin_id]
    watcher._release(cand)
    assert watcher._candidates == {} and not os.path.exists(cand.pin.root)


def test_a_file_deleted_while_a_pin_switches_to_shipping_in_place_keeps_the_pin_never_ships_torn(tmp_path, monkeypatch):
    """A pin that cannot take in a file written later (a full --state-dir disk) ships in place, if its folder
    still holds every file the pin does. The folder was read twice: once for that check, once more for what
    shipping in place starts from; a file deleted between the two reads was in neither the check's failure nor
    the baseline, so the checkpoint shipped in place without it, silently torn, and the pin holding the only
    copy of it was released. The hook here deletes it just then (as the stand-in is made). Now the folder is
    read once: the pin is kept, not shipped, and once the folder goes the loss is said."""
    from ckptvault.ops import pin as pins
    from ckptvault.ops import watch as watching

    ckpts = tmp_path / "ckpts"
    step = ckpts / "step_100"
    step.mkdir(parents=True)
    (step / "a.bin").write_bytes(os.urandom(3 << 20))
    warnings: list[str] = []
    with mounted_tmpfs(tmp_path / "state", "5m", "the full state disk test") as mount:
        watcher = watching.Watcher(
            str(ckpts),
            tags={"run": "r"},
            ship=lambda job: pytest.fail("driven by hand"),
            shipped_digests=lambda: (),
            options=watching.WatchOptions(interval=0.1, settle=0.0, state_dir=str(mount / "w")),
            on_warning=warnings.append,
        )
        os.makedirs(watcher.pins_dir)
        watcher._shipped.start_loading()
        assert watcher._shipped.loaded.wait(10)
        watcher._scan(time.monotonic())
        (pinned,) = watcher._candidates.values()
        assert pinned.pin.copied and not pinned.pin.in_place
        (step / "b.bin.tmp").write_bytes(os.urandom(3 << 20))
        (step / "b.bin.tmp").rename(step / "b.bin")  # the pin's copy of it cannot fit
        real = pins.stand_in

        def deleted_meanwhile(source, staging, **kwargs):
            (step / "a.bin").unlink(missing_ok=True)  # the trainer, in the window
            return real(source, staging, **kwargs)

        monkeypatch.setattr(pins, "stand_in", deleted_meanwhile)
        watcher._settle(time.monotonic())
        assert any("No space left" in w for w in warnings), warnings
        (cand,) = watcher._candidates.values()
        assert not cand.pin.in_place, f"ships in place as {sorted(watching.file_paths(cand.sig))}, a.bin gone"
        assert cand is pinned and os.path.exists(os.path.join(pinned.pin.data, "a.bin")) and cand.behind
        assert not watcher._due(cand, time.monotonic() + 10), "a pin lacking b.bin would ship torn"
        shutil.rmtree(step)
        watcher._settle(time.monotonic())
    assert watcher._candidates == {}
    assert any("step_100: it was deleted before it shipped, while its pin lacked part of it" in w for w in warnings)


def test_the_cli_says_what_it_dropped_to_make_room_and_exits_3(tmp_path):
    """The real CLI, slow storage, a trainer saving 0.25 MB every 0.15 s on a 4 MiB disk and deleting the
    save before: every save of the trainer succeeds; the drops are said, counted at the end, and exit 3.
    With --json each drop is an event on stdout too, beside the shipped ones."""
    repo = str(tmp_path / "repo")
    Vault.init(repo).close()
    with mounted_tmpfs(tmp_path / "mnt", "4m", "the dropping CLI test") as mount:
        ckpts = mount / "ckpts"
        ckpts.mkdir()
        args = ["watch", str(ckpts), "--repo", f"slowfile://{repo}", "-o", "delay=0.3", "--tag", "run=t", "--json"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.slowfs", *args, "--settle", "0.1", "--interval", "0.05"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _wait(lambda: (ckpts / ".ckptvault-watch" / "lock").exists(), "the watcher")
            for step in range(1, 31):
                (ckpts / "next.tmp").write_bytes(os.urandom(250_000))  # ENOSPC here fails the test
                os.replace(ckpts / "next.tmp", ckpts / f"step_{step}.pt")
                with contextlib.suppress(FileNotFoundError):
                    (ckpts / f"step_{step - 1}.pt").unlink()
                time.sleep(0.15)
            time.sleep(2)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
    dropped = [line for line in err.splitlines() if line.startswith("warning:") and "dropped without" in line]
    assert "((" not in err and "))" not in err
    assert dropped and f"{len(dropped)} dropped unshipped to leave the trainer room" in err, err
    assert proc.returncode == 3, err
    events = [json.loads(line) for line in out.splitlines()]
    lost = [e for e in events if e["event"] == "lost"]
    shipped = {e["checkpoint"] for e in events if e["event"] == "shipped"}
    assert len(lost) == len(dropped) and {e["reason"] for e in lost} == {"dropped"}, events
    assert all(e["step"] == int(e["checkpoint"][5:-3]) and "dropped without" in e["message"] for e in lost), lost
    assert shipped and not shipped & {e["checkpoint"] for e in lost}, events


def test_the_apis_watch_without_on_warning_logs_its_warnings_and_gives_them_to_the_vaults(tmp_path, repo, caplog):
    """Vault.watch() without on_warning dropped every warning (neither the logger nor vault.on_warning),
    and still recorded a left-out entry as told, so a later run never said it (review 40 A2)."""
    import logging

    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    (ckpts / "train.log").write_text("loss 1.0\n")
    (ckpts / "step_1.pt").write_bytes(b"weights")
    told: list[str] = []
    with Vault.open(repo) as vault, caplog.at_level(logging.WARNING, logger="ckptvault"):
        vault.on_warning = told.append
        result = vault.watch(str(ckpts), once=True, settle=0)
    assert [s.name for s in result.shipped] == ["step_1.pt"]
    assert any("train.log" in m for m in told), told
    assert any("train.log" in r.getMessage() for r in caplog.records)


def test_a_backup_warning_of_a_watch_is_logged_once(tmp_path, repo, caplog, monkeypatch):
    """The backup logged it, and the watcher logged it again, named (review 40 M1)."""
    import logging

    import ckptvault.ops.compact as compact_module
    from ckptvault.errors import CkptVaultError

    def compaction_fails(_repo):
        raise CkptVaultError("index compaction failed for the test")

    monkeypatch.setattr(compact_module, "compact_index", compaction_fails)
    (tmp_path / "ckpts" / "step_1").mkdir(parents=True)
    (tmp_path / "ckpts" / "step_1" / "model.pt").write_bytes(b"weights")
    told: list[str] = []
    with Vault.open(repo) as vault, caplog.at_level(logging.WARNING, logger="ckptvault"):
        result = vault.watch(str(tmp_path / "ckpts"), once=True, settle=0, on_warning=told.append)
    assert [s.name for s in result.shipped] == ["step_1"]
    logged = [r.getMessage() for r in caplog.records if "compaction failed for the test" in r.getMessage()]
    assert len(logged) == 1 and logged[0].startswith("step_1: "), logged
    assert [m for m in told if "compaction failed" in m] == logged


def test_a_stat_that_fails_does_not_settle_a_checkpoint_at_once(tmp_path, monkeypatch):
    """Review 44 #7: a checkpoint whose source the trainer deleted is settled at once (nothing more can come
    into its pin), but a stat that failed (EIO, a stale NFS handle) said the same, and a checkpoint still
    being written would have shipped at once."""
    import errno as errnos

    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    watcher = _hand_driven_watcher(ckpts, 60)
    (ckpts / "step_1.pt").write_bytes(os.urandom(1000))
    watcher._scan(time.monotonic())
    (cand,) = watcher._candidates.values()
    real_stat = os.stat

    def failing(path, *args, **kwargs):
        if str(path) == str(ckpts / "step_1.pt"):
            raise OSError(errnos.EIO, "Input/output error", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", failing)
    watcher._settle(time.monotonic())
    assert cand.frozen and not cand.settled(time.monotonic(), 60)
    monkeypatch.setattr(os, "stat", real_stat)
    watcher._settle(time.monotonic())  # the stat works again: looked at as before
    assert not cand.frozen
    (ckpts / "step_1.pt").unlink()  # the trainer's rotation
    watcher._settle(time.monotonic())
    assert cand.frozen and cand.settled(time.monotonic(), 60)
    cand.pin.release()


def test_a_watcher_starting_while_ship_pins_probes_its_lock_waits_the_probe_out(tmp_path):
    """`ship-pins` holds a shared lock on the watcher's lock file for a moment to see whether one runs; a
    watcher starting in that moment exited 11, "another ckptvault watch is already watching"."""
    import fcntl
    import threading

    from ckptvault.ops.watch_lock import WatchLock

    ckpts = tmp_path / "ckpts"
    state = ckpts / ".ckptvault-watch"
    state.mkdir(parents=True)
    probe = os.open(state / "lock", os.O_RDONLY | os.O_CREAT)
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
    threading.Timer(0.05, os.close, (probe,)).start()  # a probe, slowed down to be caught
    lock = WatchLock(str(state / "lock"), str(ckpts))
    lock.open()
    with lock:
        assert os.pread(lock.fd, 100, 0).decode().startswith(f"pid {os.getpid()}")


def test_a_restart_finds_a_shipped_folder_its_rotation_is_deleting_shipped_not_a_new_save(tmp_path, repo, cli):
    """A running watcher takes files going from a shipped checkpoint for its rotation; a restart (each cron
    ``--once`` is one) compared the folder's digest only, so what was left of it shipped again: a newer
    snapshot of the same step without its optimizer, the one ``restore latest --tag checkpoint=...`` took
    (tr59). What is left of the newest snapshot shipped under that name now counts as shipped; a file
    added or rewritten still makes it a new save."""
    ckpts = tmp_path / "ckpts"
    ckpt = ckpts / "checkpoint-7"
    (ckpt / "sub").mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.pt", "sub/rng_state.pth"):
        (ckpt / name).write_bytes(os.urandom(4096))
    args = ("watch", str(ckpts), "--repo", repo, "--tag", "run=r", "--once", "--settle", "0.2")
    assert cli(*args).stdout.decode().startswith("shipped checkpoint-7 step 7")
    (ckpt / "optimizer.pt").unlink()  # the trainer trims or deletes it while no watcher runs
    (ckpt / "sub" / "rng_state.pth").unlink()
    again = cli(*args)
    assert again.stdout.decode() == "", again.stdout.decode()
    with Vault.open(repo) as vault:
        assert len(vault.snapshots({"run": "r"})) == 1
    (ckpt / "config.json").write_text("{}")  # a file added: a new version of it, shipped
    added = cli(*args).stdout.decode()
    assert added.startswith("shipped checkpoint-7 step 7"), added
