"""Network faults between ckptvault and a real S3 server (moto_server), injected by a TCP proxy
(tests/support/faultproxy.py): connections cut in the middle of an upload, reset as they are
accepted, a server that accepts and never answers, a gateway that refuses every request.

Transient faults: the backup succeeds and stores exactly what a fault-free backup stores.
Permanent ones: a one-line error naming the operation and the URL, a non-zero exit, and no snapshot
that points at missing data (check --read-data passes, the earlier snapshot restores bit-exact).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.chunking import ChunkerParams
from ckptvault.errors import StorageError
from ckptvault.store import FsspecStore

from ..conftest import tree_digest
from ..support.faultproxy import FaultProxy
from ..support.servers import CLIENT_ENV, Backend, RunningServer
from .conftest import make_checkpoint, one_line_error

SMALL_CHUNKS = ChunkerParams(min_size=16 * 1024, avg_size=64 * 1024, max_size=256 * 1024)
PACK = 1 << 20  # 1 MiB packs: several uploads per backup, each big enough to cut in the middle
_DENIED_XML = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
)
ACCESS_DENIED = (
    b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    + f"Content-Length: {len(_DENIED_XML)}\r\n\r\n".encode()
    + _DENIED_XML
)


class ArmOnFirstBytes:
    """A Progress that arms the fault once the backup has read its first bytes: the lock is taken
    and uploads are about to start, so the fault lands in the middle of the backup."""

    def __init__(self, proxy: FaultProxy, arm) -> None:
        self.proxy, self.arm, self.armed = proxy, arm, False

    def start(self, total_bytes: int, total_files: int) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        if not self.armed:
            self.armed = True
            self.proxy.drop_all()
            self.arm(self.proxy)

    def finish(self) -> None:
        pass


@pytest.fixture
def moto(server) -> RunningServer:
    return server("s3-moto")


@pytest.fixture
def proxy(moto: RunningServer, fault_proxy) -> FaultProxy:
    return fault_proxy(moto)


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTVAULT_RETRY_DELAY", "0.05")
    monkeypatch.setenv("CKPTVAULT_RETRIES", "5")
    monkeypatch.setenv("CKPTVAULT_OP_TIMEOUT", "3")


def via(backend: Backend, proxy: FaultProxy) -> dict:
    return {**backend.storage_options, "endpoint_url": f"http://127.0.0.1:{proxy.port}"}


def signature(vault: Vault, snap) -> list[tuple]:
    return [(e.path, e.type, e.size, e.blake3, tuple(e.chunks)) for e in vault.files(snap)]


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "ckpt", step=1, mb=4)


@pytest.fixture
def expected(moto: RunningServer, src: Path) -> list[tuple]:
    """What a fault-free backup of ``src`` stores (chunk IDs included)."""
    clean = Vault.init(moto.backend.new_url("clean"), storage_options=moto.backend.storage_options,
                       chunker=SMALL_CHUNKS, pack_size=PACK)  # fmt: skip
    with clean:
        return signature(clean, clean.backup(src))


def faulty_backup(moto: RunningServer, proxy: FaultProxy, src: Path, arm) -> tuple[Vault, object]:
    url = moto.backend.new_url("faults")
    vault = Vault.init(url, storage_options=via(moto.backend, proxy), chunker=SMALL_CHUNKS, pack_size=PACK)
    proxy.drop_all()  # no pooled connection may dodge the fault
    arm(proxy)
    snap = vault.backup(src)
    proxy.heal()
    return vault, snap


@pytest.mark.parametrize(
    "fault",
    ["cut mid-upload", "reset on accept", "stalled server"],
)
def test_transient_network_faults_change_nothing(moto, proxy, src, expected, tmp_path: Path, fault: str):
    def arm(p: FaultProxy) -> None:
        if fault == "cut mid-upload":
            p.cut_after_bytes, p.max_cuts = 300_000, 3  # inside a 1 MiB pack PUT
        elif fault == "reset on accept":
            p.reset_next = 3
        else:
            p.stall, p.stall_connections = True, 1  # the first new connection never answers

    started = time.monotonic()
    vault, snap = faulty_backup(moto, proxy, src, arm)
    elapsed = time.monotonic() - started
    fired = {"cut mid-upload": proxy.cuts, "reset on accept": proxy.resets, "stalled server": proxy.stalled}[fault]
    assert fired >= 1, f"the fault never fired ({proxy.connections} connections)"
    if fault == "stalled server":
        assert elapsed >= 3, "the stalled call should have waited for its deadline"
    assert signature(vault, snap) == expected
    vault.restore(snap, tmp_path / "out")
    assert tree_digest(tmp_path / "out") == tree_digest(src)
    assert vault.check(read_data=1.0).ok
    vault.close()


def test_a_download_cut_midway_is_retried_and_the_restore_is_exact(moto, proxy, src, tmp_path: Path, caplog):
    """A connection reset in the middle of a response body (a NAT entry dropped during a restore on a new
    machine): aiohttp's ContentLengthError carries code 400, which was taken for the server's answer, so
    the restore failed at once, unretried (audit 30b F1). It is retried; the restore is bit-exact."""
    url = moto.backend.new_url("download-cuts")
    with Vault.init(url, storage_options=via(moto.backend, proxy), chunker=SMALL_CHUNKS, pack_size=PACK) as vault:
        vault.backup(src)
    proxy.drop_all()
    proxy.cut_download_after_bytes, proxy.max_download_cuts = 300_000, 3  # inside a 1 MiB pack GET
    opts = via(moto.backend, proxy)
    with caplog.at_level("WARNING", logger="ckptvault"), Vault.open(url, storage_options=opts) as vault:
        vault.restore("latest", tmp_path / "out")
    assert proxy.download_cuts == 3, f"the fault fired {proxy.download_cuts} times"
    assert tree_digest(tmp_path / "out") == tree_digest(src)
    assert any("retrying" in r.getMessage() and "ClientPayloadError" in r.getMessage() for r in caplog.records)


_SLOW_DOWN_XML = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    + f"Content-Length: {len(_SLOW_DOWN_XML)}\r\n\r\n".encode()
    + _SLOW_DOWN_XML
)


@pytest.mark.parametrize("retry_for", ["30", "0"])
def test_a_503_window_longer_than_the_retries_is_ridden_out(
    moto, proxy, src, tmp_path: Path, monkeypatch, caplog, retry_for
):
    """A restore on a fresh machine ended with exit 20 on a 20 s SlowDown window (or refused connections),
    though the storage answered again while it ran: a call's 6 attempts wait 8-15 s in all (audit 31a F1).
    A storage down or busy is retried for CKPTVAULT_RETRY_FOR seconds (default 120) past those attempts.
    Here the attempts wait 1.55 s at most (CKPTVAULT_RETRY_DELAY 0.05) and the window lasts 4 s."""
    url = moto.backend.new_url(f"slow-down-{retry_for}")
    opts = via(moto.backend, proxy)
    with Vault.init(url, storage_options=opts, chunker=SMALL_CHUNKS, pack_size=PACK) as vault:
        vault.backup(src)
    monkeypatch.setenv("CKPTVAULT_RETRY_DELAY", "0.05")
    monkeypatch.setenv("CKPTVAULT_RETRY_FOR", retry_for)
    vault = Vault.open(url, storage_options=opts)
    proxy.drop_all()
    proxy.reply = SLOW_DOWN
    healing = threading.Timer(4.0, proxy.heal)
    healing.start()
    try:
        with caplog.at_level("WARNING", logger="ckptvault"):
            if retry_for == "0":  # by attempts alone, as before
                with pytest.raises(StorageError, match=r"SlowDown|reduce your request rate"):
                    vault.restore("latest", tmp_path / "out")
                return
            vault.restore("latest", tmp_path / "out")
    finally:
        healing.join()
        vault.close()
    assert proxy.replied > 6, proxy.replied  # the window was hit, past one call's attempts
    assert tree_digest(tmp_path / "out") == tree_digest(src)
    assert any("the storage is down or busy: retrying" in r.getMessage() for r in caplog.records)


def test_a_stalled_read_says_how_long_it_waited(moto, proxy, src, tmp_path: Path, monkeypatch):
    """The client's own read timeout (60 s by default) ends a stalled download before the call's deadline
    (longer for a big object): the message said the deadline, "no answer after 92 s", after 60 s, so a
    user raised CKPTVAULT_OP_TIMEOUT to no effect (audit 30b F3). It says the time waited."""
    opts = {**via(moto.backend, proxy), "config_kwargs": {"read_timeout": 1}}
    url = moto.backend.new_url("stalled-read")
    with Vault.init(url, storage_options=opts, chunker=SMALL_CHUNKS, pack_size=PACK) as vault:
        vault.backup(src)
    monkeypatch.setenv("CKPTVAULT_OP_TIMEOUT", "20")
    monkeypatch.setenv("CKPTVAULT_RETRIES", "0")
    vault = Vault.open(url, storage_options=opts)
    proxy.drop_all()
    proxy.cut_download_after_bytes, proxy.stall_downloads = 300_000, True  # mid-body of a 1 MiB pack GET
    with pytest.raises(StorageError, match=r"GET packs/.*no answer after 1(\.\d+)? s") as info:
        vault.restore("latest", tmp_path / "out")
    assert "20 s" not in str(info.value), info.value
    proxy.heal()
    vault.close()


def test_a_stalled_put_ends_at_its_deadline(moto, proxy):
    """aiobotocore waits for "100 Continue" with no timeout of its own; the per-call deadline ends it."""
    # 3 s: the first PUT (a new connection, the bucket looked at) took over 1.5 s on a loaded machine (a CI run)
    store = FsspecStore(moto.backend.new_url("stall"), via(moto.backend, proxy), op_timeout=3)
    store.put("warm", b"x")  # the bucket is reachable
    proxy.drop_all()
    proxy.stall = True
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"PUT big on s3://.*no answer after 3 s") as info:
        store.put("big", b"\0" * (8 << 20))
    assert info.value.retryable
    assert time.monotonic() - started < 10
    assert proxy.stalled >= 1


def permanent_case(moto: RunningServer, proxy: FaultProxy, src: Path, arm) -> tuple[Vault, str, StorageError]:
    url = moto.backend.new_url("permanent")
    opts = via(moto.backend, proxy)
    vault = Vault.init(url, storage_options=opts, chunker=SMALL_CHUNKS, pack_size=PACK)
    first = vault.backup(src)
    make_checkpoint(src, step=2, mb=4)
    with pytest.raises(StorageError) as info:
        vault.backup(src, on_progress=ArmOnFirstBytes(proxy, arm))
    vault.close()
    proxy.heal()
    after = Vault.open(url, storage_options=opts)
    assert [s.id for s in after.snapshots()] == [first.id]  # nothing committed
    assert after.check(read_data=1.0).ok
    return after, first.id, info.value


def test_a_refusing_gateway_fails_at_once_without_retries(moto, proxy, src):
    vault, _, error = permanent_case(moto, proxy, src, lambda p: setattr(p, "reply", ACCESS_DENIED))
    assert "access denied" in str(error) and "attempts" not in str(error), error
    assert error.op == "PUT" and error.key.startswith("packs/"), error
    assert not error.retryable
    assert proxy.replied <= 4  # one attempt per call in flight, no retries
    vault.close()


def test_a_server_that_never_answers_fails_after_bounded_retries(moto, proxy, src, monkeypatch):
    monkeypatch.setenv("CKPTVAULT_OP_TIMEOUT", "1")
    monkeypatch.setenv("CKPTVAULT_RETRIES", "1")
    started = time.monotonic()
    vault, _, error = permanent_case(moto, proxy, src, lambda p: setattr(p, "stall", True))
    # each attempt waited out its deadline: the error says how long in all, and which setting sets that wait
    said = r"no answer after 1 s \(after 2 attempts in [\d.]+ s; CKPTVAULT_OP_TIMEOUT sets"
    assert re.search(said, str(error)), error
    assert error.op == "PUT" and error.key.startswith("packs/"), error
    assert time.monotonic() - started < 60
    vault.close()


def test_cli_upload_cut_forever_is_one_line_and_commits_nothing(moto, proxy, remote_cli, tmp_path: Path):
    """Every connection is cut after 300 kB: small requests pass, every pack upload dies midway."""
    backend = Backend(
        name="s3-moto-via-proxy",
        base_url=moto.backend.base_url,
        storage_options={},
        env=moto.backend.env,
        cli_options=["-o", f"endpoint_url=http://127.0.0.1:{proxy.port}"],
    )
    repo = moto.backend.new_url("cli-faults")
    src = make_checkpoint(tmp_path / "ckpt", step=1, mb=4)
    env = {"CKPTVAULT_RETRIES": "2", "CKPTVAULT_RETRY_DELAY": "0.05"}
    remote_cli(backend, "init", repo, "--pack-size-mib", "1", **env)
    remote_cli(backend, "backup", str(src), "--repo", repo, "-q", **env)
    before = tree_digest(src)
    make_checkpoint(src, step=2, mb=4)
    proxy.cut_after_bytes = 300_000
    proc = remote_cli(backend, "backup", str(src), "--repo", repo, check=False, **env)
    line = one_line_error(proc)
    assert proc.returncode == 20
    assert line.startswith("error: storage failed: PUT packs/") and f" on {repo}: " in line, line
    assert "(after 3 attempts)" in line, line
    assert proxy.cuts >= 3
    proxy.heal()
    snaps = json.loads(remote_cli(backend, "snapshots", "--repo", repo, "--json", **env).stdout)
    assert len(snaps) == 1
    remote_cli(backend, "check", "--read-data", "--repo", repo, **env)
    remote_cli(backend, "restore", "latest", str(tmp_path / "out"), "--repo", repo, "-q", **env)
    assert tree_digest(tmp_path / "out") == before


def test_a_restore_from_a_server_that_stopped_answering_makes_few_attempts(moto, proxy, src, tmp_path, monkeypatch):
    """Once one read gave up, the restore's other reads do not each wait out a budget of their own."""
    opts = via(moto.backend, proxy)
    url = moto.backend.new_url("stalled-restore")
    vault = Vault.init(url, storage_options=opts, chunker=SMALL_CHUNKS, pack_size=PACK)
    vault.backup(src)
    vault.close()
    monkeypatch.setenv("CKPTVAULT_OP_TIMEOUT", "1")
    monkeypatch.setenv("CKPTVAULT_RETRIES", "1")
    monkeypatch.setenv("CKPTVAULT_READAHEAD_MIB", "0.25")
    monkeypatch.setenv("CKPTVAULT_DOWNLOADS", "4")
    vault = Vault.open(url, storage_options=opts)
    stall = ArmOnFirstBytes(proxy, lambda p: setattr(p, "stall", True))
    with pytest.raises(StorageError, match=r"GET packs/.*no answer after 1 s"):
        vault.restore("latest", tmp_path / "out", on_progress=stall)
    # the reads under way (4) finish their two attempts each; the next call is one probe, and the rest
    # (queued reads, read-ahead fallbacks, the lock's release) are not tried
    assert proxy.stalled <= 4 * 2 + 1, proxy.stalled
    vault.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_backup_interrupted_while_the_network_is_dead_ends_with_the_attempts_in_flight(
    moto, proxy, src, tmp_path, sig
):
    """Mid-upload the path to the storage goes dead (nothing answers, nothing is reset: a vanished NAT
    entry), then Ctrl-C or a preemption's SIGTERM: the calls in flight are not tried again, so the
    backup ends after one deadline (3 s here), not after every retry of every upload (6 x 3 s each)."""
    url = moto.backend.new_url("interrupted")
    Vault.init(url, storage_options=moto.backend.storage_options, chunker=SMALL_CHUNKS, pack_size=PACK).close()
    env = {**os.environ, **CLIENT_ENV, **moto.backend.env, "XDG_DATA_HOME": str(tmp_path / "xdg")}
    endpoint = f"endpoint_url=http://127.0.0.1:{proxy.port}"
    args = ["backup", str(src), "--repo", url, "-q", "-o", endpoint, "--limit-upload", "1MB"]  # ~4 s of packs
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptvault", *args],
            cwd=Path(__file__).resolve().parents[2],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        deadline = time.monotonic() + 30
        while "retrying" not in (tmp_path / "stderr").read_text():
            if proxy.connections >= 4 and not proxy.stall:  # its uploads have begun: the path goes dead
                proxy.stall = True
                proxy.drop_all()
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
            time.sleep(0.05)
        proc.send_signal(sig)
        started = time.monotonic()
        rc = proc.wait(120)
    took = time.monotonic() - started
    stderr = (tmp_path / "stderr").read_text()
    assert rc == (130 if sig == signal.SIGINT else 143), stderr
    assert took < 9, f"took {took:.1f} s to end: {stderr}"


