"""Hugging Face ``transformers``: ship every checkpoint the ``Trainer`` saves.

    from ckptvault.integrations.hf import CkptVaultCallback

    trainer = Trainer(..., callbacks=[CkptVaultCallback("s3://bucket/vault", run="exp-7")])

``on_save`` runs right after the Trainer wrote ``checkpoint-<step>`` (and rotated older ones
away under ``save_total_limit``). The callback hands the folder to ``backup_async``, which pins
it with hard links in milliseconds, so the next rotation cannot take it from the upload.
``on_train_end`` waits for the queued uploads and raises the first failure, if any. Only the
main process (``state.is_world_process_zero``) ships.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..ops.async_backup import BackupHandle, OnFull
from ..vault import Vault

log = logging.getLogger("ckptvault")


class CkptVaultCallback(TrainerCallback):  # type: ignore[misc]
    def __init__(
        self,
        vault: Vault | str,
        *,
        run: str | None = None,
        tags: dict[str, str] | None = None,
        on_full: OnFull = "coalesce",
        flush_timeout: float | None = None,
        raise_on_error: bool = True,
    ) -> None:
        """``vault`` is an open Vault or a URL (opened, and created if missing). Snapshots carry
        ``tags``, ``run=<run>`` and ``step=<global step>``."""
        self.vault = vault if isinstance(vault, Vault) else Vault.open(vault, create=True)
        self.tags = dict(tags or {})
        if run is not None:
            self.tags["run"] = run
        self.on_full = on_full
        self.flush_timeout = flush_timeout
        self.raise_on_error = raise_on_error
        self.handles: list[BackupHandle] = []

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(path):
            log.warning("ckptvault: the Trainer reported a save but %s does not exist; nothing shipped", path)
            return
        tags = {**self.tags, "step": str(state.global_step)}
        self.handles.append(self.vault.backup_async(path, tags=tags, on_full=self.on_full))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        try:
            self.vault.flush(self.flush_timeout)
        except Exception:
            if self.raise_on_error:
                raise
            # already logged by the worker; training's result stands
