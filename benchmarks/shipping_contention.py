"""How much a training loop slows down while ``backup_async`` ships checkpoints from its process.

    python benchmarks/shipping_contention.py [--work DIR] [--model-mb 150] [--saves 3] [--runs 3]

A 1-thread PyTorch loop of small steps stands for the CPU side of a GPU trainer (the Python thread
that launches kernels). Each run times the loop alone for 3 s, then again while ``backup_async``
ships the saves of ``make_workload.py`` into a fresh local vault, and prints the share of its speed
the loop kept and how long the shipping took (docs/training.md). The page cache is dropped before
each run where this process may (root on Linux). Needs torch (``pip install torch==2.13.0``).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ckptvault-contention")
    parser.add_argument("--model-mb", type=int, default=150, help="make_workload --model-mb (default 150)")
    parser.add_argument("--saves", type=int, default=3, help="make_workload --saves (default 3)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline-s", type=float, default=3.0, help="how long the loop runs alone")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("this benchmark needs torch: pip install torch==2.13.0")
    from ckptvault import Vault

    workload = args.work / "workload"
    if not workload.exists():
        make = [sys.executable, str(HERE / "make_workload.py"), "--out", str(workload)]
        subprocess.run([*make, "--saves", str(args.saves), "--model-mb", str(args.model_mb)], check=True)
    saves = sorted(p for p in workload.iterdir() if p.is_dir())
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        loss = model(torch.randn(64, 256)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    print("| run | loop alone steps/s | while shipping steps/s | kept | shipping s |")
    print("|---|---|---|---|---|")
    for run in range(1, args.runs + 1):
        _drop_page_cache()
        started, steps = time.perf_counter(), 0
        while time.perf_counter() - started < args.baseline_s:
            step()
            steps += 1
        alone = steps / (time.perf_counter() - started)
        repo = args.work / f"vault-{run}"
        shutil.rmtree(repo, ignore_errors=True)
        vault = Vault.init(str(repo))
        started, steps = time.perf_counter(), 0
        handles = [vault.backup_async(save, tags={"step": save.name}, pin=False, on_full="block") for save in saves]
        while not all(h.done() for h in handles):
            step()
            steps += 1
        elapsed = time.perf_counter() - started
        vault.flush()
        vault.close()
        shutil.rmtree(repo, ignore_errors=True)
        shipping = steps / elapsed
        print(f"| {run} | {alone:.0f} | {shipping:.0f} | {shipping / alone:.2f}x | {elapsed:.1f} |", flush=True)


def _drop_page_cache() -> None:
    with contextlib.suppress(OSError):
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


if __name__ == "__main__":
    main()
