"""Pins (ops/pin.py) at the crash points of their life: a release killed half way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptvault.ops import pin as pins


def test_a_release_killed_half_way_is_discarded_not_shipped_partial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    ckpt = tmp_path / "checkpoint-100"
    ckpt.mkdir()
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json"):
        (ckpt / name).write_bytes(os.urandom(1000))
    p = pins.create(str(ckpt), str(tmp_path / "staging"))
    for f in ckpt.iterdir():  # rotated away by the trainer: the pin holds the only copy
        f.unlink()

    def killed_after_one_file(path, ignore_errors=False):
        first = next(f for f in sorted(Path(path).rglob("*")) if f.is_file())
        first.unlink()
        raise SystemExit("killed")  # the process dies with the rest of the pin still on disk

    monkeypatch.setattr(pins.shutil, "rmtree", killed_after_one_file)
    with pytest.raises(SystemExit):
        p.release()
    monkeypatch.undo()

    assert os.path.isdir(p.root)  # what the killed release left behind
    assert pins.load(p.root) is None  # a restart must not take it for a checkpoint to ship
    assert not os.path.exists(p.root)
