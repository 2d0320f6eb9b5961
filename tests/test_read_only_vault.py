"""A vault the user may only read (a read-only mount here; read-only credentials on object storage
fail the same way): restore, check, status and drill work without writing a lock, with a warning,
and still respect a prune's exclusive lock."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ckptvault import Vault

from .support.tmpfs import mounted_tmpfs


@pytest.fixture
def read_only_vault(tmp_path: Path):
    with mounted_tmpfs(tmp_path / "mnt", "64m", "the read-only vault test") as mount:
        src = tmp_path / "src"
        src.mkdir()
        (src / "weights.bin").write_bytes(os.urandom(2_000_000))
        (src / "config.json").write_text('{"step": 1}')
        repo = str(mount / "vault")
        with Vault.init(repo) as vault:
            vault.backup(src, tags={"run": "x"})
        yield mount, repo, src


def remount_read_only(mount: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, capture_output=True)


def fill(mount: Path) -> None:
    with open(mount / "filler", "wb", buffering=0) as filler, pytest.raises(OSError):
        while True:
            filler.write(b"\0" * (1 << 20))


@pytest.mark.parametrize("blocked", ["read-only", "full"])
def test_reading_commands_work_without_a_lock_where_none_can_be_written(
    read_only_vault, cli, tmp_path: Path, blocked: str
):
    """A read-only mount, or a full disk: no room for a lock object must not keep a restore from getting
    the checkpoints out."""
    mount, repo, src = read_only_vault
    if blocked == "read-only":
        remount_read_only(mount)
    else:
        fill(mount)
    out = tmp_path / "out"
    proc = cli("restore", "latest", str(out), "--repo", repo, "--tag", "run=x")
    assert "cannot write a lock" in proc.stderr.decode() and "Traceback" not in proc.stderr.decode()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in src.iterdir()}
    assert cli("check", "--repo", repo, "--read-data").stdout.decode().startswith("no problems found")
    assert cli("status", str(src), "--repo", repo).returncode == 0
    assert cli("drill", "--repo", repo).returncode == 0
    for dry_run in (["prune", "--keep-latest", "1"], ["forget", "latest", "--prune"], ["repair-index"]):
        assert cli(*dry_run, "--dry-run", "--repo", repo).returncode == 0, dry_run  # previews only read
    (src / "new.bin").write_bytes(os.urandom(100_000))
    proc = cli("backup", str(src), "--repo", repo, check=False)  # writing still needs a writable vault
    err = proc.stderr.decode()
    if blocked == "read-only":
        assert proc.returncode == 20 and "read-only file system: this vault can only be read here" in err, err
        assert ".tmp-" not in err  # not a temporary file's name
    else:
        assert proc.returncode == 21 and "no space left" in err, err


def test_an_api_reading_file_after_file_without_a_lock_is_warned_once(read_only_vault, caplog):
    """The warning promised once per Vault came at every read: each use of repo.locks made a new lock
    manager, which forgot that it had said it (review 40 A3)."""
    import logging

    mount, repo, src = read_only_vault
    remount_read_only(mount)
    with Vault.open(repo) as vault, caplog.at_level(logging.WARNING, logger="ckptvault"):
        for _ in range(3):
            assert b"".join(vault.read_file("latest", "weights.bin")) == (src / "weights.bin").read_bytes()
    said = [r for r in caplog.records if "cannot write a lock" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]


def test_a_prune_holding_the_vault_still_stops_a_lockless_reader(read_only_vault, cli, tmp_path: Path):
    mount, repo, _ = read_only_vault
    with Vault.open(repo) as vault:
        vault._repo.locks.write(exclusive=True)  # a prune's lock, as another host would leave it while running
    remount_read_only(mount)
    proc = cli("restore", "latest", str(tmp_path / "out"), "--repo", repo, check=False)
    assert proc.returncode == 11 and "is locked" in proc.stderr.decode(), proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_lockless_reader_blames_a_prune_that_began_meanwhile_not_damage(tmp_path: Path):
    from ckptvault.errors import IntegrityError, VaultLockedError
    from ckptvault.repository.locks import LocklessRead

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"data")
    with Vault.init(str(tmp_path / "repo")) as vault:
        vault.backup(tmp_path / "src")
        manager = vault._repo.locks
        with pytest.raises(IntegrityError), LocklessRead(manager):  # no prune: damage stays damage
            raise IntegrityError("the pack is missing")
        manager.write(exclusive=True)  # a prune on another host, begun while the read went on
        with pytest.raises(VaultLockedError, match="began while this command read") as info, LocklessRead(manager):
            raise IntegrityError("the pack is missing")
        assert isinstance(info.value.__cause__, IntegrityError)


def test_a_full_disk_out_of_inodes_is_named_so_not_out_of_space(tmp_path: Path, cli):
    """ENOSPC also means no inode left (many small files on a disk formatted for big ones): "free space"
    was the advice while the disk had plenty."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"step": 1}')
    with mounted_tmpfs(tmp_path / "mnt", "64m,nr_inodes=64", "the inode exhaustion test") as mount:
        repo = str(mount / "vault")
        Vault.init(repo).close()
        made = 0
        with pytest.raises(OSError):
            while True:
                (mount / f"f{made}").touch()
                made += 1
        proc = cli("backup", str(src), "--repo", repo, check=False)
        assert proc.returncode == 21, proc.stderr
        err = proc.stderr.decode()
        assert "no inode (file entry) left on its filesystem, which has free blocks" in err, err
        assert "move the vault to a filesystem with more inodes" in err
        with Vault.open(repo) as vault:
            assert vault.snapshots() == []
