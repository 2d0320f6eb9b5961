"""A failed pack upload fails its backup only: the next backup through the same Vault (or the next
backup_async job) starts from what the repository durably holds and succeeds, even when a prune
removed the failed backup's stray packs in between."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import StorageError

from .conftest import tree_digest, write_file
from .support import faultyfs
from .test_faults import fast_retries  # noqa: F401  (autouse: short retries, faults cleared around each test)

PERMISSION = r"storage failed: PUT packs/\w\w/\w+ on faulty://.*permission denied"


@pytest.fixture(autouse=True)
def patient_calls(fast_retries, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """No call here hangs, so no short deadline: with fast_retries' 0.5 s, a PUT whose thread a loaded
    machine did not run in time was retried, and the retry took the next fault's turn (a clean-clone
    CI run once saw the permission-denied upload succeed on its retry)."""
    monkeypatch.setenv("CKPTVAULT_OP_TIMEOUT", "30")


def make_source(root: Path, size: int = 4 << 20) -> Path:
    write_file(root / "model" / "weights.bin", os.urandom(size))  # several 1 MiB packs
    write_file(root / "config.json", b'{"layers": 2}')
    return root


def url() -> str:
    return f"faulty://recovery-{uuid.uuid4().hex}"


def stray_packs(target: str) -> set[bytes]:
    """Packs in the store that no index object names."""
    with Vault.open(target) as fresh:
        repo = fresh._repo
        repo.load_index()
        return set(repo.list_packs()) - repo.index.packs


def file_digest(root: Path) -> dict[str, tuple]:
    """The files' bytes, modes and mtimes (a pinned folder is a new folder: its own mtime)."""
    return {path: d for path, d in tree_digest(root).items() if d[0] == "file"}


def assert_restores(vault: Vault, snap, src: Path, out: Path) -> None:
    vault.restore(snap, out)
    assert tree_digest(out) == tree_digest(src)


def test_a_failed_pack_upload_does_not_fail_the_next_backup_of_the_same_vault(tmp_path: Path):
    src = make_source(tmp_path / "ckpt")
    target = url()
    vault = Vault.init(target, pack_size=1 << 20)
    faultyfs.FAULTS["put:/packs/"] = list("P")
    with pytest.raises(StorageError, match=PERMISSION):
        vault.backup(src, tags={"n": "1"})
    assert len(faultyfs.INJECTED) == 1

    snap = vault.backup(src, tags={"n": "2"})  # the same Vault, the same Repository object
    assert [s.id for s in vault.snapshots()] == [snap.id]
    assert_restores(vault, snap, src, tmp_path / "out")
    report = Vault.open(target).check(read_data=1.0)
    assert report.ok, report.problems
    assert report.snapshots == 1
    vault.close()


def test_a_prune_between_the_failure_and_the_retry_leaves_no_snapshot_on_a_deleted_pack(tmp_path: Path):
    # more than the largest chunk (4 MiB): two chunks at least, so a second pack to fail (4 MiB of random bytes
    # may be one chunk, and one pack, which lands: "DID NOT RAISE")
    src = make_source(tmp_path / "ckpt", 6 << 20)
    target = url()
    vault = Vault.init(target, pack_size=1 << 20)
    # one pack lands, the next ones fail (not a single "P": a clean-clone CI run once saw the backup pass,
    # the one failure taken by a call of another test, and a pack left over should fail the backup all the same)
    faultyfs.FAULTS["put:/packs/"] = list(".PPPPPPPP")
    with pytest.raises(StorageError, match=PERMISSION):
        vault.backup(src)
    faultyfs.FAULTS.clear()
    # The failed backup waited for its uploads before giving up its lock: what landed is in the
    # store now, in no index, and cannot land after a prune has looked.
    stray = stray_packs(target)
    assert stray

    with Vault.open(target) as other:
        other.prune(keep_latest=10)  # removes the packs no index names
    assert not stray & set(Vault.open(target)._repo.list_packs())

    snap = vault.backup(src)  # must not count the deleted packs' chunks as stored
    assert_restores(vault, snap, src, tmp_path / "out")
    report = Vault.open(target).check(read_data=1.0)
    assert report.ok, report.problems
    # every chunk the snapshot needs was read back (6 MiB of random bytes cut by content: 2 to 24 chunks)
    assert report.chunks_read == len({c for e in vault.files(snap) for c in e.chunks}) >= 2
    vault.close()


def test_backup_async_a_job_after_a_failed_upload_succeeds_and_no_pin_is_left(tmp_path: Path):
    first = make_source(tmp_path / "ckpt" / "step_1", 3 << 20)
    second = make_source(tmp_path / "ckpt" / "step_2", 3 << 20)
    expected = file_digest(second)
    target = url()
    vault = Vault.init(target, pack_size=1 << 20)
    faultyfs.FAULTS["put:/packs/"] = list("P")

    failed = vault.backup_async(first, tags={"run": "r", "step": "1"})
    assert failed.pinned
    assert isinstance(failed.exception(timeout=120), StorageError)
    later = vault.backup_async(second, tags={"run": "r", "step": "2"})
    assert later.pinned
    snap = later.result(timeout=120)  # before the fix: the first job's error again
    with pytest.raises(StorageError, match=PERMISSION):
        vault.flush(timeout=120)  # the first job's failure, reported once

    pins = tmp_path / "ckpt" / ".ckptvault-pins"
    assert not pins.exists() or not any(pins.iterdir()), "every pin is released"
    assert snap.tags["step"] == "2"
    vault.restore(snap, tmp_path / "out")
    assert file_digest(tmp_path / "out") == expected
    report = Vault.open(target).check(read_data=1.0)
    assert report.ok, report.problems
    assert [s.tags["step"] for s in Vault.open(target).snapshots()] == ["2"]
    vault.close()
