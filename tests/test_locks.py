"""Locks: conflicts, stale expiry, unlock, and a backup that lost its lock commits nothing."""

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import LockLostError, ObjectNotFoundError, VaultLockedError
from ckptvault.repository.locks import LockManager, process_table


def old_clock() -> datetime:
    return datetime.now(timezone.utc) - timedelta(hours=2)


def test_exclusive_and_shared_conflict(vault: Vault):
    manager = vault._repo.locks
    with manager.acquire(exclusive=False):
        with manager.acquire(exclusive=False):  # shared locks coexist
            pass
        with pytest.raises(VaultLockedError, match=r"locked by this process itself \(shared lock by .*let it finish"):
            vault.prune(keep_latest=1)
    with manager.acquire(exclusive=True), pytest.raises(VaultLockedError, match="exclusive lock"):
        vault.backup(Path(__file__).parent / "fixtures" / "source")
    assert vault.locks() == []  # every lock was released, also by the failed attempts


def test_a_lock_taken_reads_back_only_the_other_locks(vault: Vault, monkeypatch: pytest.MonkeyPatch):
    """Its own lock object was just written: reading it back was a round trip on remote storage
    before every command, while the storage's time for it comes with the listing."""
    manager = vault._repo.locks
    store, real_get = vault._repo.store, vault._repo.store.get
    read: list[str] = []
    monkeypatch.setattr(store, "get", lambda key: read.append(key) or real_get(key))
    with manager.acquire(exclusive=False) as first:
        assert read == []
        with manager.acquire(exclusive=False):
            assert read == [f"locks/{first.info.lock_id.hex()}"]
    assert vault.locks() == []


