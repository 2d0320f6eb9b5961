#!/usr/bin/env python3
"""How ckptvault and restic scale with the number of snapshots in a repository that is never pruned.

A training run that ships a small save every few minutes and keeps them all piles up snapshots (and,
in both tools, an index object or more per backup). Per tool, in a fresh repository: N backups of a
small folder whose state file changes at every step (each a fresh CLI process, as a job that calls the
CLI per checkpoint does), then, each timed in a fresh process with the repository in the page cache:

  backup     one more backup of a changed step
  listing    `ckptvault snapshots` / `restic snapshots` (all N+1 in a table)
  restore    `restore latest` into an empty folder (compared byte for byte with the source, untimed)

Prints a markdown table: the mean wall time of the first and the last 20 of the N backups (growth
with N), the three timed phases, the index objects in the repository and its size. Stdlib only; the
tools are driven as run_bench.py drives them (encrypted: ckptvault-enc, restic).

  python benchmarks/many_snapshots.py [--snapshots 300] [--tools ckptvault-enc,restic] [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_bench import TOOLS, compare_trees, du_bytes, ensure_installed, run_timed, sh

EDGE = 20  # backups averaged at each end of the series


def write_step(src: str, step: int) -> None:
    os.makedirs(src, exist_ok=True)
    with open(os.path.join(src, "state.bin"), "wb") as f:
        f.write(random.Random(step).randbytes(256 * 1024))
    with open(os.path.join(src, "trainer_state.json"), "w") as f:
        f.write(f'{{"global_step": {step}}}')


def index_objects(repo: str) -> int:
    folder = os.path.join(repo, "index")
    return sum(len(files) for _, _, files in os.walk(folder)) if os.path.isdir(folder) else 0


def bench(name: str, work: str, count: int) -> dict[str, object]:
    root = os.path.join(work, name)
    shutil.rmtree(root, ignore_errors=True)
    repo, state, src = (os.path.join(root, d) for d in ("repo", "state", "src"))
    os.makedirs(state)
    tool = TOOLS[name](repo, state)
    init = sh(tool.init_cmd, env=tool.env)
    if init.returncode:
        return {"tool": name, "error": f"init failed: {init.stderr.strip()[:200]}"}
    durations = []
    for step in range(count):
        write_step(src, step)
        started = time.perf_counter()
        done = sh(tool.backup_cmd(src, f"s{step}", step), env=tool.env)
        durations.append(time.perf_counter() - started)
        if done.returncode:
            return {"tool": name, "error": f"backup {step} failed: {done.stderr.strip()[:200]}"}
        if step % 50 == 0:
            print(f"  {name}: {step}/{count} backups, last {durations[-1]:.2f} s", file=sys.stderr, flush=True)
    write_step(src, count)
    row: dict[str, object] = {"tool": name, "snapshots": count + 1}
    row["first"] = sum(durations[:EDGE]) / len(durations[:EDGE])
    row["last"] = sum(durations[-EDGE:]) / len(durations[-EDGE:])
    log = os.path.join(root, "phase.log")
    row["backup"] = run_timed(tool.backup_cmd(src, f"s{count}", count), tool.env, log, 0).wall_s
    exe = tool.version_cmd[0]
    listing_cmd = (
        [exe, "snapshots", "--repo", repo] if name.startswith("ckptvault") else [exe, "--repo", repo, "snapshots"]
    )
    row["listing"] = run_timed(listing_cmd, tool.env, log, 0).wall_s
    dest = os.path.join(root, "restored")
    argv, cwd = tool.restore_cmd(dest)
    os.makedirs(dest, exist_ok=True)
    phase = run_timed(argv, tool.env, log, 0, cwd=cwd or None)
    row["restore"] = phase.wall_s
    ok, detail = compare_trees(src, tool.restored_root(dest, src))
    row["verified"] = "yes" if ok and phase.rc == 0 else f"NO ({detail})"
    row["index objects"] = index_objects(repo)
    row["repo MB"] = du_bytes(repo) / 1e6
    shutil.rmtree(root, ignore_errors=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--snapshots", type=int, default=300, help="backups before the timed phases")
    parser.add_argument("--tools", default="ckptvault-enc,restic")
    parser.add_argument("--work", default="/tmp/ckptvault-many")
    args = parser.parse_args()
    if args.snapshots < EDGE:
        parser.error(f"--snapshots must be at least {EDGE}")
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = [t for t in tools if t not in TOOLS]
    if unknown:
        parser.error(f"unknown tool(s) {', '.join(unknown)}; choose from {', '.join(TOOLS)}")
    ensure_installed(tools)
    rows = []
    for name in tools:
        if name in ("restic", "borg") and not shutil.which(name):
            rows.append({"tool": name, "error": "not installed"})
            continue
        rows.append(bench(name, args.work, args.snapshots))
    columns = ["tool", "snapshots", "first", "last", "backup", "listing", "restore", "index objects", "repo MB"]
    print(f"\nN = {args.snapshots} backups, then timed (wall s); first/last: mean s of the first/last {EDGE}\n")
    print("| " + " | ".join(columns) + " | verified |")
    print("|" + "---|" * (len(columns) + 1))
    for row in rows:
        if "error" in row:
            print(f"| {row['tool']} | " + " | ".join("-" for _ in columns[1:]) + f" | {row['error']} |")
            continue
        cells = [f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        print("| " + " | ".join(cells) + f" | {row['verified']} |")


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as exc:
        sys.exit(f"error: {exc}")
