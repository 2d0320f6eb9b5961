"""Many training nodes, one bucket: N backup processes write shards of one run into one S3
repository (SeaweedFS) at the same moment. All succeed, nothing is lost or overwritten, and every
shard of the run restores bit-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fsspec

from ckptvault import Vault

from ..conftest import tree_digest
from ..support import servers
from .conftest import ROOT, make_checkpoint

WRITERS = 4


def test_shards_of_one_run_from_four_processes_at_once(server, remote_cli, tmp_path: Path):
    backend = server("s3-seaweedfs").backend
    repo = backend.new_url("shards")
    remote_cli(backend, "init", repo, "--pack-size-mib", "1")
    shards = []
    for i in range(WRITERS):
        # every shard shares the frozen part (seed 0) and has its own moving part
        shard = make_checkpoint(tmp_path / f"node-{i}" / f"shard-{i}", step=100 + i, seed=0, mb=3)
        (shard / f"rank-{i}.bin").write_bytes(os.urandom(700_000))
        shards.append(shard)

    env = {**os.environ, **servers.CLIENT_ENV, **backend.env, "XDG_DATA_HOME": str(tmp_path / "xdg")}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ckptvault",
                "backup",
                str(shard),
                "--repo",
                repo,
                "--tag",
                "run=big",
                "--tag",
                f"shard={i}",
                "--host",
                f"node-{i}",
                "-q",
                *backend.cli_options,
            ],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i, shard in enumerate(shards)
    ]
    results = [(p.wait(timeout=300), p.stderr.read().decode() if p.stderr else "") for p in procs]
    for p in procs:
        for stream in (p.stdout, p.stderr):
            if stream:
                stream.close()
    assert [rc for rc, _ in results] == [0] * WRITERS, results

    listed = json.loads(remote_cli(backend, "snapshots", "--repo", repo, "--tag", "run=big", "--json").stdout)
    assert sorted(s["tags"]["shard"] for s in listed) == [str(i) for i in range(WRITERS)]
    for i, shard in enumerate(shards):
        out = tmp_path / "restored" / f"shard-{i}"
        remote_cli(backend, "restore", "latest", str(out), "--repo", repo, "--tag", "run=big", "--tag", f"shard={i}")
        assert tree_digest(out) == tree_digest(shard)
    remote_cli(backend, "check", "--read-data", "--repo", repo)

    # every index object of every writer survived, and every pack an index names exists
    vault = Vault.open(repo, storage_options=backend.storage_options)
    index_objects = vault._repo.read_index_objects()
    assert len(index_objects) >= WRITERS
    stored = vault._repo.list_packs()
    named = {pack for packs in index_objects.values() for pack in packs}
    assert named <= set(stored)
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **backend.storage_options)
    assert not fs.call_s3("list_multipart_uploads", Bucket=servers.BUCKET, Prefix=repo[5:].split("/", 1)[1]).get(
        "Uploads"
    )
    vault.close()