def test_stale_lock_is_ignored_removed_by_prune_and_by_unlock(vault: Vault, tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x")
    stale = LockManager(vault._repo, clock=old_clock).write(exclusive=True)  # a crashed prune, 2 h ago
    vault.backup(src)  # not blocked
    assert [lk.lock_id for lk in vault.locks()] == [stale.lock_id]
    assert [lk.lock_id for lk in vault.unlock()] == [stale.lock_id]
    LockManager(vault._repo, clock=old_clock).write(exclusive=False)
    vault.prune(keep_latest=1)  # ignores and removes the stale shared lock
    assert vault.locks() == []


def test_live_lock_survives_unlock_but_not_remove_all(vault: Vault):
    held = vault._repo.locks.acquire(exclusive=False)
    try:
        assert vault.unlock() == []
        assert len(vault.unlock(remove_all=True)) == 1
    finally:
        held.release()


def test_backup_that_lost_its_lock_writes_no_snapshot(vault: Vault, tmp_path: Path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"payload")
    from ckptvault.ops import backup as backup_module

    real = backup_module.encode_tree

    def prune_meanwhile(entries):  # while the backup runs, someone removes its lock as stale
        vault.unlock(remove_all=True)
        return real(entries)

    monkeypatch.setattr(backup_module, "encode_tree", prune_meanwhile)
    with pytest.raises(LockLostError, match="removed it as stale"):
        vault.backup(src)
    assert vault.snapshots() == []


def test_lock_refresh_replaces_the_object(vault: Vault):
    held = vault._repo.locks.acquire(exclusive=False)
    first = held.info.lock_id
    held.refresh()
    assert [lk.lock_id for lk in vault.locks()] == [held.info.lock_id] != [first]
    held.verify()
    held.release()
    assert vault.locks() == []


@pytest.mark.parametrize("holder_exclusive", [False, True], ids=["backup-refreshes", "prune-refreshes"])
def test_a_lock_refreshed_between_the_listing_and_its_read_still_conflicts(
    vault: Vault, monkeypatch: pytest.MonkeyPatch, holder_exclusive: bool
):
    """A holder's refresh (new lock object written, then the old one deleted) landing between another
    process's listing of the locks and its read of the old object hid the holder: a prune ran beside a
    live backup and deleted what its snapshot needed (a helper reproduced it on SeaweedFS)."""
    other = Vault.open(vault.url)  # another process: its own manager and store
    held = vault._repo.locks.acquire(exclusive=holder_exclusive)
    store = other._repo.store
    get = store.get
    refreshed = []

    def refreshing_get(key: str, *args, **kwargs):
        if key.endswith(held.info.lock_id.hex()) and not refreshed:
            refreshed.append(key)
            held.refresh()  # just after the listing named the old object
        return get(key, *args, **kwargs)

    monkeypatch.setattr(store, "get", refreshing_get)
    with pytest.raises(VaultLockedError, match="exclusive lock" if holder_exclusive else "shared lock"):
        other._repo.locks.acquire(exclusive=not holder_exclusive)
    assert refreshed, "the race was not set up"
    held.release()
    other.close()


def test_a_listing_that_names_a_deleted_lock_for_a_while_is_not_waited_for(
    vault: Vault, monkeypatch: pytest.MonkeyPatch
):
    """A store whose listing lags its deletes names a lock object that can no longer be read, in every
    listing: only a lock that vanished since the listing before sends for another one."""
    ghost = Path(vault.url) / "locks" / ("ee" * 32)
    ghost.parent.mkdir(exist_ok=True)
    ghost.write_bytes(b"listed, never readable")
    store = vault._repo.store
    get = store.get

    def lagging_get(key: str, *args, **kwargs):
        if key.endswith("ee" * 32):
            raise ObjectNotFoundError("GET", key, store.url)
        return get(key, *args, **kwargs)

    monkeypatch.setattr(store, "get", lagging_get)
    vault._repo.locks.acquire(exclusive=True).release()


def test_cli_unlock_says_when_it_is_safe(cli, tmp_path: Path):
    repo = str(tmp_path / "v")
    cli("init", repo)
    with Vault.open(repo) as vault:
        LockManager(vault._repo, clock=old_clock).write(exclusive=True)
        held = vault._repo.locks.acquire(exclusive=False)
        proc = cli("unlock", "--repo", repo)
        held.release()
    out = proc.stdout.decode()
    assert "removed 1 lock(s)" in out and "--remove-all removes them now; use it only when no ckptvault process" in out


def test_cli_unlock_remove_all_says_when_it_took_the_lock_of_a_running_process(cli, tmp_path: Path):
    repo = str(tmp_path / "v")
    cli("init", repo)
    with Vault.open(repo) as vault:
        held = vault._repo.locks.acquire(exclusive=False)  # this test's process: running, on this host
        old = LockManager(vault._repo, clock=old_clock)  # (taken after: a shared locker removes a dead one's)
        old.put(replace(old.new_info(exclusive=True), pid=_dead_pid()))  # a dead process's: no word about it
        proc = cli("unlock", "--repo", repo, "--remove-all")
        with pytest.raises(LockLostError):
            held.verify()  # what the warning says happens to it
        held.release()
    err = proc.stderr.decode().strip().splitlines()
    warned = [n for n, line in enumerate(err) if line.startswith("warning:")]
    assert [err[n] for n in warned] == [
        f"warning: pid {os.getpid()} on this host is running and held that lock: a backup or prune there now stops "
        "before committing or deleting anything more (it lost its lock) and must be run again"
    ]
    assert err[warned[0] - 1].startswith(f"removed shared lock by {socket.gethostname()} pid {os.getpid()} ")
    assert "removed 2 lock(s)" in proc.stdout.decode()


def test_garbage_collection_without_the_exclusive_lock_refuses(vault: Vault, tmp_path: Path):
    """GC verifies the exclusive lock this process holds on the Repository; with none to verify it is a
    programming error, not a silent pass. Nothing is deleted."""
    from ckptvault.ops.gc import execute_gc, plan_gc
    from ckptvault.ops.prune import run_prune
    from ckptvault.snapshot.retention import RetentionPolicy

    src = tmp_path / "src"
    src.mkdir()
    for step in range(2):
        (src / "f").write_bytes(bytes([step]) * 300_000)
        vault.backup(src)
    before = sorted(p for p in Path(vault.url).rglob("*") if p.is_file())
    repo = vault._repo
    repo.load_index()
    snapshots = vault.snapshots()
    with pytest.raises(RuntimeError, match="needs the exclusive lock"):
        run_prune(repo, snapshots, RetentionPolicy(keep_latest=1), dry_run=False)
    with repo.locks.acquire(exclusive=False), pytest.raises(RuntimeError, match="needs the exclusive lock"):
        run_prune(repo, snapshots, RetentionPolicy(keep_latest=1), dry_run=False)  # a shared one is not it
    other = Vault.open(vault.url)  # another Repository object's lock is not this one's
    with other._repo.locks.acquire(exclusive=True), pytest.raises(RuntimeError, match="needs the exclusive lock"):
        execute_gc(repo, plan_gc(repo, set(), set(), 0.1))
    other.close()
    assert sorted(p for p in Path(vault.url).rglob("*") if p.is_file()) == before
    assert run_prune(repo, snapshots, RetentionPolicy(keep_latest=1), dry_run=True).forgotten  # no lock needed
    with repo.locks.acquire(exclusive=True):
        run_prune(repo, snapshots, RetentionPolicy(keep_latest=1), dry_run=False)
    assert len(vault.snapshots()) == 1 and vault.check(read_data=1.0).ok


def test_a_dry_run_prune_lets_backups_go_on(vault: Vault, tmp_path: Path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"data")
    vault.backup(tmp_path / "src")
    backup_running = Vault.open(vault.url)
    with backup_running._repo.locks.acquire(exclusive=False):
        assert vault.prune(keep_latest=1, dry_run=True).dry_run  # a preview deletes nothing: a shared lock
        assert vault.forget([vault.latest()], prune=True, dry_run=True).dry_run
        with pytest.raises(VaultLockedError):
            vault.prune(keep_latest=1)
    backup_running.close()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid  # reaped: no process has it now (nothing reuses it this quickly)


def test_a_lock_from_another_process_table_is_not_judged_by_its_pid(vault: Vault):
    # a container sharing this hostname (host networking) numbers its processes in a PID namespace of
    # its own: a live holder there looks dead here, and a prune deleted a running backup's packs
    manager = vault._repo.locks
    dead = _dead_pid()
    here = replace(manager.new_info(exclusive=False), pid=dead)
    elsewhere = replace(manager.new_info(exclusive=False), pid=dead, pid_table="other-boot/4026532000")
    unknown = replace(manager.new_info(exclusive=False), pid=dead, pid_table=None)  # an older ckptvault's lock
    for info in (here, elsewhere, unknown):
        manager.put(info)
    listed = {lock.lock_id: lock for lock in manager.list()}
    assert manager.is_stale(listed[here.lock_id])
    assert not manager.is_stale(listed[elsewhere.lock_id]) and not manager.is_stale(listed[unknown.lock_id])
    # "shared lock by vm pid 1" read as this host's live init: where it ran is said (mw48 #4)
    assert "(in another boot: an earlier one of this machine, or another machine of this name)" in elsewhere.describe()
    container = replace(elsewhere, pid_table=process_table().partition("/")[0] + "/4026532000")
    assert f"pid {dead} (in another PID namespace of this host) since" in container.describe()
    assert "(" not in here.describe() and "(" not in unknown.describe()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare is not installed")
def test_a_pid_namespace_has_a_process_table_of_its_own():
    code = "from ckptvault.repository.locks import process_table; print(process_table())"
    inner = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code], capture_output=True, text=True
    )
    if inner.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {inner.stderr.strip()}")
    from ckptvault.repository.locks import process_table

    boot, _, namespace = process_table().partition("/")
    inner_boot, _, inner_namespace = inner.stdout.strip().partition("/")
    assert inner_boot == boot and inner_namespace and inner_namespace != namespace


