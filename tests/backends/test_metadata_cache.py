"""The local metadata cache of a remote repository (ckptvault/repository/cache.py), on moto_server:
a second listing downloads no snapshot object, cached bytes are verified like fresh ones, and the
cache follows the repository (objects a prune removed, a cache of another repository)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import fsspec
import pytest

from ckptvault import Vault

from ..support.counting_store import CountingStore
from ..support.servers import RunningServer
from .conftest import make_checkpoint


@pytest.fixture
def moto(server) -> RunningServer:
    return server("s3-moto")


@pytest.fixture
def repo(moto: RunningServer, tmp_path: Path) -> str:
    url = moto.backend.new_url("cache")
    src = tmp_path / "ckpt"
    with Vault.init(url, storage_options=moto.backend.storage_options, pack_size=1 << 20) as vault:
        for step in (1, 2, 3):
            vault.backup(make_checkpoint(src, step=step, mb=1), tags={"step": str(step)})
    shutil.rmtree(tmp_path / "cache")  # what the backups cached: start as a fresh machine would
    return url


def open_vault(moto: RunningServer, url: str) -> Vault:
    return Vault.open(url, storage_options=moto.backend.storage_options)


def cache_dir(tmp_path: Path, vault: Vault) -> Path:
    return tmp_path / "cache" / vault.config.repo_id


def test_second_listing_downloads_no_snapshot_object(moto, repo: str, tmp_path: Path):
    first = open_vault(moto, repo)
    listed = [s.id for s in first.snapshots()]
    assert (first._repo.cache.hits, first._repo.cache.misses) == (0, 3)
    first.close()

    again = open_vault(moto, repo)
    counting = CountingStore(again._repo.store)
    again._repo.store = counting
    assert [s.id for s in again.snapshots()] == listed
    assert [key for key, _, _ in counting.reads if key.startswith("snapshots/")] == []
    again.files("latest")  # lists again: the snapshots come from the Vault's memory, the tree is new
    assert (again._repo.cache.hits, again._repo.cache.misses) == (3, 1)
    again._repo.load_index()  # nobody read the index objects yet: fetched and cached
    indexed = len(again._repo.list_index_ids())
    assert (again._repo.cache.hits, again._repo.cache.misses) == (3, 1 + indexed)
    again.close()
    with open_vault(moto, repo) as third:
        third._repo.load_index()
        assert (third._repo.cache.hits, third._repo.cache.misses) == (indexed, 0)

    # what is cached is the stored object byte for byte (still sealed), never anything else
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **moto.backend.storage_options)
    root = cache_dir(tmp_path, again)
    cached = [p for p in root.rglob("*") if p.is_file() and p.parent != root]
    assert {p.parent.name for p in cached} == {"snapshots", "trees", "index"}
    for path in cached:
        assert path.read_bytes() == fs.cat_file(f"{repo[5:]}/{path.relative_to(root)}")


def test_a_damaged_cache_entry_is_fetched_again(moto, repo: str, tmp_path: Path, caplog):
    vault = open_vault(moto, repo)
    expected = [s.id for s in vault.snapshots()]
    vault.close()
    entry = next((cache_dir(tmp_path, vault) / "snapshots").iterdir())
    good = entry.read_bytes()
    entry.write_bytes(good[:10] + bytes([good[10] ^ 1]) + good[11:])
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        again = open_vault(moto, repo)
        assert [s.id for s in again.snapshots()] == expected
    assert "failed verification" in caplog.text
    assert entry.read_bytes() == good  # rebuilt from the repository
    again.close()


def test_a_stored_snapshot_of_another_size_than_the_cached_copy_is_fetched_again(moto, repo: str, tmp_path: Path):
    # cut short on the server: a host with it cached listed it as whole, one without left it out
    vault = open_vault(moto, repo)
    snaps = vault.snapshots()
    vault.close()
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **moto.backend.storage_options)
    key = f"{repo[5:]}/snapshots/{snaps[0].id}"
    fs.pipe_file(key, fs.cat_file(key)[:100])
    again = open_vault(moto, repo)
    assert [s.id for s in again.snapshots()] == [s.id for s in snaps[1:]]
    assert snaps[0].id in again.unreadable_snapshots
    again.close()


def test_the_cache_follows_the_repository(moto, repo: str, tmp_path: Path):
    vault = open_vault(moto, repo)
    snaps = vault.snapshots()
    vault.close()
    root = cache_dir(tmp_path, vault)
    gone = snaps[0]
    # another host's prune removes a snapshot: the next listing drops it from the cache too
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **moto.backend.storage_options)
    fs.rm_file(f"{repo[5:]}/snapshots/{gone.id}")
    again = open_vault(moto, repo)
    assert [s.id for s in again.snapshots()] == [s.id for s in snaps[1:]]
    assert not (root / "snapshots" / gone.id).exists()
    again.close()

    # a cache folder that claims another repository is emptied and rebuilt
    (root / "repository.json").write_text(json.dumps({"repository": "0" * 32}))
    (root / "snapshots" / ("f" * 64)).write_bytes(b"junk")
    third = open_vault(moto, repo)
    assert [s.id for s in third.snapshots()] == [s.id for s in snaps[1:]]
    assert json.loads((root / "repository.json").read_text())["repository"] == third.config.repo_id
    assert not (root / "snapshots" / ("f" * 64)).exists()
    third.close()


def test_check_reads_the_repository_not_the_cache(moto, repo: str):
    vault = open_vault(moto, repo)
    victim = vault.snapshots()[-1]
    vault.close()
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **moto.backend.storage_options)
    key = f"{repo[5:]}/snapshots/{victim.id}"
    raw = bytearray(fs.cat_file(key))
    raw[len(raw) // 2] ^= 0x10
    fs.pipe_file(key, bytes(raw))
    again = open_vault(moto, repo)
    assert victim.id in [s.id for s in again.snapshots()]  # the verified cached copy still lists
    report = again.check()
    assert not report.ok
    assert any(victim.id[:12] in p.object or victim.id[:12] in p.detail for p in report.problems), report.problems
    again.close()


def test_no_cache_when_switched_off(moto, repo: str, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("CKPTVAULT_NO_CACHE", "1")
    vault = open_vault(moto, repo)
    assert len(vault.snapshots()) == 3
    assert not vault._repo.cache.enabled
    assert not (tmp_path / "cache").exists()
    vault.close()


def test_a_fresh_machine_reads_each_snapshot_object_with_one_request(moto, repo: str, caplog):
    """s3fs asked for the size (HEAD) before every whole read: 2 requests per snapshot on a fresh box's
    first listing (925 HEAD + 925 GET for 924 snapshots)."""
    with caplog.at_level(logging.DEBUG, logger="s3fs"), open_vault(moto, repo) as vault:
        assert len(vault.snapshots()) == 3
    calls = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CALL: ")]
    assert sum("get_object" in c for c in calls) >= 3
    assert not [c for c in calls if "head_object" in c], calls


def test_a_restore_by_id_on_a_fresh_machine_reads_that_snapshot_object_alone(moto, repo: str, tmp_path: Path):
    """`restore <id>` (and `ls <id>`) on a fresh machine read every snapshot object of the vault (316 GETs
    at 300 snapshots) to find the one whose ID is the object's name."""
    with open_vault(moto, repo) as vault:
        first, *_ = vault.snapshots()
    shutil.rmtree(tmp_path / "cache")  # a fresh machine
    with open_vault(moto, repo) as vault:
        counting = CountingStore(vault._repo.store)
        vault._repo.store = counting
        vault.restore(first.id[:10], tmp_path / "out")
        assert [k for k, _, _ in counting.reads if k.startswith("snapshots/")] == [f"snapshots/{first.id}"]
        assert vault.snapshot(first.id[:10], tags={"step": "1"}).id == first.id
        with pytest.raises(Exception, match="does not carry step=2"):
            vault.snapshot(first.id, tags={"step": "2"})
