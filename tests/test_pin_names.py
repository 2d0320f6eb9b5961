"""Names inside a pinned checkpoint: the temporary-name rules pick which top-level entries are
checkpoints; inside one, every finished file ships, dot-files and ``tmp_*`` included. A
torch.distributed.checkpoint folder keeps its index in ``.metadata`` and cannot load without it."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.ops import pin as pins
from tests.conftest import tree_digest, write_file


def test_a_pin_keeps_dot_and_tmp_prefixed_files_and_skips_only_names_still_being_written(tmp_path: Path):
    ckpt = tmp_path / "step_100"
    finished = {
        ".metadata": b"dcp index",
        "__0_0.distcp": os.urandom(2000),
        "tmp_rng_state.pt": b"rng",
        "~lock": b"",
        "params/.zarray": b"{}",
        "params/.zattrs": b"{}",
        ".hidden/x.bin": b"x",
    }
    for rel, data in finished.items():
        write_file(ckpt / rel, data)
    write_file(ckpt / "optimizer.pt.tmp", b"half")  # written under a name its writer renames
    pin = pins.create(str(ckpt), str(tmp_path / "staging"))
    pinned = {str(p.relative_to(pin.data)) for p in Path(pin.data).rglob("*") if p.is_file()}
    assert pinned == set(finished)

    os.replace(ckpt / "optimizer.pt.tmp", ckpt / "optimizer.pt")
    pins.sync(pin)
    assert (Path(pin.data) / "optimizer.pt").read_bytes() == b"half"
    assert not (Path(pin.data) / "optimizer.pt.tmp").exists()


def test_a_dcp_checkpoint_shipped_by_backup_async_restores_and_loads(tmp_path: Path):
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    ckpt = tmp_path / "ckpts" / "step_100"
    model = torch.nn.Linear(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it runs single-process
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt))
    assert ".metadata" in os.listdir(ckpt)

    with Vault.open(str(tmp_path / "repo"), create=True) as vault:
        snap = vault.backup_async(str(ckpt), tags={"run": "dcp", "step": "100"}).result(timeout=120)
        assert ".metadata" in {f.path for f in vault.files(snap)}
        assert vault.is_backed_up(str(ckpt))
        vault.restore_latest(str(tmp_path / "resume"), run="dcp")
    assert tree_digest(tmp_path / "resume") == tree_digest(ckpt)

    loaded = {"model": torch.nn.Linear(8, 4).state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(loaded, checkpoint_id=str(tmp_path / "resume"))
    for key, value in model.state_dict().items():
        assert torch.equal(loaded["model"][key], value)


def test_watch_ships_the_dot_files_inside_a_checkpoint_but_not_a_dot_named_checkpoint(tmp_path: Path, cli):
    ckpts = tmp_path / "ckpts"
    write_file(ckpts / "step_100" / ".metadata", b"index")
    write_file(ckpts / "step_100" / "__0_0.distcp", os.urandom(1000))
    write_file(ckpts / ".step_200" / "__0_0.distcp", os.urandom(1000))  # top level: still being written
    repo = str(tmp_path / "repo")
    Vault.init(repo).close()
    lines = cli("watch", str(ckpts), "--repo", repo, "--tag", "run=w", "--once", "--settle", "0.2").stdout.decode()
    assert len(lines.splitlines()) == 1 and lines.startswith("shipped step_100 step 100"), lines
    with Vault.open(repo) as vault:
        (snap,) = vault.snapshots({"run": "w"})
        assert {f.path for f in vault.files(snap) if f.type == "file"} == {".metadata", "__0_0.distcp"}
