"""``ckptvault drill``: restore into a temporary folder, verify, load, time, clean up."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import deep_tree, write_file

torch = pytest.importorskip("torch", reason="the drill's --load tests need torch (pip install torch==2.13.0)")
safetensors_torch = pytest.importorskip("safetensors.torch")


def tensor_checkpoint(path: Path) -> Path:
    torch.manual_seed(0)
    path.mkdir(parents=True)
    safetensors_torch.save_file({"w": torch.randn(64, 64), "b": torch.zeros(64)}, str(path / "model.safetensors"))
    torch.save({"exp_avg": torch.randn(64, 64), "step": torch.tensor(7)}, path / "optimizer.pt")
    torch.save({"lr": 0.1, "note": object.__name__, "rng": [1, 2, 3]}, path / "extra_state.pt")
    torch.save({"custom": ValueError("a pickled Python object")}, path / "pickled.pt")
    write_file(path / "config.json", b'{"hidden": 64}')
    return path


def test_drill_restores_verifies_loads_times_each_phase_and_cleans_up(tmp_path, repo_url, vault, cli):
    ckpt = tensor_checkpoint(tmp_path / "checkpoint-7")
    vault.backup(ckpt, tags={"run": "d", "step": "7"})
    scratch = tmp_path / "scratch" / "drills"  # neither exists yet
    proc = cli("drill", "latest", "--tag", "run=d", "--load", "--json", "--tmp-dir", str(scratch), "--repo", repo_url)
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["step"] == 7 and report["files"] == 5
    for phase in ("fetch_s", "verify_s", "load_s", "total_s"):
        assert report[phase] >= 0
    loaders = {c["path"]: (c["loader"], c["ok"]) for c in report["loads"]}
    assert loaders == {
        "model.safetensors": ("safetensors", True),
        "optimizer.pt": ("torch", True),
        "extra_state.pt": ("torch", True),
        "pickled.pt": ("torch-archive", True),  # checked record by record, its pickle not run
    }
    assert not (tmp_path / "scratch").exists(), "the drill leaves nothing behind, not even the folders it made"
    kept = tmp_path / "kept"
    kept.mkdir()
    vault.drill("latest", workdir=kept)
    assert kept.is_dir() and list(kept.iterdir()) == []  # a folder that was there stays
    text = cli("drill", "--tag", "run=d", "--repo", repo_url).stdout.decode()
    assert "fetch" in text and "verify" in text and "recovery OK" in text


def test_a_tree_deeper_than_pythons_recursion_drills_and_leaves_nothing(tmp_path, vault):
    """The drill removed what it restored with shutil.rmtree: RecursionError, an internal error."""
    with deep_tree(tmp_path / "src"):
        vault.backup(tmp_path / "src")
    scratch = tmp_path / "scratch"
    report = vault.drill("latest", workdir=scratch)
    assert report.ok and report.files == 1 and report.bytes == 4
    assert not scratch.exists()


def test_a_file_that_restores_intact_but_does_not_load_fails_the_drill(tmp_path, repo_url, vault, cli):
    ckpt = tmp_path / "checkpoint-3"
    write_file(ckpt / "model.pt", os.urandom(4096))  # named like a torch file, but is not one
    vault.backup(ckpt, tags={"step": "3"})
    proc = cli("drill", "latest", "--load", "--repo", repo_url, check=False)
    assert proc.returncode == 41
    assert "FAIL model.pt" in proc.stdout.decode()
    err = proc.stderr.decode().strip().splitlines()
    assert len(err) == 1 and "does not load" in err[0]
    assert cli("drill", "latest", "--repo", repo_url).returncode == 0, "without --load the bytes alone are checked"


def test_a_pickled_torch_archive_python_cannot_open_fails_the_drill_without_a_traceback(tmp_path, repo_url, vault, cli):
    """torch refuses its pickle (weights only), then Python's zipfile refuses the archive itself (here a
    central directory asking for zip version 17.6): the file fails the drill, exit 41, one line."""
    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    torch.save({"custom": ValueError("a pickled Python object")}, ckpt / "pickled.pt")
    data = bytearray((ckpt / "pickled.pt").read_bytes())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        data[at + 6 : at + 8] = (176).to_bytes(2, "little")  # "version needed to extract": 17.6
        at = data.find(b"PK\x01\x02", at + 4)
    (ckpt / "pickled.pt").write_bytes(data)
    vault.backup(ckpt, tags={"step": "4"})
    proc = cli("drill", "latest", "--load", "--repo", repo_url, check=False)
    assert proc.returncode == 41, proc.stderr
    assert "FAIL pickled.pt" in proc.stdout.decode() and "zip file version 17.6" in proc.stdout.decode()
    assert len(proc.stderr.decode().strip().splitlines()) == 1


def test_damaged_storage_fails_the_drill_with_exit_30(tmp_path, repo_url, vault, cli):
    ckpt = tensor_checkpoint(tmp_path / "checkpoint-1")
    vault.backup(ckpt)
    for pack in (Path(repo_url) / "packs").rglob("*"):
        if pack.is_file():
            data = bytearray(pack.read_bytes())
            data[len(data) // 3] ^= 0xFF
            pack.write_bytes(bytes(data))
    proc = cli("drill", "latest", "--repo", repo_url, check=False)
    assert proc.returncode == 30
    assert "Traceback" not in proc.stderr.decode()
    as_json = cli("drill", "latest", "--repo", repo_url, "--json", check=False)  # printed nothing
    assert as_json.returncode == 30
    verdict = json.loads(as_json.stdout)
    assert verdict["ok"] is False and verdict["error"] in as_json.stderr.decode()


def test_drill_from_python_returns_the_report(tmp_path, vault):
    ckpt = tensor_checkpoint(tmp_path / "checkpoint-2")
    vault.backup(ckpt, tags={"step": "2"})
    report = vault.drill("latest", load=True)
    assert report.ok and report.bytes == sum(p.stat().st_size for p in ckpt.iterdir())
    assert report.load_s is not None and report.fetch_s >= 0


def test_weights_linked_from_outside_the_snapshot_fail_the_drill_and_links_inside_load(tmp_path, vault, cli, repo_url):
    """Weights linked to an earlier checkpoint (rotated away since) are not in the vault: --load must
    not call such a checkpoint recoverable. A link to a file the snapshot holds loads through it."""
    ckpts = tmp_path / "ckpts"
    first = tensor_checkpoint(ckpts / "checkpoint-100")
    second = ckpts / "checkpoint-200"
    second.mkdir()
    (second / "model.safetensors").symlink_to("../checkpoint-100/model.safetensors")
    (second / "best.safetensors").symlink_to("model.safetensors")  # inside, but dangling in the snapshot
    torch.save({"step": torch.tensor(200)}, second / "optimizer.pt")
    (second / "last.pt").symlink_to("optimizer.pt")  # inside, and there
    vault.backup(second, tags={"step": "200"})
    del first
    proc = cli("drill", "latest", "--load", "--json", "--repo", repo_url, check=False)
    assert proc.returncode == 41, proc.stderr
    loads = {c["path"]: (c["loader"], c["ok"]) for c in json.loads(proc.stdout)["loads"]}
    assert loads == {
        "model.safetensors": ("link", False),
        "best.safetensors": ("link", False),
        "optimizer.pt": ("torch", True),
        "last.pt": ("torch", True),
    }
    assert "which is no file of the snapshot: its bytes are not in the vault" in proc.stderr.decode()


def test_a_legacy_torch_file_holding_pickled_objects_is_checked_whole_without_unpickling_it(tmp_path, vault):
    """A legacy (not zip) torch file that a weights-only load refuses (numpy's RNG state) was skipped, so
    one cut short by a killed save passed the drill (audit 30 #3): its storages are now checked to be
    there whole, walking its pickles with nothing imported or called."""
    import numpy as np

    ckpt = tmp_path / "checkpoint-5"
    ckpt.mkdir()
    state = {"w": torch.randn(64, 64), "np_rng": np.random.get_state(), "custom": ValueError("pickled")}
    torch.save(state, ckpt / "legacy.pt", _use_new_zipfile_serialization=False)
    torch.save({"w": torch.ones(2)}, ckpt / "legacy_weights.pt", _use_new_zipfile_serialization=False)
    whole = (ckpt / "legacy.pt").read_bytes()
    vault.backup(ckpt, tags={"step": "5"})
    report = vault.drill("latest", load=True)
    assert report.ok and not report.skipped, report
    checks = {c.path: c for c in report.loads}
    assert checks["legacy_weights.pt"].loader == "torch"
    assert checks["legacy.pt"].loader == "torch-legacy" and checks["legacy.pt"].ok, checks["legacy.pt"]
    (ckpt / "legacy.pt").write_bytes(whole[: len(whole) * 2 // 3])  # a save killed mid-write, then shipped
    with pytest.raises(RuntimeError):
        torch.load(ckpt / "legacy.pt", weights_only=False)  # what a resume would meet
    vault.backup(ckpt, tags={"step": "6"})
    report = vault.drill("latest", load=True)
    (cut,) = [c for c in report.loads if not c.ok]
    assert not report.ok and cut.path == "legacy.pt" and "cut short" in cut.detail, report


def test_a_damaged_legacy_torch_file_fails_its_check_within_bounds():
    """Review 30: the C unpickler grew its memo array to a flipped memo index (gigabytes from 9 bytes), a
    key nested deep raised RecursionError out of the drill, a negative element count passed."""
    import io
    import resource
    import struct

    from ckptvault.ops.drill import _LEGACY_TORCH_MAGIC
    from ckptvault.ops.legacy_torch import legacy_torch_problem

    head = b"\x80\x02" + _LEGACY_TORCH_MAGIC + b"."
    memo_bomb = head + b"\x80\x02K\x01r" + struct.pack("<I", 0xFFFFFFF0) + b"."
    nested = head * 4 + b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b"."  # storage keys nested 100,000 deep
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for damaged in (memo_bomb, nested, head):
        assert legacy_torch_problem(io.BytesIO(damaged)) is not None
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB: not the 64 GiB asked
