"""Several backup processes and a prune process at once on one repository.

Each writer backs up its own checkpoint series (sharing a frozen part with the others) through
the real CLI; a pruner keeps the newest 2 per run. Lock conflicts (exit 11) are retried after
a seeded pause, as a user's job scheduler would. Afterwards every snapshot restores bit-exact
and check --read-data passes.
"""

from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.repository.cache import MetadataCache

DEADLINE_S = 600  # a bound on a hang, not on speed: 2 loaded cores start ~20 interpreters here


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


def test_concurrent_backups_of_two_runs_and_the_same_paths(tmp_path: Path):
    """A and B back up different runs, C the same paths as A, all at once (real processes on a
    slowed filesystem so they overlap). Every snapshot restores; both runs' index objects survive
    (no pack is left unindexed); the copies two writers of the same bytes made at the same moment
    are the only duplicates, and the next prune reclaims them."""
    from .test_crash_backup import duplicated_chunks

    vault_path = tmp_path / "vault"
    Vault.init(str(vault_path), pack_size=1 << 20).close()
    frozen = random.Random("base").randbytes(4 << 20)
    sources = {}
    for run in ("a", "b"):
        src = tmp_path / f"run-{run}"
        src.mkdir()
        (src / "model.bin").write_bytes(frozen + random.Random(run).randbytes(6 << 20))
        sources[run] = src
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.slowcli",
                "backup",
                str(sources[run]),
                "--repo",
                f"slowfile://{vault_path}",
                "--tag",
                f"run={run}",
                "--tag",
                f"writer={writer}",
                "-q",
            ],
            cwd=Path(__file__).parent.parent,
            env={**os.environ, "SLOWFS_DELAY": "0.005", "SLOWFS_PUT_DELAY": "0.03"},
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for writer, run in enumerate(("a", "b", "a"))
    ]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.stderr.read().decode()
    with Vault.open(str(vault_path)) as vault:
        snaps = vault.snapshots()
        assert sorted(s.tags["writer"] for s in snaps) == ["0", "1", "2"]
        report = vault.check(read_data=1.0)
        assert report.ok and not report.warnings, (report.problems, report.warnings)  # every pack indexed
        for snap in snaps:
            out = tmp_path / "out" / snap.tags["writer"]
            vault.restore(snap, out)
            assert (out / "model.bin").read_bytes() == (sources[snap.tags["run"]] / "model.bin").read_bytes()
        duplicates = duplicated_chunks(vault)
        unique = sum(loc.raw_len for _, loc in vault._repo.index.items())
        vault.prune(keep_latest=10)  # keeps every snapshot; GC keeps one copy of each chunk
        assert duplicated_chunks(vault) == 0
        after = vault.stats()
        assert after.stored_bytes < unique * 1.05 + (1 << 20), (after.stored_bytes, unique, duplicates)
        print(
            f"duplicated chunks before prune: {duplicates}; stored after prune {after.stored_bytes} / unique {unique}"
        )


def _two_hosts(tmp_path: Path) -> tuple[Vault, Vault, str]:
    """One remote vault (memory://, metadata cached) opened from two hosts, each with its own cache."""
    import uuid

    url = f"memory://two-hosts-{uuid.uuid4().hex}"
    src = tmp_path / "src"
    src.mkdir()
    for step in (1, 2):
        (src / "w.bin").write_bytes(os.urandom(6 << 20))  # chunks of at most 4 MiB: at least two
        with Vault.open(url, create=True) as vault:
            vault.backup(src, tags={"step": str(step)})
    here, there = Vault.open(url), Vault.open(url)
    for vault, cache in ((here, "cache-a"), (there, "cache-b")):  # memory:// is not cached on its own
        vault._repo.cache = MetadataCache.open(tmp_path / cache, vault._repo.config.repo_id)
    return here, there, url


@pytest.mark.parametrize("reader", ["restore", "show", "diff"])
def test_a_snapshot_pruned_by_another_host_after_it_was_chosen_is_gone_not_damage(tmp_path: Path, reader: str):
    """A restore kept reading the tree from this host's metadata cache and called the pruned chunks
    damage (exit 30, "run check"); show and diff --tensors read chunks with no lock at all, so a prune ran
    beside them (a multi-writer audit, on SeaweedFS)."""
    from ckptvault.errors import SnapshotNotFoundError

    here, there, _ = _two_hosts(tmp_path)
    old, new = sorted(here.snapshots(), key=lambda s: s.time)
    here.files(old)  # its tree now in this host's cache
    there.forget([old.id], prune=True)
    with pytest.raises(SnapshotNotFoundError, match="removed it meanwhile"):
        if reader == "restore":
            here.restore(old, tmp_path / "out")
        elif reader == "show":
            here.show(old, "w.bin")
        else:
            here.diff(old, new, tensors=True)
    here.close()
    there.close()


