"""ls --long and show: tensor listings read from a snapshot's chunks, fetching only the header's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from ckptvault import Vault
from ckptvault.errors import FileFormatError, PathNotInSnapshotError
from tests.support.counting_store import count_reads


def many_tensors(n: int = 1500, seed: int = 0) -> dict[str, np.ndarray]:
    """Long names make a header of a few hundred KB: several chunks with the test chunker (avg 64 KiB)."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        name = f"model.layers.{i}.self_attn.q_proj.weight." + "x" * 150
        out[name] = rng.normal(0, 0.02, (8, 16 + i % 7)).astype(np.float32 if i % 2 else np.float16)
    return out


def test_show_reads_only_the_chunks_holding_the_header(vault: Vault, tmp_path: Path) -> None:
    tensors = many_tensors()
    data = st_save(tensors, metadata={"format": "pt"})
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.safetensors").write_bytes(data)
    snap = vault.backup(tmp_path / "src")
    entry = next(e for e in vault.files(snap) if e.path == "model.safetensors")
    header_end = 8 + int.from_bytes(data[:8], "little")
    sizes = [vault._repo.locate(c).raw_len for c in entry.chunks]
    starts = np.cumsum([0, *sizes])
    header_chunks = int(np.searchsorted(starts, header_end, side="left"))  # chunks overlapping [0, header_end)
    assert 1 < header_chunks < len(entry.chunks) / 2, "the test needs a multi-chunk header in a bigger file"

    reads = count_reads(vault)
    contents = vault.show(snap, "model.safetensors")
    assert len(reads.pack_reads()) <= header_chunks
    assert contents.fetched_chunks <= header_chunks
    assert contents.format == "safetensors" and contents.metadata == {"format": "pt"}
    assert {t.name: (t.dtype, tuple(t.shape)) for t in contents.tensors} == {
        k: ("F32" if v.dtype == np.float32 else "F16", v.shape) for k, v in tensors.items()
    }
    for t in contents.tensors[:50]:
        assert data[t.offset : t.offset + t.nbytes] == tensors[t.name].tobytes()


