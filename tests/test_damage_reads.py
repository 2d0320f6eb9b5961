"""Damage found by the readers of a delta-coded vault with real bytes flipped or objects removed: what
each reader names, and that the files the damage does not touch still restore."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from ckptvault import CompressionSettings, Vault
from ckptvault.chunking import ChunkerParams
from ckptvault.errors import IntegrityError, RestoreIncompleteError

from .test_corruption import flip
from .test_delta import write_safetensors

Cli = Callable[..., subprocess.CompletedProcess]
SMALL = ChunkerParams(min_size=16 * 1024, avg_size=64 * 1024, max_size=256 * 1024)


def _save(folder: Path, step: int, weights: np.ndarray) -> None:
    write_safetensors(folder / "model.safetensors", {"w": ("F32", weights)})
    (folder / "config.json").write_text(f'{{"step": {step}}}')
    (folder / "notes.txt").write_text("the same in every save\n")


@pytest.fixture
def three_saves(tmp_path: Path) -> tuple[str, list[dict[str, bytes]], list[str], list[set[str]]]:
    """A delta-coded vault holding three saves of one folder (steps 2 and 3 stored as deltas against
    step 1's keyframes); returns its URL, each save's files, the snapshot IDs and each backup's new packs."""
    url, ckpt = str(tmp_path / "vault"), tmp_path / "ckpt"
    ckpt.mkdir()
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((256, 256)).astype(np.float32)  # 256 KiB: 4 pieces
    saves, ids, packs = [], [], []
    with Vault.init(url, chunker=SMALL, compression=CompressionSettings(delta=True)) as vault:
        for step in (1, 2, 3):
            weights = weights + (rng.random(weights.shape) < 0.05) * np.float32(1e-3)
            _save(ckpt, step, weights)
            before = {p.name for p in Path(url, "packs").glob("*/*")}
            ids.append(vault.backup(ckpt, tags={"step": str(step)}).id)
            packs.append({p.name for p in Path(url, "packs").glob("*/*")} - before)
            saves.append({p.name: p.read_bytes() for p in ckpt.iterdir()})
    return url, saves, ids, packs


def _pack(url: str, pack_id: str) -> Path:
    return Path(url, "packs", pack_id[:2], pack_id)


def test_restore_writes_the_files_whose_chunks_are_all_there_when_a_pack_is_gone_from_the_index(
    three_saves, cli: Cli, tmp_path: Path
):
    """A pack gone (and dropped from the index by repair-index, as check advises) or a damaged chunk
    dropped by repair-index --read-data: the files it does not hold still restore, those it holds are
    named (a missing delta base too), exit 30. The plan refused the whole snapshot, so following
    check's advice made files that had restored unrestorable."""
    url, saves, ids, packs = three_saves
    (pack_1,) = packs[0]  # step 1: the keyframes, config.json, notes.txt (shared by every save)
    (pack_3,) = packs[2]
    _pack(url, pack_3).unlink()
    cli("repair-index", "--repo", url)
    proc = cli("restore", ids[2][:8], str(tmp_path / "out3"), "--repo", url, check=False)
    assert proc.returncode == 30 and b"Traceback" not in proc.stderr, proc.stderr
    err = proc.stderr.decode()
    assert "missing from the repository" in err and "config.json" in err and "model.safetensors" in err, err
    restored = {p.name: p.read_bytes() for p in (tmp_path / "out3").iterdir()}
    assert restored == {"notes.txt": saves[2]["notes.txt"]}  # from step 1's pack: intact
    # a keyframe dropped from the index: the deltas coded against it are named, the rest restores
    data = _pack(url, pack_1).read_bytes()
    flip(_pack(url, pack_1), len(data) // 4)  # inside the first tensor piece, a keyframe
    cli("repair-index", "--read-data", "--repo", url)
    with Vault.open(url) as vault:
        with pytest.raises(RestoreIncompleteError) as raised:
            vault.restore(ids[1], tmp_path / "out2")
        assert list(raised.value.failed) == ["model.safetensors"], raised.value.failed
        assert "missing from the repository" in raised.value.failed["model.safetensors"]
        restored = {p.name: p.read_bytes() for p in (tmp_path / "out2").iterdir()}
        assert restored == {n: saves[1][n] for n in ("config.json", "notes.txt")}
        # a rerun into the same folder: what is there already is no failure
        with pytest.raises(RestoreIncompleteError) as raised:
            vault.restore(ids[1], tmp_path / "out2")
        assert list(raised.value.failed) == ["model.safetensors"] and raised.value.result.skipped_files == 2


def test_diff_tensors_names_the_file_whose_damaged_chunk_it_read(three_saves, cli: Cli):
    """``diff --tensors`` reads each changed file's first chunk (its format) and the tensor pieces chunk IDs
    cannot decide: damage there fails the diff (exit 30, documented), naming the file it is in, not only a
    chunk ID; ``diff`` without ``--tensors`` reads no chunk and lists the change."""
    from ckptvault.snapshot.manifest import decode_snapshot, decode_tree

    url, _saves, ids, _packs = three_saves
    with Vault.open(url) as vault:
        repo = vault._repo
        tree = decode_tree(
            repo.load_tree(bytes.fromhex(decode_snapshot(repo.load_snapshot(bytes.fromhex(ids[0]))).tree_id))
        )
        (config,) = [e for e in tree if e.path == "config.json"]
        loc = repo.index.get(config.chunks[0])
        assert loc is not None
    flip(_pack(url, loc.pack_id.hex()), loc.offset + loc.stored_len // 2)
    proc = cli("diff", ids[0][:8], ids[2][:8], "--tensors", "--repo", url, check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 30 and "Traceback" not in err, err
    assert "config.json (compared with --tensors)" in err and config.chunks[0].hex()[:12] in err, err
    with Vault.open(url) as vault, pytest.raises(IntegrityError, match=r"config\.json \(compared with tensors=True\)"):
        vault.diff(ids[0], ids[2], tensors=True)  # the API's words
    proc = cli("diff", ids[0][:8], ids[2][:8], "--repo", url, check=False)
    assert proc.returncode == 0 and b"config.json" in proc.stdout, proc.stderr


def test_a_rerun_leaves_a_file_whose_pack_is_gone_in_place_and_never_touches_a_hard_link_of_it(tmp_path: Path):
    """A file restored before and then dropped from the index (its pack gone, repair-index) is no failure of a
    rerun: it is there whole. With --overwrite, one hard-linked from outside the target is not kept: its mode
    and mtime would be set through the link (the plan replaces such a file, and this one cannot be written)."""
    import os
    import stat

    url, src, out = str(tmp_path / "vault"), tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(50_000))
    with Vault.init(url) as vault:
        vault.backup(src)
        before = set(Path(url, "packs").glob("*/*"))
        (src / "b.bin").write_bytes(os.urandom(60_000))
        os.chmod(src / "b.bin", 0o644)
        snap = vault.backup(src)
        (new_pack,) = set(Path(url, "packs").glob("*/*")) - before
        vault.restore(snap, out)
    new_pack.unlink()
    with Vault.open(url) as vault:
        vault.repair_index()
        assert vault.restore(snap, out).skipped_files == 2  # a rerun: b.bin is there whole
        outside = tmp_path / "elsewhere"
        os.link(out / "b.bin", outside)
        os.chmod(outside, 0o600)
        os.utime(outside, ns=(10**18, 10**18))
        with pytest.raises(RestoreIncompleteError) as raised:
            vault.restore(snap, out, overwrite=True)
    assert list(raised.value.failed) == ["b.bin"] and "missing from the repository" in raised.value.failed["b.bin"]
    st = outside.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (0o600, 10**18)
