"""Run the ckptvault CLI with the lock timings scaled down, stopping itself at a chosen write, so that a
test can suspend a real process at a precise moment (tests/test_lock_loss.py):
``python -m tests.support.lockcli backup ... --repo /path``.

Environment:
  LOCKCLI_STALE_S, LOCKCLI_REFRESH_S  the locks' staleness and refresh period (default 4 s and 0.2 s)
  LOCKCLI_STOP       "after-pack": SIGSTOP to itself once its first pack object is stored;
                     "before-index": just before it writes its first index object;
                     "before-snapshot": just before it writes its first snapshot object (its checks passed);
                     "after-snapshot": once its first snapshot object is stored (then a test may kill it);
                     "after-pack-delete": once its first pack object is deleted (prune: one delete at a
                     time then, so that every other delete comes after the stop);
                     "before-read": just before its first read from a pack (a reader): that read is still
                     to come after the stop, however many reads other threads made meanwhile
  LOCKCLI_MARKER     a file written just before stopping (the test waits for it, then for the stop)
  LOCKCLI_PACK_DELAY seconds each pack write waits first (default 0), so that work is left after a stop

Every write still goes through the real atomic local path (temp file, fsync, rename)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from ckptvault.repository import locks
from ckptvault.store.local import LocalStore

STOP = os.environ.get("LOCKCLI_STOP", "")
MARKER = os.environ.get("LOCKCLI_MARKER", "")
PACK_DELAY = float(os.environ.get("LOCKCLI_PACK_DELAY", "0"))

assert locks.LockManager.__init__.__kwdefaults__ is not None
locks.LockManager.__init__.__kwdefaults__.update(
    stale_after=timedelta(seconds=float(os.environ.get("LOCKCLI_STALE_S", "4"))),
    refresh_every=timedelta(seconds=float(os.environ.get("LOCKCLI_REFRESH_S", "0.2"))),
)

_real_put_file = LocalStore.put_file
_stopped = threading.Lock()  # held once the stop happened: it happens once
_resumed = threading.Event()


def _stop_here() -> None:
    if not _stopped.acquire(blocking=False):
        # Another thread is stopping the process: what this one was about to do comes after the stop
        # too (eight download workers read a whole small snapshot while the marker was being written).
        _resumed.wait()
        return
    if MARKER:
        Path(MARKER).write_text(str(os.getpid()))
    # The whole process stops, its lock refresh thread included. Sent to this thread, the stop takes it before
    # the call returns; sent to the process, the kernel woke another thread to act on it and this one ran on
    # meanwhile, under load past the next delete's lock check (a CI run: a second pack deleted after the stop).
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
    _resumed.set()


def _put_file(self: LocalStore, path: str, data: bytes | bytearray | memoryview, *args: object) -> None:
    if "/packs/" in path and PACK_DELAY:
        time.sleep(PACK_DELAY)
    if ("/index/" in path and STOP == "before-index") or ("/snapshots/" in path and STOP == "before-snapshot"):
        _stop_here()
    _real_put_file(self, path, data, *args)
    if ("/packs/" in path and STOP == "after-pack") or ("/snapshots/" in path and STOP == "after-snapshot"):
        _stop_here()


LocalStore.put_file = _put_file  # type: ignore[method-assign]

_real_pread = LocalStore.pread
_real_get = LocalStore.get


def _pread(self: LocalStore, path: str, start: int, length: int) -> bytes:
    if "/packs/" in path and STOP == "before-read":
        _stop_here()
    return _real_pread(self, path, start, length)


def _get(self: LocalStore, key: str) -> bytes:
    if key.startswith("packs/") and STOP == "before-read":
        _stop_here()
    return _real_get(self, key)


LocalStore.pread = _pread  # type: ignore[method-assign]
LocalStore.get = _get  # type: ignore[method-assign]

_real_delete = LocalStore.delete


def _delete(self: LocalStore, key: str) -> None:
    _real_delete(self, key)
    if key.startswith("packs/") and STOP == "after-pack-delete":
        _stop_here()


LocalStore.delete = _delete  # type: ignore[method-assign]
if STOP == "after-pack-delete":
    from ckptvault.ops import gc

    gc.DELETERS = 1

if __name__ == "__main__":
    from ckptvault.cli import main  # as the installed command runs: its logging, signals and exit codes

    sys.argv[0] = "ckptvault"
    main()
