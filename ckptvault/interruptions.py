"""Steps that a signal must not cut in two.

The CLI turns SIGTERM and Ctrl-C into exceptions raised wherever the main thread is. Most steps
are safe to stop anywhere (what they wrote is whole, or swept later), but a few write one object
and then remove another, and stopped between the two they leave both: ``tag`` wrote the snapshot
with its new tags and had not yet deleted the old one (a rerun then tagged the wrong twin, and
``prune --keep-latest`` counted the checkpoint twice). Such a step runs ``uninterrupted()``: the
CLI's handlers ask ``hold_back`` first, and the interruption is raised when the step ends. A second
signal meanwhile is not held back (a step stuck on a storage that does not answer can still be left).

``Terminated`` is SIGTERM as an exception, raised as Ctrl-C's KeyboardInterrupt is; once it is
raised, SIGTERM again ends the process at once (``end_at_once_on_another``).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

_depth = 0
_held: list[type[BaseException]] = []
# GNU `timeout` (and a kill of a process group) signals the process and then its group: one request,
# delivered twice within milliseconds, which must not count as "stop at once"
SAME_SIGNAL_S = 0.5


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler stopping the job, a spot instance's preemption notice), unwound as Ctrl-C
    is, so that a command gives up its writes and its lock (a lock left behind keeps other hosts out
    of a shared vault for 30 minutes); the process then ends with 143, as a terminated one does."""

    exit_code = 143


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Run the block to its end even when SIGTERM or Ctrl-C comes meanwhile; the interruption is
    raised as it ends, also when the block failed on its own (chained to that error: the signal's
    exit code is what the command ends with). Signal handlers run on the main thread: elsewhere this
    holds nothing back."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    except BaseException as exc:
        held = _leave()
        if held is not None:
            raise held from exc
        raise
    held = _leave()
    if held is not None:
        raise held


def _leave() -> type[BaseException] | None:
    """End a block; the outermost one takes what was held back (nothing is left for a later block)."""
    global _depth
    _depth -= 1
    if _depth:
        return None
    held = _held[0] if _held else None
    _held.clear()
    return held


def hold_back(interruption: type[BaseException]) -> bool:
    """For a signal handler: True when ``interruption`` is to be raised once the running
    ``uninterrupted`` block ends; False when none runs, or one was held back already."""
    if not _depth or _held:
        return False
    _held.append(interruption)
    return True


def end_at_once_on_another(signum: int) -> None:
    """For the handler of a first stopping signal (main thread): the same signal again ends the
    process at once by its default action, unless it comes within SAME_SIGNAL_S of this one."""
    first = time.monotonic()

    def again(num: int, _frame: FrameType | None) -> None:
        if time.monotonic() - first < SAME_SIGNAL_S:
            return  # the first one, delivered twice
        signal.signal(num, signal.SIG_DFL)
        signal.raise_signal(num)

    signal.signal(signum, again)
