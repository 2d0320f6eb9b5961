"""Many small files: ckptvault against restic (and borg) on a checkpoint folder of thousands of small files.

A sharded save (one file per rank and per tensor group, as ZeRO or torch.distributed.checkpoint
write them) or a run folder full of small states puts the cost per file (opening, stat, a hand-off to
a worker thread and back) ahead of the cost per byte that `run_bench.py` measures. The workload is
deterministic: save 1 is FILES files of 1-60 KB of random bytes (incompressible, as optimizer shards
nearly are) in folders of 100; save 2 is save 1 with every third file rewritten. The phases, their
timing and the table are run_bench.py's (each a fresh process under `/usr/bin/time -v`, the source read
once untimed first, the restore's repository evicted from the page cache), on this workload.

    python benchmarks/many_files.py [--work /tmp/ckptvault-many] [--files 10000] [--tools ckptvault,restic]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_bench  # beside this script


def make_saves(work: str, files: int) -> list[tuple[str, int]]:
    """Two saves of ``files`` small files (made again only when their count changed)."""
    root = os.path.join(work, f"workload-{files}")
    saves = [(os.path.join(root, "step-1000"), 1000), (os.path.join(root, "step-2000"), 2000)]
    done = os.path.join(root, "done")
    if os.path.exists(done):
        return saves
    shutil.rmtree(root, ignore_errors=True)
    rng = random.Random(1000)
    first, second = (path for path, _ in saves)
    for i in range(files):
        rel = os.path.join(f"rank{i // 100:04d}", f"shard_{i % 100:03d}.pt")
        data = rng.randbytes(rng.randint(1_000, 60_000))
        for save, content in ((first, data), (second, rng.randbytes(len(data)) if i % 3 == 0 else data)):
            os.makedirs(os.path.dirname(os.path.join(save, rel)), exist_ok=True)
            with open(os.path.join(save, rel), "wb") as f:
                f.write(content)
    open(done, "w").close()
    return saves


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/ckptvault-many", help="work dir (workload, repos, logs)")
    ap.add_argument("--files", type=int, default=10_000, help="files per save (default 10000)")
    ap.add_argument("--tools", default="ckptvault,ckptvault-enc,restic,borg", help="comma-separated subset")
    args = ap.parse_args(argv)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = sorted(set(tools) - set(run_bench.TOOLS))
    if unknown:
        ap.error(f"unknown tools {unknown}; known: {sorted(run_bench.TOOLS)}")
    run_bench.ensure_installed(tools)
    saves = make_saves(args.work, args.files)
    results = []
    for name in tools:
        print(f"{name} ...", file=sys.stderr)
        results.append(run_bench.bench_tool(name, args.work, saves, keep=False))
    size = run_bench.tree_bytes(saves[0][0])
    print(f"\nworkload: {args.files} files per save, {size / 1e6:.1f} MB; save 2 rewrites every third file")
    print(f"machine: {os.cpu_count()} CPUs, {run_bench.cpu_model()}")
    for r in results:
        print(f"{r.tool}: {r.version}  verify: {r.verify_detail or '-'}" + (f"  ERROR: {r.error}" if r.error else ""))
    print()
    print(run_bench.table(results))
    if "restic" in tools:
        print("\nratios vs restic (same run; restic seconds / this tool's seconds, >1 = faster):")
        print(run_bench.ratio_table(run_bench.ratios_vs_restic(results)))
    return 0 if all(r.error is None for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
