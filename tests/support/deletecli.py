"""Run the ckptvault CLI on any store, holding it at its first delete of an object under a prefix, so that a
test can freeze the server, cut the link or kill the process at that very step of a prune:
``python -m tests.support.deletecli prune --keep-latest 2 --repo s3://...``.

Environment:
  DELETECLI_AT      the prefix of the keys whose first delete it stops at: ``packs/`` (default), ``index/``,
                    ``snapshots/``, ``trees/``
  DELETECLI_MARKER  a file written when it gets there (the test waits for it)
  DELETECLI_GO      it waits there until this file exists (every other delete of that prefix too), then goes on
  DELETECLI_KILL    "1": SIGKILL itself there instead (a prune killed as it deletes them)

It waits before the storage call starts, outside the call's deadline: the first attempt of the delete then
meets whatever the test did meanwhile."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from ckptvault.store.retrying import RetryingStore

AT = os.environ.get("DELETECLI_AT", "packs/")
MARKER = os.environ.get("DELETECLI_MARKER", "")
GO = os.environ.get("DELETECLI_GO", "")
KILL = os.environ.get("DELETECLI_KILL") == "1"
GIVE_UP_S = 120.0  # a test that died leaves no process waiting for good

_real_delete = RetryingStore.delete
_reached = threading.Lock()  # held once the first one got there
_go = threading.Event()


def _hold() -> None:
    if not _reached.acquire(blocking=False):
        _go.wait(GIVE_UP_S)  # the deletes running beside the first one wait with it
        return
    if MARKER:
        Path(MARKER).write_text(str(os.getpid()))
    if KILL:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + GIVE_UP_S
    while GO and not os.path.exists(GO) and time.monotonic() < deadline:
        time.sleep(0.01)
    _go.set()


def _delete(self: RetryingStore, key: str) -> None:
    if key.startswith(AT):
        _hold()
    _real_delete(self, key)


RetryingStore.delete = _delete  # type: ignore[method-assign]

if __name__ == "__main__":
    from ckptvault.cli import main  # as the installed command runs: its logging, signals and exit codes

    sys.argv[0] = "ckptvault"
    main()
