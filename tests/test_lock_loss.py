"""A lock holder that may have looked stale to another process stops before it commits or deletes.

The two real-process scenarios suspend a CLI process with SIGSTOP at a precise write (it stops itself:
tests/support/lockcli.py, which also scales the locks down to 4 s staleness and 0.2 s refresh), let
the other command run, then resume it with SIGCONT:

* a backup suspended past the staleness, whose lock and uploaded packs a prune removed meanwhile, must
  fail with LockLostError (exit 11) and commit nothing;
* a prune suspended after planning, while a backup deduplicated against a pack the prune is about to
  delete and committed, must stop before deleting anything.

The in-process tests pin the lock's rules (never revived, refresh failures, skewed clocks) and the
garbage collection's re-listing of index objects and snapshots.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import LockLostError, StorageError, VaultLockedError
from ckptvault.repository import locks
from ckptvault.repository.format import lock_key
from ckptvault.repository.locks import LockManager

ROOT = Path(__file__).parent.parent
STALE_S = 4.0  # tests/support/lockcli.py's scaled-down staleness


def lockcli(*args: str, tmp_path: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.lockcli", *args],
        cwd=ROOT,
        env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg-data"), "LOCKCLI_STALE_S": str(STALE_S), **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err.decode()


def wait_stopped(proc: subprocess.Popen, marker: Path) -> None:
    """Until the process has stopped itself (tests/support/lockcli.py): no timing guess involved."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before stopping: {proc.stderr.read().decode()}")
        if marker.exists() and all(thread_state(task) == "T" for task in Path(f"/proc/{proc.pid}/task").iterdir()):
            return
        time.sleep(0.02)
    raise AssertionError("the process never stopped")


def thread_state(task: Path) -> str:
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # a thread that ended
        return "T"


def wait_until_stale() -> None:
    """The suspended process cannot refresh: its lock only gets older, so this is not a race."""
    time.sleep(STALE_S + 0.5)


def pruned_while_suspended(proc: subprocess.Popen, marker: Path, repo: Path, tmp_path: Path) -> tuple[int, str]:
    """Once ``proc`` stopped itself and its lock went stale, a prune runs (and succeeds); then ``proc`` goes
    on: how it ended."""
    try:
        wait_stopped(proc, marker)
        wait_until_stale()
        rc, err = finish(lockcli("prune", "--repo", str(repo), "--keep-latest", "1", "-q", tmp_path=tmp_path))
        assert rc == 0, err
    finally:
        proc.send_signal(signal.SIGCONT)
    return finish(proc)


def packs(repo: Path) -> set[str]:
    """The pack objects, not a suspended writer's upload in flight (a temp file the prune keeps)."""
    return {p.name for p in (repo / "packs").rglob("*") if p.is_file() and not p.name.startswith(".tmp-")}


def cli_check(repo: Path, tmp_path: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "ckptvault", "check", "--read-data", "--repo", str(repo)],
        cwd=ROOT,
        env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg-data")},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
    )
    out = proc.stdout.decode() + proc.stderr.decode()
    assert proc.returncode == 0, out
    return out


def restores_exactly(vault: Vault, snap, source: Path, out: Path) -> None:
    vault.restore(snap, out)
    for path in source.rglob("*"):
        if path.is_file():
            assert (out / path.relative_to(source)).read_bytes() == path.read_bytes(), (snap.id, path)


def make_source(path: Path, seed: str, size: int) -> Path:
    path.mkdir(parents=True)
    (path / "model.bin").write_bytes(random.Random(seed).randbytes(size))
    return path


# ---- real processes ---------------------------------------------------------------------------


