"""Hugging Face ``transformers``: ship every checkpoint the ``Trainer`` saves.

    from ckptvault.integrations.hf import CkptVaultCallback

    trainer = Trainer(..., callbacks=[CkptVaultCallback("s3://bucket/vault", run="exp-7")])

``on_save`` runs right after the Trainer wrote ``checkpoint-<step>`` (and rotated older ones
away under ``save_total_limit``). The callback hands the folder to ``backup_async``, which pins
it with hard links in milliseconds, so the next rotation cannot take it from the upload.
``on_train_end`` waits for the queued uploads and raises the first failure, if any. Only the
main process (``state.is_world_process_zero``) ships, once every rank has written its files.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .shipping import Shipping, log


class CkptVaultCallback(Shipping, TrainerCallback):  # type: ignore[misc]
    """Arguments: see ``Shipping``; ``step`` is the Trainer's global step."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.refuse_checkpoints_in_the_vault(args.output_dir)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Every rank calls on_save after its own writes (rng_state_<rank>.pth, sharded weights and
        # optimizer states): the main process pins the folder only once all of them are done.
        _wait_for_every_rank()
        if not state.is_world_process_zero:
            return
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(path):
            log.warning("ckptvault: the Trainer reported a save but %s does not exist; nothing shipped", path)
            return
        self.ship(path, state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.finish_shipping()


def _wait_for_every_rank() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
