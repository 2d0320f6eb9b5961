"""Faults between ckptvault and Azure Blob storage (Azurite behind the FaultProxy): ckptvault's
retries are the only ones, as on S3 (docs/backends.md, "One retry layer")."""

from __future__ import annotations

import time

import pytest

from ckptvault.errors import StorageError
from ckptvault.store import open_store
from ckptvault.store.retrying import RetryPolicy

from ..support.faultproxy import FaultProxy
from ..support.servers import RunningServer, azurite_connection_string

_BUSY_XML = b"<?xml version='1.0'?><Error><Code>ServerBusy</Code><Message>The server is busy.</Message></Error>"
SERVER_BUSY = (
    b"HTTP/1.1 503 The server is busy.\r\nContent-Type: application/xml\r\nx-ms-error-code: ServerBusy\r\n"
    + f"Connection: close\r\nContent-Length: {len(_BUSY_XML)}\r\n\r\n".encode()
    + _BUSY_XML
)


@pytest.fixture
def azurite(server) -> RunningServer:
    return server("azure-azurite")


@pytest.fixture
def proxy(azurite: RunningServer, fault_proxy) -> FaultProxy:
    return fault_proxy(azurite)


def test_a_busy_answer_is_one_request_per_attempt(azurite, proxy):
    """azure-storage-blob's own ExponentialRetry (15 s, then x3, 3 times) ran inside each of ckptvault's
    attempts: a 503 outage was first said after ~64 s, ended as "no answer" at the call's deadline, and a
    restore gave up after ~15 minutes (audit 31a F2). One attempt is one request now, answered at once."""
    options = {"connection_string": azurite_connection_string(proxy.port)}
    store = open_store(azurite.backend.new_url("busy"), options, RetryPolicy(retries=1, base_delay=0.05))
    store.put("obj", b"x")
    proxy.drop_all()
    proxy.reply = SERVER_BUSY
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"ServerBusy|busy") as info:
        store.get("obj")
    assert proxy.replied == 2, f"{proxy.replied} requests for 2 attempts"
    assert time.monotonic() - started < 10, "the SDK waited between tries of its own"
    assert "no answer" not in str(info.value), info.value