def test_backup_suspended_past_staleness_commits_nothing(tmp_path: Path):
    repo = tmp_path / "vault"
    first = make_source(tmp_path / "first", "first", 200_000)
    big = make_source(tmp_path / "big", "big", 4 << 20)
    with Vault.init(str(repo), pack_size=1 << 20) as vault:
        earlier = vault.backup(first)
    before = packs(repo)

    marker = tmp_path / "stopped"
    backup = lockcli(
        "backup", str(big), "--repo", str(repo), "-q",
        tmp_path=tmp_path, LOCKCLI_STOP="after-pack", LOCKCLI_MARKER=str(marker), LOCKCLI_PACK_DELAY="0.3",
    )  # fmt: skip
    try:
        wait_stopped(backup, marker)
        uploaded = packs(repo) - before
        assert uploaded  # a pack no index names yet: to a prune, a killed backup's leftover
        wait_until_stale()
        rc, err = finish(lockcli("prune", "--repo", str(repo), "--keep-latest", "1", "-q", tmp_path=tmp_path))
        assert rc == 0, err
        assert not uploaded & packs(repo)  # the prune removed the backup's stale lock and its packs
    finally:
        backup.send_signal(signal.SIGCONT)
    rc, err = finish(backup)
    assert rc == 11, err
    assert "lost the lock" in err and "nothing was committed" in err, err

    with Vault.open(str(repo)) as vault:
        assert [s.id for s in vault.snapshots()] == [earlier.id]
        assert vault.locks() == []
        restores_exactly(vault, earlier, first, tmp_path / "out")
        assert vault.check(read_data=1.0).problems == []  # not even an index naming the deleted packs
    cli_check(repo, tmp_path)


@pytest.mark.parametrize("reader", [["restore", "OLD", "OUT"], ["cat", "OLD", "model.bin"], ["check", "--read-data"]])
def test_a_reader_suspended_past_staleness_says_it_lost_its_lock_not_damage(tmp_path: Path, reader: list[str]):
    """A restore, cat or check stopped while a prune took its lock for a dead process's and removed what it
    was reading: exit 11 naming the lost lock, never exit 30 with advice to repair a healthy vault."""
    repo = tmp_path / "vault"
    with Vault.init(str(repo), pack_size=1 << 20) as vault:
        old = vault.backup(make_source(tmp_path / "old", "old", 3 << 20))
        vault.backup(make_source(tmp_path / "new", "new", 200_000))
    args = [{"OLD": old.id, "OUT": str(tmp_path / "out")}.get(a, a) for a in reader]
    marker = tmp_path / "stopped"
    stop = {"LOCKCLI_STOP": "before-read", "LOCKCLI_MARKER": str(marker)}
    rc, err = pruned_while_suspended(
        lockcli(*args, "--repo", str(repo), tmp_path=tmp_path, **stop), marker, repo, tmp_path
    )
    assert rc == 11 and "lost the lock" in err and "what looked missing may be what a prune removed" in err, err
    cli_check(repo, tmp_path)


def test_prune_suspended_after_planning_deletes_nothing(tmp_path: Path):
    repo = tmp_path / "vault"
    old = make_source(tmp_path / "old", "old", 1 << 20)
    new = make_source(tmp_path / "new", "new", 1 << 20)
    with Vault.init(str(repo), pack_size=1 << 20) as vault:
        vault.backup(old)
        kept = vault.backup(new)
    before = packs(repo)

    marker = tmp_path / "stopped"
    prune = lockcli(
        "prune", "--repo", str(repo), "--keep-latest", "1", "-q",
        tmp_path=tmp_path, LOCKCLI_STOP="before-index", LOCKCLI_MARKER=str(marker),
    )  # fmt: skip
    try:
        wait_stopped(prune, marker)  # planned: the first snapshot is forgotten, its packs are to go
        wait_until_stale()
        # the same bytes again: only the forgotten snapshot held them, so the backup stores nothing new
        rc, err = finish(lockcli("backup", str(old), "--repo", str(repo), "-q", tmp_path=tmp_path))
        assert rc == 0, err
        assert packs(repo) == before
    finally:
        prune.send_signal(signal.SIGCONT)
    rc, err = finish(prune)
    assert rc == 11, err
    assert "lost the lock" in err and "it stopped before deleting anything more" in err, err
    assert packs(repo) == before

    with Vault.open(str(repo)) as vault:
        snaps = vault.snapshots()
        assert len(snaps) == 2 and kept.id in {s.id for s in snaps}
        for snap in snaps:
            restores_exactly(vault, snap, new if snap.id == kept.id else old, tmp_path / "out" / snap.id)
    cli_check(repo, tmp_path)
    with Vault.open(str(repo)) as vault:  # the next prune finishes the job, losing nothing
        vault.prune(keep_latest=2)
        assert vault.check(read_data=1.0).ok
        for snap in vault.snapshots():
            restores_exactly(vault, snap, new if snap.id == kept.id else old, tmp_path / "again" / snap.id)


