"""A local vault whose folder goes away under an open Vault: moved, deleted, or its network disk
unmounted (leaving the empty mount point). Writes are retried, as for any storage outage, with a
message that says so; nothing is made in the vault's place; a vault back within the retries is
written as if nothing happened; a folder removed inside a vault is made again."""

from __future__ import annotations

import os
import re
import threading

import pytest

from ckptvault import Vault
from ckptvault.errors import ObjectNotFoundError, StorageError
from ckptvault.store.failures import storage_error

GONE = "the vault's folder is gone or empty (moved, deleted, or its disk unmounted?)"


@pytest.fixture
def few_retries(monkeypatch):
    monkeypatch.setenv("CKPTVAULT_RETRIES", "3")
    monkeypatch.setenv("CKPTVAULT_RETRY_DELAY", "0.05")


@pytest.fixture
def source(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(os.urandom(200_000))
    return folder


@pytest.mark.parametrize("how", ["moved", "unmounted"])
def test_a_backup_into_a_vault_gone_away_fails_as_an_outage_and_makes_nothing_in_its_place(
    tmp_path, few_retries, source, how
):
    repo = tmp_path / "vault"
    with Vault.open(str(repo), create=True) as vault:
        vault.backup(source, tags={"step": "1"})  # its folders (locks/, data/..) are known to exist now
        repo.rename(tmp_path / "elsewhere")
        if how == "unmounted":
            repo.mkdir()  # the empty mount point left behind
        gave_up = rf"PUT locks/\w+ on .*: {re.escape(GONE)} \(after 4 attempts\)"
        with pytest.raises(StorageError, match=gave_up) as caught:
            vault.backup(source, tags={"step": "2"})
        assert not isinstance(caught.value, ObjectNotFoundError)  # it said "run: ckptvault check"
        assert caught.value.retryable
        # an empty listing would read as "no snapshots" (and to prune as "no pack is needed")
        with pytest.raises(StorageError, match=rf"LIST snapshots/ on .*: {re.escape(GONE)}"):
            vault.snapshots()
    assert (os.listdir(repo) == []) if how == "unmounted" else not repo.exists()
    with Vault.open(str(tmp_path / "elsewhere")) as moved:
        assert [s.tags["step"] for s in moved.snapshots()] == ["1"]
        assert moved.check().ok


def test_a_vault_back_within_the_retries_is_written_as_if_nothing_happened(tmp_path, monkeypatch, source):
    monkeypatch.setenv("CKPTVAULT_RETRY_DELAY", "0.2")  # a network mount that drops for half a second
    repo = tmp_path / "vault"
    with Vault.open(str(repo), create=True) as vault:
        vault.backup(source, tags={"step": "1"})
        repo.rename(tmp_path / "away")
        threading.Timer(0.5, (tmp_path / "away").rename, (repo,)).start()
        vault.backup(source, tags={"step": "2"})
        assert [s.tags["step"] for s in vault.snapshots()] == ["1", "2"]
        assert vault.check(read_data=1.0).ok


def test_a_folder_removed_inside_the_vault_is_made_again(tmp_path, few_retries, source):
    repo = tmp_path / "vault"
    with Vault.open(str(repo), create=True) as vault:
        vault.backup(source, tags={"step": "1"})
        (repo / "locks").rmdir()  # emptied by the backup's unlock; removed by hand
        vault.backup(source, tags={"step": "2"})
        assert [s.tags["step"] for s in vault.snapshots()] == ["1", "2"]


def test_a_write_that_finds_no_folder_is_classified_as_an_outage_not_a_missing_object():
    # SFTP and fsspec's local folders raise FileNotFoundError for a write whose folder is gone; an object
    # store has no folders (a bucket gone is told apart before)
    missing = FileNotFoundError(2, "No such file", "/vault/locks/x")
    for url in ("sftp://host/vault", "file:///vault"):
        put = storage_error("PUT", "locks/x", url, missing)
        assert type(put) is StorageError and put.retryable
        assert "the folder it goes into is missing (the vault moved, deleted, or its disk unmounted?)" in str(put)
        assert isinstance(storage_error("GET", "locks/x", url, missing), ObjectNotFoundError)
    assert isinstance(storage_error("PUT", "locks/x", "gs://bucket/vault", missing), ObjectNotFoundError)
