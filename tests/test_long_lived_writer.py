"""A Vault kept open across many backups (a training job's shipper, the watch sidecar) reads the
index objects and snapshot objects it has not read yet, not all of them at every backup, and still
never deduplicates against what another process's prune deleted meanwhile."""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path

import pytest

from ckptvault import Vault
from tests.conftest import write_file


def _count_reads(vault: Vault, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Whole-object reads of the vault's storage, by top-level folder (``index``, ``snapshots``...)."""
    reads: Counter[str] = Counter()
    store = vault._repo.store
    get = store.get

    def counting_get(key: str):
        reads[key.split("/", 1)[0]] += 1
        return get(key)

    monkeypatch.setattr(store, "get", counting_get)
    return reads


def test_the_nth_backup_of_a_long_lived_vault_reads_only_the_new_metadata(
    tmp_path: Path, vault: Vault, monkeypatch: pytest.MonkeyPatch
):
    source = tmp_path / "ckpt"
    for step in range(12):
        write_file(source / "state.bin", os.urandom(20_000))
        vault.backup(source, tags={"run": "a", "step": str(step)})
    with Vault.open(vault.url) as other:  # another process backs up meanwhile: its objects are new here
        write_file(tmp_path / "other" / "x.bin", os.urandom(20_000))
        other.backup(tmp_path / "other")

    reads = _count_reads(vault, monkeypatch)
    write_file(source / "state.bin", os.urandom(20_000))
    snap = vault.backup(source, tags={"run": "a", "step": "12"})
    # the other process's index object; its snapshot and this vault's previous one (written, not yet
    # listed); 13 index objects and 13 snapshots before
    assert reads["index"] == 1 and reads["snapshots"] == 2, reads
    assert len(vault.snapshots()) == 14 and reads["snapshots"] == 3
    assert snap.summary.new_chunks == 1


def test_a_long_lived_vault_stores_again_what_another_process_pruned_since(
    tmp_path: Path, vault: Vault, caplog: pytest.LogCaptureFixture
):
    dropped, kept = os.urandom(1_000_000), os.urandom(300_000)
    first, second = tmp_path / "first", tmp_path / "second"
    write_file(first / "optimizer.bin", dropped)
    write_file(second / "model.bin", kept)
    vault.backup(first, tags={"step": "1"})

    with Vault.open(vault.url) as other:
        other.backup(second, tags={"step": "2"})
        pruned = other.prune(keep_latest=1)
        assert pruned.forgotten and pruned.gc.delete_packs, pruned

    # the long-lived vault loaded the index that named the pruned packs: it must not reuse them
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        again = vault.backup(first, tags={"step": "3"})
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # no "missing from the store"
    assert again.summary.new_bytes == len(dropped), again.summary

    with Vault.open(vault.url) as fresh:
        assert fresh.check(read_data=1.0).ok
        fresh.restore(again, tmp_path / "out")
    assert (tmp_path / "out" / "optimizer.bin").read_bytes() == dropped
