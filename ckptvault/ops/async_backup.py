"""Backups off the training thread: one worker thread owning a bounded queue.

``AsyncShipper.submit`` only queues a job and returns a ``BackupHandle`` (a thin view of a
``concurrent.futures.Future``); the worker runs the ordinary synchronous backup, one job at
a time (they share the uplink, and a Repository writes one backup at a time).

When the queue is full, the caller's ``on_full`` policy decides:

- ``"coalesce"`` (the default): the oldest *waiting* job is dropped for the new one; its
  handle fails with BackupSupersededError and a warning is logged. Training never waits, and
  the newest checkpoint, the one a resume needs, is always shipped. Used when uploads are
  slower than checkpointing, where blocking would stall the GPU for as long as the backlog.
- ``"block"``: the caller waits for a free slot, so every checkpoint ships, at the price of
  training time.

Failures are set on the handle, logged on the ``ckptvault`` logger, and raised again by the
next ``flush()``. A transient storage error (``StorageError.retryable``) is retried a few
times first. At interpreter exit the queue is flushed, for at most ``exit_timeout`` seconds
(Ctrl-C ends the wait: exit code 130); ``close()`` runs every queued job first, without a limit.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import math
import numbers
import os
import secrets
import shlex
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FuturesTimeoutError
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from ..errors import (
    BackupCancelledError,
    BackupSupersededError,
    BackupTimeoutError,
    CkptVaultError,
    FlushTimeoutError,
    SourceError,
    StorageError,
    UsageError,
    VaultLockedError,
    spelled,
)
from ..snapshot.model import Snapshot
from ..store.failures import unreachable
from ..store.retrying import OPEN_S
from ..units import format_bytes, format_duration, format_seconds
from . import pin as pins_module
from .leftover_pins import JobRecord, Leftover, give_up, pin_metadata, take_over
from .names import PIN_FOLDER, is_unfinished, source_name
from .pin import ROOM_FOR_A_SAVE, Pin
from .scan import NO_EXCLUDES, Excludes, check_sources, refuse_sources_in_vault, scan_sources, source_names

log = logging.getLogger("ckptvault")
retry_log = logging.getLogger("ckptvault.shipping")  # the CLI (watch) shows these as warnings
LOCK_PATIENCE_S = 3600.0  # how long a shipment waits for a prune holding the vault to finish
LOCK_RETRY_MAX_S = 30.0

OnFull = Literal["coalesce", "block"]
DEFAULT_MAX_PENDING = 2
DEFAULT_EXIT_TIMEOUT = 600.0
STARVED_AFTER = 3  # saves of one file in a row rewritten in place before they shipped: an ERROR says so
SHIPPING_NICENESS = 10  # how much lower than the training thread's the shipping threads' CPU priority is
ROOM_LOOK_S = 0.5  # how often the free room is looked at while pinned backups wait


@dataclass
class BackupJob:
    """What the worker backs up: ``sources`` are the paths read (a pin's, when pinned)."""

    sources: list[str]
    tags: dict[str, str]
    description: str = ""
    hostname: str | None = None
    skip_if_unchanged: bool = False
    exclude: tuple[str, ...] = ()  # patterns, checked by the caller (scan.Excludes)
    leave_unfinished: bool = False  # and names still being written (names.is_unfinished), as a pin does
    label: str = ""  # the paths as the caller gave them, for messages
    pins: list[Pin] = field(default_factory=list)
    pinned_as: list[pins_module.Signature] = field(default_factory=list)  # each pin's files when pinned
    expected: list[str] = field(default_factory=list)  # unpinned: the files the sources held when queued
    verify: Callable[[], None] | None = None  # raises, just before the commit, when the sources moved on
    warnings: list[str] = field(default_factory=list)
    log_warnings: bool = True  # False: only into ``warnings`` (watch says each itself, naming the checkpoint)
    leftover: bool = False  # a dead process's pins (leftover_jobs): run before newer jobs, never dropped
    on_full: OnFull = "coalesce"  # as submitted: "block" jobs are never dropped, not even to make room
    taken_at: datetime | None = None  # the snapshot's time, when not the backup's (watch: when pinned)
    future: Future[Snapshot] = field(default_factory=Future)
    cancelled_because: str = ""  # why it was cancelled before it started, for BackupCancelledError

    def describe(self) -> str:
        step = f" (step {self.tags['step']})" if "step" in self.tags else ""
        return f"{self.label}{step}"


class BackupHandle:
    """The result of ``Vault.backup_async``: ``done()``, ``result(timeout)``, ``exception(timeout)``;
    ``future`` for ``asyncio.wrap_future`` and ``concurrent.futures.wait``."""

    def __init__(
        self, job: BackupJob, cancel: Callable[[BackupJob], bool], refuse_wait: RefuseWait | None = None
    ) -> None:
        self._job = job
        self._cancel = cancel
        self._refuse_wait = refuse_wait
        self._pinned = bool(job.pins)  # the pins go when the backup ends; that it was pinned stays
        # The handle is no Future (its cancel releases a queue slot and pins; its errors are the library's):
        # tools that take only a real one get this copy, settled as result() would be. Already running, so
        # that its own cancel() does nothing: cancel the handle.
        self.future: Future[Snapshot] = Future()
        self.future.set_running_or_notify_cancel()
        job.future.add_done_callback(self._settle_future)

    def _settle_future(self, _done: Future[Snapshot]) -> None:
        error = self.exception(timeout=0)
        if error is None:
            self.future.set_result(self._job.future.result())
        else:
            self.future.set_exception(error)

    @property
    def paths(self) -> str:
        """The paths it backs up as the caller gave them, joined by ", " (for messages)."""
        return self._job.label

    @property
    def tags(self) -> dict[str, str]:
        return dict(self._job.tags)

    @property
    def pinned(self) -> bool:
        """True when the checkpoint was hard-linked at submit time, so deleting it is safe."""
        return self._pinned

    @property
    def warnings(self) -> list[str]:
        return list(self._job.warnings)

    def done(self) -> bool:
        return self._job.future.done()

    def running(self) -> bool:
        return self._job.future.running()

    def cancel(self) -> bool:
        """Drop the backup if it has not started (its queue slot and pins go at once); True when it
        was dropped."""
        return self._cancel(self._job)

    def cancelled(self) -> bool:
        return self._job.future.cancelled()

    def result(self, timeout: float | None = None) -> Snapshot:
        """The snapshot; raises the backup's error, BackupTimeoutError (a TimeoutError) when not done
        in time, or BackupCancelledError when it was cancelled before it started."""
        wait = self._wait_arg("result()", timeout)
        try:
            return self._job.future.result(wait)
        except FuturesTimeoutError:
            raise self._timeout_error(timeout) from None
        except CancelledError:
            raise self._cancelled_error() from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        wait = self._wait_arg("exception()", timeout)
        try:
            return self._job.future.exception(wait)
        except FuturesTimeoutError:
            raise self._timeout_error(timeout) from None
        except CancelledError:
            return self._cancelled_error()

    def _wait_arg(self, call: str, timeout: float | None) -> float | None:
        """``timeout`` checked; a wait for a backup not done yet is refused on the thread inside the Vault's
        backup that it waits for: a SIGTERM handler's ``backup_async(...).result()`` hung there until SIGKILL."""
        wait = _timeout_arg(timeout)
        if self._refuse_wait is not None and not self._job.future.done() and (wait is None or wait > 0):
            self._refuse_wait(f"{call} of a queued backup", WAIT_ADVICE)
        return wait

    def _cancelled_error(self) -> BackupCancelledError:
        why = self._job.cancelled_because or "cancel() was called"
        return BackupCancelledError(f"the backup of {self._job.describe()} was cancelled before it started: {why}")

    def _timeout_error(self, timeout: float | None) -> BackupTimeoutError:
        state = "running" if self._job.future.running() else "queued"
        return BackupTimeoutError(
            f"the backup of {self._job.describe()} is still {state} after {timeout:g} s; "
            "wait longer (result(timeout=...)) or check done() later"
        )

    def add_done_callback(self, fn: Callable[[BackupHandle], object]) -> None:
        """``fn(handle)`` runs when the backup ends: on the worker thread, at its lower CPU
        priority (threads it starts keep that), or at once on the caller's if already done."""
        if not callable(fn):  # it would fail later, on the worker thread
            raise UsageError(f"add_done_callback takes a function of the handle; got {type(fn).__name__}")
        self._job.future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        future = self._job.future
        state = "done" if future.done() else "running" if future.running() else "queued"
        return f"<BackupHandle {self._job.describe()} {state}>"


class _StoppedWaiting(Exception):
    """A close that cancels (SIGTERM to a sidecar, Ctrl-C while it waits) ended a job's wait to try again
    (for a prune's lock, or the storage): the job fails with ``cause``, its pins kept for the next run."""

    def __init__(self, cause: CkptVaultError) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _lock_wait_ended(exc: VaultLockedError, how: str) -> VaultLockedError:
    """``exc`` ("vault X is locked: <holder>; <advice for a command>") as a job waiting by itself ends it:
    the holder, then ``how`` it ended, instead of the advice for a command."""
    ended = VaultLockedError(f"{str(exc).split('; ', 1)[0]}; {how}")
    ended.held_since = exc.held_since
    return ended


def _pins_folders(jobs: list[BackupJob]) -> list[str]:
    return sorted({os.path.dirname(p.root) for j in jobs for p in j.pins})


def _timeout_arg(timeout: float | None) -> float | None:
    """A wait in seconds for a Future: None (or infinity) waits for the end; NaN, a negative or another
    kind is refused (a Future would return at once, or raise a TypeError or an OverflowError)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not float(timeout) >= 0:
        raise UsageError(f"timeout must be a number of seconds from 0, or None to wait for the end; got {timeout!r}")
    return None if math.isinf(timeout) else min(float(timeout), threading.TIMEOUT_MAX)


# ``AsyncShipper``'s ``refuse_wait``: called with the call's name and what to do instead before a wait that
# only the worker can end; raises UsageError on a thread the worker waits for in turn (``Vault._writing``).
RefuseWait = Callable[[str, str], None]


def _never_refused(_call: str, _advice: str) -> None:
    """The ``refuse_wait`` of a queue made without one (a watch's): no wait is refused."""


WAIT_ADVICE = "raise SystemExit there (sys.exit(143)): the exit waits for what is queued (exit_timeout)"

# The call (backup_async, ship_leftover_pins) this thread is inside, if any: see ``queueing``.
_queueing = threading.local()


@contextlib.contextmanager
def queueing(call: str) -> Iterator[None]:
    """Refuse ``call`` on a thread already inside one that queues backups. A signal handler (a SIGTERM
    handler shipping the save just written) runs on the main thread between two bytecodes of whatever it
    interrupted, and a ``backup_async`` there may hold a pins folder's flock (which a second descriptor of
    the same process waits for) or the queue's room mutex: the handler's own ``backup_async`` waited for
    them forever, and the process hung until SIGKILL. Per thread, not per Vault: the flock is the folder's."""
    outer = getattr(_queueing, "call", None)
    if outer is not None:
        raise UsageError(
            f"{call} was called on a thread already inside {outer} (from a signal handler), which it would wait "
            "for forever; set a flag in the handler and call it from the training loop, or raise SystemExit there "
            "(sys.exit(143)): the exit ships what is already queued"
        )
    try:
        _queueing.call = call
        yield
    finally:
        _queueing.call = None


def check_on_full(on_full: str) -> None:
    if on_full not in ("coalesce", "block"):
        raise UsageError(f"on_full={on_full!r}: use 'coalesce' or 'block'")


def check_sources_unchanged(job: BackupJob) -> None:
    """Raise SourceError when an unpinned job's file is gone, BackupSupersededError when a pinned
    file changed after it was pinned. A hard link pins an inode, not its bytes: a trainer that
    rewrites a file in place (Lightning's ``last.ckpt`` when its temporary folder is on another
    filesystem: the move becomes a copy into the old file) changes the pin too, and the snapshot
    would hold a later save under this save's tags, or a torn file."""
    if job.verify is not None:
        job.verify()
    gone = [path for path in job.expected if not os.path.lexists(path)]
    if gone:
        raise SourceError(
            job.label,
            f"{len(gone)} of its {len(job.expected)} file(s) were deleted before it shipped (e.g. {gone[0]}), so "
            "it was not stored",
            "an unpinned checkpoint must stay until its handle is done",
        )
    for pin, pinned_as in zip(job.pins, job.pinned_as, strict=True):
        try:
            now = pins_module.signature(pin.data)
        except OSError:
            now = None
        if now != pinned_as:
            raise BackupSupersededError(
                f"{pin.source} was rewritten in place by a later save before it shipped; that save ships "
                "its content, this one is not stored",
                rewritten=(pin.source,),
            )


def staging_folder(source: str) -> str:
    """Where ``source``'s pins go: beside it, so on its filesystem."""
    return os.path.join(os.path.dirname(os.path.abspath(source).rstrip(os.sep)), PIN_FOLDER)


def make_job(
    paths: list[str],
    *,
    vault_id: str,
    tags: dict[str, str],
    description: str,
    hostname: str | None,
    pin: bool,
    skip_if_unchanged: bool = False,
    exclude: Excludes = NO_EXCLUDES,
    vault_folder: str | None = None,
) -> BackupJob:
    """Check the sources and pin them, on the caller's thread: after this returns, the trainer
    may delete or rewrite-by-rename the checkpoint. Pins are hard links in a ``.ckptvault-pins``
    folder beside each source (the same filesystem); where that is impossible the sources are
    backed up in place, with a warning, because a copy would hold up the training loop. Each
    pin's metadata records the job, so that a later process can ship it if this one dies first
    (leftover_pins.py). ``vault_folder``: the vault's local folder, refused as a source and left
    out of the pins (scan.refuse_sources_in_vault); what ``exclude`` leaves out is not pinned."""
    sources = check_sources(paths)
    source_names(sources)  # refused now, as backup() refuses it, not on the worker after the caller moved on
    vault = refuse_sources_in_vault(sources, vault_folder)
    job = BackupJob(
        sources=sources,
        tags=dict(tags),
        description=description,
        hostname=hostname,
        skip_if_unchanged=skip_if_unchanged,
        exclude=exclude.patterns,
    )
    job.label = ", ".join(paths)
    if not pin:
        return _expecting_its_files(job, exclude)
    # the snapshot's paths are the pins': the description says what was saved, as watch's does
    description = description or f"ckptvault backup_async: {', '.join(sources)}"
    job_id = secrets.token_hex(8)
    folders = [staging_folder(src) for src in sources]
    pins: list[Pin] = []
    pinned_as: list[pins_module.Signature] = []

    def metadata(made: Pin) -> dict[str, object]:
        made.hold_owner_lock()  # before the metadata names this process: leftover_pins.py
        pinned_as.append(pins_module.signature(made.data))
        digest = pins_module.digest(pinned_as[-1])
        record = JobRecord(job_id, vault_id, job.tags, description, hostname, folders, digest, list(exclude.patterns))
        return pin_metadata(record)

    try:
        for src, staging in zip(sources, folders, strict=True):
            excluded = _pin_excludes(exclude, src, whole_root=len(sources) == 1)
            made = pins_module.create(src, staging, link_only=True, meta=metadata, skip_dir=vault, excluded=excluded)
            pins.append(made)
    except OSError as exc:
        for made in pins:
            made.release()
        log.warning(
            "cannot pin %s with hard links (%s); it is read in place when its turn comes: "
            "do not delete it before the handle is done",
            job.label,
            exc.strerror or exc,
        )
        return _expecting_its_files(job, exclude)
    if not any(any(pins_module.files_of(sig)) for sig in pinned_as):
        for made in pins:  # an empty folder, only links, or only files still being written (*.tmp)
            made.release()
        if exclude:  # or every file left out
            scan_sources(sources, skip_unreadable=True, exclude=exclude)  # raises the backup's own error
        raise SourceError(job.label, "it holds no finished files", "check the path; nothing was queued")
    job.pins = pins
    job.sources = [p.data for p in pins]
    job.pinned_as = pinned_as
    job.description = description
    return job


def _expecting_its_files(job: BackupJob, exclude: Excludes) -> BackupJob:
    """An unpinned job notes the files its sources hold now: one deleted before the backup commits
    (a rotation that did not wait for the handle) fails it, rather than a snapshot tagged as this save
    holding part of it."""
    for src in job.sources:
        excluded = _pin_excludes(exclude, src, whole_root=len(job.sources) == 1)
        with contextlib.suppress(OSError):  # gone already: the backup's own scan says so
            for rel, _, _ in pins_module.files_of(pins_module.signature(src, excluded)):
                # a name still being written (*.tmp) is renamed when done: only finished files must stay
                if not is_unfinished(os.path.basename(rel)):
                    job.expected.append(os.path.join(src, rel) if rel else src)
    return job


def _pin_excludes(exclude: Excludes, source: str, *, whole_root: bool) -> pins_module.Excluded | None:
    """What of ``source`` the backup leaves out, by path inside it ("" for the source itself): its
    snapshot paths start with its name unless it is the one folder backed up (scan_sources)."""
    if not exclude:
        return None
    if whole_root and os.path.isdir(source):
        return exclude.match
    name = source_name(source)
    if exclude.match(name, os.path.isdir(source)):
        return lambda _rel, _is_dir: True  # the whole source is left out
    return lambda rel, is_dir: exclude.match(f"{name}/{rel}" if rel else name, is_dir)


def leftover_jobs(staging: list[str], vault_id: str) -> list[BackupJob]:
    """Jobs for the pins that dead processes left in the ``staging`` folders (and in the other
    folders their jobs pinned into), oldest first: one per job they were made for, which
    the queue runs before newer jobs and never drops. A job is shipped only whole and unchanged:
    one with a pin missing (its process died while pinning) or changed since it was made (a file
    rewritten in place) no longer holds its checkpoint, and its pins are released, with a warning.
    Never raises for the filesystem (the caller is the training loop): what cannot be taken over
    is named in a warning and left for a later try."""
    found: dict[str, list[Leftover]] = {}
    for left in take_over(staging, vault_id, log.warning):
        found.setdefault(left.job.job_id, []).append(left)
    jobs = []
    for lefts in found.values():
        job = _leftover_job(lefts)
        if job is not None:
            # not "(a close cut short)" alone: a cut-short ship_leftover_pins and a stopped retry give pins up too
            when = next((left.given_up_here for left in lefts if left.given_up_here), "")
            by = f"by this process, which gave it up {when}" if when else "by a process that ended before it shipped"
            log.warning(
                "shipping %s, left pinned in %s %s",
                job.describe(),
                ", ".join(dict.fromkeys(os.path.dirname(p.root) for p in job.pins)),
                by,
            )
            jobs.append(job)
    return jobs


def ship_leftovers(
    shipper: AsyncShipper, jobs: list[BackupJob], folder: str, pins: str, timeout: float | None
) -> list[Snapshot]:
    """Ship ``jobs`` (what dead processes left pinned in ``pins``, the pins folder of ``folder``) and wait
    for them. A wait cut short, at ``timeout`` (FlushTimeoutError) or by Ctrl-C or SIGTERM, ships no more
    of them: those not started stay pinned for a later run, and only the one under way goes on. Else the
    caller, gone on without them (`ship-pins` to its exit, which waited for them all, a resume to its
    restore), would have them land behind its back, as `latest` over the resumed run's own saves."""
    handles = [shipper.submit(job) for job in jobs]
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        return [h.result(None if deadline is None else max(0.0, deadline - time.monotonic())) for h in handles]
    except BackupTimeoutError:
        assert timeout is not None  # only a bounded wait runs out
        within = f"within {format_seconds(timeout)} s ({spelled('--timeout', 'timeout')})"
        raise FlushTimeoutError(_stop_shipping(shipper, jobs, folder, pins, within, interrupted=False)) from None
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (Terminated): the caller says that it stopped
        if said := _stop_shipping(shipper, jobs, folder, pins, "when the wait was interrupted", interrupted=True):
            retry_log.warning("%s", said)
        raise


def _stop_shipping(
    shipper: AsyncShipper, jobs: list[BackupJob], folder: str, pins: str, why: str, *, interrupted: bool
) -> str:
    """Withdraw the ``jobs`` not started; what is left and what becomes of it ("" when nothing is)."""
    withdrawn = shipper.withdraw(jobs, f"the wait for it ended {why}")
    under_way = [job for job in jobs if job.future.running()]
    if not (withdrawn or under_way):
        return ""
    left = len(withdrawn) + len(under_way)
    said = [f"{left} of the {len(jobs)} checkpoint(s) left pinned in {pins} were not shipped {why}"]
    if under_way:
        again = " (a second Ctrl-C or SIGTERM leaves it pinned too)" if interrupted else ""
        ends = spelled("is finished before the command ends", "goes on shipping (close() waits for it)")
        said.append(f"the one under way, {under_way[0].describe()}, {ends}{again}")
    if withdrawn:
        ship = spelled(
            f"run ckptvault ship-pins {shlex.quote(folder)} again", f"call ship_leftover_pins({folder!r}) again"
        )
        if len(withdrawn) == 1:
            stays, them = ("the other one stays" if under_way else "it stays"), "it"
        else:
            stays, them = (f"the other {len(withdrawn)} stay" if under_way else "they stay"), "them"
        said.append(f"{stays} pinned: {ship} to ship {them}")
    return "; ".join(said)


def _leftover_job(lefts: list[Leftover]) -> BackupJob | None:
    record = lefts[0].job
    label = ", ".join(left.pin.source for left in lefts)
    signatures = []
    for left in lefts:
        try:
            signatures.append(pins_module.signature(left.pin.data))
        except OSError:
            signatures.append(())
    if len(lefts) != len(record.folders) or any(
        pins_module.digest(sig) != left.job.pinned for sig, left in zip(signatures, lefts, strict=True)
    ):
        what = "lost part of its pins" if len(lefts) != len(record.folders) else "was changed since it was pinned"
        log.warning("%s, left by a process that ended before it shipped, %s; not shipped", label, what)
        for left in lefts:
            left.pin.release()
        return None
    return BackupJob(
        sources=[left.pin.data for left in lefts],
        tags=dict(record.tags),
        description=record.description,
        hostname=record.hostname or lefts[0].owner_host or None,
        skip_if_unchanged=True,  # it may have been committed just before its process died
        exclude=tuple(record.exclude),
        label=label,
        pins=[left.pin for left in lefts],
        pinned_as=signatures,
        leftover=True,
    )


def _held_by_deleted(job: BackupJob) -> int:
    """What dropping a waiting job frees for the trainer: what its pins hold of checkpoints the trainer
    deleted; 0 for one submitted with "block" (never dropped) or whose sources are still there."""
    if job.on_full != "coalesce" or any(pins_module.source_alive(p) for p in job.pins):
        return 0  # its pins free nothing
    return sum(pins_module.bytes_held(p) for p in job.pins)


def lower_this_threads_priority(by: int) -> None:
    """Raise the calling thread's nice value by ``by`` (Linux: nice is per thread, and a thread
    inherits its creator's). The trainer keeps the CPU it needs when both want it; shipping runs
    on whatever is left. Nowhere else does a process have per-thread nice values: nothing changes."""
    if by <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))