def test_a_file_read_part_way_holds_a_shared_lock_until_the_vault_closes(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(3 << 20))
    vault = Vault.init(str(tmp_path / "repo"))
    snap = vault.backup(src)
    reader = vault.read_file(snap, "w.bin")
    next(reader)
    assert len(vault.locks()) == 1  # a prune waits while the file is read
    vault.close()  # a reader left part way must not keep its lock refreshed for the life of the process
    with Vault.open(str(tmp_path / "repo")) as again:
        assert again.locks() == []
        again.prune(keep_latest=1)


def test_an_acquire_interrupted_while_the_storage_fails_raises_the_interrupt_and_leaves_its_lock(vault, monkeypatch):
    """Ctrl-C (or SIGTERM) while a lock is being taken, with the storage not answering: removing the
    lock just written fails too; the interrupt is what the command reports (exit 130/143, not a
    storage error), and the lock is left behind for a later command or `unlock` to remove."""
    from ckptvault.errors import StorageError

    manager = vault._repo.locks

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def not_answering(self, lock):
        raise StorageError("DELETE", "locks/x", vault.url, "no answer after 3 s")

    monkeypatch.setattr(LockManager, "_list_settled", interrupted)
    monkeypatch.setattr(LockManager, "remove", not_answering)
    with pytest.raises(KeyboardInterrupt):
        manager.acquire(exclusive=False, retry=False)
    monkeypatch.undo()
    assert len(manager.list()) == 1  # left behind: the next acquire removes it, as its own
    with manager.acquire(exclusive=True, retry=False):
        assert len(manager.list()) == 1


