"""A spot GPU box that vanishes mid-upload: `ckptvault backup` of a checkpoint into S3 (SeaweedFS) is a
real CLI process killed with SIGKILL at a seeded random moment while its packs are uploading. Then, as
the user would: `check --read-data` passes (the killed run's packs are leftovers, not damage), the
snapshot stored before restores bit-exact, the backup rerun completes without waiting out the dead
process's lock and without uploading again what the killed run stored, and a prune leaves no pack that
no index names and no lock.

The killed process reaches S3 through a bandwidth-limited proxy that is cut together with the kill, so
that, as when a machine vanishes, PUTs are cut mid-body and what its kernel still buffered never
arrives. Each trial has a vault of its own; the three take 45-55 s on 2 cores."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import fsspec
import pytest

from ckptvault import Vault
from ckptvault.errors import CkptVaultError
from ckptvault.repository.format import INDEX_PREFIX, LOCKS_PREFIX, PACKS_PREFIX

from ..conftest import tree_digest
from ..support import servers
from ..support.faultproxy import FaultProxy
from .conftest import ROOT, make_checkpoint

# 1 MiB packs: a 40 MB checkpoint is ~26 PUTs and 3 index objects (one per 8 packs), so kills land
# between packs, with PUTs half sent, before or after the run's first index object.
PACK_MIB = "1"
B_MB = 40.0
MAX_PACKS_BEFORE_KILL = 8  # a third of B's packs: the kill lands well before the snapshot is written
# (moment, seed): twice after a seeded number of landed packs; once the instant the run's first index
# object lands, where a write-order bug would show (an index naming a pack still in flight)
TRIALS = [("packs", 0), ("packs", 1), ("index", 2)]
# The killed backup talks to S3 through a SlowLink: each connection carries at most this (4 uploads at
# once: ~32 MB/s in all), so a pack's PUT takes ~0.2 s, as over a real network (to 127.0.0.1 a body is
# sent in a millisecond, and almost every kill would land between PUTs).
LINK_BYTES_PER_S = 8e6


class _Throttled:
    """A stream reader that hands on bytes no faster than LINK_BYTES_PER_S."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    async def read(self, n: int) -> bytes:
        data = await self.reader.read(n)
        await asyncio.sleep(len(data) / LINK_BYTES_PER_S)
        return data


class SlowLink(FaultProxy):
    """The spot box's uplink: the fault proxy with a bandwidth limit. When the box vanishes its network
    goes with it: ``drop_all()`` resets every connection, and the bytes the link had not passed on are
    lost (killing the process alone would not do that: its kernel still sends what it had written)."""

    async def _pipe(self, src, dst, src_writer, budget, take_cut, stall=False, stall_for=None) -> None:
        throttled = cast(asyncio.StreamReader, _Throttled(src))  # it only reads
        await super()._pipe(throttled, dst, src_writer, budget, take_cut, stall, stall_for)


@pytest.fixture
def uplink(server) -> Iterator[SlowLink]:
    link = SlowLink(server("s3-seaweedfs").port)
    link.start()
    yield link
    link.stop()


def listed(fs, repo: str, prefix: str) -> dict[str, int]:
    """Keys (relative to the repository) and sizes straight from the S3 listing, bypassing ckptvault and
    every cache: what the bucket really holds."""
    bucket, _, root = repo.removeprefix("s3://").partition("/")
    out: dict[str, int] = {}
    args = {"Bucket": bucket, "Prefix": f"{root}/{prefix}"}
    while True:
        page = fs.call_s3("list_objects_v2", **args)
        out.update({o["Key"].removeprefix(f"{root}/"): o["Size"] for o in page.get("Contents", [])})
        if not page.get("IsTruncated"):
            return out
        args["ContinuationToken"] = page["NextContinuationToken"]


