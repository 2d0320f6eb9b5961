"""``python -m tests.support.holding_event ckptvault-args...``: the CLI with every
``threading.Event.wait`` holding the event's lock for 50 ms before it waits, as ``Event.wait``
itself holds it for a moment each time it wakes. A signal handler that sets such an event on the
thread that holds the lock hangs for good; the stretch makes the moment a signal lands there
likely instead of rare (about 1 SIGTERM in 30 hung ``watch --interval 0.0001``)."""

from __future__ import annotations

import sys
import threading
import time


class HoldingEvent(threading.Event):
    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:  # type: ignore[attr-defined]
            time.sleep(0.05)
        return super().wait(timeout)


threading.Event = HoldingEvent  # type: ignore[misc]

if __name__ == "__main__":
    from ckptvault.cli import main  # as the installed command runs: its logging, signals and exit codes

    sys.argv[0] = "ckptvault"
    main()
