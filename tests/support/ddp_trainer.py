"""Run under ``torchrun --nproc_per_node 2``: a tiny Trainer on CPU (gloo) with the ckptvault
callback, where rank 1 writes its own file of each checkpoint (``rng_state_1.pth``) late.
``python -m torch.distributed.run --nproc_per_node 2 tests/support/ddp_trainer.py OUT VAULT``."""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from ckptvault.integrations.hf import CkptVaultCallback


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.layer(x).squeeze(-1), labels)}


class SlowRankOne(Trainer):
    def _save_rng_state(self, output_dir: str) -> None:
        if os.environ.get("RANK") == "1":
            time.sleep(0.5)  # a rank that is behind: its file lands after rank 0's
        super()._save_rng_state(output_dir)


def main() -> None:
    out, vault = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    data = [{"x": torch.randn(8), "labels": torch.randn(())} for _ in range(64)]
    args = TrainingArguments(
        output_dir=out,
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = CkptVaultCallback(vault, run="ddp")
    SlowRankOne(model=Tiny(), args=args, train_dataset=data, callbacks=[callback]).train()


if __name__ == "__main__":
    main()
