"""``ckptvault watch DIR``: the sidecar that ships each finished checkpoint a trainer writes."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Annotated, TypeVar

import typer

from ..errors import CkptVaultError
from ..interruptions import SAME_SIGNAL_S
from ..ops.watch_options import LostCheckpoint, ShippedCheckpoint, check_watch_args
from ..vault import exclude_arg
from .app import (
    NO_VAULT_ARGS,
    ExcludeOpt,
    JsonOpt,
    QuietOpt,
    RecordHostOpt,
    TagOpt,
    VaultArgs,
    app,
    command,
    require_nonempty,
    vault_options,
)
from .output import Output, counted, discard_stdout, format_bytes, writing_stdout
from .params import parse_new_tags

T = TypeVar("T")


@app.command("watch")
@command
@vault_options
def watch_cmd(
    directory: Annotated[
        str, typer.Argument(metavar="DIR", help="The folder the trainer saves checkpoints into (it may not exist yet).")
    ],
    tag: TagOpt = None,
    host: RecordHostOpt = None,
    once: Annotated[
        bool, typer.Option("--once", help="Ship what is there now and exit (for cron), instead of watching.")
    ] = False,
    interval: Annotated[
        float,
        typer.Option(
            "--interval", metavar="S", help="Seconds between looks; a checkpoint must live at least this long."
        ),
    ] = 0.1,
    settle: Annotated[
        float,
        typer.Option("--settle", metavar="S", help="Seconds a checkpoint must stay unchanged to count as complete."),
    ] = 2.0,
    grace: Annotated[
        float,
        typer.Option(
            "--grace",
            metavar="S",
            help="Once stopped (SIGTERM, Ctrl-C), go on shipping what is pinned and what the trainer still saves "
            "(its save on preemption) for this many seconds. Default 0: stop after the upload in flight.",
        ),
    ] = 0.0,
    include: Annotated[
        list[str] | None,
        typer.Option(
            "--include",
            "-i",
            metavar="GLOB",
            help="Only names matching this glob (repeatable); logs and configs it names ship too.",
        ),
    ] = None,
    exclude: ExcludeOpt = None,
    state_dir: Annotated[
        str | None,
        typer.Option(
            "--state-dir",
            metavar="DIR",
            help="Staging folder for pins (default DIR/.ckptvault-watch). On the checkpoints' disk pins are links, "
            "and the oldest deleted ones are dropped unshipped when the trainer needs room; on another disk they "
            "are copies, never dropped.",
        ),
    ] = None,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Watch a checkpoint folder: pin each complete checkpoint at once, back it up tagged with its step.

    Prints one line per shipped checkpoint (one JSON object per line with --json, where a checkpoint
    dropped or deleted unshipped is one too, "event": "lost"). SIGTERM or
    Ctrl-C stops it after the upload in flight, or with --grace after that many more seconds of
    shipping (a second one abandons the upload, exit 143 for SIGTERM, 130 for Ctrl-C); pinned checkpoints wait
    for the next start."""
    out = Output(json_mode=json_out, quiet=quiet)
    tags = parse_new_tags(tag)
    # before the default vault may be made
    path = check_watch_args(directory, tags, interval, settle, once=once, include=include or (), grace=grace)
    exclude_arg(exclude)
    missing = not os.path.exists(path)
    if state_dir is not None:
        require_nonempty("--state-dir", state_dir, "a folder", default="DIR/.ckptvault-watch")
    stop = threading.Event()
    info, warn = _never_failing(out.info), _never_failing(out.warn)

    events = _Events(json_out=json_out, quiet=quiet, warn=warn)
    with vault_args.open(out, writing=True) as vault:
        on_signal = _StopOnSignal(stop, grace, info, uploading=lambda: vault.writing)
        # from here on: a Ctrl-C at the passphrase prompt (or while the vault opens) cancels as in backup, not
        # "stopping after the upload in flight" while the prompt waits on (ek44 #10)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

        def on_start(resumed: int) -> None:
            again = f"; {resumed} pinned checkpoint(s) from an earlier run to ship" if resumed else ""
            mode = " (once)" if once else ""
            new = " (it did not exist when watch started)" if missing else ""
            info(f"watching {directory}{new} for checkpoints{mode}; shipping to {vault.url}{again}")

        result = _off_the_main_thread(
            functools.partial(
                vault.watch,
                directory,
                tags=tags,
                hostname=host,
                interval=interval,
                settle=settle,
                include=include or (),
                exclude=exclude or (),
                state_dir=state_dir,
                once=once,
                grace=grace,
                stop=stop,
                on_shipped=events.shipped,
                on_warning=warn,
                on_start=on_start,
                on_lost=events.lost,
            )
        )
    # The watch is over: a late copy of the stop signal (`timeout` signals the process group too)
    # must not kill the exiting process (Python restores the default action at exit, but not SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    left = f"; {result.left} pinned checkpoint(s) wait for the next run" if result.left else ""
    dropped = f"; {len(result.dropped)} dropped unshipped to leave the trainer room" if result.dropped else ""
    info(f"watch ended: {len(result.shipped)} checkpoint(s) shipped{left}{dropped}")
    if result.errors:
        raise result.errors[0]
    if events.failure is not None:
        raise events.failure


