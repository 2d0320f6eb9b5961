"""Pins (ops/pin.py) at the crash points of their life: a release killed half way, a pin made on a full disk."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from ckptvault.ops import pin as pins
from tests.conftest import DEEP, deep_tree


def test_a_release_killed_half_way_is_discarded_not_shipped_partial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    ckpt = tmp_path / "checkpoint-100"
    ckpt.mkdir()
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json"):
        (ckpt / name).write_bytes(os.urandom(1000))
    p = pins.create(str(ckpt), str(tmp_path / "staging"))
    for f in ckpt.iterdir():  # rotated away by the trainer: the pin holds the only copy
        f.unlink()

    def killed_after_one_file(path):
        first = next(f for f in sorted(Path(path).rglob("*")) if f.is_file())
        first.unlink()
        raise SystemExit("killed")  # the process dies with the rest of the pin still on disk

    monkeypatch.setattr(pins, "remove_tree", killed_after_one_file)
    with pytest.raises(SystemExit):
        p.release()
    monkeypatch.undo()

    assert os.path.isdir(p.root)  # what the killed release left behind
    assert pins.load(p.root) is None  # a restart must not take it for a checkpoint to ship
    assert not os.path.exists(p.root)


def test_a_pin_that_fails_half_made_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A full disk (ENOSPC) between the pin's folder and its data folder, or while writing its
    metadata: no folder and no temporary file is left to fill the disk further at each retry."""
    ckpt = tmp_path / "checkpoint-100"
    ckpt.mkdir()
    (ckpt / "model.pt").write_bytes(os.urandom(1000))
    staging = tmp_path / "staging"
    makedirs = os.makedirs

    def full_at_data(path, *args, **kwargs):
        if os.path.basename(path) == pins.DATA:
            makedirs(os.path.dirname(path))  # the pin's own folder was made, then the disk was full
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return makedirs(path, *args, **kwargs)

    monkeypatch.setattr(pins.os, "makedirs", full_at_data)
    with pytest.raises(OSError, match="No space left"):
        pins.create(str(ckpt), str(staging))
    monkeypatch.undo()
    assert os.listdir(staging) == []

    p = pins.create(str(ckpt), str(staging))
    os.unlink(os.path.join(p.root, pins.META))
    os.mkdir(os.path.join(p.root, pins.META))  # os.replace onto it fails (EISDIR)
    with pytest.raises(IsADirectoryError):
        p.save_meta(digest="0" * 16)
    assert sorted(os.listdir(p.root)) == [pins.DATA, pins.META]


def test_a_checkpoint_deeper_than_pythons_recursion_is_pinned_and_released(tmp_path: Path):
    """The signature, the links and the release each recursed once per folder: RecursionError."""
    with deep_tree(tmp_path / "checkpoint-100", os.urandom(1000)):
        p = pins.create(str(tmp_path / "checkpoint-100"), str(tmp_path / "staging"))
        sig = pins.signature(str(tmp_path / "checkpoint-100"))
        assert len(sig) == DEEP + 1 and pins.signature(p.data) == sig
        p.release()
        assert not os.path.exists(p.root)
