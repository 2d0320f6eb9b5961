"""Commands SIGKILLed at a chosen write call to a real S3 server (SeaweedFS) or a real sshd
(tests/support/killremote.py), then run again: the rerun exits 0, `check --read-data` is clean, every
snapshot restores bit-exact, no lock is left, and a prune (its leftovers' age limit passed) leaves no
temp file or multipart upload behind.

A sample of the exhaustive sweep (tests/support/remote_sweep.py: every write call of backup, forget --prune,
prune --repack-threshold, tag, copy and repair-index, plain and encrypted, on both servers); each case
here is one such point, picked by the call and the kind of object rather than its number, so that it stays
put when a command's writes move."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from ckptvault import Vault
from ckptvault.ops import prune as prune_module

from ..conftest import CKPTVAULT_ENV
from ..support import servers
from ..support.remote_sweep import checkpoint, tree, write_tree
from .conftest import ROOT

CASES = {
    # backend, command ({v}: the vault, {src2}: step 2's checkpoint, {s1}..: the IDs), the write call it is
    # killed at (op and key, as killremote counts them), how many of those it made first, and the steps after
    "s3-backup-at-its-index": ("s3-seaweedfs", "backup {src2} --tag step=2 --repo {v}", "put_object", "/index/", 1),
    "s3-forget-prune-at-a-pack-removal": (
        "s3-seaweedfs",
        "forget {s1} {s2} --prune --repo {v}",
        "delete_object",
        "/packs/",
        1,
    ),
    # the old snapshot gone, its tree not yet: the rerun said "no snapshot <ID>" (exit 18) for a tag that was done
    "s3-tag-at-the-old-trees-removal": (
        "s3-seaweedfs",
        "tag {s2} --add keep=best --repo {v}",
        "delete_object",
        "/trees/",
        1,
    ),
    "sftp-backup-before-its-packs-rename": (
        "sftp-openssh",
        "backup {src2} --tag step=2 --repo {v}",
        "posix_rename",
        "/packs/",
        1,
    ),
    "sftp-prune-repacking-at-a-pack-removal": (
        "sftp-openssh",
        "prune --keep-latest 1 --repack-threshold 0.9 --repo {v}",
        "remove",
        "/packs/",
        1,
    ),
}
STEPS = {"backup": [1, 2, 3], "forget": [3], "tag": [1, 2, 3], "prune": [3]}


def known_hosts(srv: servers.RunningServer, home: Path) -> None:
    """The sshd's key recorded, as a user would have it (else each command warns that it is unchecked)."""
    if not (srv.log.parent / "sshd").is_dir():
        return
    kind, blob = (srv.log.parent / "sshd" / "host_key.pub").read_text().split()[:2]
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{srv.port} {kind} {blob}\n")


def run(backend: servers.Backend, tmp_path: Path, args: list[str], **kill: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **servers.CLIENT_ENV, **backend.env, "XDG_DATA_HOME": str(tmp_path / "xdg"), **kill}
    env["HOME"] = str(tmp_path / "home")
    for var in CKPTVAULT_ENV:
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "tests.support.killremote" if kill else "ckptvault", *args, *backend.cli_options],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=180,
    )


def leftovers(backend: servers.Backend, url: str) -> list[str]:
    """Unfinished multipart uploads (S3) or temp files (SFTP: the sshd serves this machine's files) under
    the vault, straight from the server."""
    if url.startswith("s3://"):
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **backend.storage_options)
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{prefix}/")
        return [u["Key"] for u in page.get("Uploads", []) or []]
    return [str(p) for p in Path("/" + url.split("/", 3)[3]).rglob(".tmp*")]


@pytest.mark.parametrize("case", CASES)
def test_a_command_killed_at_a_remote_write_is_finished_by_running_it_again(server, tmp_path, monkeypatch, case):
    name, command, op, where, nth = CASES[case]
    srv = server(name)
    backend = srv.backend
    known_hosts(srv, tmp_path / "home")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    url = backend.new_url("kill")
    sources = {f"src{s}": str(write_tree(tmp_path / f"src{s}", checkpoint(s))) for s in (1, 2, 3)}
    with Vault.init(url, storage_options=backend.storage_options, pack_size=1 << 20) as vault:
        for step in (1, 2, 3) if not command.startswith("backup") else (1, 3):
            vault.backup(sources[f"src{step}"], tags={"step": str(step)})
        ids = {f"s{s.tags['step']}": s.id for s in vault.snapshots()}
    args = command.format(v=url, **sources, **ids).split()

    # the vault's root as the calls name it: the key under the bucket (S3), the server's path (SFTP)
    root = url.removeprefix(f"s3://{servers.BUCKET}/") if url.startswith("s3://") else "/" + url.split("/", 3)[3]
    log = tmp_path / "kill.log"
    killed = run(
        backend, tmp_path, args, KILLREMOTE_MATCH=f"{op} {root}{where}", KILLREMOTE_AT=str(nth), KILLREMOTE_LOG=str(log)
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()

    again = run(backend, tmp_path, args)
    assert again.returncode == 0, again.stderr.decode()
    assert "error" not in again.stderr.decode()
    monkeypatch.setattr(prune_module, "STALE_TEMP_AGE_S", 0.0)  # as if an hour had passed: no writer is live
    with Vault.open(url, storage_options=backend.storage_options) as vault:
        report = vault.check(read_data=1.0)
        assert report.ok and not report.warnings, (report.problems, report.warnings)
        snaps = vault.snapshots()
        assert sorted(int(s.tags["step"]) for s in snaps) == STEPS[args[0]]
        for snap in snaps:
            vault.restore(snap, tmp_path / "out" / snap.id)
            assert tree(tmp_path / "out" / snap.id) == checkpoint(int(snap.tags["step"]))
            shutil.rmtree(tmp_path / "out" / snap.id)
        if args[0] == "tag":
            assert [s.tags.get("keep") for s in snaps if s.tags["step"] == "2"] == ["best"]
        assert vault.locks() == []
        vault.prune()
    assert leftovers(backend, url) == []
