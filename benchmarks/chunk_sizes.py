"""Measure FastCDC parameters on the shared workload: dedup overhead and chunking speed.

For each average chunk size, chunk save 1 and save 2 of the workload and report
  - chunks per GB (objects in the tree, per-chunk overhead),
  - the bytes of save 2 whose chunks are not in save 1 (what an incremental backup stores
    before compression), against the bytes that truly changed (`--changed-mb`, default
    696.9 MB for the default workload),
  - chunking + hashing throughput (one thread, warm page cache).

    python benchmarks/chunk_sizes.py /tmp/ckptvault-bench/workload/step-1000 /tmp/ckptvault-bench/workload/step-2000
"""

from __future__ import annotations

import argparse
import os
import time

from blake3 import blake3

from ckptvault.chunking import ChunkerParams, iter_chunks

KiB = 1024


def chunk_dir(directory: str, params: ChunkerParams) -> tuple[dict[bytes, int], int, float]:
    ids: dict[bytes, int] = {}
    total = 0
    started = time.perf_counter()
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb", buffering=0) as f:
            for chunk in iter_chunks(f, params):
                ids[blake3(chunk).digest()] = len(chunk)
                total += len(chunk)
    return ids, total, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("save1")
    parser.add_argument("save2")
    parser.add_argument("--changed-mb", type=float, default=696.9)
    args = parser.parse_args()
    print("| avg | min | max | chunks/GB | save-2 new MB | overhead vs truly changed | chunk+hash MB/s |")
    print("|---|---|---|---|---|---|---|")
    for avg_kib in (256, 512, 1024, 2048, 4096):
        params = ChunkerParams(min_size=avg_kib * KiB // 4, avg_size=avg_kib * KiB, max_size=avg_kib * KiB * 8)
        first, total, secs = chunk_dir(args.save1, params)
        second, _, _ = chunk_dir(args.save2, params)
        new = sum(size for cid, size in second.items() if cid not in first)
        print(
            f"| {avg_kib} KiB | {params.min_size // KiB} KiB | {params.max_size // KiB} KiB "
            f"| {len(first) / (total / 1e9):.0f} | {new / 1e6:.1f} "
            f"| {100 * (new / 1e6 - args.changed_mb) / args.changed_mb:+.2f} % | {total / secs / 1e6:.0f} |"
        )


if __name__ == "__main__":
    main()
