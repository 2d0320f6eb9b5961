"""A prune stopped in its deleting phase (its snapshots forgotten, its packs being deleted) by a server frozen
(SIGSTOP), a link cut (every connection reset, tests/support/faultproxy.py) or a SIGKILL: every kept snapshot
restores byte-identical, check --read-data calls nothing damage, the same prune run again finishes the job and
reclaims the space. Real servers, real CLI processes, held at their first pack delete (tests/support/deletecli.py)
so that the fault lands there and not before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptvault import Vault

from ..conftest import tree_digest
from ..support.servers import RunningServer
from .conftest import ROOT, make_checkpoint
from .test_sftp_faults import _signal_server, own_sshd  # noqa: F401 - the fixture: a server of this test alone

FAST = {
    "CKPTVAULT_OP_TIMEOUT": "2",
    "CKPTVAULT_RETRIES": "1",
    "CKPTVAULT_RETRY_FOR": "0",
    "CKPTVAULT_RETRY_DELAY": "0.1",
}


def _vault_of_four_steps(srv: RunningServer, tmp_path: Path) -> tuple[str, dict[str, dict]]:
    url = srv.backend.new_url("prune")
    trees = {}
    with Vault.init(url, storage_options=srv.backend.storage_options, pack_size=1 << 20) as vault:
        for step in range(1, 5):
            src = make_checkpoint(tmp_path / f"step{step}", step=step, mb=1.5)
            vault.backup(src, tags={"step": str(step)})
            trees[str(step)] = tree_digest(src)
    return url, trees


def _prune_stopped(srv: RunningServer, url: str, cli_options: list[str], tmp_path: Path, fault) -> tuple[int, str]:
    """``prune --keep-latest 2`` held at its first pack delete, where ``fault()`` is done (None: the process
    SIGKILLs itself there); its exit code and stderr."""
    marker, go = tmp_path / "at-delete", tmp_path / "go"
    env = {
        **os.environ,
        **srv.backend.env,
        **FAST,
        "CKPTVAULT_CACHE_DIR": str(tmp_path / "cache"),
        "DELETECLI_MARKER": str(marker),
        "DELETECLI_GO": str(go),
        "DELETECLI_KILL": "1" if fault is None else "",
    }
    args = [sys.executable, "-m", "tests.support.deletecli", "prune", "--keep-latest", "2", "--repo", url, *cli_options]
    with subprocess.Popen(args, cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL) as proc:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.01)
        try:
            if fault is not None:
                fault()
            go.write_text("")
            err = proc.communicate(timeout=120)[1].decode()
        finally:
            if fault is not None:
                fault.undo()
    return proc.returncode, err


def _finishes_and_loses_nothing(srv: RunningServer, url: str, trees: dict[str, dict], tmp_path: Path) -> None:
    with Vault.open(url, storage_options=srv.backend.storage_options) as vault:
        snapshots = vault.snapshots()
        assert sorted(s.tags["step"] for s in snapshots) == ["3", "4"]  # forgotten before the packs went
        for snap in snapshots:
            vault.restore(snap, tmp_path / snap.short_id)
            assert tree_digest(tmp_path / snap.short_id) == trees[snap.tags["step"]]
        report = vault.check(read_data=1.0)
        assert report.ok and not any("damage" in w or "corrupt" in w for w in report.warnings), report
        assert vault.prune(keep_latest=2).forgotten == []  # the same prune again: it finishes the job
        report = vault.check(read_data=1.0)
        assert report.ok and report.warnings == [], report  # no pack left in no index
        assert vault.prune().reclaim_bytes == 0


class _Freeze:
    def __init__(self, srv: RunningServer) -> None:
        self.srv = srv

    def __call__(self) -> None:
        _signal_server(self.srv, signal.SIGSTOP)

    def undo(self) -> None:
        _signal_server(self.srv, signal.SIGCONT)


class _Cut:
    def __init__(self, proxy) -> None:
        self.proxy = proxy

    def __call__(self) -> None:
        self.proxy.reset_next = 1_000_000  # every new connection reset as it arrives
        self.proxy.drop_all()  # and every open one

    def undo(self) -> None:
        self.proxy.heal()


def _said_as_stopped_part_way(code: int, err: str) -> None:
    assert code == 20 and "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert "DELETE packs/" in line and "corrupt" not in line and "damage" not in line, line
    assert line.endswith(
        "; prune stopped part way: the snapshots it keeps are intact, and what it was removing is partly there "
        "still; run the command again once the storage answers to finish the job"
    ), line


def test_a_prune_whose_sftp_server_freezes_as_it_deletes_packs_loses_nothing_and_a_rerun_finishes(
    own_sshd,  # noqa: F811
    tmp_path,
):
    """The error was the storage's alone ("DELETE packs/...: no answer after 2 s"): nothing said that the kept
    snapshots were fine, nor that running the prune again finishes it (check then names packs in no index)."""
    url, trees = _vault_of_four_steps(own_sshd, tmp_path)
    code, err = _prune_stopped(own_sshd, url, own_sshd.backend.cli_options, tmp_path, _Freeze(own_sshd))
    _said_as_stopped_part_way(code, err)
    _finishes_and_loses_nothing(own_sshd, url, trees, tmp_path)


@pytest.mark.parametrize("fault", ["cut", "kill"])
def test_a_prune_cut_off_from_s3_or_killed_as_it_deletes_packs_loses_nothing_and_a_rerun_finishes(
    server, fault_proxy, tmp_path, fault
):
    moto = server("s3-moto")
    proxy = fault_proxy(moto)
    url, trees = _vault_of_four_steps(moto, tmp_path)
    through = ["-o", f"endpoint_url=http://127.0.0.1:{proxy.port}"]
    if fault == "kill":
        code, err = _prune_stopped(moto, url, through, tmp_path, None)
        assert code == -signal.SIGKILL, err
    else:
        code, err = _prune_stopped(moto, url, through, tmp_path, _Cut(proxy))
        _said_as_stopped_part_way(code, err)
    _finishes_and_loses_nothing(moto, url, trees, tmp_path)
