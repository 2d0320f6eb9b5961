"""The watching sidecar: find each finished checkpoint in a folder, pin it, ship it, unpin it.

Every entry at the top of the watched folder is a checkpoint (a folder such as
``checkpoint-1200/`` or a file such as ``latest.pt``), except names still being written
(``*.tmp``, ``tmp-*``, ``.*``: see names.py), the watcher's own staging folder, and what no
checkpoint of a run should be (logs, configs, the other entries of a Trainer's output folder:
watch_folder.py).

The life of a checkpoint:

1. **seen**: a new name, or a name that now holds a new file or folder (a rename over it
   gives a new inode), or an old file rewritten in place. It is pinned at once (pin.py): hard
   links into the staging folder, so the trainer's rotation may delete it from then on.
2. **settling**: on every poll the pin is brought up to date with the source while the source
   exists; the checkpoint is *complete* once the pin's signature (paths, sizes, mtimes) has not
   changed for ``settle`` seconds. A source deleted meanwhile settles from its pin. A folder
   without a file, or a Trainer's ``checkpoint-N`` without ``trainer_state.json``, waits for it.
3. **shipping**: a backup of the pin, tagged with the user's tags, ``step`` (names.py),
   ``checkpoint=<name>`` and ``watch-sig=<signature digest>``. Backups run one at a time on a
   worker thread while polling goes on, so a long upload never makes the watcher miss a
   checkpoint. Each is chosen when the last one ends: the newest ready checkpoint, since a resume
   needs the newest, and uploads slower than saves would otherwise keep it waiting behind the
   whole backlog (a preemption's last save among them); while watching goes on, every other one
   the oldest, so that the backlog is not starved (``_promote``). When the pins leave the trainer
   too little room for its next save, the oldest deleted checkpoints are dropped (watch_room.py).
4. **shipped**: the snapshot is durable (committed); the pin is deleted.

Where no pin can be made (the checkpoints' disk is full) a checkpoint ships in place: a stand-in
pin (``pins.stand_in``) goes through the same states, the backup commits only if the source is
still what was queued, and one that goes first is lost and an error of the run.

Restart safety: pins live on disk until their snapshot is durable, so a watcher killed at any
moment finds them again when it starts and ships them (no gaps for checkpoints it had pinned).
Before shipping, the pin's ``watch-sig`` is looked up among the vault's snapshots, so a
checkpoint whose snapshot was committed just before the kill is not shipped twice.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import functools
import logging
import os
import queue
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from ..errors import (
    BackupSupersededError,
    CheckpointLostError,
    CkptVaultError,
    SourceError,
    StorageFullError,
    UsageError,
    spelled,
)
from ..snapshot.model import WATCH_SIG_TAG, Snapshot
from . import pin as pins
from .async_backup import AsyncShipper, BackupJob
from .names import STATE_FOLDERS, WATCH_STATE_FOLDER, checkpoint_step, is_temporary
from .scan import refuse_sources_in_vault
from .watch_candidate import (
    Candidate,
    Done,
    file_paths,
    gone_or_replaced,
    stat_if_same,
    step_of,
    tag_text,
    temporary_activity,
    unchanged,
    unpinnable,
)
from .watch_complete import Completeness
from .watch_folder import LEFT_OUT_TOLD, CheckpointFolder, Keep, LeftOutTold, step_order
from .watch_in_place import InPlaceShipping
from .watch_lock import WatchLock
from .watch_options import LostCheckpoint, ShippedCheckpoint, WatchOptions, WatchResult, check_watch_args
from .watch_room import DiskRoom
from .watch_shipped import Digests, Shipped, ShippedIndex

log = logging.getLogger("ckptvault")

RETRY_AFTER = (5.0, 15.0, 60.0, 300.0)


Ship = Callable[[BackupJob], Snapshot]


POLL_S = 0.1  # how often a wait looks whether it may end (stopped, uploads done, list loaded), whatever --interval says
# How often a shipped folder that is still there has its files compared with what was shipped: a file
# rewritten in place, or added to a subfolder, changes no mtime of the folder itself.
LOOK_INSIDE_S = 1.0
# ... or less often, so that those looks take at most this share of the time: a sidecar keeping 200 shipped
# DeepSpeed checkpoints of 130 files each spent 0.14 s of every second on them (14 % of a core the trainer's
# data loaders could use); a file rewritten in a shipped checkpoint then ships a little later.
# A settled checkpoint waiting behind an upload is looked at on the same terms: looking at its pin every
# --interval only finds what a look a second later would (it would have shipped as it was had the shipper been
# free); a backlog of four pins of 1,000 files each kept a quarter of a core busy.
LOOK_INSIDE_SHARE = 0.05
MANY_NAMES = 5  # checkpoints named in a line about several; the others are counted
LATE_LOOK_S = 1.0  # looks for new checkpoints later than --interval by more than this (or --interval) are said


class Watcher:
    def __init__(
        self,
        directory: str,
        *,
        tags: dict[str, str],
        ship: Ship,
        shipped_digests: Digests,
        options: WatchOptions,
        shipped_files: Shipped | None = None,
        stop: threading.Event | None = None,
        on_shipped: Callable[[ShippedCheckpoint], None] | None = None,
        on_warning: Callable[[str], None] | None = None,
        on_start: Callable[[int], None] | None = None,
        on_lost: Callable[[LostCheckpoint], None] | None = None,
        vault_folder: str | None = None,
    ) -> None:
        self.directory = check_watch_args(
            directory,
            tags,
            options.interval,
            options.settle,
            once=options.once,
            include=options.include,
            grace=options.grace,
        )
        self._vault = refuse_sources_in_vault([self.directory], vault_folder)  # a vault inside is no checkpoint
        self.tags = dict(tags)
        self.options = options
        excludes = options.exclude
        self._excluded = excludes.match if excludes else None  # never pinned, nor in a signature
        self._as_pinned = functools.partial(unpinnable, self._excluded)  # what a pin leaves out
        self._names_excluded = functools.partial(excludes.match, names_only=True)
        # the patterns are part of what was shipped: a checkpoint shipped with others ships again
        self._sig_extra: pins.Signature = (("exclude", *excludes.key()),) if excludes else ()
        self.state_dir = os.path.abspath(options.state_dir or os.path.join(self.directory, WATCH_STATE_FOLDER))
        self._refuse_state_dir(vault_folder)
        # a state folder of the watched folder's own holds its pins only, whatever path it had then (renamed,
        # mounted elsewhere); one given elsewhere may be given to watches of other folders too
        self._state_shared = os.path.dirname(self.state_dir) != self.directory
        self.pins_dir = os.path.join(self.state_dir, "pins")
        self._lock = WatchLock(os.path.join(self.state_dir, "lock"), self.directory)
        self._ship = ship
        self._stop = stop or threading.Event()
        self._on_shipped = on_shipped or (lambda _s: None)
        self._on_warning = on_warning or (lambda _m: None)
        self._on_lost = on_lost or (lambda _l: None)
        self._candidates: dict[str, Candidate] = {}  # by pin id
        self._done: dict[str, Done] = {}  # by top-level name
        self._on_start = on_start or (lambda _n: None)
        self._warned: set[tuple[str, str]] = set()  # (stage, name) whose local error was reported
        self._unpinned: dict[str, CkptVaultError] = {}  # checkpoint name -> why it could not be pinned
        self._lost: list[CkptVaultError] = []  # checkpoints gone unshipped (shipping in place; dropped for room)
        self._folder = CheckpointFolder(
            self.directory,
            include=options.include,
            warn_left_out=LeftOutTold(os.path.join(self.state_dir, LEFT_OUT_TOLD), self._on_warning),
            warn_once=self._warn_once,
            forget_others=self._forget_others,
        )
        self._complete = Completeness(
            folder=self._folder,
            settle=options.settle,
            excluded=self._excluded,
            on_warning=self._on_warning,
            warn_once=self._warn_once,
            release=self._release,
        )
        self._retry_after = RETRY_AFTER  # the delays before each try again, as the module gives them now
        self._shipped = ShippedIndex(
            shipped_digests,
            once=options.once,
            retry_s=self._retry_after[0],
            warn_once=self._warn_once,
            files=shipped_files,
        )
        self._scanned_at = 0.0
        self._grace_ends = 0.0  # stopped with a grace: when it ends
        self._finished: queue.SimpleQueue[tuple[Candidate, BackupJob]] = queue.SimpleQueue()
        self._upload_ended = threading.Event()  # set by the worker: the next upload can start
        self._submitted: set[str] = set()  # --once: pin ids whose backup started (each is tried once)
        self._oldest_turn = False  # the next upload with a choice goes to the oldest waiting (see _promote)
        self.result = WatchResult()
        self._room = DiskRoom(
            directory=self.directory,
            pins_dir=self.pins_dir,
            settle=options.settle,
            candidates=self._candidates,
            found_shipped=self._found_shipped,
            release=self._release,
            report_lost=self._report_lost,
            dropped=self.result.dropped,
            on_warning=self._on_warning,
        )
        self._in_place = InPlaceShipping(
            pins_dir=self.pins_dir,
            vault=self._vault,
            excluded=self._excluded,
            signature=self._signature,
            done=self._done,
            warn_once=self._warn_once,
            on_warning=self._on_warning,
            report_lost=self._report_lost,
            release=self._release,
            pin_retry_s=self._retry_after[0],
            pin_meta=self._pin_meta,
        )

    def _refuse_state_dir(self, vault_folder: str | None) -> None:
        """The watched folder as its own state folder shipped its lock file as a checkpoint, and pinned its
        pins into themselves until the names grew too long (wt47 F4); one inside the vault mixes with it."""
        option = spelled("--state-dir", "state_dir")
        if self._watches(self.state_dir):
            raise UsageError(
                f"{option} {self.state_dir} is the watched folder: the watcher would take its own pins for "
                f"checkpoints; give a folder beside it, or leave {option} out (then {WATCH_STATE_FOLDER} in it)"
            )
        try:
            refuse_sources_in_vault([self.state_dir], vault_folder)
        except UsageError:
            raise UsageError(
                f"{option} {self.state_dir} is in the vault at {vault_folder}; give a folder outside it"
            ) from None

    # ---- the loop ----------------------------------------------------------------------

    def run(self) -> WatchResult:
        try:
            os.makedirs(self.pins_dir, exist_ok=True)
            lock = self._lock
            lock.open()
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # writable, but full: exit 21, not a bad argument
                raise StorageFullError(
                    "write",
                    self.state_dir,
                    self.state_dir,
                    f"cannot keep the watch's state there: {exc.strerror or exc}",
                    hint="free a few KB on that disk (the watcher keeps its lock there, and pins checkpoints there "
                    f"when there is room), or give {spelled('--state-dir', 'state_dir')} on a disk with room, and "
                    "start it again",
                ) from None
            raise UsageError(
                f"cannot keep the watch's state in {self.state_dir}: {exc.strerror or exc}; the watcher pins "
                "checkpoints there, so it must be a writable folder on the checkpoints' filesystem "
                f"({spelled('--state-dir', 'state_dir')})"
            ) from None
        with lock:
            self._room.find_disks()
            resumed = self._adopt_pins()
            self._shipped.start_loading()
            if self.options.once:  # its one look must know what was shipped (a full disk ships in place)
                while not self._stop.is_set() and not self._shipped.loaded.wait(POLL_S):
                    pass  # a slow or retrying store must not make Ctrl-C wait for the list
            now = time.monotonic()
            if not self._stop.is_set():  # stopped while the list loaded: nothing is pinned blind
                self._scan(now)
                self._settle(now)
            self._on_start(resumed)
            if warning := self._folder.one_checkpoint():
                self._on_warning(warning)
            # exit_timeout=0: after a second SIGTERM/Ctrl-C the process exits without waiting for the upload
            shipper = AsyncShipper(
                self._ship,
                max_pending=None,
                exit_timeout=0.0,
                name="ckptvault-watch",
                log_failures=False,
                retry_lock=self.options.retry_lock,
            )  # each failure is reported by _collect, with what happens next
            try:
                if self.options.once:
                    self._run_once(shipper)
                else:
                    self._run_forever(shipper)
                    self._drain(shipper)
            finally:
                shipper.close(cancel_pending=True)
                self._collect()
            self.result.left = sum(1 for c in self._candidates.values() if not c.pin.in_place)
            # failures that a later retry fixed are not errors of the run
            self.result.errors = [c.error for c in self._candidates.values() if c.error is not None]
            self.result.errors += [*self._unpinned.values(), *self._lost]  # never pinned, so never shipped
        return self.result

    def _run_forever(self, shipper: AsyncShipper) -> None:
        while not self._stop.is_set():
            self._look(shipper)
            self._pause(self.options.interval)

    def _pause(self, seconds: float, *, stoppable: bool = True) -> None:
        """Until the next look: ``seconds``, or less when an upload ends (the next one starts then, not a
        whole ``--interval`` later) or, when ``stoppable``, when the watcher is stopped."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0 and not (stoppable and self._stop.is_set()):
            if self._upload_ended.wait(min(left, POLL_S)):
                break
        self._upload_ended.clear()

    def _drain(self, shipper: AsyncShipper) -> None:
        """Stopped with a grace (a preemption: the trainer got the same signal, and may be gathering and
        writing its last save now, which a resume needs, while the machine may not come back for the
        pins): go on looking and shipping until the grace runs out. The sidecar cannot know whether a
        save is still coming, so it waits the whole grace; an upload started before the end finishes."""
        deadline = self._grace_ends = time.monotonic() + self.options.grace
        while time.monotonic() < deadline:
            self._look(shipper)
            self._pause(min(self.options.interval, deadline - time.monotonic()), stoppable=False)

    def _look(self, shipper: AsyncShipper) -> None:
        now = time.monotonic()
        self._lock.renew()
        self._scan(now)
        self._settle(now)
        self._promote(shipper, now)
        self._collect()
        self._room.make_room(now)
        self._room.warn_if_low()

    def _run_once(self, shipper: AsyncShipper) -> None:
        """One pass for cron: what is there now and stays unchanged for ``settle`` seconds ships;
        what is still being written is left for the next run."""
        start = time.monotonic()
        for cand in self._candidates.values():
            cand.first_sig = cand.sig
        deadline = start + self.options.settle
        while not self._stop.is_set() and time.monotonic() < deadline:
            self._stop.wait(min(self.options.interval, max(0.0, deadline - time.monotonic())))
            self._settle(time.monotonic())
        for cand in list(self._candidates.values()):
            if cand.sig != cand.first_sig and pins.source_alive(cand.pin):
                self._on_warning(f"{cand.pin.name} is still being written; it is left for the next run")
                self._release(cand)
            else:
                cand.last_change = 0.0  # settled
        while not self._stop.is_set() and not self._shipped.known():
            self._shipped.loaded.wait(POLL_S)
        while not self._stop.is_set():  # stopped: nothing more starts
            self._promote(shipper, time.monotonic())
            if not self._shipping():
                break  # nothing more is ready
            while not self._stop.is_set() and self._shipping():
                self._upload_ended.wait(POLL_S)
                self._upload_ended.clear()
                self._collect()
        self._collect()

    def _shipping(self) -> bool:
        return any(c.state == "queued" for c in self._candidates.values())

    # ---- finding and pinning -----------------------------------------------------------

    def _wanted(self, name: str) -> bool:
        if is_temporary(name):
            return False
        return not self.options.include or any(fnmatch.fnmatchcase(name, g) for g in self.options.include)

    def _say_if_looks_are_late(self, gap: float) -> None:
        """A checkpoint must exist for one look's gap to be seen: --interval, unless the looks take
        longer (a busy machine, a folder slow to list, pins of many files). Said once, with the gap."""
        if gap - self.options.interval > max(LATE_LOOK_S, self.options.interval):
            self._warn_once(
                ("late look", ""),
                f"{gap:.1f} s passed between two looks for new checkpoints in {self.directory} "
                f"({spelled('--interval', 'interval')} is {self.options.interval:g} s): a checkpoint saved and "
                "deleted within that long is never seen (the machine is busy, the folder is slow to list, or pins "
                "of many files take long to walk); let the trainer keep at least two checkpoints (said once)",
            )

    def _excluded_checkpoint(self, name: str, st: os.stat_result) -> bool:
        """A folder is the root of its snapshot: only a name pattern leaves it out; a file checkpoint
        is stored under its name, which any pattern may match."""
        if stat.S_ISDIR(st.st_mode):
            return self._names_excluded(name, True)
        return self._excluded is not None and self._excluded(name, False)

    def _digest(self, sig: pins.Signature) -> str:
        return pins.digest(sig + self._sig_extra)

    def _found_shipped(self, cand: Candidate) -> bool:
        """Whether a snapshot of the vault holds its pin as it is now (adopted from an earlier run that shipped it)."""
        return self._shipped_before(cand.pin.name, self._signature(cand.pin))

    def _shipped_before(self, name: str, sig: pins.Signature) -> bool:
        """Whether the vault holds the checkpoint ``name`` with these files, or with these and more: what is left
        of one shipped before, whose files its rotation has been deleting (as ``_changed_since_shipped`` takes it)."""
        return self._shipped.holds(name, self._digest(sig)) or self._shipped.holds_what_is_left(name, sig, self._digest)

    def _scan(self, now: float) -> None:
        started = time.monotonic()
        if self._scanned_at and not self.options.once:
            self._say_if_looks_are_late(started - self._scanned_at)
        self._scanned_at = started
        tracked = {(c.pin.name, c.pin.source_ino) for c in self._candidates.values()}
        try:
            with os.scandir(self.directory) as it:
                entries = [e for e in it if self._wanted(e.name)]
            entries = self._folder.checkpoints(entries)
        except FileNotFoundError:
            return
        except OSError as exc:  # EIO, EACCES: the folder may come back; the sidecar must not die
            self._warn_once(("list", self.directory), f"cannot list {self.directory}: {exc}; trying again")
            return
        self._warned.discard(("list", self.directory))
        listed = {entry.name for entry in entries}
        for name in [name for name in self._done if name not in listed]:
            # rotated away: no record kept (a long run would keep thousands); if the name comes back,
            # what it holds is found shipped, or not, by its digest, as after a restart
            del self._done[name]
        looks_s = sum(done.look_s for done in self._done.values())
        look_every = max(LOOK_INSIDE_S, self.options.interval, looks_s / LOOK_INSIDE_SHARE)
        # pinned in step order: a pin's time is its snapshot's
        for entry in sorted(entries, key=lambda e: step_order(e.name)):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # deleted while we looked, or unreadable: the next poll looks again
            if stat.S_ISLNK(st.st_mode) or not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                continue  # a link names a checkpoint that is watched under its own name
            if self._folder.is_log_folder(entry.name, st.st_ino):
                continue
            if self._excluded_checkpoint(entry.name, st):
                self._warn_once(
                    ("excluded checkpoint", ""),
                    f"{entry.name} is never shipped: an exclude pattern matches its name, and a pattern without "
                    f"'/' leaves out whole checkpoints too; change {spelled('--exclude', 'exclude')} if it should "
                    "ship (said once)",
                )
                continue
            if (
                entry.path == self.state_dir
                or (entry.name, st.st_ino) in tracked
                or (st.st_dev, st.st_ino) == self._vault
            ):
                continue
            done = self._done.get(entry.name)
            if done is not None and done.ino == st.st_ino:
                same = done.size == st.st_size and done.mtime_ns == st.st_mtime_ns
                looked = not stat.S_ISDIR(st.st_mode) or now - done.looked < look_every
                if same and looked:
                    continue  # unchanged since it was shipped (or looked into)
                done.looked = now
                if not self._changed_since_shipped(entry.path, done, st):
                    continue
            if stat.S_ISDIR(st.st_mode) and self._holds_only_state(entry.name, entry.path):
                continue
            self._start(entry.name, entry.path, st, now)

    def _holds_only_state(self, name: str, path: str) -> bool:
        """A folder holding nothing but another watch's state or backup_async's pins (a run's folder, its
        checkpoints rotated away) is no checkpoint: pinned, it held nothing a backup takes, and failed every
        run (wt47 F5). One holding files beside them (a checkpoint once watched by mistake) is one."""
        try:
            names = os.listdir(path)
        except OSError:
            return False  # pinned, or said unreadable, as before
        if not names or any(n not in STATE_FOLDERS for n in names):
            return False
        what = " and ".join(f"{n} ({STATE_FOLDERS[n]})" for n in sorted(names))
        self._warn_once(("state", name), f"{name} holds only {what}: no checkpoint; left out")
        return True

    def _changed_since_shipped(self, path: str, done: Done, st: os.stat_result) -> bool:
        """A shipped checkpoint whose own mtime moved, or a shipped folder looked into again: new or
        changed files make it a new version;
        files only disappearing is its deletion in progress (rotation), not a new version."""
        started = time.monotonic()
        try:
            sig = pins.signature(path, self._as_pinned)  # as Done.sig was taken
        except OSError:
            return False  # deleted, or unreadable for now: the next poll looks again
        finally:
            done.look_s = time.monotonic() - started
        done.size, done.mtime_ns = st.st_size, st.st_mtime_ns
        return not pins.is_subset(sig, done.sig)

    def _start(self, name: str, path: str, st: os.stat_result, now: float) -> None:
        try:
            sig = pins.signature(path, self._as_pinned)  # as a pin of it would be: so its digest was taken
            if self._shipped.loaded.is_set() and self._shipped_before(name, sig):
                self._done[name] = Done(st.st_ino, st.st_size, st.st_mtime_ns, sig)
                self._unpinned.pop(name, None)
                return  # shipped before (by an earlier run of the watcher)
            pin = pins.create(path, self.pins_dir, skip_dir=self._vault, excluded=self._excluded, meta=self._pin_meta)
        except FileNotFoundError as exc:
            if exc.strerror == pins.DELETED_WHILE_PINNED:  # seen whole, yet lost: said (else deleted before)
                self._on_warning(
                    f"{name} was deleted while it was being pinned: part of it was gone, so it is not shipped (a "
                    f"checkpoint must stay at least one {spelled('--interval', 'interval')} after it is written, "
                    "and pinning one of many files takes longer)"
                )
            return  # deleted between the look and the pin: it never was complete here
        except OSError as exc:  # EIO, EACCES, a full disk: create left nothing
            # the next poll tries again; the run's error unless that passes
            self._unpinned[name] = self._pin_error(path, exc)
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                self._warn_once(("pin", name), f"{name}: cannot pin: {exc}; trying again")
            elif self._shipped.readable():  # a shipped one is not read again
                cand = self._in_place.start(name, path, st, now, exc)
                if cand is not None:  # it ships in place
                    self._candidates[cand.pin.pin_id] = cand
                    self._unpinned.pop(name, None)
                    self._warned.discard(("pin", name))
            return
        self._warned.discard(("pin", name))
        self._unpinned.pop(name, None)
        if pin.source_ino != st.st_ino:  # replaced between the look and the pin: pin what is there now
            pin.release()
            return
        self._warn_if_copied(pin)
        self._candidates[pin.pin_id] = Candidate(pin=pin, seen=now, last_change=now, settled_noted=False)

    def _pin_error(self, path: str, exc: OSError) -> SourceError:
        """Why ``path`` could not be pinned, as the run's error (exit 3): a write into the pins folder that
        failed (not writable, full) is said as that, not as the checkpoint's read."""
        reason = exc.strerror or str(exc)
        written = next((f for f in (exc.filename, exc.filename2) if _lies_in(f, self.pins_dir)), None)
        if written is None:
            return SourceError(path, f"cannot pin it: {reason}")
        room = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        fix = f"free space on the disk of {self.pins_dir}" if room else f"make {self.pins_dir} writable for this user"
        elsewhere = f"give {spelled('--state-dir', 'state_dir')} a writable folder on the checkpoints' filesystem"
        return SourceError(path, f"writing {written} failed: {reason}", f"{fix}, or {elsewhere}", action="pin")

    def _pin_meta(self, _pin: pins.Pin) -> dict[str, object]:
        """What a restart must know of a pin: the tags it ships with, and whether it was seen to settle."""
        return {"tags": self.tags, "settled": False}

    def _warn_if_copied(self, pin: pins.Pin) -> None:
        if pin.copied:
            self._warn_once(
                ("copied", self.pins_dir),
                f"{pin.name}: hard links into {self.pins_dir} are impossible; checkpoints are pinned by copying "
                f"(it costs time and disk: give {spelled('--state-dir', 'state_dir')} on the checkpoints' filesystem)",
            )

    def _report_lost(self, cand: Candidate, step: int | None, reason: str, error: CheckpointLostError) -> None:
        self._lost.append(error)
        self._on_warning(str(error))
        self._on_lost(LostCheckpoint(cand.pin.name, cand.pin.source, step, reason, error))

    def _signature(self, pin: pins.Pin) -> pins.Signature:
        """A pin's files; in place, the source's files that a pin would hold (not those still being
        written), so that both give one digest for one checkpoint."""
        return pins.signature(pin.data, self._as_pinned if pin.in_place else self._excluded)

    def _verify_pinned(self, pin: pins.Pin, sig: pins.Signature) -> None:
        """Just before a backup commits (on the shipping thread): the pin's files as they were when it
        was queued. A hard link pins a file's inode, not its bytes: a trainer that rewrites a file in
        place (Lightning's ``last.ckpt`` when its temporary folder is on another filesystem) changes
        the pin too, and the snapshot would hold a torn file, or the next save, under this one's tags."""
        if not unchanged(self._signature, pin, sig):
            raise BackupSupersededError(  # no ``rewritten``: the watcher ships what was written, not the shipper
                f"{pin.name} was rewritten in place while it shipped (a pin holds its files, not their bytes): "
                "this backup is not stored; what was written ships once it settles"
            )

    def _adopt_pins(self) -> int:
        """Pins left by an earlier run: each was promised, so each is shipped (or found shipped), with the
        tags it was pinned under; not one of another folder's watch sharing the state folder. One that never
        settled whose source went while no watcher looked may hold part of a save: said so."""
        now = time.monotonic()
        before = len(self._candidates)
        unsettled_gone: list[str] = []  # pins never seen settled whose source went while no watcher ran
        for pin_id in sorted(os.listdir(self.pins_dir)):
            root = os.path.join(self.pins_dir, pin_id)
            if not os.path.isdir(root):
                continue
            held: list[str] = []
            with contextlib.suppress(OSError):
                held = os.listdir(os.path.join(root, pins.DATA))  # before load removes an unfinished pin
            loaded = pins.load(root)
            if loaded is None:
                for name in held:  # killed while pinning (its checkpoint never promised) or releasing it
                    self._on_warning(
                        f"an earlier watcher stopped while pinning or releasing {name}: its unfinished pin was "
                        f"removed; {name} ships from its folder if it is still there and has not shipped"
                    )
                continue
            pin, meta = loaded
            if self._state_shared and not self._watches(os.path.dirname(pin.source)):
                self._on_warning(
                    f"{self.pins_dir} holds a pin of {pin.source}, which a watch of another folder left: not "
                    "shipped by this one; ship it with: "
                    + spelled(
                        f"ckptvault watch {os.path.dirname(pin.source)} --once --state-dir {self.state_dir}",
                        f"vault.watch({os.path.dirname(pin.source)!r}, once=True, state_dir={self.state_dir!r})",
                    )
                    + " (with that watch's tags)"
                )
                continue
            pin.skip_dir = self._vault  # its next sync must leave out a vault nested in the checkpoint too
            pin.excluded = self._excluded  # and what this run's patterns leave out
            source = stat_if_same(pin)  # before the first look: a folder replaced while no watcher ran is a new one
            if meta.get("settled") is False and source is None and gone_or_replaced(pin):
                unsettled_gone.append(pin.name)  # the pin is the only copy left: shipped, but not as seen whole
            tags, settled = meta.get("tags"), meta.get("settled")
            pinned_under = tags if isinstance(tags, dict) and all(isinstance(v, str) for v in tags.values()) else None
            self._candidates[pin.pin_id] = Candidate(
                pin=pin,
                seen=now,
                last_change=now,
                tags=pinned_under,
                settled_noted=settled if isinstance(settled, bool) else None,
            )
            log.info("resuming pinned checkpoint %s from an earlier run", pin.name)
        if unsettled_gone:
            self._say_unsettled_gone(unsettled_gone)
        return len(self._candidates) - before

    def _say_unsettled_gone(self, names: list[str]) -> None:
        """One line for every adopted pin never seen settled whose source went while no watcher ran (a
        preempted trainer and watcher, the trainer's rotation at its restart): what is done with them, and
        what to do if one was a save written in place (each its own line was noise, sp54)."""
        many = len(names) > 1
        more = len(names) - MANY_NAMES
        shown = ", ".join(names[:MANY_NAMES]) + (f" and {more} more" if more > 0 else "")
        name = "NAME" if many else tag_text(names[0])
        self._on_warning(
            f"adopting {len(names)} checkpoint{'s' if many else ''} ({shown}) pinned by a watcher that stopped "
            f"before {'they' if many else 'it'} settled, deleted or replaced before this one started: "
            f"{'they ship' if many else 'it ships'} now as pinned then, which may be part of a save a trainer wrote "
            f"in place; if so, forget {'such a' if many else 'its'} snapshot ("
            + spelled(f"ckptvault snapshots --tag checkpoint={name}", f"vault.snapshots({{'checkpoint': {name!r}}})")
            + " names it) before a resume takes it"
        )

    def _watches(self, folder: str) -> bool:
        if folder == self.directory:
            return True
        try:
            return os.path.samefile(folder, self.directory)
        except OSError:
            return False

    # ---- settling and shipping ---------------------------------------------------------

    def _settle(self, now: float) -> None:
        shipping = self._shipping()
        for cand in list(self._candidates.values()):
            if cand.state == "queued":
                continue  # its backup reads the pin
            if shipping and self._resting(cand, now):
                self._note_settled(cand, True)  # settled since its last look
                continue
            if not self.options.once and time.monotonic() - self._scanned_at >= self.options.interval:
                self._scan(time.monotonic())  # pins of many files take long to look at: new names first
                if cand.pin.pin_id not in self._candidates:
                    continue  # dropped by that look (logs, a trainer's output folder found)
            started = time.monotonic()
            try:
                cand.source_stat = stat_if_same(cand.pin)
                if cand.source_stat is None and self._complete.deleted_unfinished(cand, now):
                    continue
                if cand.source_stat is not None or cand.pin.in_place:
                    cand.frozen = False
                elif cand.frozen:
                    continue  # its folder is gone or replaced: nothing can be added to the pin
                else:
                    cand.frozen = True  # one last look at the pin, below; again if its folder comes back
                    cand.gone = gone_or_replaced(cand.pin)  # not a stat that failed (EIO, an NFS hiccup)
                    if cand.gone and cand.behind:
                        self._lost_behind(cand)  # its pin never got all of it: shipped, it would be a torn save
                        continue
                if cand.pin.in_place:
                    if self._in_place.gone(cand):
                        continue
                    sig = self._signature(cand.pin)
                    if self._in_place.cut_down(cand, sig):  # before a pin of what is left
                        continue
                    pinned = self._in_place.pin_after_all(cand, now)
                    if pinned is not None:
                        del self._candidates[cand.pin.pin_id]
                        cand.pin, cand.settled_noted = pinned, False
                        self._candidates[pinned.pin_id] = cand
                if not cand.pin.in_place:  # pinned, maybe just now
                    try:
                        pins.sync(cand.pin)
                    except OSError as exc:
                        if self._fell_behind(cand, exc, now):
                            continue  # it ships in place from now on
                        raise
                    if cand.source_stat is not None:
                        cand.behind = ""  # the pin holds all its source does
                    self._warn_if_copied(cand.pin)
                    sig = self._signature(cand.pin)
                sig += temporary_activity(cand.pin)
            except FileNotFoundError:
                self._vanished(cand)
                continue
            except OSError as exc:
                self._warn_once(("pin", cand.pin.name), f"{cand.pin.name}: cannot pin: {exc}; trying again")
                continue
            self._warned.discard(("pin", cand.pin.name))
            first_look = not cand.looked
            cand.looked, cand.look_s = now, time.monotonic() - started
            self._complete.count_rewrites(cand, sig, now)
            if sig != cand.sig:
                # a failed one that changes settles again and ships its new content (it may have
                # failed for being incomplete: a folder made before its files were written)
                cand.sig, cand.last_change, cand.state = sig, now, "settling"
            if not first_look:  # an adopted pin's record stands until this run has seen it change or settle
                self._note_settled(cand, cand.settled(now, self.options.settle))

    def _fell_behind(self, cand: Candidate, exc: OSError, now: float) -> bool:
        """Its pin could not take in what its source holds now (``exc``: a full disk, a copy into a
        --state-dir that filled up, a permission): it must not settle, or it would ship without the files
        it lacks as the whole save. Where the disk is full and its source still holds every file the pin
        does, it ships in place, as one that could not be pinned at all (True: the candidate was replaced)."""
        cand.behind = exc.strerror or str(exc)
        cand.last_change = now  # not settled while its pin lags its source
        if cand.state == "failed":
            cand.state = "settling"  # a failed one is tried again once its pin holds all of it
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._shipped.readable():
            return False
        try:
            st = os.stat(cand.pin.source)
            held = file_paths(self._signature(cand.pin))
        except OSError:
            return False
        if st.st_ino != cand.pin.source_ino:
            return False
        # the source is read once, for the check and as what shipping in place starts from: a file deleted
        # between two reads was in neither, and the checkpoint shipped in place without it
        in_place = self._in_place.start(cand.pin.name, cand.pin.source, st, now, exc, tags=cand.tags, holding=held)
        if in_place is None:
            return False  # the pin holds files its source lost: it is kept, as the only copy of those
        self._release(cand)
        self._candidates[in_place.pin.pin_id] = in_place
        return True

    def _lost_behind(self, cand: Candidate) -> None:
        """Deleted by the trainer, or replaced by another save of the same name, while its pin lacked part of
        it: what the pin holds is not the save."""
        replaced = os.path.lexists(cand.pin.source)  # gone_or_replaced said it is not the one pinned
        what = "replaced by another save of the same name" if replaced else "deleted"
        error = CheckpointLostError(
            cand.pin.source,
            f"it was {what} before it shipped, while its pin lacked part of it ({cand.behind}), so it is not in "
            "the vault",
            f"free space on the disk of {self.pins_dir}, or give {spelled('--state-dir', 'state_dir')} on a disk "
            "with room, so that checkpoints are pinned whole",
        )
        self._report_lost(cand, step_of(cand), "replaced" if replaced else "deleted", error)
        self._release(cand)

    def _note_settled(self, cand: Candidate, settled: bool) -> None:
        """Keep the pin's record of whether it settled (read by ``_adopt_pins`` after a restart); a disk
        that refuses the write (full, read-only) leaves it for the next change: the sidecar goes on."""
        if cand.settled_noted is not None and cand.settled_noted != settled:
            try:
                pins.update_meta(cand.pin, settled=settled)
            except OSError:
                return
            cand.settled_noted = settled

    def _resting(self, cand: Candidate, now: float) -> bool:
        """A pinned checkpoint that settled and waits behind an upload is looked at only as often as a
        shipped folder (``LOOK_INSIDE_S``): the look before its own upload starts is a full one, as the
        upload in flight must end first."""
        return (
            cand.state == "settling"
            and cand.steady
            and not cand.pin.in_place
            and not self.options.once
            and cand.settled(now, self.options.settle)
            and now - cand.looked < max(LOOK_INSIDE_S, cand.look_s / LOOK_INSIDE_SHARE)
        )

    def _promote(self, shipper: AsyncShipper, now: float) -> None:
        """Start the next backup when none runs: the newest ready checkpoint's (by pin time, which
        follows the steps), one shipping in place first: nothing pins it against the trainer's rotation.
        The others wait, pinned and still looked at, for the upload to end. While watching goes on, every
        other upload that has a choice goes to the oldest instead: with uploads slower than saves, the
        newest first alone would leave older ones (and their disk space) waiting for as long as training
        runs when the newest is always a new save (``last.ckpt`` saved every epoch). Stopping (the grace)
        and --once go newest first only: what is left is for the save a resume needs. With --once each
        is tried once: one saved again in place during its upload is left for the next run."""
        if self._shipping() or not self._shipped.known():
            return
        due = [c for c in self._candidates.values() if self._due(c, now)]
        alternate = len(due) > 1 and not self.options.once and not self._stop.is_set()
        if alternate and self._oldest_turn:
            due.sort(key=lambda c: (not c.pin.in_place, c.pin.pin_id))
        else:
            due.sort(key=lambda c: (c.pin.in_place, c.pin.pin_id), reverse=True)
        for cand in due:
            sig = self._ready(cand, now)
            if sig is None:
                continue
            job = self._job_for(cand, sig)
            cand.state = "queued"
            self._note_settled(cand, True)  # as it ships: a restart ships it too, whatever happened to its source
            if self.options.once:
                self._submitted.add(cand.pin.pin_id)
            if alternate and not cand.pin.in_place:
                self._oldest_turn = not self._oldest_turn
            shipper.submit(job, on_full="block")
            return

    def _ready(self, cand: Candidate, now: float) -> pins.Signature | None:
        """The files of a checkpoint due to ship, as it ships them; None when it does not ship now: cut
        down in place, only logs, not complete, found shipped (then released), gone or unreadable."""
        try:
            sig = self._signature(cand.pin)  # a pin from a run with other patterns too
            if cand.pin.in_place and self._in_place.cut_down(cand, sig):  # since the last look
                return None
            if self._holds_only_logs(cand, sig) or self._complete.not_complete(cand, sig, now):
                return None
            cand.digest, cand.shipped_sig = self._digest(sig), sig
            if self._shipped_before(cand.pin.name, sig):
                self._finish_done(cand, sig)
                self._release(cand)
                return None
            cand.step = checkpoint_step(cand.pin.data)
        except FileNotFoundError:
            self._vanished(cand)
            return None
        except OSError as exc:  # EIO, EACCES: its state is unchanged, so the next poll tries again
            self._warn_once(("read", cand.pin.name), f"{cand.pin.name}: cannot read it: {exc}; trying again")
            return None
        self._warned.discard(("read", cand.pin.name))
        return sig

    def _job_for(self, cand: Candidate, sig: pins.Signature) -> BackupJob:
        """The backup of a checkpoint whose files are ``sig``: it commits only if they still are."""
        pinned_under = self.tags if cand.tags is None else cand.tags
        tags = {**pinned_under, "checkpoint": tag_text(cand.pin.name), WATCH_SIG_TAG: cand.digest}
        if cand.step is not None:
            tags["step"] = str(cand.step)
        job = BackupJob(
            sources=[cand.pin.data],
            tags=tags,
            description=f"ckptvault watch: {cand.pin.source}",
            exclude=self.options.exclude.patterns,
            label=cand.pin.name,
            # when it was pinned, not when it ships: a save retried after an outage, committed after a
            # newer save of the same name, must not become 'latest' of a name without a step
            taken_at=cand.pin.made_at,
            log_warnings=False,  # _collect says them, naming the checkpoint
        )
        if cand.pin.in_place:  # nothing holds its files: the backup leaves out what a pin would, and
            # commits only if every file is still as it was queued
            job.leave_unfinished = True
            job.verify = functools.partial(self._in_place.verify, cand.pin, sig)
        else:
            job.verify = functools.partial(self._verify_pinned, cand.pin, sig)
        job.future.add_done_callback(functools.partial(self._on_done, cand, job))
        return job

    def _vanished(self, cand: Candidate) -> None:
        """Its files went while it was read: shipping in place, it was deleted, and is lost; pinned, the pin
        itself was (deleted by hand)."""
        if cand.pin.in_place:
            self._in_place.lost(cand, "it was deleted")
        else:
            self._release(cand)

    def _holds_only_logs(self, cand: Candidate, sig: pins.Signature) -> bool:
        if not self._folder.holds_only_logs(cand.pin.name, cand.pin.source_ino, sig):
            return False
        self._release(cand)
        return True

    def _forget_others(self, keep: Keep) -> None:
        """The folder's kind was just found: what was pinned before that and is no checkpoint there goes."""
        for cand in list(self._candidates.values()):
            if cand.state == "settling" and not keep(cand.pin.name, cand.pin.data):
                self._release(cand)

    def _due(self, cand: Candidate, now: float) -> bool:
        """Whether a backup of it may start now: settled, or failed and its retry delay over."""
        if self.options.once and cand.pin.pin_id in self._submitted:
            return False
        if cand.behind:
            return False  # its pin lacks part of it: not the whole save
        if cand.state == "failed":
            return now >= cand.retry_at and not self.options.once
        return cand.state == "settling" and cand.settled(now, self.options.settle)

    def _warn_once(self, key: tuple[str, str], message: str) -> None:
        """A local error retried at every poll is reported once, until that stage succeeds."""
        if key not in self._warned:
            self._warned.add(key)
            self._on_warning(message)

    def _on_done(self, cand: Candidate, job: BackupJob, future: Future[Snapshot]) -> None:
        self._finished.put((cand, job))  # on the worker thread: hand over, touch nothing
        self._upload_ended.set()

    def _collect(self) -> None:
        """Handle finished backups on the polling thread (the only one that touches state)."""
        while True:
            try:
                cand, job = self._finished.get_nowait()
            except queue.Empty:
                return
            future = job.future
            if cand.pin.pin_id not in self._candidates:
                continue
            if future.cancelled():  # the watch stopping: its pin is kept for the next run
                cand.state = "failed"
                continue
            for warning in job.warnings:  # e.g. a file that changed while it was read
                self._on_warning(f"{cand.pin.name}: {warning}")
            outcome = future.exception()
            if isinstance(outcome, BackupSupersededError):  # rewritten in place while it shipped
                self._on_warning(str(outcome))
                cand.state, cand.last_change = "settling", time.monotonic()
            elif outcome is None:
                snapshot = future.result()
                self._shipped.add(cand.pin.name, cand.digest)
                # what was shipped, not the pin now: a file rewritten in place during the upload
                # changed the pin too (a hard link), and is a new version
                self._finish_done(cand, cand.shipped_sig)
                self._release(cand)
                shipped = ShippedCheckpoint(
                    name=cand.pin.name,
                    source=cand.pin.source,
                    step=cand.step,
                    snapshot=snapshot,
                    copied=cand.pin.copied,
                    waited_s=round(time.monotonic() - cand.seen, 3),
                    in_place=cand.pin.in_place,
                )
                self.result.shipped.append(shipped)
                self._on_shipped(shipped)
            else:
                cand.failures += 1
                cand.state = "failed"
                delay = self._retry_after[min(cand.failures, len(self._retry_after)) - 1]
                cand.retry_at = time.monotonic() + delay
                if isinstance(outcome, CkptVaultError):
                    cand.error = outcome
                # stopping: no retry comes after the grace (if any) ends
                grace_ends = self._grace_ends or time.monotonic() + self.options.grace  # 0: the grace not begun
                ending = self._stop.is_set() and time.monotonic() + delay >= grace_ends
                if not (self.options.once or ending):
                    when = f"retrying in {delay:.0f} s"
                else:
                    when = (
                        "it is tried again at the next run" if cand.pin.in_place else "it stays pinned for the next run"
                    )
                self._on_warning(f"{cand.pin.name}: backup failed: {outcome}; {when}")

    def _finish_done(self, cand: Candidate, sig: pins.Signature) -> None:
        """Remember what the source name held when its pin was last synced: whatever changes in it
        after that (a writer that went on writing) makes it count as a new version."""
        st = cand.source_stat
        if st is not None and pins.source_alive(cand.pin):
            self._done[cand.pin.name] = Done(st.st_ino, st.st_size, st.st_mtime_ns, sig)

    def _release(self, cand: Candidate) -> None:
        """Forget it and delete its pin: shipped, found shipped, or dropped unshipped (deleted before it was
        complete, logs, no checkpoint of this folder, lost)."""
        self._candidates.pop(cand.pin.pin_id, None)
        try:
            cand.pin.release()
        except OSError as exc:  # EACCES, a read-only remount: the watcher goes on; a restart finds it shipped
            self._on_warning(f"{cand.pin.name}: its pin {cand.pin.root} could not be removed: {exc}; delete it")
        with contextlib.suppress(OSError):  # a full disk: pins.create makes it again when it can
            os.makedirs(self.pins_dir, exist_ok=True)  # release removes an empty staging folder


def _lies_in(path: object, folder: str) -> bool:
    """Whether ``path`` (an OSError's filename: a str, bytes or None) is ``folder`` or lies in it."""
    return isinstance(path, str) and (path == folder or path.startswith(os.path.join(folder, "")))