def test_prune_suspended_in_its_pack_deletes_deletes_nothing_more_once_resumed(tmp_path: Path):
    """audit mw45 H1: the packs a prune condemned are in no index while it deletes them; a backup that got in
    while the suspended prune's lock looked stale adopted them (their headers verify) and deduplicated
    against them, and the resumed prune deleted the rest of its batch: the backup's snapshot lost data."""
    repo = tmp_path / "vault"
    old = make_source(tmp_path / "old", "old", 3 << 20)
    new = make_source(tmp_path / "new", "new", 1 << 20)
    with Vault.init(str(repo), pack_size=1 << 20) as vault:
        vault.backup(old)
        vault.backup(new)
    marker = tmp_path / "stopped"
    prune = lockcli(
        "prune", "--repo", str(repo), "--keep-latest", "1", "-q",
        tmp_path=tmp_path, LOCKCLI_STOP="after-pack-delete", LOCKCLI_MARKER=str(marker),
    )  # fmt: skip
    try:
        wait_stopped(prune, marker)  # one of the old snapshot's packs deleted, the others to go
        wait_until_stale()
        rc, err = finish(lockcli("backup", str(old), "--repo", str(repo), "-q", tmp_path=tmp_path))
        assert rc == 0, err
        adopted = packs(repo)
    finally:
        prune.send_signal(signal.SIGCONT)
    rc, err = finish(prune)
    assert rc == 11, err
    assert "lost the lock" in err and "it stopped before deleting anything more" in err, err
    assert packs(repo) == adopted
    with Vault.open(str(repo)) as vault:
        restores_exactly(vault, vault.snapshots()[-1], old, tmp_path / "out")  # the backup made meanwhile
        assert vault.check(read_data=1.0).ok


@pytest.mark.parametrize("command", ["backup", "tag"])
def test_a_writer_suspended_just_before_its_snapshot_commits_nothing_and_keeps_the_old(tmp_path: Path, command: str):
    """audit mw45 M1/M2: suspended between its last lock check and its snapshot's PUT, while a prune removed its
    tree (and a backup's packs), the writer committed a snapshot of missing data with exit 0; `tag` then also
    deleted the snapshot it replaced, the only one of that checkpoint."""
    repo = tmp_path / "vault"
    first = make_source(tmp_path / "first", "first", 200_000)
    with Vault.init(str(repo), pack_size=1 << 20) as vault:
        earlier = vault.backup(first, tags={"run": "x"})
    args = {
        "backup": ["backup", str(make_source(tmp_path / "big", "big", 2 << 20)), "--tag", "run=y"],
        "tag": ["tag", "latest", "--add", "keep=best"],
    }[command]
    marker = tmp_path / "stopped"
    stop = {"LOCKCLI_STOP": "before-snapshot", "LOCKCLI_MARKER": str(marker)}
    writer = lockcli(*args, "--repo", str(repo), "-q", tmp_path=tmp_path, **stop)
    rc, err = pruned_while_suspended(writer, marker, repo, tmp_path)
    assert rc == 11, err
    assert "lost the lock" in err and "nothing was committed" in err, err
    with Vault.open(str(repo)) as vault:
        assert [(s.id, s.tags) for s in vault.snapshots()] == [(earlier.id, {"run": "x"})]
        restores_exactly(vault, earlier, first, tmp_path / "out")
    cli_check(repo, tmp_path)


# ---- the lock's rules, in process -------------------------------------------------------------


def manager(vault: Vault, **kwargs) -> LockManager:
    """Refreshes only when a test says so (the thread waits an hour)."""
    return LockManager(vault._repo, refresh_every=timedelta(hours=1), **kwargs)


