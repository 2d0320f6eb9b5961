"""An SFTP vault trusts the server keys of known_hosts: a different key is refused, an unrecorded one is
accepted with a warning, or refused with ``-o host_key_policy=reject`` (rb44 #1: fsspec loaded no
known_hosts file, and every key was accepted, a changed one too)."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import StorageError, UsageError
from tests.support.servers import RunningServer


@pytest.fixture
def sshd(server) -> RunningServer:
    return server("sftp-openssh")


def _known_hosts(home: Path, sshd: RunningServer, public_key_line: str) -> None:
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    kind, blob = public_key_line.split()[:2]
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{sshd.port} {kind} {blob}\n")


def test_an_sftp_vault_refuses_a_server_key_other_than_the_recorded_one(
    sshd: RunningServer, tmp_path: Path, monkeypatch, caplog
):
    from ckptvault.store import ssh_hosts

    monkeypatch.setattr(ssh_hosts, "_told", set())  # other tests of this process met the same server
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CKPTVAULT_RETRIES", "1")
    options = sshd.backend.storage_options
    url = sshd.backend.new_url("keys")
    real_key = (sshd.log.parent / "sshd" / "host_key.pub").read_text()

    # nothing recorded: accepted, said once
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        Vault.init(url, storage_options=options).close()
        Vault.open(url, storage_options=options).close()
    told = [r.getMessage() for r in caplog.records if "is in no known_hosts file" in r.getMessage()]
    assert len(told) == 1 and f"[127.0.0.1]:{sshd.port}" in told[0], told
    with pytest.raises(StorageError, match=r"is in no known_hosts file, and the host key policy refuses such a host"):
        Vault.open(url, storage_options={**options, "host_key_policy": "reject"})

    # recorded: accepted quietly, with reject too
    _known_hosts(tmp_path / "home", sshd, real_key)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        Vault.open(url, storage_options={**options, "host_key_policy": "reject"}).close()
    assert not [r for r in caplog.records if "known_hosts" in r.getMessage()]

    # another key recorded for that host (a machine in between, or a reinstalled server): refused, at once
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    _known_hosts(tmp_path / "home", sshd, (other.with_suffix(".pub")).read_text())
    with pytest.raises(StorageError, match=r"is not the one ~/.ssh/known_hosts records for it: refused") as refused:
        Vault.open(url, storage_options=options)
    assert "ssh-keygen -R" in str(refused.value) and "attempts" not in str(refused.value)

    with pytest.raises(UsageError, match=r"host_key_policy=trust is not one of warn, reject, auto_add"):
        Vault.open(url, storage_options={**options, "host_key_policy": "trust"})


def test_the_cli_says_a_server_key_was_accepted_unchecked(sshd: RunningServer, remote_cli, tmp_path: Path):
    """The warning went to the "ckptvault" logger, which the CLI keeps to errors: a command line user never
    learnt that the server's key was taken unchecked (review of rb44 #1)."""
    (tmp_path / "home").mkdir()
    proc = remote_cli(sshd.backend, "init", sshd.backend.new_url("cli-keys"), HOME=str(tmp_path / "home"))
    said = [line for line in proc.stderr.decode().splitlines() if "is in no known_hosts file" in line]
    assert len(said) == 1 and said[0].startswith("warning: the host key of "), proc.stderr
