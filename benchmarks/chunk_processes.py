#!/usr/bin/env python3
"""One big file of no known format (cut by content, FastCDC) backed up with 0, 1 and 2 helper
processes (``CKPTVAULT_CHUNK_PROCESSES``), and by restic, on the same data in the same run.

Two phases per setting, each a fresh CLI process under ``/usr/bin/time -v`` in a fresh repository:
``first`` (every chunk new: chunk, hash, compress, pack) and ``re-read`` (the file touched and read
again: every chunk already stored, so only reading, chunking and hashing are left; restic with
``--force``). The settings are alternated over ``--rounds`` rounds, page cache kept warm (the file is
read once, untimed, before each phase). Data: float32 normal * 0.02 from a seeded PCG64 (the bytes of
bigfile.py's F32 tensors, without a header), kept in WORK and reused. Stdlib + numpy. See README.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import sys
from dataclasses import dataclass

import numpy as np
from run_bench import TIME_BIN, ckptvault_tool, ensure_installed, restic_tool, run_timed, sh

GB = 10**9
BLOCK = 8 << 20  # float32 values generated and written at a time


@dataclass
class Timed:
    wall_s: float
    cpu_s: float | None
    rss_mb: float | None


def make_data(path: str, size: int, seed: int) -> None:
    if os.path.isfile(path) and os.path.getsize(path) == size:
        return
    rng = np.random.Generator(np.random.PCG64(seed))
    with open(path + ".part", "wb") as f:
        left = size // 4
        while left:
            x = rng.standard_normal(min(BLOCK, left), dtype=np.float32)
            x *= np.float32(0.02)
            f.write(x.data)
            left -= len(x)
    os.replace(path + ".part", path)


def warm(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass


def timed(cmd: list[str], env: dict, log: str, size: int) -> Timed:
    phase = run_timed(cmd, env, log, size)
    if phase.rc != 0:
        sys.exit(f"{' '.join(cmd)} exited {phase.rc}; see {log}")
    cpu = None
    if os.path.exists(log + ".time"):
        with open(log + ".time") as f:
            text = f.read()
        times = [float(m) for m in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", text)]
        cpu = sum(times) if len(times) == 2 else None
    rss = phase.max_rss_kb * 1024 / 1e6 if phase.max_rss_kb else None
    return Timed(phase.wall_s, cpu, rss)


def run_setting(name: str, src: str, work: str, size: int) -> dict[str, Timed]:
    repo, state, logs = (os.path.join(work, d) for d in ("repo", "state", "logs"))
    for d in (repo, state):
        shutil.rmtree(d, ignore_errors=True)
    os.makedirs(state)
    os.makedirs(logs, exist_ok=True)
    if name == "restic":
        tool = restic_tool(repo, state)
        again = [*tool.backup_cmd(src, "backup", 2), "--force"]
    else:
        tool = ckptvault_tool(repo, state)
        tool.env["CKPTVAULT_CHUNK_PROCESSES"] = name.rsplit("=", 1)[1]
        again = tool.backup_cmd(src, "backup", 2)
    if sh(tool.init_cmd, env=tool.env).returncode != 0:
        sys.exit(f"{name}: init failed")
    out = {}
    warm(src)
    out["first"] = timed(tool.backup_cmd(src, "backup", 1), tool.env, os.path.join(logs, "first.log"), size)
    os.utime(src)
    warm(src)
    out["re-read"] = timed(again, tool.env, os.path.join(logs, "again.log"), size)
    shutil.rmtree(repo, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0, help="file size, GB = 1e9 bytes")
    ap.add_argument("--processes", default="0,1,2", help="comma-separated CKPTVAULT_CHUNK_PROCESSES values")
    ap.add_argument("--no-restic", action="store_true", help="leave restic out")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default="/tmp/ckptvault-chunk-processes")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    size = int(a.size_gb * GB) // 4 * 4
    work = os.path.abspath(a.work)
    os.makedirs(work, exist_ok=True)
    src = os.path.join(work, f"weights-{size}-s{a.seed}.bin")
    if shutil.disk_usage(work).free < 2.2 * size + GB:
        sys.exit(f"not enough free space in {work} for the data and one repository; use a smaller --size-gb")
    print(f"generating {src} ...", file=sys.stderr)
    make_data(src, size, a.seed)
    settings = [f"processes={p.strip()}" for p in a.processes.split(",") if p.strip()]
    if not a.no_restic:
        ensure_installed(["restic"])
        if shutil.which("restic"):
            settings.append("restic")
    load_before = os.getloadavg()[0]
    rows = []
    for rnd in range(1, a.rounds + 1):
        for name in settings:
            print(f"round {rnd}: {name} ...", file=sys.stderr)
            res = run_setting(name, src, work, size)
            rows.append((rnd, name, res))
    print(
        f"\nmachine: {platform.platform()}, {len(os.sched_getaffinity(0))} CPUs, load average "
        f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after; file {size / GB:g} GB, no known format"
    )
    print(f"timer: {TIME_BIN if os.access(TIME_BIN, os.X_OK) else 'wall clock only'}\n")
    cols = ["round", "setting", "first MB/s", "first CPU s", "first peak RSS MB", "re-read MB/s", "re-read CPU s"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))

    def cell(v: float | None, spec: str) -> str:
        return "-" if v is None else f"{v:{spec}}"

    for rnd, name, res in rows:
        first, again = res["first"], res["re-read"]
        print(
            f"| {rnd} | {name} | {size / 1e6 / first.wall_s:.0f} | {cell(first.cpu_s, '.2f')} | "
            f"{cell(first.rss_mb, '.1f')} | {size / 1e6 / again.wall_s:.0f} | {cell(again.cpu_s, '.2f')} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
