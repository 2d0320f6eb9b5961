"""Shipping in place: a checkpoint the watcher (watch.py) could not pin, as the checkpoints' disk is full.

That is when shipping them matters most: the checkpoint is read where it is, as ``backup`` would, and
pinned after all if room comes back first. Nothing keeps it from the trainer's rotation meanwhile: one
deleted or cut down before it shipped is lost, and an error of the run; one that changes while it ships
is not committed (``verify``), and ships once it settles again. Its stand-in pin (``pins.stand_in``) goes
through the same states as a pin.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Set

from ..errors import CheckpointLostError, SourceError, spelled
from . import pin as pins
from .watch_candidate import (
    Candidate,
    Done,
    ReportLost,
    SignatureOf,
    WarnOnce,
    file_paths,
    saved_anew,
    stat_if_same,
    step_of,
    temporary_activity,
    unchanged,
)


class InPlaceShipping:
    """Checkpoints shipping in place: starts them, pins them once there is room, and says which were lost;
    ``release`` forgets one (the watcher's)."""

    def __init__(
        self,
        *,
        pins_dir: str,
        vault: tuple[int, int] | None,
        excluded: pins.Excluded | None,
        signature: SignatureOf,
        done: dict[str, Done],
        warn_once: WarnOnce,
        on_warning: Callable[[str], None],
        report_lost: ReportLost,
        release: Callable[[Candidate], None],
        pin_retry_s: float,
        pin_meta: Callable[[pins.Pin], dict[str, object]],
    ) -> None:
        self._pins_dir = pins_dir
        self._pin_meta = pin_meta  # what the watcher records in each of its pins
        self._vault = vault
        self._excluded = excluded
        self._signature = signature
        self._done = done
        self._warn_once = warn_once
        self._on_warning = on_warning
        self._report_lost = report_lost
        self._release = release
        self._pin_retry_s = pin_retry_s  # how often pinning it is tried again

    def start(
        self,
        name: str,
        path: str,
        st: os.stat_result,
        now: float,
        exc: OSError,
        *,
        tags: dict[str, str] | None = None,
        holding: Set[str] = frozenset(),
    ) -> Candidate | None:
        """``path`` could not be pinned (``exc``): it ships in place from now on, as the candidate returned,
        under ``tags`` (those of the pin it replaces, adopted from an earlier run; None: this run's).
        None when it went or was replaced meanwhile: the next poll sees what is there now; or when it lacks
        a file of ``holding`` (the paths its pin holds), in the very read that the in-place shipping starts
        from: deleted since it was pinned, the pin is the only copy, and the checkpoint is no longer whole."""
        try:
            pin = pins.stand_in(path, self._pins_dir, excluded=self._excluded)
            # what it holds, before the user is told not to delete it: a file deleted after that is a loss
            sig = self._signature(pin) + temporary_activity(pin)
        except OSError:
            return None  # deleted or changed between the look and now
        if pin.source_ino != st.st_ino:
            return None  # replaced meanwhile
        if holding - file_paths(sig):
            return None  # files of it went since it was pinned
        reason = exc.strerror or str(exc)
        self._warn_once(
            ("in place", name),
            f"{name}: cannot pin: {reason}; it ships in place: do not delete it before it has shipped (to pin: "
            f"free space on the disk of {self._pins_dir}, or give {spelled('--state-dir', 'state_dir')} on "
            "another disk, where pins are copies)",
        )
        return Candidate(
            pin=pin,
            seen=now,
            last_change=now,
            sig=sig,
            unpinned=reason,
            pin_retry_at=now + self._pin_retry_s,
            tags=tags,
        )

    def pin_after_all(self, cand: Candidate, now: float) -> pins.Pin | None:
        """The pin of a checkpoint shipping in place, once there is room (tried every few seconds)."""
        if now < cand.pin_retry_at:
            return None
        cand.pin_retry_at = now + self._pin_retry_s
        meta = self._pin_meta
        if cand.tags is not None:  # the tags it ships under, for a restart to ship it under them too
            meta = lambda pin: {**self._pin_meta(pin), "tags": cand.tags}  # noqa: E731
        try:
            pin = pins.create(cand.pin.source, self._pins_dir, skip_dir=self._vault, excluded=self._excluded, meta=meta)
        except OSError:
            return None  # still no room; or gone, which the next look names
        if pin.source_ino != cand.pin.source_ino:
            pin.release()  # replaced meanwhile: the next look says so
            return None
        sig = self._signature(pin)
        if file_paths(cand.sig) - file_paths(sig):  # files went while it was being pinned
            pin.release()  # before cut_down's release, which makes the staging folder again
            self.cut_down(cand, sig)
            return None
        return pin

    def lost(self, cand: Candidate, what: str, reason: str = "deleted") -> None:
        """What is left of it (a folder cut down) is remembered as shipped: not a new checkpoint. ``reason``:
        "deleted", or "replaced" (a new save in its folder)."""
        error = CheckpointLostError(
            cand.pin.source,
            f"{what} before it shipped; it was shipping in place, as it could not be pinned ({cand.unpinned}), "
            "so it is not in the vault",
            f"give {spelled('--state-dir', 'state_dir')} on another disk, or free space, so that checkpoints are "
            "pinned",
        )
        self._report_lost(cand, step_of(cand), reason, error)
        with contextlib.suppress(OSError):
            st = os.lstat(cand.pin.source)
            if st.st_ino == cand.pin.source_ino:
                self._done[cand.pin.name] = Done(st.st_ino, st.st_size, st.st_mtime_ns, cand.sig)
        self._release(cand)

    def cut_down(self, cand: Candidate, sig: pins.Signature) -> bool:
        """Files of a checkpoint shipping in place are gone since its last look (a rotation under way, or a
        new save written into its folder, seen now or at an earlier look: ``saved_anew``): it is lost, said so,
        and True. A file that only grew beside the ones that went is its own save still being written: deleted."""
        if not file_paths(cand.sig) - file_paths(sig):
            return False
        if cand.saved_anew or saved_anew(cand.sig, sig, cand.steady):
            self.lost(cand, "it was replaced by a new save in its folder", "replaced")  # files deleted, others written
        else:
            self.lost(cand, "files of it were deleted")
        return True

    def gone(self, cand: Candidate) -> bool:
        """Whether a checkpoint shipping in place went: lost when deleted; when replaced by a newer save
        (a ``latest.pt`` saved by a rename), that save ships instead, as a pin would have it."""
        try:
            st = os.stat(cand.pin.source)
        except FileNotFoundError:
            self.lost(cand, "it was deleted")
            return True
        except OSError:
            return False  # unreadable for now: the next look tries again
        if st.st_ino == cand.pin.source_ino:
            return False
        self._on_warning(f"{cand.pin.name} was replaced by a newer save before it shipped in place: that one ships")
        self._release(cand)
        return True

    def verify(self, pin: pins.Pin, sig: pins.Signature) -> None:
        """Just before an in-place backup commits (on the shipping thread): every file still as it was
        when it was queued, or the snapshot could hold parts of two saves."""
        if stat_if_same(pin) is None or not unchanged(self._signature, pin, sig):
            raise SourceError(
                pin.source,
                "it changed or went while it shipped in place (it could not be pinned); this backup is not stored",
                "it ships again once it settles, if it is still there",
            )