class _StopOnSignal:
    """The handler of SIGTERM and SIGINT: the first stops the watch (after the upload in flight, or once
    ``grace`` is over); another one aborts it."""

    def __init__(
        self, stop: threading.Event, grace: float, info: Callable[[str], None], *, uploading: Callable[[], bool]
    ) -> None:
        self._stop = stop
        self._grace = grace
        self._info = info
        self._uploading = uploading  # whether a snapshot is being written now (what an abort abandons)
        self._first: tuple[int, float] | None = None  # the first stopping signal, and when

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        if self._stop.is_set():
            # `timeout` signals the process and then its process group: one request, delivered twice
            first = self._first
            if not (first is not None and first[0] == signum and time.monotonic() - first[1] < SAME_SIGNAL_S):
                code = 143 if signum == signal.SIGTERM else 130  # as the exit-code table has them
                _abort(code, self._abandoned(signal.Signals(signum).name))
            return
        self._first = (signum, time.monotonic())
        self._stop.set()
        name = signal.Signals(signum).name
        if self._grace:
            self._info(
                f"{name}: shipping what is pinned and what is saved meanwhile for {self._grace:g} s (again to abort)"
            )
        else:
            self._info(f"{name}: stopping after the upload in flight (again to abort it)")

    def _abandoned(self, name: str) -> str:
        """What the abort ends: an upload, or (during the grace, or while the watch ends) only the waiting;
        "aborted during an upload" with none in flight sent users looking for a torn snapshot (lo60 #1)."""
        if self._uploading():
            return "aborted during an upload (nothing partial was committed)"
        during = "the grace" if self._grace else "stopping"
        return f"aborted by a second {name} during {during}, with no upload in flight"


class _Events:
    """The watch's events on stdout: one line per shipped checkpoint (with --json one JSON object, and one
    per checkpoint lost too). A sidecar that can no longer print (a full disk, a closed pipe) goes on
    shipping: it says so once (``warn``), and ``failure`` is the error of the run when it ends."""

    def __init__(self, *, json_out: bool, quiet: bool, warn: Callable[[str], None]) -> None:
        self._json = json_out
        self._quiet = quiet
        self._warn = warn
        self.failure: Exception | None = None

    def _emit(self, line: str) -> None:
        if self.failure is not None or sys.stdout is None:
            return
        try:
            with writing_stdout():
                sys.stdout.write(line + "\n")
        except (BrokenPipeError, CkptVaultError) as exc:
            if isinstance(exc, BrokenPipeError):
                discard_stdout()  # writing_stdout did it for the other failures
            self.failure = exc
            reason = "standard output was closed" if isinstance(exc, BrokenPipeError) else str(exc)
            self._warn(f"shipped checkpoints are no longer printed, shipping goes on: {reason}")

    def shipped(self, item: ShippedCheckpoint) -> None:
        s = item.snapshot.summary
        if self._json:
            event = {
                "event": "shipped",
                "checkpoint": item.name,
                "step": item.step,
                "snapshot": item.snapshot.id,
                "files": s.files,
                "bytes": s.logical_bytes,
                "new_bytes": s.new_bytes,
                "duration_s": s.duration_s,
                "waited_s": item.waited_s,
                "copied": item.copied,
                "in_place": item.in_place,
            }
            self._emit(json.dumps(event))
        elif not self._quiet:
            step = f" step {item.step}" if item.step is not None else ""
            self._emit(
                f"shipped {item.name}{step} as snapshot {item.snapshot.short_id}: {counted(s.files, 'file')}, "
                f"{format_bytes(s.logical_bytes)}, {format_bytes(s.new_bytes)} new, {s.duration_s:.1f} s"
            )

    def lost(self, item: LostCheckpoint) -> None:
        """Its warning is on stderr already; a --json reader also gets it as an event."""
        if self._json:
            event = {"event": "lost", "checkpoint": item.name, "step": item.step, "reason": item.reason}
            self._emit(json.dumps({**event, "message": str(item.error)}))


def _off_the_main_thread(work: Callable[[], T]) -> T:
    """Run ``work`` in a thread while the main thread, where signal handlers run, only waits for it.
    The handler sets the stop event, whose lock is not reentrant: run on the main thread, the watch
    loop holds that lock inside each ``stop.wait``, and a signal landing there hung the process for
    good (a second signal too, as its handler never got to run)."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as exc:
            failure.append(exc)

    worker = threading.Thread(target=run, name="ckptvault-watch")
    worker.start()
    worker.join()  # waits on the thread's own lock, which no handler takes; signals still run
    if failure:
        raise failure[0]
    return outcome[0]


def _never_failing(show: Callable[[str], None]) -> Callable[[str], None]:
    """A message for stderr that cannot fail the sidecar: stderr may be the very pipe that closed
    (``watch ... 2>&1 | reader``), and shipping matters more than saying so."""

    def say(message: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            show(message)

    return say


def _abort(code: int, what: str) -> None:
    """A second signal: end now, without waiting for the upload in flight (a thread cannot be
    stopped, and unwinding would wait for it in ``Vault.close``). Nothing is lost: a snapshot is
    committed by its last write, so the abandoned one is either whole or absent, and every pin
    stays for the next start, which skips what was shipped. The vault's lock of this dead process
    is stale at once for commands on this host (its PID is gone), after the stale age elsewhere."""
    # os.write, no flush: the watch thread may hold a stream's lock, blocked on a pipe nobody reads
    message = f"error: {what}; the checkpoints still pinned ship at the next start\n"
    with contextlib.suppress(OSError):
        os.write(2, message.encode())
    os._exit(code)
