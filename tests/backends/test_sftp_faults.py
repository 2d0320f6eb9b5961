"""SFTP through a fault-injecting proxy: a download that stalls mid-body (a connection dropped without
a word: a NAT entry, a VPN) must not hold its pooled session for good."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptvault import Vault

from ..conftest import tree_digest
from ..support.faultproxy import FaultProxy
from ..support.servers import RunningServer
from .conftest import make_checkpoint


@pytest.fixture
def sshd(server) -> RunningServer:
    return server("sftp-openssh")


@pytest.fixture
def proxy(sshd: RunningServer, fault_proxy) -> FaultProxy:
    return fault_proxy(sshd)


def test_stalled_downloads_give_their_sessions_back(sshd, proxy, tmp_path: Path, monkeypatch):
    """Each stalled read's thread stayed blocked after its deadline gave up on it, holding one of the
    pool's 8 sessions: after 8, every call of the process failed ("no free session"), the server healthy
    again, until it restarted: a watch sidecar or a trainer's backup_async (audit 32a F1)."""
    monkeypatch.setenv("CKPTVAULT_OP_TIMEOUT", "2")
    monkeypatch.setenv("CKPTVAULT_RETRY_DELAY", "0.05")
    url = sshd.backend.base_url.replace(f":{sshd.port}/", f":{proxy.port}/") + "/stalls"
    options = sshd.backend.storage_options
    src = make_checkpoint(tmp_path / "ckpt", step=1, mb=8)
    with Vault.init(url, storage_options=options, pack_size=1 << 20) as vault:
        vault.backup(src)
    with Vault.open(url, storage_options=options) as vault:
        proxy.drop_all()
        proxy.cut_download_after_bytes, proxy.stall_downloads, proxy.max_download_cuts = 300_000, True, 8
        vault.restore("latest", tmp_path / "out")  # every stalled read is retried on a new session
        assert proxy.download_cuts == 8
        assert tree_digest(tmp_path / "out") == tree_digest(src)
        make_checkpoint(src, step=2, mb=8)
        vault.backup(src)  # the same Vault, long after: its sessions were given back
        vault.restore("latest", tmp_path / "out2")
    assert tree_digest(tmp_path / "out2") == tree_digest(src)