_LIVE: weakref.WeakSet[AsyncShipper] = weakref.WeakSet()
_exit_hook_lock = threading.Lock()
_exit_hook_registered = False


def _flush_all_at_exit() -> None:
    # A forked child (a DataLoader worker, a multiprocessing.Pool process) runs this hook at its exit
    # too, with a copy of the parent's queues but none of its worker threads: the parent ships them,
    # and a child that waited for them would stall its parent's join until the exit timeout.
    shippers = [shipper for shipper in _LIVE if shipper.pid == os.getpid()]
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Lightning ignores SIGINT once it has handled a Ctrl-C; the wait must stay interruptible
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # One deadline for all: each vault's exit_timeout runs from the start of the exit, not from the end of the
    # previous vault's wait (their workers ship side by side meanwhile). Waited for one after another, three
    # vaults held a process 3 x exit_timeout, past the grace period it was set to fit, and a SIGKILL then
    # cut the ERROR line naming what was not shipped.
    started = time.monotonic()
    try:
        for shipper in shippers:
            shipper.flush_at_exit(started)
    except KeyboardInterrupt:  # Ctrl-C during the wait: the user gives up on the uploads
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second one must not cut the report short
        for shipper in shippers:
            shipper.report_unshipped("on Ctrl-C")
        _exit_interrupted()


