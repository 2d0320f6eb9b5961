"""The room the watcher's pins (watch.py) leave the trainer on the checkpoints' disk.

A pin keeps the files the trainer's rotation deleted until it ships, so uploads slower than saves pile
them up until the trainer's next save fails for want of room, which ends training and every save after
it. The oldest deleted checkpoints waiting are dropped to leave room for that save (``make_room``), and
a disk getting full is said before that (``warn_if_low``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..errors import CheckpointLostError, spelled
from ..units import format_bytes
from . import pin as pins
from .watch_candidate import Candidate, ReportLost, step_of

LOW_DISK_SAVES = 8  # saves of the largest waiting checkpoint the pins' disk has room for, under which a backlog is said


class DiskRoom:
    """Looks at the room left on the disk of ``pins_dir`` by the watcher's ``candidates``; ``release``
    forgets one (the watcher's), ``found_shipped`` says whether a vault snapshot already holds it."""

    def __init__(
        self,
        *,
        directory: str,
        pins_dir: str,
        settle: float,
        candidates: dict[str, Candidate],
        found_shipped: Callable[[Candidate], bool],
        release: Callable[[Candidate], None],
        report_lost: ReportLost,
        dropped: list[str],
        on_warning: Callable[[str], None],
    ) -> None:
        self._directory = directory
        self._pins_dir = pins_dir
        self._settle = settle
        self._candidates = candidates
        self._found_shipped = found_shipped
        self._release = release
        self._report_lost = report_lost
        self._dropped = dropped  # the names of the checkpoints dropped, for the run's result
        self._on_warning = on_warning
        self._beside_checkpoints = False  # the pins take room the trainer's saves need
        self._low_told = False  # the disk getting full was said (until it has room again)

    def find_disks(self) -> None:
        """Once the pins' folder is made: whether it is on the checkpoints' disk. Pins elsewhere
        (``--state-dir``) compete with no save, and are copies that hold no deleted file."""
        self._beside_checkpoints = _same_disk(self._pins_dir, self._directory)

    def make_room(self, now: float) -> None:
        """When the checkpoints' disk holds the pins and has less room than the largest checkpoint
        waiting takes (x ``pins.ROOM_FOR_A_SAVE``), the oldest waiting checkpoints the trainer already deleted
        are dropped, unshipped, until it has (``pins.make_room``): as ``backup_async`` coalesces a full
        queue. Never the newest waiting one, the one shipping, or one still in the folder (its pin frees
        nothing, and it would never ship); nor, while none ships, the newest complete one (a save being
        written may be the newest: this one ships next). While one ships, the newest complete one goes
        last: a disk with room for the trainer's saves and one pin then ships every few saves, where
        keeping a second pin would fail the trainer's next save. Each dropped one is an error of the run.
        Pins elsewhere: nothing is dropped there."""
        waiting = sorted(
            (c for c in self._candidates.values() if c.state != "queued" and not c.pin.in_place),
            key=lambda c: c.pin.pin_id,
        )
        shipping = any(c.state == "queued" for c in self._candidates.values())
        if len(waiting) < (2 if shipping else 3) or not self._beside_checkpoints:
            return  # the newest waiting one is never dropped, nor the one before it while none ships
        largest = self._largest_checkpoint()
        free = pins.free_bytes(self._pins_dir)
        if free is None:
            return
        kept = {waiting[-1].pin.pin_id}
        if not shipping:  # the newest complete one ships next
            complete = [c for c in waiting if c.state == "failed" or c.settled(now, self._settle)]
            kept.update(c.pin.pin_id for c in complete[-1:])

        def held(cand: Candidate) -> int:
            if cand.pin.pin_id in kept or pins.source_alive(cand.pin):
                return 0
            return pins.bytes_held(cand.pin)

        pins.make_room(free, pins.ROOM_FOR_A_SAVE * largest, waiting, held, self._drop)

    def _largest_checkpoint(self) -> int:
        """Bytes of the largest checkpoint known: what the trainer's next save may need."""
        return max((pins.bytes_of(c.sig) for c in self._candidates.values()), default=0)

    def _drop(self, cand: Candidate, free: int, held: int) -> bool:
        if self._found_shipped(cand):
            self._release(cand)  # adopted from an earlier run that shipped it: nothing is lost
            return True
        error = CheckpointLostError(
            cand.pin.source,
            f"dropped without shipping it, to leave the trainer room for its next save: the disk of "
            f"{self._directory} had {format_bytes(free)} free and its pin kept {format_bytes(held)} the trainer "
            "had deleted; uploads are slower than saves (newer checkpoints still ship)",
            "save less often, raise the upload rate, or pin on another disk with "
            f"{spelled('--state-dir', 'state_dir')}, where pins are copies and nothing is dropped",
        )
        step = step_of(cand)
        self._release(cand)
        self._dropped.append(cand.pin.name)
        self._report_lost(cand, step, "dropped", error)
        return True

    def warn_if_low(self) -> None:
        """Pins keep the files the trainer deletes until they ship: uploads slower than saves pile
        them up until the disk is full and the trainer's next save fails. Said once the disk has room
        for fewer than ``LOW_DISK_SAVES`` saves of the largest waiting checkpoint with checkpoints
        waiting (again only once it had twice that: a disk that stays nearly full is said to be once).
        In bytes, not a share of the disk: 10 % of a big volume is many saves, of a small one none."""
        waiting = sum(1 for c in self._candidates.values() if not c.pin.in_place)
        if waiting < 2 and not self._low_told:  # nothing to say nor to forget: no disk look at each poll
            return
        largest = self._largest_checkpoint()
        free = pins.free_bytes(self._pins_dir)
        if free is None:
            return
        if free >= 2 * LOW_DISK_SAVES * largest:
            self._low_told = False
        elif free < LOW_DISK_SAVES * largest and waiting >= 2 and not self._low_told:
            self._low_told = True
            self._on_warning(
                f"the disk of {self._pins_dir} has {format_bytes(free)} free, room for {free // max(largest, 1)} "
                f"more save(s) of {format_bytes(largest)}, and {waiting} checkpoints wait to ship, "
                "pinned (a pin keeps the files the trainer deleted until it ships): uploads are slower than saves, "
                "and a full disk fails the trainer's next save; save less often, raise the upload rate, or give "
                f"{spelled('--state-dir', 'state_dir')} on another disk (pins are copies there)",
            )


def _same_disk(a: str, b: str) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:  # cannot tell: nothing is dropped to make room
        return False