def test_a_lock_left_by_a_machine_that_is_gone_names_when_it_goes_stale_and_the_way_out(cli, tmp_path: Path):
    """A spot instance reclaimed mid-prune: its replacement could not restore for 30 minutes, told only to
    wait for the lock to finish, with no time and no word of `unlock --remove-all`; `unlock` called it live."""
    repo = str(tmp_path / "v")
    cli("init", repo)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.pt").write_bytes(b"weights")
    cli("backup", str(tmp_path / "ckpt"), "--repo", repo)
    with Vault.open(repo) as vault:
        manager = vault._repo.locks
        gone = replace(manager.new_info(exclusive=True), hostname="reclaimed-box", pid_table="gone-boot/1")
        manager.put(gone)
    stale_at = f"{gone.time + timedelta(minutes=30):%Y-%m-%d %H:%M:%S} UTC"
    restore = cli("restore", "latest", str(tmp_path / "out"), "--repo", repo, check=False)
    said = restore.stderr.decode()
    assert restore.returncode == 11 and f"(at {stale_at})" in said, said
    assert f"gone for good (a reclaimed instance), ckptvault unlock --repo {repo} --remove-all removes it" in said
    assert "wait for it to finish (with --retry-lock 30m a command waits for it by itself)" in said  # audit 31a F5
    unlock = cli("unlock", "--repo", repo).stdout.decode()
    assert "live" not in unlock and "not stale yet remain (exclusive lock by reclaimed-box" in unlock, unlock
    assert "--remove-all removes them now" in unlock, unlock
    cli("unlock", "--repo", repo, "--remove-all")
    assert cli("restore", "latest", str(tmp_path / "out"), "--repo", repo, check=False).returncode != 11


