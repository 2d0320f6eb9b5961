"""The store conformance suite (tests/test_store.py) against every real server, through the same
``open_store`` (retries, deadlines) a repository uses."""

from __future__ import annotations

import pytest

from ckptvault.store import RetryPolicy, open_store

from ..test_store import StoreConformance


class RemoteConformance(StoreConformance):
    backend = ""

    @pytest.fixture
    def store(self, server):
        b = server(self.backend).backend
        # short backoff: the suite's short-read case is retried (over a network the next try may succeed)
        return open_store(b.new_url("conformance"), b.storage_options, RetryPolicy(base_delay=0.01, op_timeout=60))

    def test_store_knows_it_is_remote(self, store):
        assert store.remote
        assert store.transfers.uploads >= 4 and store.transfers.downloads >= 8


class TestS3SeaweedFS(RemoteConformance):
    backend = "s3-seaweedfs"


class TestS3Moto(RemoteConformance):
    backend = "s3-moto"


class TestGcsFakeGcsServer(RemoteConformance):
    backend = "gcs-fake-gcs-server"


class TestAzureAzurite(RemoteConformance):
    backend = "azure-azurite"


class TestSftpOpenSSH(RemoteConformance):
    backend = "sftp-openssh"