def test_a_removed_lock_is_lost_for_good(vault: Vault):
    held = manager(vault).acquire(exclusive=False)
    vault.unlock(remove_all=True)  # what a prune does to a lock it judges stale
    held.refresh()  # writes a new object, then finds the old one gone: never revived
    assert vault.locks() == []
    for _ in range(2):
        with pytest.raises(LockLostError, match="removed it as stale"):
            held.verify()
        held.refresh()
    assert vault.locks() == []
    held.release()


def test_a_lock_unrefreshed_too_long_is_lost(vault: Vault, monkeypatch):
    held = manager(vault).acquire(exclusive=True)
    assert vault._repo.locks.held == (held,)
    vault._repo.locks.verify_held()
    real = locks.ticks
    monkeypatch.setattr(locks, "ticks", lambda: real() + 23 * 60)  # suspended 23 of the 30 minutes
    with pytest.raises(LockLostError, match=r"without a refresh.*stopped before deleting anything more"):
        vault._repo.locks.verify_held()
    monkeypatch.setattr(locks, "ticks", real)
    held.refresh()  # lost stays lost
    with pytest.raises(LockLostError):
        held.verify()
    held.release()
    assert vault.locks() == [] and vault._repo.locks.held == ()


def test_a_lock_refreshed_in_time_is_not_lost_however_long_it_is_held(vault: Vault, monkeypatch):
    """Each refresh restarts the count: a command that runs for hours keeps its lock."""
    held = manager(vault).acquire(exclusive=True)
    real = locks.ticks
    for hours in range(1, 4):  # refreshed every 15 minutes (of the steady clock) for three hours
        for quarter in range(1, 5):
            monkeypatch.setattr(locks, "ticks", lambda h=hours, q=quarter: real() + (h - 1) * 3600 + q * 15 * 60)
            held.refresh()
    held.verify()
    held.check_age()
    monkeypatch.undo()
    held.release()


def test_a_lock_whose_wall_clock_age_passed_the_limit_is_lost_though_the_steady_clock_did_not(vault: Vault):
    """The wall clock counts too (the larger wins): a suspend the steady clock missed still loses the lock."""
    later = [datetime.now(timezone.utc)]
    held = manager(vault, clock=lambda: later[0]).acquire(exclusive=False)
    later[0] += timedelta(minutes=23)  # past 22.5 of the 30 minutes, by the wall clock only
    with pytest.raises(LockLostError, match="without a refresh"):
        held.check_age()
    held.release()


def fail_once(monkeypatch, store, op: str, key_part: str) -> list[str]:
    failed: list[str] = []
    real = getattr(store, op)

    def flaky(key, *args, **kwargs):
        if key_part in key and not failed:
            failed.append(key)
            raise StorageError(op.upper(), key, store.url, "connection reset", retryable=True)
        return real(key, *args, **kwargs)

    monkeypatch.setattr(store, op, flaky)
    return failed


def test_a_failed_refresh_is_forgiven_by_a_later_one(vault: Vault, monkeypatch):
    held = manager(vault).acquire(exclusive=False)
    first = held.info.lock_id
    failed = fail_once(monkeypatch, vault._repo.store, "put", "locks/")
    with pytest.raises(StorageError):
        held.refresh()
    assert failed
    held.verify()  # refreshes again itself; that succeeds, well within the staleness
    assert [lk.lock_id for lk in vault.locks()] == [held.info.lock_id] != [first]

    def down(key, *args, **kwargs):
        raise StorageError("PUT", key, vault.url, "connection reset", retryable=True)

    monkeypatch.setattr(vault._repo.store, "put", down)
    with pytest.raises(StorageError):
        held.refresh()
    # the retried refresh fails too: the storage's error, which a caller may retry; the lock is not lost
    for _ in range(2):
        with pytest.raises(StorageError, match="connection reset") as caught:
            held.verify()
        assert not isinstance(caught.value, LockLostError) and caught.value.retryable
        assert not held.lost
    real = locks.ticks
    monkeypatch.setattr(locks, "ticks", lambda: real() + 23 * 60)  # failing for too long: now it is lost
    with pytest.raises(LockLostError, match="without a refresh"):
        held.verify()
    monkeypatch.undo()
    held.release()
    assert vault.locks() == []


