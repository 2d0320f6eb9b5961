"""Run the ckptvault CLI and SIGKILL it just before its K-th filesystem change, so that a test can sweep
every step of a command: ``python -m tests.support.killcli forget ID --repo /path``.

The changes counted are the os calls that alter names or open a file for writing: ``os.replace``,
``os.rename``, ``os.link``, ``os.symlink``, ``os.unlink``, ``os.remove``, ``os.rmdir``, ``os.mkdir``, and
``os.open`` with a write flag and ``open`` in a writing mode (a kill there lands after the open: the file
exists, empty or truncated).
Every thread counts into one sequence; the vault's objects, its locks, the metadata cache, keyfiles and a
restore's target all go through these calls.

Environment:
  KILLCLI_AT     K (1-based): SIGKILL itself at the K-th change; unset or 0 counts only
  KILLCLI_MATCH  count only the changes whose op and path (``open /x/.key.tmp-1``) hold this text
  KILLCLI_COUNT  a file that gets the number of changes made (written at exit: a run that was not killed)
  KILLCLI_LOG    a file that gets one line per change (``N op path``), for a failure's message
"""

from __future__ import annotations

import atexit
import builtins
import io
import os
import signal
import sys
import threading

AT = int(os.environ.get("KILLCLI_AT") or 0)
COUNT = os.environ.get("KILLCLI_COUNT", "")
LOG = os.environ.get("KILLCLI_LOG", "")
MATCH = os.environ.get("KILLCLI_MATCH", "")

_mutex = threading.Lock()
_done = 0
_lines: list[str] = []
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _change(op: str, path: object) -> None:
    """Count one change; at the K-th, die before it is made (after it, for an open)."""
    global _done
    what = f"{op} {os.fsdecode(path) if isinstance(path, (str, bytes)) else path}"
    if MATCH not in what:
        return
    with _mutex:
        _done += 1
        _lines.append(f"{_done} {what}")
        if _done == AT:
            _write_log()
            os.kill(os.getpid(), signal.SIGKILL)


def _write_log() -> None:
    if LOG:
        with _real_io_open(LOG, "w") as f:  # not counted: the count is the command's
            f.write("\n".join(_lines) + "\n")


def _wrap(name: str) -> None:
    real = getattr(os, name)

    def changed(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        _change(name, path)
        return real(path, *args, **kwargs)

    setattr(os, name, changed)


for _name in ("replace", "rename", "link", "symlink", "unlink", "remove", "rmdir", "mkdir"):
    _wrap(_name)

_real_open = os.open


def _open(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
    fd = _real_open(path, flags, *args, **kwargs)
    if flags & _WRITE_FLAGS:
        _change("open", path)
    return fd


os.open = _open  # type: ignore[assignment]

_real_io_open = io.open


def _io_open(file, mode="r", *args, **kwargs):  # type: ignore[no-untyped-def]
    f = _real_io_open(file, mode, *args, **kwargs)
    if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
        _change("open", os.fspath(file))
    return f


io.open = builtins.open = _io_open  # type: ignore[assignment]


def _at_exit() -> None:
    if COUNT:
        with _real_io_open(COUNT, "w") as f:
            f.write(str(_done))
    _write_log()


atexit.register(_at_exit)

if __name__ == "__main__":
    from ckptvault.cli import main  # as the installed command runs: its logging, signals and exit codes

    sys.argv[0] = "ckptvault"
    main()