def test_a_lock_met_moments_after_it_was_written_is_looked_at_again(tmp_path: Path, monkeypatch):
    """A restore and a prune from another host started at one instant: each wrote its lock, saw the other's,
    backed off, and both were refused in 4 of 12 rounds, the restore told to wait for a prune that had
    already given up (audit 31a F3). A lock seconds old gets one more look after a random wait of up to a
    second (here the other side backs off during it); an older one is refused at once."""
    from ckptvault.repository import locks

    repo = tmp_path / "v"
    with Vault.init(str(repo)) as vault:
        manager = vault._repo.locks
        newcomer = replace(manager.new_info(exclusive=True), hostname="cron-host", pid_table="other-boot/1")
        manager.put(newcomer)
        waits = []
        monkeypatch.setattr(
            locks.random, "uniform", lambda lo, hi: (waits.append(hi), manager.remove(newcomer), 0.0)[2]
        )
        with manager.acquire(exclusive=False):
            pass
        assert waits == [locks.NEWCOMER_WAIT_S]
        old = replace(manager.new_info(exclusive=True), hostname="cron-host", pid_table="other-boot/1")
        old = replace(old, time=old.time - timedelta(seconds=60))
        manager.put(old)
        a_minute_ago = datetime.now().timestamp() - 60
        for path in (repo / "locks").rglob("*"):
            os.utime(path, (a_minute_ago, a_minute_ago))  # the storage wrote it a minute ago too
        with pytest.raises(VaultLockedError, match="cron-host"):
            manager.acquire(exclusive=False)
        assert waits == [locks.NEWCOMER_WAIT_S], "no second look at a lock a minute old"
        manager.remove(old)


def test_unlock_on_a_host_whose_clock_runs_ahead_keeps_a_live_lock(vault: Vault):
    """unlock judged ages by its own clock alone: 40 minutes ahead, it removed a running backup's lock, a prune
    then deleted the backup's new pack, and check failed on the index naming it (bug hunt 40 M1). It corrects
    its clock by the storage's, as taking a lock does."""
    from datetime import timedelta

    from ckptvault.repository.locks import utc_now

    held = vault._repo.locks.acquire(exclusive=False)
    try:
        vault._repo.locks.clock = lambda: utc_now() + timedelta(minutes=40)
        assert vault.unlock() == []
        assert [lk.lock_id for lk in vault.locks()] == [held.info.lock_id]  # and the probe is gone
    finally:
        held.release()


def _written_in_boot(manager: LockManager, repo: Path, boot: str, refreshed: datetime) -> object:
    """A lock as a process of boot ``boot`` (of this machine or another) last refreshed it at ``refreshed``."""
    from ckptvault.repository.format import lock_key

    info = replace(manager.new_info(exclusive=True), time=refreshed, pid_table=f"{boot}/4026531836")
    manager.put(info)
    os.utime(repo / lock_key(info.lock_id), (refreshed.timestamp(), refreshed.timestamp()))  # the storage's too
    return info


@pytest.mark.skipif(not Path("/proc/sys/kernel/random/boot_id").exists(), reason="no boot ID on this system")
def test_a_lock_this_machine_wrote_before_it_restarted_is_stale_at_once(tmp_path: Path, monkeypatch):
    """A box that lost power mid-prune came back, and its resume's `restore latest` was refused for 30
    minutes by the dead prune's lock, told it would go stale "at once if it ran on this host" (cr48 F1).
    A boot is this machine's only where this machine listed it: a clone or a sandbox kernel with this
    hostname runs a boot of its own, whose live holder must not be judged dead (rv48 H1)."""
    from ckptvault.repository import locks

    history = tmp_path / "state" / "boot-ids"
    monkeypatch.setattr(locks, "boot_history_path", lambda: history)
    locks.record_this_boot.cache_clear()
    booted = locks.utc_now() - timedelta(minutes=10)  # a restart 10 minutes ago: no lock is stale by age yet
    monkeypatch.setattr(locks, "boot_time", lambda: booted)
    this_boot = locks.process_table().partition("/")[0]
    history.parent.mkdir()
    history.write_text("an-earlier-boot\n")
    repo = tmp_path / "v"
    with Vault.init(str(repo)) as vault:
        manager = vault._repo.locks
        before = booted - timedelta(minutes=1)  # the last refresh, a minute before the power went
        dead_prune = _written_in_boot(manager, repo, "an-earlier-boot", before)
        with manager.acquire(exclusive=False):  # a restore: it goes ahead, and removes the dead prune's lock
            assert dead_prune.lock_id not in {lock.lock_id for lock in manager.list()}
        assert history.read_text().split() == ["an-earlier-boot", this_boot]  # listed by the first lock written
        # a boot this machine never listed (a clone's, a sandbox kernel's): its holder may live
        twin = _written_in_boot(manager, repo, "a-twins-boot", before)
        said = r"pid \d+ \(in another boot: .*or before this machine last restarted"
        with pytest.raises(VaultLockedError, match=said):
            manager.acquire(exclusive=False, retry=False)
        manager.remove(twin)
        # refreshed after this boot began: not a holder this restart ended
        _written_in_boot(manager, repo, "an-earlier-boot", booted + timedelta(minutes=1))
        with pytest.raises(VaultLockedError):
            manager.acquire(exclusive=False, retry=False)
    locks.record_this_boot.cache_clear()


