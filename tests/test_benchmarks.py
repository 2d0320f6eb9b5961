"""The benchmark script is a deliverable: run it end to end on a tiny workload (ckptvault only, as
restic and borg may be missing), so that a change to it or to the CLI cannot silently break it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "run_bench.py"


@pytest.mark.slow
def test_run_bench_times_every_phase_and_verifies_both_restores(tmp_path: Path):
    tiny = ["--model-mb", "5", "--saves", "2", "--tools", "ckptvault"]
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--work", str(tmp_path), *tiny],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (result,) = json.loads((tmp_path / "results.json").read_text())["results"]
    assert result["error"] is None and result["verified"] is True
    phases = result["phases"]
    for phase in ("backup1_first", "backup2_incr", "backup2_nochange", "restore_latest", "restore_cached"):
        assert phases[phase]["rc"] == 0 and phases[phase]["wall_s"] > 0, phase
    assert "| ckptvault |" in proc.stdout and "restore cached MB/s" in proc.stdout
    machine = json.loads((tmp_path / "results.json").read_text())["machine"]
    assert "AVX-512: " in machine["cpu"] and machine["cpu"] in proc.stdout  # which host: the ratios move with it


@pytest.mark.slow
def test_shipping_contention_runs_end_to_end(tmp_path: Path):
    pytest.importorskip("torch", reason="pip install torch==2.13.0")
    script = BENCH.parent / "shipping_contention.py"
    tiny = ["--model-mb", "5", "--saves", "2", "--runs", "1", "--baseline-s", "0.5"]
    proc = subprocess.run(
        [sys.executable, str(script), "--work", str(tmp_path), *tiny], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("| 1 |")]
    alone, shipping, kept = (cell.strip() for cell in row.split("|")[2:5])
    assert float(alone) > 0 and float(shipping) > 0 and kept.endswith("x")
    assert not list(tmp_path.glob("vault-*")), "its vaults are removed"


@pytest.mark.slow
def test_chunk_processes_runs_end_to_end(tmp_path: Path):
    script = BENCH.parent / "chunk_processes.py"
    tiny = ["--size-gb", "0.2", "--processes", "0,1", "--rounds", "1", "--no-restic"]
    proc = subprocess.run(
        [sys.executable, str(script), "--work", str(tmp_path), *tiny], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| 1 | processes=0 |" in proc.stdout and "| 1 | processes=1 |" in proc.stdout


@pytest.mark.slow
def test_many_files_runs_end_to_end(tmp_path: Path):
    script = BENCH.parent / "many_files.py"
    tiny = ["--files", "150", "--tools", "ckptvault"]
    proc = subprocess.run(
        [sys.executable, str(script), "--work", str(tmp_path), *tiny], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "workload: 150 files per save" in proc.stdout and "150 files identical" in proc.stdout
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("| ckptvault |")]
    assert row.endswith("| yes |")
