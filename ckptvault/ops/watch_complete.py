"""What keeps a checkpoint the watcher (watch.py) pinned from shipping once it settles: not complete yet
(a trainer killed while saving leaves such a checkpoint, which cannot resume), deleted before it was, or
saved again in place so often that it never settles."""

from __future__ import annotations

import os
from collections.abc import Callable

from ..errors import spelled
from ..formats import not_whole, pread_at
from . import pin as pins
from .names import TRAINER_STATE
from .watch_candidate import Candidate, WarnOnce, rewritten, saved_anew
from .watch_folder import CheckpointFolder

# A checkpoint saved in place this many times, over at least this long (or 10 --settle), without settling
# is said never to ship
REWRITES_TOLD = 3
REWRITES_TOLD_AFTER_S = 5.0
INCOMPLETE_WARN_S = 60.0  # a checkpoint-N settled this long without trainer_state.json is said to wait


class Completeness:
    """Judges the watcher's checkpoints by what ``folder`` knows of the trainer that writes them; ``release``
    forgets one (the watcher's)."""

    def __init__(
        self,
        *,
        folder: CheckpointFolder,
        settle: float,
        excluded: pins.Excluded | None,
        on_warning: Callable[[str], None],
        warn_once: WarnOnce,
        release: Callable[[Candidate], None],
    ) -> None:
        self._folder = folder
        self._settle = settle
        self._excluded = excluded
        self._on_warning = on_warning
        self._warn_once = warn_once
        self._release = release

    def count_rewrites(self, cand: Candidate, sig: pins.Signature, now: float) -> None:
        """A checkpoint saved again in place (``torch.save`` over the same file, a copy into it) more
        often than ``settle`` never settles, so never ships: said once it was seen saved in place a few
        times over a while without settling. A save in place is a look that finds a file changed
        without growing (a file being written only grows) after a look that found nothing changed (the
        files of one save, written one after another, count once)."""
        files = {rel: (size, mtime) for rel, size, mtime in pins.files_of(sig)}
        if sig == cand.sig:
            if now - cand.last_change >= self._settle:
                cand.rewrites = 0  # settled: it ships (or shipped) as it is, the saves before it done with
                cand.saved_anew = False
            cand.steady = True
        else:
            before = cand.files
            cand.saved_anew = cand.saved_anew or saved_anew(cand.sig, sig, cand.steady)
            if cand.steady and rewritten(before, files):
                cand.rewrites_since = cand.rewrites_since if cand.rewrites else now
                cand.rewrites += 1
            cand.steady = False
        cand.files = files
        waited = now - cand.rewrites_since
        if cand.rewrites >= REWRITES_TOLD and waited >= max(REWRITES_TOLD_AFTER_S, 10 * self._settle):
            rename = " (or to a temporary name, renamed over it)" if set(files) == {""} else ""
            self._warn_once(
                ("rewritten", cand.pin.pin_id),
                f"{cand.pin.name} was saved again in place {cand.rewrites} times in {waited:.0f} s without staying "
                f"unchanged for {spelled('--settle', 'settle')} ({self._settle:g} s): it ships once it does, "
                f"so saved in place this often it never ships; lower {spelled('--settle', 'settle')}, or save each "
                f"checkpoint under a new name{rename}",
            )

    def deleted_unfinished(self, cand: Candidate, now: float) -> bool:
        """A Hugging Face Trainer writes a ``checkpoint-N`` folder's ``trainer_state.json`` last: in
        its output folder (one of its ``checkpoint-N`` folders was seen holding that file), one
        deleted before it settled whose pin never got that file was seen only in part (its last files
        came and went within one poll, or its pin was made while it was being deleted), and shipped it
        would be the run's newest step. Dropped, and said so. Other trainers name folders
        ``checkpoint-N`` too, without that file: theirs ship as they were pinned, like any other
        folder. (In place nothing held it: whether it was complete or not, it is lost, which
        ``InPlaceShipping.gone`` says.)"""
        if (
            cand.pin.in_place
            or not self._folder.trainer_checkpoint(cand.pin.name, cand.pin.data)
            or now - cand.last_change >= self._settle
            or os.path.lexists(cand.pin.source)
            or os.path.exists(os.path.join(cand.pin.data, TRAINER_STATE))
        ):
            return False
        self._on_warning(
            f"{cand.pin.name} was deleted before it was complete (its {TRAINER_STATE}, which a Hugging Face Trainer "
            f"writes last, was never seen): not shipped; a checkpoint must stay at least one "
            f"{spelled('--interval', 'interval')} after it is written to be seen whole"
        )
        self._release(cand)
        return True

    def not_complete(self, cand: Candidate, sig: pins.Signature, now: float) -> bool:
        """Settled, but not a checkpoint to ship yet: a folder without a file (made before its files
        are written), a Hugging Face Trainer's ``checkpoint-N`` without its ``trainer_state.json``,
        which the Trainer writes last, a DeepSpeed or Megatron-LM step folder its save folder's pointer
        file does not name yet (written last too), or a file whose format says it ends later than it does (a
        ``torch.save`` zip without its directory, a safetensors file shorter than its header says). A
        trainer killed while saving leaves such a checkpoint, and shipped it would be the run's newest
        step, which cannot resume. Each waits, pinned, for what it lacks (a Trainer still saving is said
        to wait only after ``INCOMPLETE_WARN_S``: its ranks may meet at a barrier first); once its source
        is gone it is dropped, and said so."""
        if any(pins.files_of(sig)):
            if not self._folder.trainer_checkpoint(cand.pin.name, cand.pin.data):
                lacks = self._folder.unnamed_step_folder(cand.pin.name) or file_not_whole(cand, sig)
                if lacks is None:
                    return False
            elif os.path.exists(os.path.join(cand.pin.data, TRAINER_STATE)):
                return False
            elif self._excluded is not None and self._excluded(TRAINER_STATE, False):
                return False  # left out by the user's patterns: never coming
            else:
                lacks = f"no {TRAINER_STATE} (a Hugging Face Trainer writes it last)"
        elif self._excluded is not None and _holds_a_file(cand.pin.source):
            # never complete under these patterns: not a trainer that died while saving (wt47 F8)
            self._warn_once(
                ("excluded", cand.pin.name),
                f"{cand.pin.name} holds only files the exclude patterns leave out: it never ships under them; "
                f"change {spelled('--exclude', 'exclude')} to ship it",
            )
            return True
        else:
            lacks = "no file to ship (only folders or links)"
        if not pins.source_alive(cand.pin):
            self._on_warning(f"{cand.pin.name} was deleted while it held {lacks}: it was never complete; not shipped")
            self._release(cand)
            return True
        if now - cand.last_change < INCOMPLETE_WARN_S:
            return True
        self._warn_once(
            ("incomplete", cand.pin.name),
            f"{cand.pin.name} holds {lacks}: it ships once it is complete (if the trainer died while saving it, "
            f"it never will: delete it, or ship it as it is with {spelled('ckptvault backup', 'Vault.backup')})",
        )
        return True


def file_not_whole(cand: Candidate, sig: pins.Signature) -> str | None:
    """Which file of the checkpoint its own format calls cut short, and why (read again only when
    its files change: a checkpoint held back is looked at on every poll)."""
    if cand.not_whole is not None and cand.not_whole[0] == sig:
        return cand.not_whole[1] or None
    found = ""
    for rel, _, _ in pins.files_of(sig):
        path = os.path.join(cand.pin.data, rel) if rel else cand.pin.data
        with open(path, "rb") as f:
            reason = not_whole(pread_at(f.fileno()), os.fstat(f.fileno()).st_size)
        if reason is not None:
            found = f"a file that is not whole ({f'{rel}: ' if rel else ''}{reason})"
            break
    cand.not_whole = (sig, found)
    return found or None


def _holds_a_file(folder: str) -> bool:
    """Whether ``folder`` holds a file anywhere below it, patterns aside (False when it cannot be read)."""
    try:
        return any(entry.is_file(follow_symlinks=False) for _, entry in pins.walk(folder))
    except OSError:
        return False