def test_a_lock_released_by_another_thread_is_not_judged(vault: Vault, monkeypatch):
    """An async backup checks the locks while the main thread's restore releases its own: the released
    lock (its object already removed) must not fail the backup's check as "removed as stale"."""
    backup = manager(vault).acquire(exclusive=False)
    restore = manager(vault).acquire(exclusive=False)
    real_held = LockManager.held

    def release_meanwhile(self):  # the other thread releases between the listing and the checks
        listed = real_held.fget(self)
        if restore in listed:
            other = threading.Thread(target=restore.release)
            other.start()
            other.join()
        return listed

    monkeypatch.setattr(LockManager, "held", property(release_meanwhile))
    assert vault._repo.locks.verify_held(exclusive=False) == 2
    assert vault._repo.locks.check_held_age(exclusive=False) == 1
    monkeypatch.undo()
    restore.verify()  # a released lock is never judged, not even by its own holder
    restore.check_age()
    restore.refresh()  # nor refreshed: no object reappears
    assert [lk.lock_id for lk in vault.locks()] == [backup.info.lock_id]
    assert vault._repo.locks.held == (backup,)
    backup.release()
    assert vault.locks() == []


def test_a_release_interrupted_while_joining_unregisters_the_lock(vault: Vault, monkeypatch):
    held = manager(vault).acquire(exclusive=False)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(held._thread, "join", interrupted)
    with pytest.raises(KeyboardInterrupt):
        held.release()
    assert vault._repo.locks.held == ()
    held.verify()  # released: not judged, although its object is still there
    monkeypatch.undo()
    vault.unlock(remove_all=True)


def test_index_objects_check_the_lock_without_storage_calls(vault: Vault, tmp_path: Path, monkeypatch):
    """The check before and after each index object is the cheap one; the lock object's existence is
    checked twice per backup: before the snapshot is committed, and after (audit mw45 M1)."""
    repo = vault._repo
    lookups: list[str] = []
    real_exists = repo.store.exists

    def exists(key):
        if key.startswith("locks/"):
            lookups.append(key)
        return real_exists(key)

    monkeypatch.setattr(repo.store, "exists", exists)
    with repo.locks.acquire(exclusive=False):
        written = {repo.write_index({}) for _ in range(3)}
    assert len(written) == 3 and repo.written_index_ids >= written
    assert lookups == []
    vault.backup(make_source(tmp_path / "src", "src", 3 << 20))
    assert len(lookups) == 2, lookups


def test_a_lock_lost_while_an_index_object_was_written_leaves_no_index_object(
    vault: Vault, tmp_path: Path, monkeypatch
):
    """Suspended between the check before the index object and its PUT: the check after the PUT finds
    the lock lost, removes the object (a prune may have deleted the packs it names) and stops."""
    earlier = vault.backup(make_source(tmp_path / "first", "first", 300_000))
    index_dir = Path(vault.url) / "index"
    before = {p.name for p in index_dir.rglob("*") if p.is_file()}
    repo = vault._repo
    real_put = repo._put
    real_ticks = locks.ticks
    suspended: list[str] = []

    def put_then_suspended(key, data, **kwargs):
        real_put(key, data, **kwargs)
        if key.startswith("index/") and not suspended:
            suspended.append(key)
            monkeypatch.setattr(locks, "ticks", lambda: real_ticks() + 23 * 60)  # 23 of the 30 minutes

    monkeypatch.setattr(repo, "_put", put_then_suspended)
    with pytest.raises(LockLostError, match=r"without a refresh.*nothing was committed"):
        vault.backup(make_source(tmp_path / "second", "second", 600_000))
    monkeypatch.undo()
    assert suspended
    assert {p.name for p in index_dir.rglob("*") if p.is_file()} == before  # the new one was removed
    assert [s.id for s in vault.snapshots()] == [earlier.id]
    assert vault.locks() == [] and repo.locks.held == ()
    assert vault.check(read_data=1.0).ok


