"""Which entries at the top of a watched folder are checkpoints.

Every entry is one, except what no checkpoint of a run should be, as each would ship as a snapshot
without a step that ``latest`` and prune's newest-N then go by time for: logs and configs at the top
(``_files_not_checkpoints``), TensorBoard log folders (``holds_only_logs``), and the other entries
of a Hugging Face Trainer's output folder or of a DeepSpeed or Megatron-LM save folder
(``_trainer_checkpoints_only``, ``_step_folders_only``). ``--include`` patterns name what ships
instead, and then nothing here leaves anything out.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable

from ..errors import spelled
from . import pin as pins
from .names import (
    TRAINER_CHECKPOINT,
    TRAINER_STATE,
    is_log,
    is_not_a_checkpoint,
    step_from_name,
    step_from_trainer_state,
)

# Written by a Hugging Face Trainer into each checkpoint-N with the model, before trainer_state.json: the
# first save of a run is told apart by it, before any checkpoint-N of the folder holds trainer_state.json
TRAINER_ARGS = "training_args.bin"
TENSORBOARD_EVENTS = "events.out.tfevents."
# Files saved beside the weights of one checkpoint, never checkpoints by themselves (Hugging Face, PyTorch)
CHECKPOINT_PARTS = frozenset(
    {"optimizer.pt", "optimizer.bin", "scheduler.pt", "rng_state.pth", TRAINER_ARGS, TRAINER_STATE}
)
POINTER_FILES = {"latest": "DeepSpeed", "latest_checkpointed_iteration.txt": "Megatron-LM"}
LEFT_OUT_TOLD = "left-out.json"  # in the state folder: the top-level entries already named as left out

Keep = Callable[[str, str], bool]  # (name, path) -> whether it is a checkpoint of the folder as now told apart


class LeftOutTold:
    """``warn_left_out`` for ``CheckpointFolder``: an entry left out is named once for the folder, not at
    every run: ``--once`` from cron would mail the same warnings every few minutes (the names told are
    kept in ``path``, in the state folder)."""

    def __init__(self, path: str, on_warning: Callable[[str], None]) -> None:
        self._path = path
        self._on_warning = on_warning
        self._told: set[str] | None = None  # the entries named as left out, in this or an earlier run

    def __call__(self, name: str, message: str) -> None:
        if self._told is None:
            try:
                with open(self._path, encoding="utf-8") as f:
                    self._told = set(json.load(f))
            except (OSError, ValueError, TypeError):
                self._told = set()
        if name in self._told:
            return
        self._on_warning(message)
        self._told.add(name)
        with contextlib.suppress(OSError):  # at worst it is said again next run
            pins.write_json(self._path, sorted(self._told))


class CheckpointFolder:
    """What a watched folder holds, learnt as it fills: a Trainer's output folder or a save folder
    with a pointer file is told apart from its first checkpoint on, and its other entries are left
    out from then on. ``warn_left_out(name, message)`` names an entry left out (once per folder);
    ``warn_once(key, message)`` says a thing once; ``forget_others(keep)`` is called when the folder's
    kind is found, for the watcher to drop what it pinned before that and ``keep`` refuses."""

    def __init__(
        self,
        directory: str,
        *,
        include: tuple[str, ...],
        warn_left_out: Callable[[str, str], None],
        warn_once: Callable[[tuple[str, str], str], None],
        forget_others: Callable[[Keep], None],
    ) -> None:
        self.directory = directory
        self._include = include
        self._warn_left_out = warn_left_out
        self._warn_once = warn_once
        self._forget_others = forget_others
        self.trainer_output = False  # a Hugging Face Trainer's output folder: only checkpoint-N ships
        self._pointer_file: str | None = None  # the file naming the newest step folder (DeepSpeed, Megatron-LM)
        self._log_folders: set[tuple[str, int]] = set()  # (name, inode) of folders of TensorBoard logs

    def checkpoints(self, entries: list[os.DirEntry[str]]) -> list[os.DirEntry[str]]:
        """The entries that are checkpoints (all of them under ``--include``)."""
        if self._include:
            return entries
        return self._files_not_checkpoints(self._step_folders_only(self._trainer_checkpoints_only(entries)))

    def is_log_folder(self, name: str, ino: int) -> bool:
        return (name, ino) in self._log_folders

    def one_checkpoint(self) -> str | None:
        """Watching one checkpoint instead of the folder it was saved into ships each of its files as
        a checkpoint of its own: the warning that says so, or None. Only a folder whose name gives the
        step its own ``trainer_state.json`` records, a step-named torch.distributed.checkpoint folder,
        or one holding a part of a checkpoint (``_part_of_one_checkpoint``) is taken for one (a run's
        output folder holds a trainer_state.json of another step at the end, beside its step folders)."""
        name = os.path.basename(self.directory)
        step = step_from_name(name)
        if step is not None and step_from_trainer_state(self.directory) == step:
            holds = f"step {step}, it holds {TRAINER_STATE}"
        elif step is not None and os.path.isfile(os.path.join(self.directory, ".metadata")):
            holds = f"step {step}, it holds .metadata"
        elif part := self._part_of_one_checkpoint():
            holds = f"it holds {part}, and nothing in it is named by a step"
        else:
            return None
        return (
            f"{self.directory} looks like one checkpoint ({holds}), and watch ships each "
            f"entry of the folder it watches as a checkpoint of its own: watch the folder the trainer saves "
            f"checkpoints into ({os.path.dirname(self.directory)}), or back this one up with: "
            f"{spelled('ckptvault backup', 'Vault.backup')} {self.directory}"
        )

    def _part_of_one_checkpoint(self) -> str | None:
        """A file at the top of the watched folder that is a part of one checkpoint, not one of its own
        (an optimizer's state, a sharded model's index), when no entry there is named by a step: each
        entry would ship as a snapshot of its own, and ``latest`` of the run would then be any one part
        (a log folder, shipped last)."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return None
        if any(step_from_name(n) is not None for n in names):
            return None
        return next((n for n in sorted(names) if n in CHECKPOINT_PARTS or n.endswith(".index.json")), None)

    def _trainer_checkpoints_only(self, entries: list[os.DirEntry[str]]) -> list[os.DirEntry[str]]:
        """In a Hugging Face Trainer's output folder (a ``checkpoint-N`` folder in it holds
        ``trainer_state.json``) only the ``checkpoint-N`` folders are checkpoints: ``runs/``
        (TensorBoard logs, appended all along) and the final model's files at the top would each
        ship as a snapshot without a step, and ``latest`` of the run would then go by time and
        restore one of them. What is left out is named once; ``--include`` takes it back."""
        if not self.trainer_output:
            self.trainer_output = any(
                TRAINER_CHECKPOINT.fullmatch(e.name) and os.path.isfile(os.path.join(e.path, TRAINER_STATE))
                for e in entries
            )
            if not self.trainer_output:
                return entries
            self._forget_others(lambda name, _path: TRAINER_CHECKPOINT.fullmatch(name) is not None)
        kept = [e for e in entries if TRAINER_CHECKPOINT.fullmatch(e.name)]
        return self._said_left_out(
            entries,
            kept,
            lambda name: (
                f"{name}: left out from now on: {self.directory} is a Hugging Face Trainer's output folder, where "
                f"only checkpoint-N folders are checkpoints (to ship it too: {spelled('--include', 'include=')} "
                f"with a pattern for it and 'checkpoint-*'; a final model: "
                f"{spelled('ckptvault backup', 'Vault.backup')})"
            ),
        )

    def _step_folders_only(self, entries: list[os.DirEntry[str]]) -> list[os.DirEntry[str]]:
        """DeepSpeed saves each step into a folder (``global_step1200/``) and then names it in a
        ``latest`` file beside it; Megatron-LM does the same with ``iter_0001200/`` and
        ``latest_checkpointed_iteration.txt``. In such a folder only the step folders are checkpoints:
        the pointer file (rewritten at every save) and the scripts beside it (``zero_to_fp32.py``)
        would each ship as a snapshot without a step, and ``latest`` of the run would then go by time
        and restore one of them. What is left out is named once; ``--include`` takes it back."""
        if self._pointer_file is None:
            self._pointer_file = next((e.name for e in entries if _names_a_step_folder(e, entries)), None)
            if self._pointer_file is None:
                return entries
            self._forget_others(_is_step_folder)
        kept = [e for e in entries if _is_step_folder(e.name, e.path)]
        framework, pointer = POINTER_FILES[self._pointer_file], self._pointer_file
        return self._said_left_out(
            entries,
            kept,
            lambda name: (
                f"{name}: left out from now on: {self.directory} is {framework}'s save folder, where only the step "
                f"folders are checkpoints (to resume: restore the newest into {self.directory}/<its name>, and write "
                f"{pointer} as {framework} does; to ship {name} too: "
                f"{spelled('--include', 'include=')} with a pattern for it and one for the step folders)"
            ),
        )

    def _said_left_out(
        self, entries: list[os.DirEntry[str]], kept: list[os.DirEntry[str]], why: Callable[[str], str]
    ) -> list[os.DirEntry[str]]:
        """``kept``, once each entry it leaves out is named (``why(name)``: the message)."""
        for name in sorted({e.name for e in entries} - {e.name for e in kept}):
            self._warn_left_out(name, why(name))
        return kept

    def _files_not_checkpoints(self, entries: list[os.DirEntry[str]]) -> list[os.DirEntry[str]]:
        """Files at the top that are no checkpoint by their name (names.is_not_a_checkpoint): logs always,
        configs, metrics, scripts and images without a step in their name once something beside them
        ships (a folder holding only LightGBM's ``model.txt`` ships it). Each would ship as a snapshot
        without a step, and with one of those in the run ``restore latest`` goes by time (a log
        appended to all along would be the newest), and ``prune --keep-latest`` with it. Named once;
        ``--include`` takes it back."""
        named = {e.name for e in entries if is_not_a_checkpoint(e.name) and e.is_file(follow_symlinks=False)}
        if len(named) == len(entries):  # nothing else here: only the logs stay out
            named = {name for name in named if is_log(name)}
        for name in sorted(named):
            self._warn_left_out(
                name,
                f"{name}: left out: a log, config, script or image by its name, not a checkpoint (shipped, it "
                "would be a snapshot without a step, which `latest` and prune's newest-N then go by time for; "
                f"to ship it too: {spelled('--include', 'include=')} with a pattern for it and one for the "
                "checkpoints)",
            )
        return [e for e in entries if e.name not in named]

    def holds_only_logs(self, name: str, ino: int, sig: pins.Signature) -> bool:
        """A folder without a step in its name that holds TensorBoard event files (``runs/`` of a
        Hugging Face Trainer, ``lightning_logs/``) is logs, not a checkpoint: shipped, it would be a
        snapshot without a step, and ``latest`` of the run would go by time. Left out (and not looked
        at again: ``is_log_folder``) unless ``--include`` names what to ship."""
        if self._include or step_from_name(name) is not None:
            return False
        if not any(rel.rpartition("/")[2].startswith(TENSORBOARD_EVENTS) for rel, _, _ in pins.files_of(sig)):
            return False
        self._log_folders.add((name, ino))
        self._warn_once(
            ("logs", name),
            f"{name}: not shipped: it holds TensorBoard logs ({TENSORBOARD_EVENTS}*), not a checkpoint "
            f"(to ship it: {spelled('--include', 'include=')} with a pattern for it and one for the checkpoints)",
        )
        return True

    def trainer_checkpoint(self, name: str, data: str) -> bool:
        """A Hugging Face Trainer's ``checkpoint-N`` (its files in ``data``), which is complete once it
        holds ``trainer_state.json``: in the Trainer's output folder, or holding the ``training_args.bin``
        the Trainer writes into each (its run's first save, before the folder is known). Other trainers
        name folders so too."""
        if not TRAINER_CHECKPOINT.fullmatch(name):
            return False
        return self.trainer_output or os.path.exists(os.path.join(data, TRAINER_ARGS))

    def unnamed_step_folder(self, name: str) -> str | None:
        """In a DeepSpeed or Megatron-LM save folder, a step folder newer than the one its pointer file
        names is still being saved (the pointer is written last, once every rank wrote its shards; a
        pause between shards outlasts a settle): what it lacks, or None."""
        step = step_from_name(name)
        if self._pointer_file is None or step is None:
            return None
        named = _pointed_step(os.path.join(self.directory, self._pointer_file))
        if named is not None and named >= step:
            return None
        return f"no mention in {self._pointer_file} ({POINTER_FILES[self._pointer_file]} writes it last)"


