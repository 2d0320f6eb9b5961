"""Run the ckptvault CLI on ``slowfile://`` (tests/support/slowfs.py) with slow object writes too.

Every repository write still goes through the real atomic local path (temp file, fsync,
rename); it just starts ``SLOWFS_PUT_DELAY`` seconds later, so a SIGKILL at a random moment
lands between writes: ``python -m tests.support.slowcli backup ... --repo slowfile:///path``."""

from __future__ import annotations

import os
import sys
import time

from ckptvault.store.local import LocalStore

from . import slowfs  # noqa: F401 - registers slowfile://

PUT_DELAY = float(os.environ.get("SLOWFS_PUT_DELAY", "0.04"))
_real_put_file = LocalStore.put_file


def _slow_put_file(self: LocalStore, path: str, data: bytes | bytearray | memoryview, *args: object) -> None:
    time.sleep(PUT_DELAY)
    _real_put_file(self, path, data, *args)


LocalStore.put_file = _slow_put_file  # type: ignore[method-assign]

if __name__ == "__main__":
    from ckptvault.cli import main  # as the installed command runs: its logging, signals and exit codes

    sys.argv[0] = "ckptvault"
    main()