def test_an_old_lock_that_cannot_be_deleted_is_retried(vault: Vault, monkeypatch, caplog):
    held = manager(vault).acquire(exclusive=False)
    first = held.info.lock_id
    failed = fail_once(monkeypatch, vault._repo.store, "delete", lock_key(first))
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        held.refresh()
    assert failed == [lock_key(first)]
    assert "could not remove the old lock object" in caplog.text
    assert {lk.lock_id for lk in vault.locks()} == {first, held.info.lock_id}
    held.refresh()  # removes the leftover first
    assert [lk.lock_id for lk in vault.locks()] == [held.info.lock_id]
    held.release()
    assert vault.locks() == []


def test_a_judge_whose_clock_runs_ahead_does_not_remove_a_live_lock(vault: Vault):
    held = manager(vault).acquire(exclusive=False)
    ahead = LockManager(vault._repo, clock=lambda: datetime.now(timezone.utc) + timedelta(hours=1))
    with pytest.raises(VaultLockedError, match="shared lock"):
        ahead.acquire(exclusive=True)  # its own lock shows the storage's clock an hour behind its own
    held.verify()
    held.release()
    assert vault.locks() == []


def test_a_holder_whose_clock_runs_behind_keeps_its_lock(vault: Vault):
    now = datetime.now(timezone.utc)
    behind = LockManager(vault._repo, clock=lambda: now - timedelta(minutes=35)).write(exclusive=False)
    lock_file = Path(vault.url) / lock_key(behind.lock_id)
    written = (now - timedelta(minutes=25)).timestamp()  # 25 minutes ago by the storage, 35 by its document
    os.utime(lock_file, (written, written))
    (listed,) = vault.locks()
    assert not vault._repo.locks.is_stale(listed)
    with pytest.raises(VaultLockedError) as refused:
        vault.prune(keep_latest=1)
    # the time it says it holds the lock since is the one staleness goes by, not the holder's slow clock (mw45 L2)
    since = datetime.fromtimestamp(written, timezone.utc)
    assert f"since {since:%Y-%m-%d %H:%M:%S} UTC" in str(refused.value), refused.value
    os.utime(lock_file, (now.timestamp() - 31 * 60,) * 2)
    (listed,) = vault.locks()
    assert vault._repo.locks.is_stale(listed)


# ---- garbage collection re-lists what it is about to delete -----------------------------------


@pytest.mark.parametrize("what", ["forgotten bytes", "new bytes"])
def test_prune_stops_when_another_writer_added_data(vault: Vault, tmp_path: Path, monkeypatch, what: str):
    """A backup whose host judged the prune's lock stale (a skewed clock) commits after the plan: the
    prune stops before deleting any index object or pack, naming the cause."""
    old = make_source(tmp_path / "old", "old", 600_000)
    new = make_source(tmp_path / "new", "new", 600_000)
    vault.backup(old)
    vault.backup(new)
    other = Vault.open(vault.url)
    repo = vault._repo
    real_write_index = type(repo).write_index
    written: list[Path] = []

    def backup_meanwhile(self, batch):
        index_id = real_write_index(self, batch)
        if not written:
            source = old if what == "forgotten bytes" else make_source(tmp_path / "third", "third", 600_000)
            written.append(source)
            with monkeypatch.context() as m:
                m.setattr(LockManager, "is_stale", lambda *a, **k: True)
                other.backup(source)
        return index_id

    monkeypatch.setattr(type(repo), "write_index", backup_meanwhile)
    before_packs = packs(Path(vault.url))
    before_index = sorted((Path(vault.url) / "index").rglob("*"))
    with pytest.raises(VaultLockedError, match="another writer added data") as caught:
        vault.prune(keep_latest=1)
    assert not isinstance(caught.value, LockLostError)
    monkeypatch.undo()
    assert before_packs <= packs(Path(vault.url))
    assert set(before_index) <= set((Path(vault.url) / "index").rglob("*"))
    report = vault.check(read_data=1.0)
    assert report.ok, report.problems
    snaps = vault.snapshots()
    assert len(snaps) == 2  # the forgotten one went, the new one stays
    sources = {"old": old, "new": new, "third": tmp_path / "third"}
    for snap in snaps:
        src = sources[Path(snap.paths[0]).name]
        restores_exactly(vault, snap, src, tmp_path / "out" / snap.id)
    other.close()