def step_order(name: str) -> tuple[bool, int]:
    """Checkpoints found at one look are pinned in step order (not the folder's): a snapshot's time is
    its pin's, so snapshot times follow the steps (and ready ones ship newest pin first)."""
    step = step_from_name(name)
    return step is None, step or 0


def _is_step_folder(name: str, path: str) -> bool:
    return step_from_name(name) is not None and os.path.isdir(path) and not os.path.islink(path)


def _names_a_step_folder(entry: os.DirEntry[str], entries: list[os.DirEntry[str]]) -> bool:
    """``entry`` is DeepSpeed's ``latest`` or Megatron-LM's tracker file, beside step folders: a small
    file whose text names one of them (DeepSpeed: its name; Megatron-LM: its iteration number)."""
    if entry.name not in POINTER_FILES or not entry.is_file(follow_symlinks=False):
        return False
    named = _pointed_step(entry.path)
    return named is not None and named in {step_from_name(e.name) for e in entries if _is_step_folder(e.name, e.path)}


def _pointed_step(path: str) -> int | None:
    """The step a pointer file names (DeepSpeed: a folder's name; Megatron-LM: an iteration number);
    None for none (being rewritten, "release", not there)."""
    try:
        with open(path, "rb") as f:
            text = f.read(256).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else step_from_name(text)