def cli_process(backend: servers.Backend, tmp_path: Path, *args: str) -> subprocess.Popen:
    """The CLI as remote_cli runs it, but started, not waited for, so that it can be killed."""
    env = {**os.environ, **servers.CLIENT_ENV, **backend.env, "XDG_DATA_HOME": str(tmp_path / "xdg-data")}
    for var in ("CKPTVAULT_REPO", "CKPTVAULT_KEYFILE", "CKPTVAULT_PASSPHRASE"):
        env.pop(var, None)
    with open(tmp_path / "killed.stderr", "wb") as err:  # a file: a full pipe would stall the backup
        return subprocess.Popen(
            [sys.executable, "-m", "ckptvault", *args, *backend.cli_options],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def vanish_mid_upload(
    proc: subprocess.Popen, link: SlowLink, fs, repo: str, before: set[str], moment: str, seed: int
) -> str:
    """SIGKILL ``proc`` and cut its ``link`` at ``moment`` (TRIALS); ``before``: the repository's keys before
    it started. Returns what the kill interrupted, for messages."""
    rng = random.Random(seed)
    if moment == "packs":  # plus a sliver of a pack's time, so that kills land at different points of a PUT
        prefix, wanted, extra = PACKS_PREFIX, rng.randint(1, MAX_PACKS_BEFORE_KILL), rng.uniform(0.0, 0.1)
    else:
        prefix, wanted, extra = INDEX_PREFIX, 1, 0.0
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if len(set(listed(fs, repo, prefix)) - before) >= wanted:
            break
        time.sleep(0.01)
    time.sleep(extra)
    proc.send_signal(signal.SIGKILL)
    link.drop_all()
    proc.wait(timeout=30)
    time.sleep(0.2)  # the server is done with the cut PUTs before anyone looks
    packs, index = (len(set(listed(fs, repo, p)) - before) for p in (PACKS_PREFIX, INDEX_PREFIX))
    return (
        f"seed {seed}: killed after {wanted} new object(s) under {prefix} + {extra:.2f} s; "
        f"{packs} new pack(s), {index} new index object(s) stored"
    )


def chunks_stored_twice(vault: Vault) -> int:
    """Chunks in more than one pack, from every stored pack's own header (indexed or not). A pack whose
    header does not verify holds nothing a reader can find, so storing its chunks again is right: SeaweedFS
    keeps an empty object for a PUT whose client died before sending its body (real S3 keeps nothing)."""
    repo = vault._repo
    homes: dict[bytes, int] = {}
    for pack_id, size in repo.list_packs().items():
        try:
            entries = repo.read_pack_header(pack_id, size)
        except CkptVaultError:
            continue
        for e in entries:
            homes[e.chunk_id] = homes.get(e.chunk_id, 0) + 1
    return sum(1 for n in homes.values() if n > 1)


@pytest.mark.slow
@pytest.mark.parametrize(("moment", "seed"), TRIALS)
def test_backup_killed_mid_upload_to_s3_loses_nothing_and_a_rerun_finishes(
    server, uplink, remote_cli, tmp_path, moment, seed
):
    backend = server("s3-seaweedfs").backend
    spot_box = dataclasses.replace(backend, cli_options=["-o", f"endpoint_url=http://127.0.0.1:{uplink.port}"])
    repo = backend.new_url("crash")
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **backend.storage_options)
    remote_cli(backend, "init", repo, "--pack-size-mib", PACK_MIB)
    a = make_checkpoint(tmp_path / "a", step=1, seed=0, mb=3)
    snap_a = json.loads(remote_cli(backend, "backup", str(a), "--repo", repo, "--tag", "step=1", "--json").stdout)
    b = make_checkpoint(tmp_path / "b", step=2, seed=1 + seed, mb=B_MB)  # no chunk in common with A: all PUTs

    before = set(listed(fs, repo, ""))
    proc = cli_process(spot_box, tmp_path, "backup", str(b), "--repo", repo, "--tag", "step=2", "-q")
    what = vanish_mid_upload(proc, uplink, fs, repo, before, moment, seed)
    # a backup that finished (or failed) before the kill would make the trial prove nothing
    stderr = (tmp_path / "killed.stderr").read_text()
    assert proc.returncode == -signal.SIGKILL, f"{what}; it exited {proc.returncode} first: {stderr}"
    assert listed(fs, repo, LOCKS_PREFIX), f"{what}: no lock of the killed process is left to be judged stale"

    # The killed run's packs that no index names are leftovers for the rerun to adopt, not damage: at
    # most a warning saying so, exit 0. No snapshot of B: the kill landed before it could be written.
    checked = remote_cli(backend, "check", "--read-data", "--repo", repo, "--json", check=False)
    assert checked.returncode == 0, f"{what}: {checked.stdout.decode()} {checked.stderr.decode()}"
    report = json.loads(checked.stdout)
    assert report["ok"] and report["problems"] == [] and report["snapshots"] == 1, f"{what}: {report}"
    assert all("left by an interrupted backup" in w for w in report["warnings"]), f"{what}: {report}"
    remote_cli(backend, "restore", snap_a["id"], str(tmp_path / "out-a"), "--repo", repo, "-q")
    assert tree_digest(tmp_path / "out-a") == tree_digest(a), what

    # The rerun (a shared lock, like the dead one's: no wait; over the fast link, to save time) finishes
    # the job, and uploads nothing the killed run already stored: bandwidth is what a spot box is short of
    remote_cli(backend, "backup", str(b), "--repo", repo, "--tag", "step=2", "-q")
    with Vault.open(repo, storage_options=backend.storage_options) as vault:
        assert chunks_stored_twice(vault) == 0, f"{what}: the rerun uploaded chunks that were already stored"
        vault.restore(vault.latest({"step": "2"}), tmp_path / "out-b")
    assert tree_digest(tmp_path / "out-b") == tree_digest(b), what

    # prune's exclusive lock: the dead process's lock is stale at once (this host, a PID that is gone),
    # not 30 minutes later, and goes; so do A's snapshot and every pack that no index names
    remote_cli(backend, "prune", "--keep-latest", "1", "--repo", repo, "-q")
    checked = remote_cli(backend, "check", "--read-data", "--repo", repo, "--json")
    assert json.loads(checked.stdout)["warnings"] == [], f"{what}: {checked.stdout.decode()}"
    with Vault.open(repo, storage_options=backend.storage_options) as vault:
        named = {pack.hex() for packs in vault._repo.read_index_objects().values() for pack in packs}
        # what the rerun adopted from the killed run survived the prune: B still restores whole
        vault.restore("latest", tmp_path / "out-b2")
    assert tree_digest(tmp_path / "out-b2") == tree_digest(b), what
    stored = {key.rsplit("/", 1)[1] for key in listed(fs, repo, PACKS_PREFIX)}
    assert stored == named, f"{what}: {len(stored - named)} pack(s) in no index, {len(named - stored)} indexed but gone"
    assert listed(fs, repo, LOCKS_PREFIX) == {}, f"{what}: a lock outlived the commands that held it"
