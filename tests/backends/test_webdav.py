"""WebDAV (WsgiDAV through webdav4): a backend with folders and no adapter of its own, served by the
generic fsspec path (docs/backends.md)."""

from __future__ import annotations

import shutil
import threading
import uuid
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import ObjectNotFoundError, StorageError
from ckptvault.store import RetryPolicy, open_store

from ..conftest import tree_digest
from ..support.servers import RunningServer
from .conftest import make_checkpoint


@pytest.fixture
def dav(server) -> RunningServer:
    return server("webdav-wsgidav")


def test_parallel_first_writes_into_folders_not_made_yet(dav, monkeypatch):
    """A backup's upload threads each make their pack's folder, packs/ itself missing in a new vault: a
    thread whose mkdir failed for the missing packs/, which another thread made just after, failed its
    PUT as "object packs/.. is missing" (or webdav4's "ResourceConflict"), no retry: the first backup of a
    new WebDAV vault failed so about once in ten (h53). 8 writers at once, each into a folder of its own."""
    monkeypatch.setenv("CKPTVAULT_RETRIES", "0")
    b = dav.backend
    for _ in range(3):
        store = open_store(b.new_url("race"), b.storage_options, RetryPolicy(base_delay=0.01, op_timeout=60))
        store.put("config", b"{}")  # the vault exists: its folders are made one level at a time from here
        start = threading.Barrier(8)
        errors: list[Exception] = []

        def write(i: int, store=store, start=start, errors=errors) -> None:
            start.wait()
            try:
                store.put(f"packs/{i:02x}/{i:02x}{uuid.uuid4().hex}", b"pack" * 256)
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert len(store.list("packs/")) == 8


def test_backup_restore_check_round_trip(dav, tmp_path: Path):
    b = dav.backend
    url = b.new_url("roundtrip")
    src = make_checkpoint(tmp_path / "ckpt", step=1, mb=4)
    with Vault.init(url, storage_options=b.storage_options, pack_size=1 << 20) as vault:
        vault.backup(src, tags={"step": "1"})
        make_checkpoint(src, step=2, mb=4)
        vault.backup(src, tags={"step": "2"})
        vault.restore("latest", tmp_path / "out")
        assert vault.check(read_data=1.0).ok
    assert tree_digest(tmp_path / "out") == tree_digest(src)


def _served_folder(dav: RunningServer, url: str) -> Path:
    """The folder of this machine that WsgiDAV serves as ``url`` (webdav://BUCKET/name)."""
    return dav.log.parent / "dav" / url.removeprefix("webdav://")


@pytest.mark.parametrize("how", ["vault moved away", "folder removed after webdav4 made it"])
def test_a_put_into_a_missing_folder_says_so_as_on_sftp(dav, monkeypatch, how):
    """A PUT whose folder is missing was "object packs/.. is missing ...; run: check" (the vault's folder
    gone: a write misses no object), or WsgiDAV's "409 (Conflict)" as a permanent failure (the folder
    removed between webdav4's mkdirs and its PUT); SFTP and local folders say the folder is missing, an
    outage retried. The second case is a real race, made to happen by removing the folder right after
    webdav4 made it; WsgiDAV answers that PUT 409 (RFC 4918: no parent collection)."""
    from webdav4.fsspec import WebdavFileSystem

    b = dav.backend
    url = b.new_url("gone")
    store = open_store(url, b.storage_options, RetryPolicy(retries=0, op_timeout=60))
    store.put("config", b"{}")
    store.put("packs/aa/first", b"pack")  # packs/aa is known to exist from here
    folder = _served_folder(dav, url)
    if how == "vault moved away":
        folder.rename(folder.with_name(folder.name + "-away"))
        key = "packs/bb/second"  # a folder not made yet: made one level at a time, never the vault's own
    else:
        made = WebdavFileSystem.mkdirs

        def mkdirs_then_another_host_removes_it(self, path, exist_ok=False):
            made(self, path, exist_ok=exist_ok)
            shutil.rmtree(dav.log.parent / "dav" / path.strip("/"))

        monkeypatch.setattr(WebdavFileSystem, "mkdirs", mkdirs_then_another_host_removes_it)
        key = "packs/aa/second"
    with pytest.raises(StorageError) as caught:
        store.put(key, b"pack")
    assert not isinstance(caught.value, ObjectNotFoundError), caught.value
    assert "the folder it goes into is missing" in str(caught.value), caught.value
    assert caught.value.retryable
