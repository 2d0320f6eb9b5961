"""GCS (fake-gcs-server) through a fault-injecting proxy: ckptvault's retries are the only ones, so
CKPTVAULT_RETRY_FOR bounds how long a failing call goes on, and each retry is said."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import StorageError
from ckptvault.store import backends

from ..conftest import tree_digest
from ..support.faultproxy import FaultProxy
from ..support.servers import RunningServer
from .conftest import make_checkpoint


@pytest.fixture
def gcs(server) -> RunningServer:
    return server("gcs-fake-gcs-server")


@pytest.fixture
def proxy(gcs: RunningServer, fault_proxy) -> FaultProxy:
    return fault_proxy(gcs)


@pytest.fixture
def options(gcs: RunningServer, proxy: FaultProxy) -> dict:
    """Storage options that reach the server through the proxy."""
    return {**gcs.backend.storage_options, "endpoint_url": f"http://127.0.0.1:{proxy.port}"}


def test_a_failing_call_is_bounded_by_ckptvaults_retries_and_said(
    gcs, proxy, options, tmp_path: Path, monkeypatch, caplog
):
    """gcsfs retried every request 6 times itself (~35 s) inside each of ckptvault's attempts: a restore
    over a link cutting every download gave up after ~220 s whether CKPTVAULT_RETRY_FOR was 20 or 120,
    and a 30 s outage was never said (audit 32a F5, F6)."""
    monkeypatch.setenv("CKPTVAULT_RETRIES", "2")
    monkeypatch.setenv("CKPTVAULT_RETRY_DELAY", "0.05")
    monkeypatch.setenv("CKPTVAULT_RETRY_FOR", "2")
    url = gcs.backend.new_url("cut-for-good")
    src = make_checkpoint(tmp_path / "ckpt", step=1, mb=4)
    with Vault.init(url, storage_options=options, pack_size=1 << 20) as vault:
        vault.backup(src)
    with Vault.open(url, storage_options=options) as vault:
        proxy.drop_all()
        proxy.cut_download_after_bytes = 300_000  # every pack GET, for good
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="ckptvault"), pytest.raises(StorageError, match="ClientPayloadError"):
            vault.restore("latest", tmp_path / "out")
        assert time.monotonic() - started < 30
        assert any("retrying in" in r.getMessage() for r in caplog.records), "the retries are said"
        proxy.heal()
        vault.restore("latest", tmp_path / "out")
    assert tree_digest(tmp_path / "out") == tree_digest(src)


def _gcs_error(status: str, message: str) -> bytes:
    body = json.dumps({"error": {"code": int(status.split()[0]), "message": message, "errors": []}}).encode()
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"Connection: close\r\n\r\n" + body


UNAUTHORIZED = _gcs_error("401 Unauthorized", "Invalid Credentials")


@pytest.mark.parametrize("refusals", [1, 2])
def test_a_token_refused_as_it_expires_is_tried_again(gcs, proxy, options, tmp_path: Path, refusals: int):
    """gcsfs's retry decorator, bypassed for outages, also tried a 401 "Invalid Credentials" again (a token
    that expired between its check and the call; the next call refreshes it): so does ckptvault, up to
    GCS_AUTH_TRIES, instead of failing a backup as access denied (review 32 L5)."""
    url = gcs.backend.new_url("token-expired")
    src = make_checkpoint(tmp_path / "ckpt", step=1, mb=1)
    with Vault.init(url, storage_options=options) as vault:
        proxy.drop_all()  # the next request opens a new connection, which the proxy refuses
        proxy.reply, proxy.max_replies = UNAUTHORIZED, refusals
        vault.backup(src)
        assert proxy.replied == refusals
        vault.restore("latest", tmp_path / "out")
    assert tree_digest(tmp_path / "out") == tree_digest(src)


def test_credentials_refused_for_good_fail_at_once_as_denied(gcs, proxy, options, tmp_path: Path):
    url = gcs.backend.new_url("token-bad")
    with Vault.init(url, storage_options=options) as vault:
        proxy.drop_all()
        proxy.reply = UNAUTHORIZED
        started = time.monotonic()
        with pytest.raises(StorageError, match="Invalid Credentials") as caught:
            vault.backup(make_checkpoint(tmp_path / "ckpt", step=1, mb=1))
        assert not caught.value.retryable
        assert proxy.replied == backends.GCS_AUTH_TRIES
        assert time.monotonic() - started < 10


def test_a_requester_pays_bucket_is_named_with_the_option_to_give(gcs, proxy, options, tmp_path: Path):
    url = gcs.backend.new_url("requester-pays")
    with Vault.init(url, storage_options=options) as vault:
        proxy.drop_all()
        proxy.reply = _gcs_error("400 Bad Request", "Bucket is a requester pays bucket but no user project provided.")
        with pytest.raises(StorageError, match=re.escape("give -o requester_pays=true")) as caught:
            vault.snapshots()
        assert "Error" not in str(caught.value) and not caught.value.retryable  # advice, not an exception's name


def test_an_emulator_gets_gcsfs_plain_filesystem_even_when_gcsfs_was_imported_first(gcs, tmp_path: Path):
    """gcsfs registers its experimental filesystem unless GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set
    before it was imported; that one probes each bucket's type over gRPC, which an emulator does not serve:
    a minute per bucket. A program that imported gcsfs first (its own code, another library) got it."""
    src = make_checkpoint(tmp_path / "ckpt", step=1, mb=1)
    script = (
        "import sys, gcsfs, json\n"
        "from ckptvault import Vault\n"
        "url, options, src = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]\n"
        "with Vault.init(url, storage_options=options) as vault:\n"
        "    vault.backup(src)\n"
        "    print(len(vault.snapshots()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"}
    args = [gcs.backend.new_url("imported-first"), json.dumps(gcs.backend.storage_options), str(src)]
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr
    assert "bucket type" not in proc.stderr, proc.stderr
    assert time.monotonic() - started < 40