def test_show_and_diff_hold_a_shared_lock_while_they_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """They read chunks with no lock: a prune ran beside them and they called its deletions damage."""
    from ckptvault.errors import FileFormatError, VaultLockedError
    from ckptvault.ops import inspect as inspect_module

    here, there, _ = _two_hosts(tmp_path)
    old, new = sorted(here.snapshots(), key=lambda s: s.time)
    refused = []

    def read_while_a_prune_tries(real):
        def reading(*args, **kwargs):
            with pytest.raises(VaultLockedError):
                there.forget([old.id], prune=True)
            refused.append(real.__name__)
            return real(*args, **kwargs)

        return reading

    monkeypatch.setattr(inspect_module, "show_file", read_while_a_prune_tries(inspect_module.show_file))
    monkeypatch.setattr(inspect_module, "diff_trees", read_while_a_prune_tries(inspect_module.diff_trees))
    with pytest.raises(FileFormatError):  # random bytes: no tensors to show, once read
        here.show(old, "w.bin")
    here.diff(old, new, tensors=True)
    assert refused == ["show_file", "diff_trees"]
    here.close()
    there.close()


def test_an_open_file_of_a_snapshot_pruned_meanwhile_says_so_not_damage(tmp_path: Path):
    """An open_file handle holds no lock: a prune beside it removed its chunks, and the next read said
    the vault was damaged (exit 30, "run check")."""
    from ckptvault.errors import SnapshotNotFoundError

    here, there, _ = _two_hosts(tmp_path)
    old, _new = sorted(here.snapshots(), key=lambda s: s.time)
    with here.open_file(old, "w.bin", cache_chunks=1) as f:
        f.read(10)
        there.forget([old.id], prune=True)
        f.seek((6 << 20) - 1)  # in another chunk than the first bytes
        with pytest.raises(SnapshotNotFoundError, match="removed by another process"):
            f.read(1)
    here.close()
    there.close()


def test_an_index_reloaded_while_a_backup_indexes_its_packs_keeps_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """A restore on one thread reloads the index while backup_async on another has packs landed but not yet in
    an index object: the reload left them out, the backup then marked its new object as read, and the restore
    of that snapshot warned of "pack(s) that no index object names ... run: ckptvault repair-index" on a
    healthy vault (tp47 #1). The reload is made to come at the worst moment: right before the object is put."""
    import logging

    from ckptvault.repository.repository import Repository

    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(3 << 20))
    real = Repository.write_index

    def reloaded_first(self, packs):
        self.load_index()  # what a restore's load_index_as_stored on another thread does
        return real(self, packs)

    with Vault.init(str(tmp_path / "v")) as vault:
        monkeypatch.setattr(Repository, "write_index", reloaded_first)
        snap = vault.backup(src)
        monkeypatch.undo()
        with caplog.at_level(logging.WARNING, logger="ckptvault.damage"):
            vault.restore(snap, tmp_path / "out")
    assert (tmp_path / "out" / "w.bin").read_bytes() == (src / "w.bin").read_bytes()
    assert not [r.getMessage() for r in caplog.records], caplog.records


def test_a_new_metadata_cache_folder_is_private_to_its_user(tmp_path: Path):
    """It holds an unencrypted vault's trees (file names) in the clear: other local users may not list or read it."""
    cache = MetadataCache.open(tmp_path / "cache", "ab" * 32)
    assert cache.directory is not None and stat.S_IMODE(cache.directory.stat().st_mode) == 0o700


def test_a_metadata_cache_folder_made_before_caches_were_private_is_made_so(tmp_path: Path):
    """A cache folder made 0755 by an earlier ckptvault kept its mode: the 0700 reached new ones only."""
    MetadataCache.open(tmp_path / "cache", "ab" * 32)
    folder = tmp_path / "cache" / ("ab" * 32)
    folder.chmod(0o755)
    cache = MetadataCache.open(tmp_path / "cache", "ab" * 32)
    assert cache.directory == folder and stat.S_IMODE(folder.stat().st_mode) == 0o700
