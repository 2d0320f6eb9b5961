"""Checkpoint names: which names are still being written, and which training step a name means.

Trainers publish a checkpoint by writing it under a temporary name and renaming it
(``tmp-checkpoint-1200`` -> ``checkpoint-1200``, ``latest.pt.tmp`` -> ``latest.pt``); names
like those are never taken for a finished checkpoint. Inside a checkpoint only the suffixes
mean "still being written": formats name finished files with a leading dot (the ``.metadata``
of torch.distributed.checkpoint, zarr's ``.zarray``). The step comes from the name
(``checkpoint-1200``, ``step_1200``, ``epoch=3-step=1200.ckpt``, ``ckpt-000120.pt``), or from
the ``global_step`` of a Hugging Face ``trainer_state.json`` inside the checkpoint.
"""

from __future__ import annotations

import json
import os
import re

WATCH_STATE_FOLDER = ".ckptvault-watch"  # the watch sidecar's pins and lock, inside the watched folder
PIN_FOLDER = ".ckptvault-pins"  # backup_async's pins, beside each source
STATE_FOLDERS = {WATCH_STATE_FOLDER: "the watch sidecar's state", PIN_FOLDER: "backup_async's pins"}  # never backed up
TEMP_PREFIXES = (".", "tmp-", "tmp_", "~")
TEMP_SUFFIXES = (".tmp", ".temp", ".part", ".partial", ".incomplete", "~")

# Files that are no checkpoint by their name (a watched folder's top): logs, appended to all along, and
# configs, metrics, scripts, images, unless their name gives a step (XGBoost saves model_100.json)
LOG_SUFFIXES = (".log", ".out", ".err")
NOT_CHECKPOINT_SUFFIXES = (
    ".txt", ".json", ".jsonl", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".conf", ".md", ".rst", ".csv",
    ".tsv", ".py", ".sh", ".ipynb", ".html", ".png", ".jpg", ".svg", ".pid", ".lock",
)  # fmt: skip

# Most specific first: an explicit "step", then a checkpoint-ish word, then a lone trailing number.
_STEP_PATTERNS = (
    re.compile(r"(?:^|[^a-z])(?:global_)?steps?[-_=]?(\d+)", re.IGNORECASE),
    re.compile(r"(?:^|[^a-z])(?:checkpoint|ckpt|iter|iteration)[-_=]?(\d+)", re.IGNORECASE),
    re.compile(r"^(?!.*epoch)[^\d]*?[-_](\d+)(?:\.[a-z]+)*$", re.IGNORECASE),
)
TRAINER_STATE = "trainer_state.json"
TRAINER_CHECKPOINT = re.compile(r"checkpoint-\d+")  # how a Hugging Face Trainer names each save


def source_name(path: str) -> str:
    """The name a backed-up file or folder is stored under in a snapshot: its base name ("root" for /)."""
    return os.path.basename(path.rstrip(os.sep)) or "root"


def is_temporary(name: str) -> bool:
    """A name that a writer uses before it renames the finished file or folder."""
    lower = name.lower()
    return lower.startswith(TEMP_PREFIXES) or lower.endswith(TEMP_SUFFIXES)


def is_unfinished(name: str) -> bool:
    """A name inside a checkpoint folder that its writer will rename (``.metadata.tmp`` ->
    ``.metadata``). The prefixes of ``is_temporary`` are left out: below the top level a
    leading dot or ``tmp_`` is part of a finished file's name."""
    return name.lower().endswith(TEMP_SUFFIXES)


def is_log(name: str) -> bool:
    """A log file (``train.log``, ``slurm-1234.out``): appended to all along, never a checkpoint."""
    return name.lower().endswith(LOG_SUFFIXES)


def is_not_a_checkpoint(name: str) -> bool:
    """A file named as a log, or as a config, metrics, a script or an image without a step in its name
    (``config.yaml``, ``train.log``; not XGBoost's ``model_100.json``)."""
    return is_log(name) or (name.lower().endswith(NOT_CHECKPOINT_SUFFIXES) and step_from_name(name) is None)


def step_from_name(name: str) -> int | None:
    for pattern in _STEP_PATTERNS:
        found = pattern.search(name)
        if found:
            return int(found.group(1))
    return None


def step_from_trainer_state(directory: str) -> int | None:
    """``global_step`` from a Hugging Face ``trainer_state.json`` in ``directory``, if any."""
    try:
        with open(os.path.join(directory, TRAINER_STATE), encoding="utf-8") as f:
            value = json.load(f).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def checkpoint_step(path: str) -> int | None:
    """The training step of a checkpoint file or folder: ``trainer_state.json`` when the folder
    has one (the trainer's own record), else the number in its name."""
    if os.path.isdir(path):
        step = step_from_trainer_state(path)
        if step is not None:
            return step
    return step_from_name(os.path.basename(path.rstrip(os.sep)))
