"""Read-only S3 credentials (a SeaweedFS identity allowed Read and List only): a node given read
access restores, checks and drills without writing a lock, with a warning; writing is refused with
one line naming access."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import StorageError

from ..conftest import tree_digest
from ..support import servers
from .conftest import make_checkpoint

READ_KEY, READ_SECRET = "read-only-key", "read-only-secret"


@pytest.fixture(scope="module")
def seaweed_with_a_reader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.RunningServer]:
    workdir = tmp_path_factory.mktemp("seaweed-ro")
    reader = servers.s3_identity("reader", READ_KEY, READ_SECRET, ("Read", "List"))
    try:
        srv = servers.start_seaweedfs(workdir, more_identities=(reader,))
    except servers.ServerUnavailable as exc:
        pytest.skip(f"BACKEND NOT TESTED: s3-seaweedfs (read-only identity): {exc}")
    yield srv
    srv.stop()


def test_read_only_credentials_restore_and_check_without_a_lock(
    seaweed_with_a_reader, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    backend = seaweed_with_a_reader.backend
    url = f"{backend.base_url}/ro-{tmp_path.name}"
    src = make_checkpoint(tmp_path / "ckpt", 1)
    with Vault.init(url, storage_options=backend.storage_options) as vault:
        snap = vault.backup(src, tags={"run": "x"})
    read_only = {**backend.storage_options, "key": READ_KEY, "secret": READ_SECRET}
    reading = Vault.open(url, storage_options=read_only)
    with caplog.at_level(logging.WARNING, logger="ckptvault.locks"), reading as vault:
        vault.restore(vault.latest({"run": "x"}), tmp_path / "out")
        assert tree_digest(tmp_path / "out") == tree_digest(src)
        assert vault.check(read_data=1.0).ok and vault.is_backed_up(src)
        assert "cannot write a lock" in caplog.text and "access denied" in caplog.text
        with pytest.raises(StorageError, match="access denied"):
            vault.backup(src, tags={"run": "x"})
        assert [s.id for s in vault.snapshots()] == [snap.id]
