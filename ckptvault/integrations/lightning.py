"""PyTorch Lightning: ship every checkpoint file a ``ModelCheckpoint`` writes.

    from ckptvault.integrations.lightning import CkptVaultCallback

    trainer = pl.Trainer(callbacks=[ModelCheckpoint(...), CkptVaultCallback("s3://bucket/vault", run="exp-7")])

Lightning comes as two packages holding separate copies of the same classes: ``pytorch_lightning``
and the unified ``lightning`` (``lightning.pytorch``). The callback is a ``Callback`` of each one
installed, so it goes into either one's Trainer.

Lightning has no hook after a checkpoint file is written (``on_save_checkpoint`` runs before),
but checkpoint callbacks write only inside their own hooks (batch, epoch and validation end, the
end of training, an exception), and Lightning runs them after all other callbacks in each hook.
So at ``setup`` the callback moves itself to the end of the Trainer's list: in each of those
hooks it runs right after them and hands each file they wrote (last, best, top-k, the exception
checkpoints of ``ModelCheckpoint(save_on_exception=True)`` and ``OnExceptionCheckpoint``) to
``backup_async``, which pins it with a hard link before ``save_top_k`` can delete it. The step
tag comes from the file name (``epoch=0-step=200.ckpt``), else from the checkpoint saved. Only
the global-zero process ships. ``on_train_end`` waits for the uploads; after an exception the
interpreter's exit does (up to ``exit_timeout``). After a resume, ModelCheckpoint's restored
state lists the files the earlier run wrote: they are offered again and add no snapshot where
one of the same name, tags and contents exists (``skip_if_unchanged``).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from ..ops.names import step_from_name
from .shipping import Shipping, log


def _callback_classes() -> tuple[type, ...]:
    """``Callback`` of each Lightning package installed (the Trainers check ``isinstance``)."""
    classes = []
    for package in ("pytorch_lightning", "lightning.pytorch"):
        try:
            classes.append(importlib.import_module(package).Callback)
        except ImportError:
            continue
        except Exception as exc:  # installed but broken (built for another torch): the other one may serve
            log.debug("ckptvault: %s cannot be imported (%s); its Trainer will not take the callback", package, exc)
    if not classes:
        raise ImportError(
            "ckptvault's Lightning callback needs PyTorch Lightning: pip install 'ckptvault[lightning]'"
            " (or the unified package: pip install lightning)"
        )
    return tuple(classes)


class CkptVaultCallback(Shipping, *_callback_classes()):  # type: ignore[misc]
    """Arguments: see ``Shipping``; ``step`` comes from the checkpoint's file name or the save."""

    ship_on_sigterm = False  # Lightning's own SIGTERM handling ends fit, and the exit hook ships

    _saving_step: int | None = None  # the global step of the last checkpoint saved, if any
    _loaded: tuple[str, int] | None = None  # the checkpoint a resumed run loaded, and its global step

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Run after the checkpoint callbacks in every hook, so that each file is queued in the hook
        # that wrote it, not one batch later (a crash in between would lose it). Not by subclassing
        # Checkpoint: Lightning would take this for a ModelCheckpoint (no default one added,
        # enable_checkpointing=False refused, trainer.checkpoint_callback). Setup runs after
        # Lightning's own reordering; a new list, since Lightning is iterating the old one.
        trainer.callbacks = [c for c in trainer.callbacks if c is not self] + [self]

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        for callback in trainer.checkpoint_callbacks:  # their folders are known once set up
            self.refuse_checkpoints_in_the_vault(getattr(callback, "dirpath", None))

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self._saving_step = checkpoint.get("global_step", trainer.global_step)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # fit(ckpt_path=...): a file the earlier run wrote but never shipped (last.ckpt: no step in its
        # name) is offered before this run saves anything; the loaded one's step is known from it
        if trainer.ckpt_path and isinstance(checkpoint.get("global_step"), int):
            self._loaded = (os.path.abspath(trainer.ckpt_path), checkpoint["global_step"])

    def _step_of(self, path: str) -> int | None:
        step = step_from_name(os.path.basename(path))
        if step is not None or self._saving_step is not None:
            return step if step is not None else self._saving_step
        if self._loaded is not None and os.path.abspath(path) == self._loaded[0]:
            return self._loaded[1]
        return None  # a file of the earlier run, neither saved nor loaded by this one

    def _ship_new(self, trainer: Any) -> None:
        if not trainer.is_global_zero:
            return
        # weights-only saves first: a full save of the same step queued after them is the newer snapshot,
        # the one latest takes (weights alone cannot resume training)
        for callback in sorted(trainer.checkpoint_callbacks, key=lambda c: not getattr(c, "save_weights_only", False)):
            # _last_checkpoint_saved is ModelCheckpoint's only record of its save_on_exception file;
            # ckpt_path is where OnExceptionCheckpoint writes (and, at teardown, deletes) its own
            names = ("last_model_path", "best_model_path", "_last_checkpoint_saved", "ckpt_path")
            paths = {getattr(callback, name, None) for name in names} | set(getattr(callback, "best_k_models", ()))
            last = getattr(callback, "last_model_path", None)
            saved_steps: set[int | None] = set()
            # last.ckpt after the rest: a ModelCheckpoint's save_last writes it beside its own top-k file of
            # the same step, the same save; as a snapshot of its own it doubled the snapshots (prune
            # --keep-latest 4 kept two saves). Another callback's last.ckpt may be another save (weights
            # only beside a full one): it ships. Not skipped before that top-k file was taken. An earlier
            # run's last.ckpt (no step known: this run neither saved nor loaded it) beside its top-k files
            # is a copy of one of them too; shipped alone, it had no step, and latest went by time.
            for path in sorted((p for p in paths if p), key=lambda p: (p == last, p)):
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                key = (os.path.abspath(path), st.st_ino, st.st_mtime_ns, st.st_size)
                if key in self._shipped:
                    continue
                step = self._step_of(path)
                copy = step in saved_steps if step is not None else any(s is not None for s in saved_steps)
                if path != last or not copy:
                    self.ship(path, step)
                    saved_steps.add(step)
                self._shipped.add(key)  # only once taken: a file whose ship raised is offered again

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        self._ship_new(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._ship_new(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._ship_new(trainer)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        # on_train_epoch_end is the one hook where Lightning runs checkpoint callbacks in a second
        # pass after all others, whatever their order: an epoch-end save is queued here, before the
        # next step (or in on_train_end after the last epoch)
        self._ship_new(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Queue only: the exit hook waits for the uploads, and the training error is not held up
        # by them, nor replaced by an error of ours.
        try:
            self._ship_new(trainer)
        except Exception as exc:
            log.error("ckptvault: could not queue the checkpoints written before %r: %s", exception, exc)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._ship_new(trainer)
        if trainer.is_global_zero:
            self.finish_shipping()
