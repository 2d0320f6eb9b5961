"""Backups compact the small index objects (ops/compact.py): a vault that is never pruned keeps a
bounded number of them, and nothing is lost when compaction fails, races a long-lived Vault, or is
killed."""

from __future__ import annotations

import logging
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import StorageError
from ckptvault.ops.compact import COMPACT_AT
from tests.conftest import write_file

ROOT = Path(__file__).parent.parent


def state(step: int) -> bytes:
    return random.Random(step).randbytes(30_000)


def save(source: Path, step: int) -> None:
    write_file(source / "state.bin", state(step))
    write_file(source / "meta.json", f'{{"step": {step}}}'.encode())


def contents(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.iterdir()}


def assert_every_step_restores(url: str, tmp_path: Path, steps: list[int]) -> None:
    with Vault.open(url) as vault:
        report = vault.check(read_data=1.0)
        assert report.ok, report.problems
        for step in steps:
            out = tmp_path / f"out-{step}"
            vault.restore(vault.latest({"step": str(step)}), out)
            assert contents(out) == {"meta.json": f'{{"step": {step}}}'.encode(), "state.bin": state(step)}, step


def test_a_vault_that_is_never_pruned_keeps_few_index_objects(tmp_path: Path, vault: Vault, caplog):
    source = tmp_path / "ckpt"
    watcher = Vault.open(vault.url)  # another process that loaded the index before the compaction
    save(source, 0)
    vault.backup(source, tags={"step": "0"})
    watcher.snapshots()
    watcher._repo.load_index()
    counts = []
    for step in range(1, COMPACT_AT + 8):
        save(source, step)
        vault.backup(source, tags={"step": str(step)})
        counts.append(len(vault._repo.list_index_ids()))
    # one index object per backup; the one that makes more than COMPACT_AT leaves one for all of them
    assert counts == [*range(2, COMPACT_AT + 1), *range(1, 9)], counts

    with caplog.at_level(logging.WARNING, logger="ckptvault"):  # the watcher goes on as if nothing happened
        save(tmp_path / "other", 1000)
        watcher.backup(tmp_path / "other", tags={"step": "1000"})
        watcher.restore(watcher.latest({"step": "1"}), tmp_path / "watched")
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    # the watcher's index follows the compaction: what the vault stored meanwhile is not stored again
    assert watcher.backup(source, tags={"step": "9"}).summary.new_chunks == 0
    watcher.close()
    assert_every_step_restores(vault.url, tmp_path, [0, 1, COMPACT_AT, COMPACT_AT + 7, 1000])


def test_a_compaction_that_fails_is_a_warning_and_loses_nothing(
    tmp_path: Path, vault: Vault, monkeypatch: pytest.MonkeyPatch
):
    source = tmp_path / "ckpt"
    for step in range(COMPACT_AT):
        save(source, step)
        vault.backup(source, tags={"step": str(step)})
    deleted: list[bytes] = []
    real_delete = vault._repo.delete_index
    one_at_a_time = threading.Lock()  # the deletes run on several threads

    def failing_delete(index_id: bytes) -> None:
        with one_at_a_time:
            if deleted:
                raise StorageError("delete", "index/x", vault.url, "the network is down")
            deleted.append(index_id)
        real_delete(index_id)

    monkeypatch.setattr(vault._repo, "delete_index", failing_delete)
    warnings: list[str] = []
    save(source, COMPACT_AT)
    snap = vault.backup(source, tags={"step": str(COMPACT_AT)}, on_warning=warnings.append)
    assert snap.tags["step"] == str(COMPACT_AT)
    assert len(warnings) == 1 and "could not compact the vault's index objects" in warnings[0], warnings
    assert "the network is down" in warnings[0] and "the next backup tries again" in warnings[0]
    assert len(deleted) == 1 and len(vault._repo.list_index_ids()) > COMPACT_AT  # compacted one + old ones

    monkeypatch.undo()
    save(source, COMPACT_AT + 1)
    vault.backup(source, tags={"step": str(COMPACT_AT + 1)})
    assert len(vault._repo.list_index_ids()) == 1  # the next backup compacts them, duplicates included
    assert_every_step_restores(vault.url, tmp_path, [0, COMPACT_AT - 1, COMPACT_AT, COMPACT_AT + 1])


KILLING_BACKUP = """
import os, signal, sys
from ckptvault import Vault
from ckptvault.repository.repository import Repository

url, source, call, at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
real = getattr(Repository, call)
calls = [0]

def killing(self, *args):
    calls[0] += 1
    if calls[0] == at:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, *args)

setattr(Repository, call, killing)
with Vault.open(url) as vault:
    vault.backup(source, tags={"step": sys.argv[5]})
"""


@pytest.mark.parametrize(
    "call, at",
    [
        ("write_index", 2),  # the compacted object's write (the backup's own index object is the first)
        ("delete_index", 1),  # the compacted object written, nothing deleted
        ("delete_index", 2),
        ("delete_index", COMPACT_AT // 2),
        ("delete_index", COMPACT_AT + 1),  # the last of the 33
    ],
)
def test_a_backup_killed_while_it_compacts_loses_nothing(tmp_path: Path, vault: Vault, call: str, at: int):
    source = tmp_path / "ckpt"
    for step in range(COMPACT_AT):
        save(source, step)
        vault.backup(source, tags={"step": str(step)})
    save(source, COMPACT_AT)
    killed = subprocess.run(
        [sys.executable, "-c", KILLING_BACKUP, vault.url, str(source), call, str(at), str(COMPACT_AT)],
        cwd=ROOT,
        capture_output=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()  # killed where asked: in the compaction
    vault.close()
    with Vault.open(vault.url) as again:
        assert again.snapshots({"step": str(COMPACT_AT)})  # written before the compaction began
        save(source, COMPACT_AT + 1)
        again.backup(source, tags={"step": str(COMPACT_AT + 1)})
        assert len(again._repo.list_index_ids()) <= COMPACT_AT  # compacted again, or few enough left
    assert_every_step_restores(vault.url, tmp_path, [*range(COMPACT_AT + 2)])