def test_downloads_cut_for_good_are_a_network_fault_not_pack_damage(moto, proxy, src, tmp_path, monkeypatch):
    """A link that resets every long download (a middlebox, a flaky VPN): the storage answered, nothing
    stored is damaged. It was called pack damage ("damaged where it is stored"), repair-index
    --drop-failing-packs then dropped intact packs, and the restore's shared lock was left behind as
    "the storage is not answering", refusing other hosts' prunes for 30 minutes (audit 32a F2, F3)."""
    monkeypatch.setenv("CKPTVAULT_RETRY_FOR", "1")
    url = moto.backend.new_url("cut-for-good")
    with Vault.init(url, storage_options=via(moto.backend, proxy), pack_size=PACK) as vault:  # chunks of ~1 MiB
        vault.backup(src)
    proxy.drop_all()
    proxy.cut_download_after_bytes = 300_000  # every pack GET, for good
    with Vault.open(url, storage_options=via(moto.backend, proxy)) as vault:
        with pytest.raises(StorageError, match="ClientPayloadError") as caught:
            vault.restore("latest", tmp_path / "out")
        assert "drop-failing-packs" not in str(caught.value)
        assert vault.locks() == [], "the restore's shared lock is removed: the storage answers"
        report = vault.check(read_data=1.0)
        assert report.problems and not any(p.failing for p in report.problems)
        assert all(p.unreadable for p in report.problems)
        assert vault.repair_index(drop_failing=True).failing_packs == []
    proxy.heal()
    with Vault.open(url, storage_options=moto.backend.storage_options) as vault:
        vault.restore("latest", tmp_path / "out")
        assert vault.check(read_data=1.0).ok
    assert tree_digest(tmp_path / "out") == tree_digest(src)