def _exit_interrupted() -> None:
    """End the process with 130, as after Ctrl-C. An exception raised in this exit hook would only
    be printed ("Exception ignored ...") and the exit code would stay 0, so the process ends here:
    the ``atexit`` handlers run first (logging's flush, the program's cleanup), as they would on
    a normal exit, then the standard streams are flushed."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed or missing stream
                stream.flush()
        os._exit(130)


def _register_exit_hook() -> None:
    """Flush before the interpreter tears threads down. ``threading._register_atexit`` hooks run
    before concurrent.futures refuses new work (its own hook, registered earlier, runs after
    ours), so a backup still running at exit can use its thread pools; plain ``atexit`` would
    run too late for that."""
    global _exit_hook_registered
    with _exit_hook_lock:
        if _exit_hook_registered:
            return
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(_flush_all_at_exit)
        else:  # pragma: no cover - every supported Python has it
            atexit.register(_flush_all_at_exit)
        _exit_hook_registered = True


class AsyncShipper:
    """A queue of backup jobs and the worker thread that runs them, oldest first."""

    def __init__(
        self,
        run: Callable[[BackupJob], Snapshot],
        *,
        max_pending: int | None = DEFAULT_MAX_PENDING,
        exit_timeout: float | None = DEFAULT_EXIT_TIMEOUT,
        retries: int = 2,
        retry_delay: float = 2.0,
        name: str = "ckptvault-async",
        log_failures: bool = True,  # False: the caller reports each job's failure itself (watch)
        refuse_wait: RefuseWait | None = None,  # the Vault's: no wait for the worker inside its backup
        retry_lock: float = 0.0,  # the Vault's: a job waits for another process's lock this long when over an hour
    ) -> None:
        if max_pending is not None and max_pending < 1:
            raise UsageError(f"max_pending {max_pending} must be at least 1")
        self._run = run
        self.max_pending = max_pending
        self.exit_timeout = exit_timeout
        self._retries = retries
        self._retry_delay = retry_delay
        self._name = name
        self._log_failures = log_failures
        self._refuse_wait: RefuseWait = refuse_wait or _never_refused
        self._retry_lock = retry_lock
        self._cond = threading.Condition()
        self._pending: deque[BackupJob] = deque()
        self._running: BackupJob | None = None
        self._failures: list[BaseException] = []  # since the last flush
        self._rewrites: dict[str, int] = {}  # source -> saves of it rewritten in place in a row, none shipped
        self._starving_told: set[str] = set()  # sources the ERROR named since their last save shipped
        self._leftovers: dict[tuple[object, ...], BackupJob] = {}  # a dead process's jobs, by what they ship
        self._flushing = 0  # flush() and close() calls waiting: the saves have stopped for now
        # source -> a job superseded by an in-place rewrite when no later backup of it was queued yet: the
        # save that rewrote it is usually queued once written; what is still here at a flush is lost
        self._orphans: dict[str, tuple[BackupJob, BackupSupersededError]] = {}
        self._low_room_told = False  # the disk has too little room for the trainer's next save: said once
        self._room: tuple[str, int] | None = None  # the newest pinned checkpoint's staging folder and size
        self._room_keeper: threading.Thread | None = None
        self._room_mutex = threading.Lock()  # one _make_room at a time: the caller's thread and the keeper's
        self._closed = False
        self._stopping = threading.Event()  # close(cancel_pending=True) or abandon: stop waiting on locks
        self._thread: threading.Thread | None = None
        self.pid = os.getpid()  # the process whose worker thread ships the queue
        _register_exit_hook()
        _LIVE.add(self)

    # ---- the caller's side -------------------------------------------------------------

    def submit(self, job: BackupJob, *, on_full: OnFull = "coalesce") -> BackupHandle:
        """Queue ``job``; a job refused (bad ``on_full``, closed queue) has its pins released, but
        for a leftover's: they may hold the only copy of a save, for a later process to ship."""
        job.on_full = on_full
        if (twin := self._leftover_twin(job)) is not None:
            log.debug("backup of %s: a dead process's pins of the same files ship it", job.describe())
            self._release(job)
            return BackupHandle(twin, self._cancel, self._refuse_handle_wait)
        try:
            dropped = self._enqueue(job, on_full)
        except BaseException:
            with self._cond:
                queued = any(j is job for j in self._pending)
            if not queued and not job.leftover:
                self._release(job)
            raise
        if dropped is not None:
            self._supersede(
                dropped,
                f"backup of {dropped.describe()} was dropped for the newer {job.describe()}: "
                f"{self.max_pending} backups were already waiting (on_full='coalesce')",
            )
        if job.pins and not job.leftover:
            size = sum(pins_module.bytes_of(sig) for sig in job.pinned_as)
            with self._cond:
                self._room = (os.path.dirname(job.pins[0].root), size)
                if self._room_keeper is None:
                    self._room_keeper = threading.Thread(target=self._keep_room, name=f"{self._name}-room", daemon=True)
                    self._room_keeper.start()
            self._make_room()
        return BackupHandle(job, self._cancel, self._refuse_handle_wait)

    def _leftover_twin(self, job: BackupJob) -> BackupJob | None:
        """A dead process's job (``leftover_jobs``) that ships what ``job`` would: the same files, unchanged
        since they were pinned, under the same tags. A resumed run offers again the saves its framework
        remembers (Lightning's ModelCheckpoint): queued twice, the second was dropped for a newer save,
        and the log said a save that shipped was lost. None when there is none, or it failed."""
        if not job.pins:
            return None
        key = (
            tuple(pin.source for pin in job.pins),
            tuple(sorted(job.tags.items())),
            tuple(pins_module.digest(sig) for sig in job.pinned_as),
        )
        with self._cond:
            if job.leftover:
                self._leftovers[key] = job
                return None
            twin = self._leftovers.get(key)
        failed = twin is not None and twin.future.done() and (twin.future.cancelled() or twin.future.exception())
        return None if failed else twin

    def _keep_room(self) -> None:
        """Looks at the room left while pinned backups wait: the trainer's rotation, right after a
        ``backup_async`` returns, deletes the checkpoint before, whose pin then keeps its bytes."""
        while not self._stopping.wait(ROOM_LOOK_S):
            with self._cond:
                if not any(j.pins for j in self._waiting()):
                    self._room_keeper = None  # the next pinned submit starts another
                    return
            self._make_room()
        with self._cond:
            self._room_keeper = None

    def _make_room(self) -> None:
        """A pin keeps the files the trainer's rotation deleted until it ships, so with uploads slower
        than saves the waiting pins take the room the trainer's next save needs, and that save fails,
        ending training. When the checkpoints' disk has less free room than the newest checkpoint takes
        (x ``ROOM_FOR_A_SAVE``), waiting jobs whose checkpoints the trainer already deleted are dropped,
        oldest first, until it has (what their pins held counts as freed at once: some filesystems free
        space late), as "coalesce" drops one for a newer save: never the running one, the newest waiting
        one, one submitted with "block", nor a dead process's (leftover). What is still short is said
        once (again once the disk had twice the room: a rotation frees room for a moment at each save).
        Not once the queue is closed: no save follows. One call at a time: the caller's thread and the
        keeper's."""
        with self._room_mutex:
            with self._cond:
                if self._room is None or self._closed:
                    return
                folder, size = self._room
                waiting = [j for j in self._waiting() if j.pins]
            free = pins_module.free_bytes(folder)
            if free is None:
                return
            if free >= ROOM_FOR_A_SAVE * size:
                if free >= 2 * ROOM_FOR_A_SAVE * size:  # not at each rotation's brief room: said once while tight
                    self._low_room_told = False
                return
            drop = functools.partial(self._drop_for_room, folder)
            free = pins_module.make_room(free, ROOM_FOR_A_SAVE * size, waiting[:-1], _held_by_deleted, drop)
            if free < ROOM_FOR_A_SAVE * size and not self._low_room_told:
                self._low_room_told = True
                log.warning(
                    "the disk of %s has %s free, less than %g times the newest checkpoint (%s), and the pins of "
                    "queued backups keep what the trainer deletes until they ship: its next save may fail for want "
                    "of room; keep fewer checkpoints, save less often, lower max_pending, or raise the upload rate",
                    folder,
                    format_bytes(free),
                    ROOM_FOR_A_SAVE,
                    format_bytes(size),
                )

    def _drop_for_room(self, folder: str, old: BackupJob, free: int, held: int) -> bool:
        """Take ``old`` out of the queue to leave the trainer room (``pins.make_room``), and say so;
        False when it started meanwhile."""
        with self._cond:
            if old not in self._waiting():
                return False  # started meanwhile
            self._pending.remove(old)
            self._cond.notify_all()
        self._supersede(
            old,
            f"backup of {old.describe()} was dropped to leave the trainer room for its next save: the disk "
            f"of {folder} had {format_bytes(free)} free and its pins kept {format_bytes(held)} of deleted "
            "checkpoints; uploads are slower than saves (newer checkpoints still ship)",
        )
        return True

    def _cancel(self, job: BackupJob) -> bool:
        with self._cond:  # the worker takes a job and marks it running under this lock
            if not job.future.cancel():
                return False
            if job in self._pending:
                self._pending.remove(job)
            self._cond.notify_all()  # a submit blocked on a full queue may go on
        self._release(job)
        return True

    def _enqueue(self, job: BackupJob, on_full: OnFull) -> BackupJob | None:
        """Queue ``job``; returns the waiting job it replaced under "coalesce", if any."""
        check_on_full(on_full)
        dropped: BackupJob | None = None
        with self._cond:
            if self._closed:
                raise UsageError("this vault no longer takes backups: it was closed")
            for pin in job.pins:  # the save that rewrote an earlier one's pin in place: it ships that content
                self._orphans.pop(pin.source, None)
            if job.leftover:  # older than every job queued since it was pinned: after the other leftovers
                first_new = next((i for i, j in enumerate(self._pending) if not j.leftover), len(self._pending))
                self._pending.insert(first_new, job)
                self._ensure_worker()
                self._cond.notify_all()
                return None
            if self._full():
                # "block" jobs are never dropped: with only those waiting, a "coalesce" call waits as they did
                droppable = [j for j in self._waiting() if j.on_full == "coalesce"] if on_full == "coalesce" else []
                if droppable:
                    dropped = droppable[0]
                    self._pending.remove(dropped)
                else:
                    self._refuse_wait(
                        f"backup_async(on_full={on_full!r}) on a full queue",
                        "set a flag in the handler and queue it from the training loop, or raise SystemExit there "
                        "(sys.exit(143)): the exit ships what is already queued",
                    )
                    self._cond.wait_for(lambda: self._closed or not self._full())
                    if self._closed:
                        raise UsageError("this vault no longer takes backups: it was closed")
            self._pending.append(job)
            self._ensure_worker()
            self._cond.notify_all()
        return dropped

    def _full(self) -> bool:
        """``max_pending`` jobs wait behind the running one (leftovers are not counted)."""
        return self.max_pending is not None and len(self._waiting()) >= self.max_pending

    def _waiting(self) -> list[BackupJob]:
        """The jobs that wait, oldest first, but for leftovers and a job the worker has not
        picked up yet while nothing runs (it is about to run)."""
        about_to_run = self._pending[0] if self._running is None and self._pending else None
        return [j for j in self._pending if j is not about_to_run and not j.leftover]

    def _supersede(self, old: BackupJob, message: str) -> None:
        """Fail a job taken out of the queue; one its caller cancelled meanwhile was released by ``_cancel``."""
        if old.future.set_running_or_notify_cancel():
            log.warning(message)
            old.future.set_exception(BackupSupersededError(message))
            self._release(old)

    def pending(self) -> int:
        """Jobs waiting or running."""
        with self._cond:
            return len(self._pending) + (self._running is not None)

    def on_worker_thread(self) -> bool:
        """Whether the caller is this queue's worker (a backup's done-callback), which cannot wait for it."""
        return threading.current_thread() is self._thread

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued backup has ended. Raises FlushTimeoutError when some are still
        unfinished after ``timeout`` seconds, else the first error of the backups that failed
        since the previous flush (each failure is also on its handle and was logged)."""
        if self.on_worker_thread():
            raise UsageError("flush() cannot be called from a backup's done-callback")
        if self.pending():  # the queued backups wait for the backup this thread is inside: so would the flush
            self._refuse_wait("flush()", WAIT_ADVICE)
        timeout = _timeout_arg(timeout)
        with self._cond:
            self._flushing += 1
            try:
                idle = self._cond.wait_for(lambda: not self._pending and self._running is None, timeout)
            finally:
                self._flushing -= 1
            if not idle:
                left = len(self._pending) + (self._running is not None)
                raise FlushTimeoutError(f"{left} queued backup(s) still unfinished after {timeout:g} s")
            self._fail_orphans()
            failures, self._failures = self._failures, []
        if failures:
            if len(failures) > 1:
                log.error("%d queued backups failed since the last flush; raising the first", len(failures))
            raise failures[0]

    def _refuse_handle_wait(self, call: str, advice: str) -> None:
        """A handle's wait for a backup not done yet, refused where it would never end: on this queue's worker (a
        done-callback, which would run that backup once it returned) as inside the Vault's own backup."""
        if self.on_worker_thread():
            raise UsageError(
                f"{call} was called from a backup's done-callback or callback, on the worker thread that would run "
                "that backup; keep the handle and wait for it from your own code"
            )
        self._refuse_wait(call, advice)

    def wait_for_queued(self) -> None:
        """Wait until the backups queued now have ended (not those queued meanwhile: a trainer saving faster
        than it ships would keep the queue busy), keeping their failures for the next ``flush``: what an
        exclusive lock of this process waits for (its own backups' shared locks are never waited out)."""
        with self._cond:
            queued = [*self._pending, *([self._running] if self._running is not None else [])]
        futures.wait([job.future for job in queued])

    def close(self, *, cancel_pending: bool = False, timeout: float | None = None) -> list[BackupJob]:
        """Stop taking jobs. With ``cancel_pending``, jobs not started are cancelled (and returned,
        their pins kept for the caller); the running one finishes, unless it is waiting to try again
        (for a prune's lock, or the storage), which it then gives up (failing, its pins kept). Else the worker runs
        every queued job before it stops. Waits at most ``timeout`` seconds for the worker (None:
        as long as the jobs take)."""
        with self._cond:
            self._closed = True
            cancelled: list[BackupJob] = []
            if cancel_pending:
                self._stopping.set()  # a running job waiting to try again stops waiting
                while self._pending:
                    job = self._pending.popleft()
                    job.future.cancel()
                    cancelled.append(job)
            self._cond.notify_all()
            thread = self._thread
            self._flushing += 1  # as a flush: the saves have stopped
        try:
            if thread is not None:
                thread.join(timeout)
        finally:
            with self._cond:
                self._flushing -= 1
        with self._cond:
            self._fail_orphans()
        _LIVE.discard(self)
        return cancelled

    def _fail_orphans(self) -> None:
        """Saves rewritten in place before they shipped, with no later backup of the file queued since:
        nothing will ship what the rewrite left, so each is a failure (the caller holds the lock)."""
        for source, (job, exc) in self._orphans.items():
            lost = BackupSupersededError(
                f"{source} was rewritten in place after it was pinned, and no later backup of it was queued: "
                "this save is not stored; back it up again, and write each save to a new name (a hard link "
                "pins the file, not its bytes: docs/training.md)",
                rewritten=exc.rewritten,
            )
            log.error("async backup of %s failed: %s", job.describe(), lost)
            self._failures.append(lost)
        self._orphans.clear()

    def abandon(self, why: str) -> None:
        """Give up on the queue at once (Ctrl-C while ``close`` waits): log what will not ship and
        where its pins stay, cancel the jobs not started, keeping their pins, and leave this queue
        out of the exit-time wait. The running job goes on until it ends or the process does, but for
        one waiting to try again: it fails, its pins kept too."""
        self.report_unshipped(why, running_goes_on=True)
        self._stopping.set()
        with self._cond:
            self._closed = True
            for job in self._pending:
                kept = _pins_folders([job])
                job.cancelled_because = why + (f"; its pinned files stay in {', '.join(kept)}" if kept else "")
                job.future.cancel()
                give_up(job.pins, why)
            self._pending.clear()
            self._cond.notify_all()
        _LIVE.discard(self)

    def withdraw(self, jobs: list[BackupJob], why: str) -> list[BackupJob]:
        """Take ``jobs`` that have not started out of the queue, keeping their pins for a later run (a
        wait for them that was cut short: their caller goes on without them); returns those taken out.
        One already running goes on."""
        with self._cond:
            withdrawn = [job for job in jobs if job in self._pending and job.future.cancel()]
            for job in withdrawn:
                self._pending.remove(job)
                kept = _pins_folders([job])
                job.cancelled_because = why + (f"; its pinned files stay in {', '.join(kept)}" if kept else "")
                give_up(job.pins, f"when {why}")
            self._cond.notify_all()
        return withdrawn

    def flush_at_exit(self, started: float) -> None:
        """Wait for the queued backups until ``exit_timeout`` seconds after ``started`` (the exit's start, by
        ``time.monotonic``), saying so first (a WARNING: the process seems to hang otherwise); an ERROR
        line names those not shipped in time. On Ctrl-C, KeyboardInterrupt is raised; the caller reports
        (``report_unshipped``)."""
        waiting = self.pending()
        if waiting == 0:
            return
        left = None if self.exit_timeout is None else max(0.0, started + self.exit_timeout - time.monotonic())
        if left == 0:  # the other vaults' waits used it up: the ERROR line alone, not "waiting up to 0 s"
            self.report_unshipped(f"after {self.exit_timeout} s")
            return
        if left is None:
            bound = "as long as they take"
        elif self.exit_timeout is not None and left < self.exit_timeout - 0.05:  # another vault's wait took some
            bound = f"up to {left:.1f} s more (exit_timeout {self.exit_timeout:g} s, from the start of the exit)"
        else:
            bound = f"up to {self.exit_timeout:g} s"
        log.warning(
            "ckptvault: waiting %s for %d queued backup(s) before the interpreter exits "
            "(configure_async(exit_timeout=...) sets the bound)",
            bound,
            waiting,
        )
        try:
            self.flush(left)
        except FlushTimeoutError:
            self.report_unshipped(f"after {self.exit_timeout} s")
        except Exception:
            pass  # each failure was logged when it happened

    def report_unshipped(self, why: str, *, running_goes_on: bool = False) -> None:
        """Log at ERROR each backup still queued or running, and where their pins stay;
        ``running_goes_on``: the running one is named apart, as going on while the process lives."""
        with self._cond:
            running = [self._running] if self._running else []
            left = list(self._pending) if running_goes_on else running + list(self._pending)
        if not left:
            return
        kept = _pins_folders(left)
        goes_on = (
            f"; the backup of {running[0].describe()} under way goes on while this process lives"
            if (running_goes_on and running)
            else ""
        )
        log.error(
            "ckptvault: %d backup(s) not shipped %s: %s%s%s",
            len(left),
            why,
            ", ".join(j.describe() for j in left),
            f" (their pinned files stay in {', '.join(kept)}: the next backup_async of a checkpoint beside them "
            "ships them)"
            if kept
            else "",
            goes_on,
        )

    # ---- the worker's side -------------------------------------------------------------

    def _ensure_worker(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            # A daemon: a process may always exit; the exit hook gives queued work its bounded time.
            self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
            self._thread.start()

    def _work(self) -> None:
        lower_this_threads_priority(SHIPPING_NICENESS)  # the threads a backup starts inherit it
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return  # closed and drained
                job = self._pending.popleft()
                if not job.future.set_running_or_notify_cancel():
                    self._release(job)
                    self._cond.notify_all()
                    continue
                self._running = job
                self._cond.notify_all()  # a blocked submit may go on
            try:
                snapshot = self._run_with_retries(job)
            except BackupSupersededError as exc:  # a later save holds its content: as when coalesced
                if self._log_failures:  # else the owner (watch) says it, with what happens next
                    log.warning("async backup of %s: %s", job.describe(), exc)
                self._starving(exc.rewritten)
                with self._cond:  # its backup is usually queued once that save is written; if none comes, lost
                    queued = {pin.source for later in self._pending for pin in later.pins}
                    self._orphans.update({source: (job, exc) for source in exc.rewritten if source not in queued})
                self._release(job)
                job.future.set_exception(exc)
            except _StoppedWaiting as stopped:  # its checkpoint may be deleted already: the pins stay
                if self._log_failures:
                    log.error(
                        "async backup of %s failed: %s; its pinned files stay for the next backup_async",
                        job.describe(),
                        stopped.cause,
                    )
                give_up(job.pins, "when a close ended its wait to try again")
                with self._cond:
                    self._failures.append(stopped.cause)
                job.future.set_exception(stopped.cause)
            except BaseException as exc:
                if self._log_failures:
                    log.error("async backup of %s failed: %s", job.describe(), exc)
                self._release(job)
                with self._cond:
                    self._failures.append(exc)
                job.future.set_exception(exc)
            else:
                for pin in job.pins:
                    self._rewrites.pop(pin.source, None)
                    self._starving_told.discard(pin.source)
                self._release(job)  # the snapshot is committed: the pin has done its job
                job.future.set_result(snapshot)
            with self._cond:
                self._running = None  # after the handle is done: flush() returning means all are
                self._cond.notify_all()

    def _starving(self, sources: tuple[str, ...]) -> None:
        """A file saved in place faster than one upload takes never ships: each save's pin is rewritten
        by the next before its backup commits. Said once at ERROR after a few in a row (each one only
        warns), since the vault then holds nothing newer of it, however long training goes on. Not while a
        flush or close waits: the saves have stopped, and the newest queued ships (or its failure is raised).
        (A flush from another thread while training saves also holds it back: it is said at a later one.)"""
        with self._cond:
            flushing = self._flushing > 0
        for source in sources:
            count = self._rewrites[source] = self._rewrites.get(source, 0) + 1
            if count >= STARVED_AFTER and not flushing and source not in self._starving_told:
                self._starving_told.add(source)
                log.error(
                    "ckptvault: %s was rewritten in place before each of its last %d backups could ship: nothing "
                    "newer of it is stored while it is saved faster than it uploads; save each checkpoint to a new "
                    "name, or to a temporary name followed by a rename (a hard link pins the file, not its bytes: "
                    "docs/training.md)",
                    source,
                    count,
                )

    def _run_with_retries(self, job: BackupJob) -> Snapshot:
        attempt = lock_waits = 0
        locked_since: float | None = None
        while True:
            try:
                return self._run(job)
            except VaultLockedError as exc:
                # a prune holds the vault (or this backup lost its lock to one): wait it out, a
                # checkpoint must not be lost to maintenance; a close that cancels (SIGTERM to the
                # sidecar) ends the wait, and the job fails with its pins kept for the next run
                now = time.monotonic()
                locked_since = now if locked_since is None else locked_since
                if now - locked_since >= self._lock_patience():
                    longer = spelled("--retry-lock", "Vault.open(retry_lock=...)")
                    gave_up = f"gave up waiting after {self._patience_said()} ({longer} longer than that waits longer)"
                    raise _lock_wait_ended(exc, gave_up) from None
                delay = min(LOCK_RETRY_MAX_S, self._retry_delay * 2 ** min(lock_waits, 8))
                lock_waits += 1
                # said once per backup, without the advice for a command a user runs (retry_lock, unlock):
                # this backup waits by itself, and a prune running beside training is no stale lock (tr43)
                retry_log.log(
                    logging.WARNING if lock_waits == 1 else logging.DEBUG,
                    "async backup of %s waits: %s; trying again in %.0f s, for up to %s",
                    job.describe(),
                    str(exc).split("; ", 1)[0],
                    delay,
                    self._patience_said(),
                )
                if self._stopping.wait(delay):
                    # the advice for a command ("with --retry-lock 30m a command waits") is wrong here: this
                    # job was waiting by itself, and a stop (SIGTERM to a watch, a cancelling close) ended it
                    waited = f"{format_seconds(time.monotonic() - locked_since)} s"
                    said = f"stopped after waiting {waited} for it (of up to {self._patience_said()})"
                    raise _StoppedWaiting(_lock_wait_ended(exc, said)) from None
            except StorageError as exc:
                if not exc.retryable or attempt >= self._retries:
                    raise
                delay = self._retry_delay * (2**attempt)
                if unreachable(exc):  # wait out the store's breaker, so the retry gets its full retries
                    delay = max(delay, OPEN_S)
                attempt += 1
                retry_log.warning("async backup of %s: %s; retrying in %.0f s", job.describe(), exc, delay)
                if self._stopping.wait(delay):  # as for a lock: a close that cancels ends the wait
                    raise _StoppedWaiting(exc) from None

    def _lock_patience(self) -> float:
        """How long a job waits for another process's lock: an hour (maintenance never costs a checkpoint), or
        longer when the Vault was opened with a longer ``retry_lock`` (a prune known to take longer)."""
        return max(LOCK_PATIENCE_S, self._retry_lock)

    def _patience_said(self) -> str:
        return format_duration(self._lock_patience())

    @staticmethod
    def _release(job: BackupJob) -> None:
        """Remove the job's pins. One that cannot be removed (EACCES, a read-only remount, EIO) is
        warned about and left: the worker must go on to the job's result and the jobs queued after it."""
        for pin in job.pins:
            try:
                pin.release()
            except OSError as exc:
                log.warning(
                    "ckptvault: the pin %s of %s could not be removed (%s); delete it once it can be "
                    "(the next run ships it again if no snapshot of it is found)",
                    pin.root,
                    pin.source,
                    exc.strerror or exc,
                )
        job.pins = []