def test_show_stats_match_numpy(vault: Vault, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(0, 1, (300, 200)).astype(np.float32)
    w[3, 4] = np.nan
    bf16 = (rng.normal(0, 0.5, 5000).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    ids = np.arange(-50, 950, dtype=np.int64)
    (tmp_path / "src").mkdir()
    payload = st_save({"w": w, "ids": ids, "h": bf16})
    # mark "h" as BF16 (same bytes; only the header says what they are), keeping the header's length
    n = int.from_bytes(payload[:8], "little")
    header = payload[8 : 8 + n].rstrip().replace(b'"dtype":"U16"', b'"dtype":"BF16"')
    assert len(header) <= n
    payload = payload[:8] + header.ljust(n) + payload[8 + n :]
    (tmp_path / "src" / "m.safetensors").write_bytes(payload)
    snap = vault.backup(tmp_path / "src")
    rows = {t.name: t for t in vault.show(snap, "m.safetensors", stats=True).tensors}
    s = rows["w"].stats
    finite = w[np.isfinite(w)].astype(np.float64)
    assert s is not None and s.nan == 1 and s.count == w.size - 1
    assert s.min == pytest.approx(finite.min()) and s.max == pytest.approx(finite.max())
    assert s.mean == pytest.approx(finite.mean(), abs=1e-9) and s.std == pytest.approx(finite.std(), rel=1e-9)
    h = rows["h"]
    assert h.dtype == "BF16" and h.stats is not None
    as_f32 = (bf16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    assert h.stats.mean == pytest.approx(as_f32.mean(), abs=1e-12)
    assert rows["ids"].stats is not None and rows["ids"].stats.min == -50 and rows["ids"].stats.max == 949


def test_show_stats_near_the_dtypes_limits_do_not_overflow(cli, tmp_path: Path) -> None:
    """float64 values near 1.8e308: the sums overflowed (mean Infinity, std NaN, which --json wrote as
    invalid JSON, and numpy's overflow warnings reached stderr)."""
    big = np.array([1e308, 1e308, -1e308], np.float64)
    src = tmp_path / "src"
    src.mkdir()
    (src / "m.safetensors").write_bytes(st_save({"big": big, "inf": np.array([np.inf, 1.0])}))
    repo = str(tmp_path / "v")
    cli("init", repo)
    cli("backup", str(src), "--repo", repo, "--quiet")
    proc = cli("show", "latest", "m.safetensors", "--stats", "--json", "--repo", repo)
    assert b"Warning" not in proc.stderr and b"overflow" not in proc.stderr, proc.stderr
    shown = json.loads(proc.stdout, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    stats = {t["name"]: t["stats"] for t in shown["tensors"]}
    assert stats["big"]["mean"] == pytest.approx(1e308 / 3)
    assert stats["big"]["std"] == pytest.approx(1e308 * (8 / 9) ** 0.5)
    assert stats["inf"]["inf"] == 1 and stats["inf"]["mean"] == 1.0
    table = cli("show", "latest", "m.safetensors", "--stats", "--repo", repo).stdout.decode()
    header, row = (line.split() for line in table.splitlines() if line.split()[:1] in (["name"], ["inf"]))
    assert header[-2:] == ["nan", "inf"] and row[-2:] == ["0", "1"]  # the table shows infinities too
    lines = table.splitlines()
    for column in ("bytes", "offset", "mean", "inf"):  # figures right-aligned under their header, as ls and stats
        end = lines[0].index(column) + len(column)
        assert all(line[end - 1] != " " and line[end : end + 1] in ("", " ") for line in lines), (column, table)


def test_ls_long_and_show_through_the_cli(cli, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(st_save({"a": np.ones((64, 64), np.float32)}))
    np.save(src / "emb.npy", np.arange(100, dtype=np.int32))
    (src / "notes.txt").write_text("hello")
    repo = str(tmp_path / "v")
    cli("init", repo)
    cli("backup", str(src), "--repo", repo, "--quiet")
    listing = json.loads(cli("ls", "latest", "--long", "--json", "--repo", repo).stdout)
    by_path = {e["path"]: e for e in listing["entries"]}
    assert by_path["model.safetensors"]["stored_bytes"] > 0 and by_path["model.safetensors"]["chunks"] == 1
    assert len(by_path["emb.npy"]["blake3"]) == 64
    text = cli("ls", "latest", "--long", "--repo", repo).stdout.decode()
    assert "stored" in text and by_path["notes.txt"]["blake3"][:16] in text

    shown = json.loads(cli("show", "latest", "model.safetensors", "--json", "--repo", repo).stdout)
    assert shown["tensors"] == [
        {
            "name": "a",
            "dtype": "F32",
            "shape": [64, 64],
            "nbytes": 16384,
            "offset": shown["tensors"][0]["offset"],
            "stats": None,
        }
    ]
    assert "I32" in cli("show", "latest", "emb.npy", "--repo", repo).stdout.decode()
    bad = cli("show", "latest", "notes.txt", "--repo", repo, check=False)
    assert bad.returncode == FileFormatError.exit_code and bad.stderr.decode().count("\n") == 1
    assert bad.stderr.decode().startswith("error: notes.txt is not a safetensors, .npy/.npz or torch zip file")
    missing = cli("show", "latest", "nope.safetensors", "--repo", repo, check=False)
    assert missing.returncode == PathNotInSnapshotError.exit_code and b"Traceback" not in missing.stderr


def test_damaged_header_in_snapshot_is_one_line(vault: Vault, tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    good = st_save({"a": np.zeros(10, np.float32)})
    (tmp_path / "src" / "m.safetensors").write_bytes(good[:8] + b"{not json" + good[17:])
    snap = vault.backup(tmp_path / "src")
    with pytest.raises(FileFormatError, match="not JSON"):
        vault.show(snap, "m.safetensors")
    assert st_load(good)["a"].shape == (10,)
