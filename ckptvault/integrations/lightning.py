"""PyTorch Lightning: ship every checkpoint file a ``ModelCheckpoint`` writes.

    from ckptvault.integrations.lightning import CkptVaultCallback

    trainer = pl.Trainer(callbacks=[ModelCheckpoint(...), CkptVaultCallback("s3://bucket/vault", run="exp-7")])

Lightning has no hook after a checkpoint file is written (``on_save_checkpoint`` runs before),
and it runs ``ModelCheckpoint`` after other callbacks in each hook. So at every following hook
(the next batch end, epoch end, validation end, and the end of training) the callback looks at
the files each ``ModelCheckpoint`` knows (last, best, top-k) and hands each new one to
``backup_async``, which pins it with a hard link before ``save_top_k`` can delete it. The step
tag comes from the file name (``epoch=0-step=200.ckpt``), else from the checkpoint being saved.
Only the global-zero process ships. ``on_train_end`` waits for the uploads.
"""

from __future__ import annotations

import os
from typing import Any

from pytorch_lightning import Callback

from ..ops.names import step_from_name
from .shipping import Shipping


class CkptVaultCallback(Shipping, Callback):  # type: ignore[misc]
    """Arguments: see ``Shipping``; ``step`` comes from the checkpoint's file name or the save."""

    _saving_step: int | None = None  # the global step of the checkpoint being saved, if any

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self._saving_step = checkpoint.get("global_step", trainer.global_step)

    def _ship_new(self, trainer: Any) -> None:
        if not trainer.is_global_zero:
            return
        for callback in trainer.checkpoint_callbacks:
            paths = {callback.last_model_path, callback.best_model_path, *callback.best_k_models}
            for path in sorted(p for p in paths if p):
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                key = (os.path.abspath(path), st.st_ino, st.st_mtime_ns, st.st_size)
                if key in self._shipped:
                    continue
                step = step_from_name(os.path.basename(path))
                self.ship(path, step if step is not None else self._saving_step)
                self._shipped.add(key)  # only once taken: a file whose ship raised is offered again

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        self._ship_new(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._ship_new(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._ship_new(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._ship_new(trainer)
        if trainer.is_global_zero:
            self.finish_shipping()
