"""Faulty backends: transient faults are retried with backoff and change nothing in the result;
permanent ones fail with one line naming the backend operation, and leave no snapshot that
points at missing data."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import IntegrityError, StorageError

from .conftest import tree_digest
from .support import faultyfs

ROOT = Path(__file__).parent.parent


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CKPTVAULT_RETRY_DELAY", "0.01")
    monkeypatch.setenv("CKPTVAULT_RETRIES", "3")
    monkeypatch.setenv("CKPTVAULT_OP_TIMEOUT", "0.5")
    faultyfs.FAULTS.clear()
    faultyfs.INJECTED.clear()
    yield
    faultyfs.FAULTS.clear()


@pytest.fixture
def src(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    (root / "model").mkdir(parents=True)
    (root / "model" / "weights.bin").write_bytes(os.urandom(3 << 20))
    (root / "config.json").write_text('{"layers": 2}')
    return root


def url() -> str:
    return f"faulty://vault-{uuid.uuid4().hex}"


def tree_signature(vault: Vault, snap) -> list[tuple]:
    return [(e.path, e.type, e.size, e.blake3, tuple(e.chunks)) for e in vault.files(snap)]


def test_transient_faults_are_retried_and_change_nothing(tmp_path: Path, src: Path):
    clean = Vault.init(url(), pack_size=1 << 20)
    expected = tree_signature(clean, clean.backup(src))

    faulty = url()
    vault = Vault.init(faulty, pack_size=1 << 20)
    faultyfs.FAULTS.update(
        {"put:/packs/": list("TT.T"), "put:/index/": list("T"), "list": list("T"), "get": list("T.S.C")}
    )
    snap = vault.backup(src)
    assert tree_signature(vault, snap) == expected
    vault.restore(snap, tmp_path / "out")
    assert tree_digest(tmp_path / "out") == tree_digest(src)
    kinds = {action for _, _, action in faultyfs.INJECTED}
    assert kinds == {"T", "S", "C"}, faultyfs.INJECTED
    assert Vault.open(faulty).check(read_data=1.0).ok


def test_a_hanging_call_is_abandoned_and_retried(src: Path):
    vault = Vault.init(url(), pack_size=1 << 20)
    faultyfs.FAULTS["put:/packs/"] = list("H")
    snap = vault.backup(src)
    assert ("put", "H") in {(op, a) for op, _, a in faultyfs.INJECTED}
    assert b"".join(vault.read_file(snap, "config.json")) == b'{"layers": 2}'


def test_permanent_fault_fails_naming_the_operation_and_leaves_no_snapshot(src: Path):
    target = url()
    vault = Vault.init(target, pack_size=1 << 20)
    first = vault.backup(src, tags={"n": "1"})
    (src / "new.bin").write_bytes(os.urandom(1 << 20))
    faultyfs.FAULTS["put:/packs/"] = list("P")
    with pytest.raises(StorageError, match=r"storage failed: PUT packs/\w\w/\w+ on faulty://.*permission denied"):
        vault.backup(src, tags={"n": "2"})
    assert len(faultyfs.INJECTED) == 1  # not retried: permission errors do not pass by themselves
    after = Vault.open(target)
    assert [s.id for s in after.snapshots()] == [first.id]
    assert after.check(read_data=1.0).ok


def test_transient_faults_that_never_stop_give_up(src: Path):
    vault = Vault.init(url(), pack_size=1 << 20)
    faultyfs.FAULTS["put:/packs/"] = list("TTTTTTTT")
    with pytest.raises(StorageError, match=r"PUT packs/.*connection reset.*\(after 4 attempts\)"):
        vault.backup(src)
    assert vault.snapshots() == []


def test_persistent_corruption_is_reported_not_retried_forever(tmp_path: Path, src: Path):
    vault = Vault.init(url(), pack_size=1 << 20)
    vault.backup(src)
    faultyfs.FAULTS["get:/packs/"] = list("CCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC")
    with pytest.raises(IntegrityError, match=r"restore incomplete: 2 file\(s\) failed verification"):
        vault.restore("latest", tmp_path / "out")
    assert not (tmp_path / "out" / "model" / "weights.bin").exists()


def test_cli_permanent_fault_is_one_line_with_the_operation(tmp_path: Path, src: Path):
    # faulty:// starts empty in a new process: fail the very first write, init's config
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.faultyfs", "init", "faulty://cli-vault"],
        cwd=ROOT,
        env={**os.environ, "CKPTVAULT_TEST_FAULTS": "put:/config=P"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 20
    assert err.count("\n") == 1 and err.startswith("error: storage failed: PUT config on faulty://cli-vault")
    assert "Traceback" not in err


def test_a_storage_error_stops_the_restore_and_leaves_no_temp_files(tmp_path: Path, src: Path):
    vault = Vault.init(url(), pack_size=1 << 20)
    vault.backup(src)
    faultyfs.FAULTS["get:/packs/"] = list("P")
    out = tmp_path / "out"
    with pytest.raises(StorageError, match=r"GET packs/.*permission denied"):
        vault.restore("latest", out)
    assert not [p for p in out.rglob("*") if ".ckptvault-tmp-" in p.name]