def test_a_killed_backups_lock_is_removed_by_the_next_shared_locker(vault: Vault):
    """A kill -9'd backup's lock stayed until a prune (cr48 F4): after a restart it was one only age clears."""
    manager = vault._repo.locks
    killed = replace(manager.new_info(exclusive=False), pid=_dead_pid())
    manager.put(killed)
    with manager.acquire(exclusive=False):
        assert killed.lock_id not in {lock.lock_id for lock in manager.list()}


SIGNAL_IN_RELEASE_SCRIPT = """
import os, signal, sys, threading
import fsspec
from fsspec.implementations.local import LocalFileSystem
from ckptvault import Vault
from ckptvault.errors import StorageError, UsageError


class TermOnUnlock(LocalFileSystem):
    protocol = ("termonunlock",)

    def rm_file(self, path):
        if "/locks/" in path and threading.current_thread() is threading.main_thread():
            os.kill(os.getpid(), signal.SIGTERM)  # the preemption notice, as the backup's lock is removed
        return super().rm_file(path)


fsspec.register_implementation("termonunlock", TermOnUnlock, clobber=True)
repo, src = sys.argv[1:3]
vault = Vault.open("termonunlock://" + repo)


def on_sigterm(signum, frame):  # a handler whose close() is refused inside the backup, or whose flush() fails
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.argv[3] == "storage":
        raise StorageError("put", "data/ab/abcdef", "s3://bucket/vault", "the handler's own error: stop training")
    raise UsageError("the handler's own error: stop training")


signal.signal(signal.SIGTERM, on_sigterm)
vault.backup(src)
print("backup returned: training goes on", flush=True)
"""


@pytest.mark.parametrize("error", ["usage", "storage"])
def test_an_error_a_signal_handler_raises_while_the_lock_is_removed_is_not_swallowed(tmp_path: Path, error: str):
    """A lock whose removal fails after the work is done is left with a warning, not raised in place of
    the result; but every CkptVaultError counted as that failure, so the error a SIGTERM handler raised
    there (its vault.close() refused inside the backup, or its own) became 'lock ... is left behind (<the
    handler's error>)' and the backup returned: training went on after the preemption notice. Only the
    storage's errors about a lock object are now taken for a failed removal; the handler's error (its own, or
    a storage error about another object: its flush() failing an upload) goes on to the caller."""
    Vault.init(str(tmp_path / "repo")).close()
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.pt").write_bytes(os.urandom(10_000))
    proc = subprocess.run(
        [sys.executable, "-c", SIGNAL_IN_RELEASE_SCRIPT, str(tmp_path / "repo"), str(src), error],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=120,
    )
    assert "training goes on" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 1, proc.stderr
    assert f"{error.capitalize()}Error: " in proc.stderr, proc.stderr
    assert "the handler's own error: stop training" in proc.stderr, proc.stderr
    assert "is left behind" not in proc.stderr, proc.stderr
