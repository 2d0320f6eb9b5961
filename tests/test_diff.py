"""diff: files added/removed/changed, bytes new, and exactly which tensors changed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save as st_save

from ckptvault import Vault
from tests.support.counting_store import count_reads


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Big tensors (many chunks) and small ones (several per chunk, so chunks straddle tensors)."""
    rng = np.random.default_rng(seed)
    out = {f"big.{i}": rng.normal(0, 0.02, (256, 256)).astype(np.float32) for i in range(6)}
    out |= {f"small.{i}": rng.normal(0, 0.02, (100 + i,)).astype(np.float16) for i in range(12)}
    out["norm"] = np.ones(1000, np.float32)
    return out


def test_diff_tensors_names_exactly_the_three_changed(vault: Vault, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    w = weights()
    (src / "model.safetensors").write_bytes(st_save(w))
    (src / "config.json").write_text("{}")
    (src / "old.txt").write_text("gone soon")
    a = vault.backup(src)

    w["big.2"] = w["big.2"] + np.float32(1e-3)  # a whole multi-chunk tensor
    w["small.5"][7] += np.float16(1)  # one element of a tensor that shares its chunk with neighbours
    w["norm"][-1] = 2.0  # the last element of the file
    (src / "model.safetensors").write_bytes(st_save(w))
    (src / "old.txt").unlink()
    (src / "new.txt").write_text("added")
    b = vault.backup(src)

    reads = count_reads(vault)
    d = vault.diff(a, b, tensors=True)
    by_path = {f.path: f for f in d.files}
    assert {p: f.status for p, f in by_path.items()} == {
        "model.safetensors": "changed",
        "old.txt": "removed",
        "new.txt": "added",
    }
    assert d.unchanged_files == 1
    t = by_path["model.safetensors"].tensors
    assert t is not None and sorted(t.changed) == ["big.2", "norm", "small.5"]
    assert t.added == [] and t.removed == [] and t.unchanged == len(w) - 3
    model = next(e for e in vault.files(b) if e.path == "model.safetensors")
    assert len(reads.pack_reads()) < len(model.chunks), "diff must not read the whole file"
    assert 0 < by_path["model.safetensors"].new_bytes <= d.new_bytes
    assert d.new_bytes >= w["big.2"].nbytes


def test_diff_tensors_added_removed_and_without_tensors(vault: Vault, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    w = weights(1)
    (src / "m.safetensors").write_bytes(st_save(w))
    a = vault.backup(src)
    w["extra"] = np.zeros(10, np.float32)
    del w["small.0"]
    (src / "m.safetensors").write_bytes(st_save(w))
    b = vault.backup(src)
    t = vault.diff(a, b, tensors=True).files[0].tensors
    assert t is not None and (t.added, t.removed, t.changed) == (["extra"], ["small.0"], [])
    assert vault.diff(a, b).files[0].tensors is None
    same = vault.diff(b, b)
    assert same.files == [] and same.new_bytes == 0


def test_diff_through_the_cli(cli, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    w = weights(2)
    (src / "m.safetensors").write_bytes(st_save(w))
    repo = str(tmp_path / "v")
    cli("init", repo)
    cli("backup", str(src), "--repo", repo, "--quiet")
    w["big.0"] *= 2
    (src / "m.safetensors").write_bytes(st_save(w))
    cli("backup", str(src), "--repo", repo, "--quiet")
    snaps = json.loads(cli("snapshots", "--json", "--repo", repo).stdout)
    a, b = snaps[0]["id"][:10], snaps[1]["id"][:10]
    out = json.loads(cli("diff", a, b, "--tensors", "--json", "--repo", repo).stdout)
    assert out["files"][0]["tensors"]["changed"] == ["big.0"]
    text = cli("diff", a, b, "--tensors", "--repo", repo).stdout.decode()
    assert "~ big.0" in text and "1 changed" in text
    bad = cli("diff", a, "ffffffffff", "--repo", repo, check=False)
    assert bad.returncode == 18 and b"Traceback" not in bad.stderr
    # --tag scopes 'latest' to a run: a newer snapshot without the tag is not the one compared
    cli("backup", str(src), "--repo", repo, "--quiet", "--tag", "run=x")
    run_x = json.loads(cli("snapshots", "--json", "--repo", repo).stdout)[-1]["id"][:10]
    w["small.0"] = w["small.0"] + 1
    (src / "m.safetensors").write_bytes(st_save(w))
    cli("backup", str(src), "--repo", repo, "--quiet")
    scoped = json.loads(cli("diff", run_x, "latest", "--tag", "run=x", "--json", "--repo", repo).stdout)
    assert scoped["files"] == []  # latest of run=x is run_x itself
    unscoped = json.loads(cli("diff", run_x, "latest", "--tensors", "--json", "--repo", repo).stdout)
    assert unscoped["files"][0]["tensors"]["changed"] == ["small.0"]


def test_diff_names_links_folders_types_and_modes(vault: Vault, tmp_path: Path, cli) -> None:
    """A retargeted `latest` link, a removed and an added folder, a file become a link, a mode change
    and a touched file: restic's diff reports each; ckptvault's said "0 changed"."""
    src = tmp_path / "src"
    for d in ("step-100", "step-200", "emptydir"):
        (src / d).mkdir(parents=True)
    (src / "step-100" / "w.bin").write_bytes(b"w" * 100)
    (src / "step-200" / "w.bin").write_bytes(b"v" * 100)
    (src / "config.json").write_text("{}")
    (src / "notes.txt").write_text("notes")
    (src / "same.txt").write_text("same")
    (src / "ckpt").write_bytes(b"c" * 300)
    os.symlink("step-100", src / "latest")
    a = vault.backup(src)

    (src / "latest").unlink()
    os.symlink("step-200", src / "latest")
    (src / "emptydir").rmdir()
    (src / "emptydir2").mkdir()
    (src / "step-100" / "w.bin").chmod(0o600)
    (src / "notes.txt").unlink()
    os.symlink("config.json", src / "notes.txt")
    os.utime(src / "config.json", ns=(10**18, 10**18))
    (src / "ckpt").unlink()
    (src / "ckpt").mkdir()
    (src / "ckpt" / "part").write_bytes(b"p" * 7)
    b = vault.backup(src)

    changes = {c.path: c for c in vault.diff(a, b).files}
    assert changes["latest"].status == "changed" and changes["latest"].details == ("target step-100 -> step-200",)
    assert (changes["emptydir"].status, changes["emptydir"].type_a) == ("removed", "dir")
    assert (changes["emptydir2"].status, changes["emptydir2"].type_b) == ("added", "dir")
    assert changes["step-100/w.bin"].status == "metadata"
    assert changes["step-100/w.bin"].details == ("mode 0o644 -> 0o600",)
    assert changes["notes.txt"].status == "changed" and changes["notes.txt"].details == ("type file -> symlink",)
    assert changes["config.json"].details == ("mtime",)
    assert "same.txt" not in changes and "step-200/w.bin" not in changes

    repo = str(vault.url)
    text = cli("diff", a.id, b.id, "--repo", repo).stdout.decode()
    lines = text.splitlines()
    # the sizes right-aligned in one column before the paths, so that both line up
    assert "changed         latest  (target step-100 -> step-200)" in lines
    assert "removed         emptydir/" in lines and "added           emptydir2/" in lines
    assert "metadata 100 B  step-100/w.bin  (mode 0o644 -> 0o600)" in lines
    # a file that became a link or a folder has no size in B: A's (5 B, 300 B) was shown beside the new entry
    assert "changed         notes.txt -> config.json  (type file -> symlink)" in lines, text
    assert "changed         ckpt/  (type file -> dir)" in lines and "added      7 B  ckpt/part  (7 B new)" in lines, (
        text
    )
    paths = ("latest", "emptydir/", "step-100/w.bin", "notes.txt")
    starts = {line.index(path) for line in lines for path in paths if path in line}
    assert len(starts) == 1, text
    assert "2 with new mode or mtime" in text.splitlines()[-1], text


def test_diff_tensors_lists_them_in_the_files_order(vault: Vault, tmp_path: Path) -> None:
    """As `show` lists them: sorted as text, "w.10" came before "w.2"."""
    torch = pytest.importorskip("torch")
    src = tmp_path / "src"
    src.mkdir()
    state = {f"w.{i}": torch.arange(1000, dtype=torch.float32) + i for i in range(12)}
    torch.save(state, src / "model.pt")
    a = vault.backup(src)
    for name in ("w.10", "w.2"):
        state[name] = state[name] + 1
    torch.save(state, src / "model.pt")
    b = vault.backup(src)
    (changed,) = vault.diff(a, b, tensors=True).files
    assert changed.tensors is not None and changed.tensors.changed == ["w.2", "w.10"], changed.tensors
