"""What a crashed client leaves behind is cleaned by the next prune: unfinished S3 multipart uploads
(a pack of more than 100 MiB is uploaded in parts) and SFTP temp files (a put writes a temp name,
then renames). Leftovers younger than an hour may belong to a live writer and are kept."""

from __future__ import annotations

import time
from pathlib import Path

import fsspec
import pytest

from ckptvault import Vault
from ckptvault.ops import prune as prune_module
from ckptvault.store import FsspecStore

from ..support import servers
from .conftest import make_checkpoint


def backed_up(backend: servers.Backend, tmp_path: Path, prefix: str) -> str:
    url = backend.new_url(prefix)
    with Vault.init(url, storage_options=backend.storage_options, pack_size=1 << 20) as vault:
        vault.backup(make_checkpoint(tmp_path / "ckpt", step=1, mb=1))
    return url


@pytest.mark.parametrize("backend_name", ["s3-seaweedfs", "s3-moto"])
def test_prune_aborts_multipart_uploads_a_crashed_client_left(server, backend_name, tmp_path: Path, monkeypatch):
    backend = server(backend_name).backend
    url = backed_up(backend, tmp_path, "mpu")
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **backend.storage_options)
    repo_key = url.removeprefix(f"s3://{servers.BUCKET}/")

    def start_upload(key: str) -> str:
        upload = fs.call_s3("create_multipart_upload", Bucket=servers.BUCKET, Key=key)
        fs.call_s3(
            "upload_part", Bucket=servers.BUCKET, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1024
        )
        return upload["UploadId"]

    def open_uploads(prefix: str) -> set[str]:
        page = fs.call_s3("list_multipart_uploads", Bucket=servers.BUCKET, Prefix=prefix)
        return {u["UploadId"] for u in page.get("Uploads", []) or []}

    crashed = start_upload(f"{repo_key}/packs/ab/{'ab' * 32}")
    elsewhere = start_upload(f"other-{repo_key}/packs/cd/{'cd' * 32}")  # not this repository's
    if backend_name != "s3-moto":  # moto reports every upload as initiated in 2010
        with Vault.open(url, storage_options=backend.storage_options) as vault:
            vault.prune(keep_latest=1)  # a fresh upload may be a live writer's: kept
        assert crashed in open_uploads(f"{repo_key}/")

    monkeypatch.setattr(prune_module, "STALE_TEMP_AGE_S", 0.0)  # as if an hour had passed
    time.sleep(1.1)  # Initiated has one-second resolution
    with Vault.open(url, storage_options=backend.storage_options) as vault:
        vault.prune(keep_latest=1)
        assert vault.check(read_data=1.0).ok
    assert open_uploads(f"{repo_key}/") == set()
    assert elsewhere in open_uploads(f"other-{repo_key}/")
    fs.call_s3("abort_multipart_upload", Bucket=servers.BUCKET, Key=f"other-{repo_key}/packs/cd/{'cd' * 32}",
               UploadId=elsewhere)  # fmt: skip


def test_prune_removes_sftp_temp_files_a_crashed_client_left(server, tmp_path: Path):
    backend = server("sftp-openssh").backend
    url = backed_up(backend, tmp_path, "tmpfiles")
    store = FsspecStore(url, backend.storage_options)
    fs, root = store.fs, store.root
    old, fresh = f"{root}/packs/ab/.tmp-0123456789abcdef", f"{root}/packs/ab/.tmp-fedcba9876543210"
    fs.makedirs(f"{root}/packs/ab", exist_ok=True)
    for path in (old, fresh):
        fs.pipe_file(path, b"half a pack")
    two_hours_ago = time.time() - 7200
    fs.ftp.utime(old, (two_hours_ago, two_hours_ago))
    with Vault.open(url, storage_options=backend.storage_options) as vault:
        assert all(".tmp-" not in o.key for o in vault._repo.store.list("packs/"))  # never listed as objects
        vault.prune(keep_latest=1)
        assert vault.check(read_data=1.0).ok
    assert not fs.exists(old)
    assert fs.exists(fresh)
    fs.client.close()
