"""Run the ckptvault CLI and SIGKILL it at its K-th write-type call to a remote store, so that a test can
sweep every step of a command against a real S3 server or a real sshd:
``python -m tests.support.killremote forget ID --prune --repo s3://bucket/vault -o endpoint_url=...``.
killcli.py does the same for a local vault's filesystem changes.

The calls counted are those that change what the server holds:
- S3 (s3fs's ``_call_s3``, which every request goes through, ckptvault's own ``call_s3`` too): put_object,
  create_multipart_upload, upload_part, complete_multipart_upload, abort_multipart_upload, delete_object(s),
  copy_object, upload_part_copy, create_bucket;
- SFTP (paramiko's ``SFTPClient``): open for writing, the close of such a file (its bytes are sent by then,
  or as the close flushes them), rename, posix_rename, remove/unlink, mkdir, rmdir.
Every thread counts into one sequence.

Environment:
  KILLREMOTE_AT       K (1-based): SIGKILL itself at the K-th write call; unset or 0 counts only
  KILLREMOTE_WHEN     ``before`` (default): die before the call is sent; ``after``: once its answer came back
                      (it landed, and the command never learnt it), or, for an SFTP open, once the file exists
  KILLREMOTE_MATCH    count only the calls whose op and key (``put_object vault/packs/ab12``) hold this text
  KILLREMOTE_COUNT    a file that gets the number of write calls made (written at exit: a run that was not killed)
  KILLREMOTE_LOG      a file that gets one line per write call (``N op key``)
  KILLREMOTE_STACKS   also log the Python stack of each write call (where it came from)
  KILLREMOTE_PART_MIB make s3fs cut puts of twice this size or more into multipart uploads of parts this size
                      (its default is 50 MiB parts from 100 MiB), so that a sweep with small packs crosses parts
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import sys
import threading
import traceback
from typing import Any

AT = int(os.environ.get("KILLREMOTE_AT") or 0)
AFTER = os.environ.get("KILLREMOTE_WHEN", "before") == "after"
COUNT = os.environ.get("KILLREMOTE_COUNT", "")
LOG = os.environ.get("KILLREMOTE_LOG", "")
MATCH = os.environ.get("KILLREMOTE_MATCH", "")
STACKS = bool(os.environ.get("KILLREMOTE_STACKS"))
PART_MIB = float(os.environ.get("KILLREMOTE_PART_MIB") or 0)

S3_WRITES = frozenset(
    {
        "put_object",
        "create_multipart_upload",
        "upload_part",
        "complete_multipart_upload",
        "abort_multipart_upload",
        "delete_object",
        "delete_objects",
        "copy_object",
        "upload_part_copy",
        "create_bucket",
    }
)

_mutex = threading.Lock()
_done = 0
_lines: list[str] = []


def _count(op: str, key: str) -> bool:
    """Count one write call; True when it is the K-th (the caller dies before or after it)."""
    global _done
    what = f"{op} {key}"
    if MATCH not in what:
        return False
    with _mutex:
        _done += 1
        _lines.append(f"{_done} {what}")
        if STACKS:
            _lines.append("".join(traceback.format_stack(limit=25)[:-2]))
        return _done == AT


def _die() -> None:
    _write_log()
    os.kill(os.getpid(), signal.SIGKILL)


def _write_log() -> None:
    if LOG:
        with open(LOG, "w") as f:
            f.write("\n".join(_lines) + "\n")


def _patch_s3() -> None:
    try:
        import s3fs.core
    except ImportError:
        return
    cls: Any = s3fs.core.S3FileSystem
    real_call = cls._call_s3

    @functools.wraps(real_call)
    async def call_s3(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        name = method if isinstance(method, str) else getattr(method, "__name__", str(method))
        if name not in S3_WRITES:
            return await real_call(self, method, *args, **kwargs)
        key = str(kwargs.get("Key") or kwargs.get("Bucket") or "")
        if name == "upload_part":
            key = f"{key} part {kwargs.get('PartNumber')}"
        elif name == "delete_objects":
            key = " ".join(o.get("Key", "") for o in (kwargs.get("Delete") or {}).get("Objects", []))
        hit = _count(name, key)
        if hit and not AFTER:
            _die()
        out = await real_call(self, method, *args, **kwargs)
        if hit:
            _die()
        return out

    cls._call_s3 = call_s3
    if PART_MIB:
        real_pipe = cls._pipe_file
        part = int(PART_MIB * 2**20)

        @functools.wraps(real_pipe)
        async def pipe_file(self: Any, path: Any, data: Any, chunksize: int = part, **kwargs: Any) -> Any:
            return await real_pipe(self, path, data, chunksize=chunksize, **kwargs)

        cls._pipe_file = pipe_file


def _counted(op: str, real: Any, *, writes: Any = None) -> Any:
    """An SFTPClient method counted as a write (``writes(args)``: whether this call is one)."""

    @functools.wraps(real)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if writes is not None and not writes(args, kwargs):
            return real(self, *args, **kwargs)
        hit = _count(op, " ".join(str(a) for a in args[:2]))
        if hit and not AFTER:
            _die()
        out = real(self, *args, **kwargs)
        if hit:
            _die()
        return out

    return method


def _writing_mode(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
    return any(c in str(mode) for c in "wax+")


def _patch_sftp() -> None:
    try:
        import paramiko
    except ImportError:
        return
    client: Any = paramiko.SFTPClient
    real_open = client.open

    @functools.wraps(real_open)
    def open_(self: Any, filename: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = _counted("open", real_open, writes=_writing_mode)(self, filename, mode, *args, **kwargs)
        if _writing_mode((filename, mode), {}):
            _count_close(f, str(filename))
        return f

    client.open = client.file = open_
    for name in ("rename", "posix_rename", "remove", "mkdir", "rmdir"):
        setattr(client, name, _counted(name, getattr(client, name)))
    client.unlink = client.remove


def _count_close(f: Any, path: str) -> None:
    """The close of a file opened for writing is one more write call (the last of its bytes go with it)."""
    real_close = f.close
    closed = False

    def close() -> None:
        nonlocal closed
        if closed:
            return real_close()
        closed = True
        hit = _count("close", path)
        if hit and not AFTER:
            _die()
        real_close()
        if hit:
            _die()

    f.close = close


def _at_exit() -> None:
    if COUNT:
        with open(COUNT, "w") as f:
            f.write(str(_done))
    _write_log()


_patch_s3()
_patch_sftp()
atexit.register(_at_exit)

if __name__ == "__main__":
    from ckptvault.cli import main  # as the installed command runs: its logging, signals and exit codes

    sys.argv[0] = "ckptvault"
    main()
