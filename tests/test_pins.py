"""Pins (ops/pin.py) at the crash points of their life: a release killed half way, a pin made on a full disk."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from ckptvault.ops import pin as pins
from tests.conftest import DEEP, deep_tree
from tests.support.races import at_file_linked


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


def _save(folder: Path, step: int, parts: int = 6) -> None:
    folder.mkdir()
    (folder / "sub").mkdir()
    for i in range(parts):
        (folder / f"part_{i}.bin").write_text(f"step {step} part {i}\n")
    (folder / "sub" / "meta.json").write_text(f"step {step}\n")


def _steps_in(pin: pins.Pin) -> set[str]:
    return {p.read_text().split()[1] for p in Path(pin.data).rglob("*") if p.is_file()}


@pytest.mark.parametrize("old_one", ["deleted", "kept"])
def test_a_folder_renamed_over_while_its_pin_syncs_leaves_the_pin_one_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old_one: str
):
    """A trainer publishing ``latest/`` by renaming a new folder over the name while the watcher's
    sync walks it: the walk followed the path, so the rest of the old save's pin was linked from the
    new save (a snapshot holding files of both, shipped as complete)."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    _save(ckpts / "latest", 10)
    pin = pins.create(str(ckpts / "latest"), str(tmp_path / "staging"))
    (ckpts / "latest" / "part_9.bin").write_text("step 10 part 9\n")  # written since: the sync links it
    _save(ckpts / "latest.tmp", 20, parts=10)

    def swap() -> None:
        os.rename(ckpts / "latest", ckpts / "latest.old")
        os.rename(ckpts / "latest.tmp", ckpts / "latest")
        if old_one == "deleted":
            shutil.rmtree(ckpts / "latest.old")

    calls = at_file_linked(monkeypatch, 3, swap)
    whole = pins.sync(pin)
    monkeypatch.undo()
    assert len(calls) >= 3
    assert _steps_in(pin) == {"10"}
    names = {p.name for p in Path(pin.data).rglob("*") if p.is_file()}
    written_since = {"part_9.bin"} if old_one == "kept" else set()
    assert names == {f"part_{i}.bin" for i in range(6)} | {"meta.json"} | written_since
    assert whole is (old_one == "kept")  # the deleted one's later files went before they were linked


def test_a_folder_deleted_while_it_is_first_pinned_gives_no_pin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A pin made while its folder was being deleted holds part of it: it is refused (as a folder
    deleted before the pin), not kept to ship as the checkpoint."""
    _save(tmp_path / "latest", 10)
    at_file_linked(monkeypatch, 3, lambda: shutil.rmtree(tmp_path / "latest"))
    with pytest.raises(FileNotFoundError, match="deleted while it was being pinned"):
        pins.create(str(tmp_path / "latest"), str(tmp_path / "staging"))
    monkeypatch.undo()
    assert not os.listdir(tmp_path / "staging")
    _save(tmp_path / "latest", 20)  # a folder whole at its pin is pinned whole
    pin = pins.create(str(tmp_path / "latest"), str(tmp_path / "staging"))
    assert _steps_in(pin) == {"20"} and pins.signature(pin.data) == pins.signature(str(tmp_path / "latest"))


def test_a_subfolder_swapped_for_a_link_during_a_sync_is_not_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Subfolders are opened by their path from the pinned folder's descriptor: one replaced by a link
    after it was listed (to a folder outside the checkpoint) must not have its target pinned."""
    outside = tmp_path / "outside" / "b"
    outside.mkdir(parents=True)
    (outside / "secret.key").write_text("not part of the checkpoint\n")
    ckpt = tmp_path / "latest"
    (ckpt / "a" / "b").mkdir(parents=True)
    (ckpt / "model.bin").write_text("step 10\n")
    real, swapped = pins._sync_entries, []

    def swap_a_once_it_is_listed(pin, fd, entries, folder, folders, link_only):
        whole = real(pin, fd, entries, folder, folders, link_only)
        if folder.rel == "a":  # "a/b" is listed and queued: now "a" becomes a link to a folder elsewhere
            swapped.append(True)
            shutil.rmtree(ckpt / "a")
            os.symlink(tmp_path / "outside", ckpt / "a")
        return whole

    monkeypatch.setattr(pins, "_sync_entries", swap_a_once_it_is_listed)
    pin = pins.create(str(ckpt), str(tmp_path / "staging"))
    monkeypatch.undo()
    pinned = sorted(str(p.relative_to(pin.data)) for p in Path(pin.data).rglob("*") if p.is_file())
    assert swapped and pinned == ["model.bin"]


def test_making_room_drops_the_oldest_that_free_something_until_there_is_enough():
    """The rule the watcher and backup_async share: oldest first, skipping what frees nothing or could not
    be dropped, counting what a dropped pin held as freed, and asking no more once there is room."""
    held = {"a": 0, "b": 30, "c": 50, "d": 40, "e": 70}
    asked: list[str] = []
    dropped: list[tuple[str, int, int]] = []

    def held_by(name: str) -> int:
        asked.append(name)
        return held[name]

    def drop(name: str, free: int, freed: int) -> bool:
        dropped.append((name, free, freed))
        return name != "c"  # started shipping meanwhile: not dropped, so nothing freed

    free = pins.make_room(10, 75, ["a", "b", "c", "d", "e"], held_by, drop)
    assert dropped == [("b", 10, 30), ("c", 40, 50), ("d", 40, 40)]
    assert asked == ["a", "b", "c", "d"] and free == 80
    assert pins.make_room(100, 75, ["a"], held_by, drop) == 100 and asked[-1] == "d"


def test_making_room_stops_as_soon_as_the_room_is_exactly_what_a_save_needs():
    """Room equal to what the save needs is room enough: the next oldest pin is neither asked about nor
    dropped (dropping it would lose an unshipped checkpoint for nothing)."""
    dropped: list[str] = []
    asked: list[str] = []

    def held_by(name: str) -> int:
        asked.append(name)
        return 30

    def drop(name: str, free: int, freed: int) -> bool:
        dropped.append(name)
        return True

    assert pins.make_room(10, 40, ["a", "b", "c"], held_by, drop) == 40
    assert dropped == ["a"] and asked == ["a"]
    assert pins.make_room(40, 40, ["a"], held_by, drop) == 40 and dropped == ["a"]
