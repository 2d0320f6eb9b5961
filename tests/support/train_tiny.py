"""A small, deterministic PyTorch training run on the CPU, as a process.

    python -m tests.support.train_tiny --steps 30 --out params.pt                      # uninterrupted
    python -m tests.support.train_tiny --steps 20 --ckpt-dir D --every 5 --repo R --run X --out a.pt
    python -m tests.support.train_tiny --steps 30 --resume RESTORED --out b.pt         # resumed

Every ``--every`` steps it writes a checkpoint (model, optimizer, scheduler, RNG state, step) the
way trainers do (a temporary folder, then a rename), ships it with ``Vault.backup_async`` and
rotates: only the newest checkpoint is kept locally, the older one is deleted at once. The
data and dropout draw from torch's global RNG, so a resume that lost the RNG state diverges.

Restarted on the same disk (``--resume`` a checkpoint there, same ``--ckpt-dir``), it goes on as
trainers do: a ``tmp-step_N`` a killed save left is removed when step N is saved again (it failed with
FileExistsError), a ``step_N`` already there is replaced, and the checkpoints of the run before count
for the rotation. ``--kill-mid-save N`` SIGKILLs the process half way through writing step N's
checkpoint (a test's real kill at that moment).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import time

import torch
from torch import nn

from ckptvault import Vault

SEED = 1234


def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
    return model, optimizer, scheduler


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    x = torch.randn(16, 8)
    y = x.sum(dim=1, keepdim=True).sin()
    model.train()
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def save_checkpoint(directory: str, step: int, model, optimizer, scheduler, kill_mid_save: int = 0) -> str:
    tmp = os.path.join(directory, f"tmp-step_{step}")
    shutil.rmtree(tmp, ignore_errors=True)  # a save killed before its rename left it: never a checkpoint
    os.makedirs(tmp)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": torch.get_rng_state(),
        "step": step,
    }
    path = os.path.join(tmp, "state.pt")
    torch.save(state, path)
    if step == kill_mid_save:
        os.truncate(path, os.path.getsize(path) // 2)  # what the disk holds half way through the write
        os.kill(os.getpid(), signal.SIGKILL)
    final = os.path.join(directory, f"step_{step}")
    if os.path.isdir(final):  # saved by the run before (restarted from an older checkpoint): replaced, as trainers do
        shutil.rmtree(final)
    os.rename(tmp, final)
    return final


def newest_checkpoint(directory: str) -> str | None:
    """The newest complete checkpoint a run before left in ``directory`` (the rotation goes on from it)."""
    steps = [int(m.group(1)) for name in os.listdir(directory) if (m := re.fullmatch(r"step_(\d+)", name))]
    return os.path.join(directory, f"step_{max(steps)}") if steps else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt-dir")
    parser.add_argument("--every", type=int, default=0)
    parser.add_argument("--repo")
    parser.add_argument("--run")
    parser.add_argument("--resume")
    parser.add_argument("--kill-mid-save", type=int, default=0, metavar="STEP")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    model, optimizer, scheduler = build()
    start = 0
    if args.resume:
        state = torch.load(os.path.join(args.resume, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        start = state["step"]
        print(f"resumed at step {start}", flush=True)

    vault = Vault.open(args.repo) if args.repo else None
    latencies = []
    previous = newest_checkpoint(args.ckpt_dir) if args.ckpt_dir and os.path.isdir(args.ckpt_dir) else None
    for step in range(start + 1, args.steps + 1):
        train_step(model, optimizer, scheduler)
        if vault is not None and args.every and step % args.every == 0:
            path = save_checkpoint(args.ckpt_dir, step, model, optimizer, scheduler, args.kill_mid_save)
            started = time.perf_counter()
            vault.backup_async(path, tags={"run": args.run, "step": str(step)}, on_full="block")
            latencies.append(time.perf_counter() - started)
            if previous and previous != path:
                shutil.rmtree(previous)  # rotation: keep only the newest checkpoint locally
            previous = path
    if vault is not None:
        vault.flush(timeout=300)
        vault.close()
        print(f"backup_async latencies (ms): {[round(x * 1000, 2) for x in latencies]}", flush=True)
    torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
