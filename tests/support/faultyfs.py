"""``faulty://``: an in-memory fsspec filesystem that injects faults on chosen calls.

A plan maps an operation, optionally narrowed to keys containing a fragment, to a script of
actions consumed one per call (borg's failing chunker and kopia's FaultyStorage, as fsspec):

    FAULTS["put:/packs/"] = list("TT")   # the next two pack uploads fail, then succeed
    FAULTS["get"] = list(".C")           # the second read returns a flipped byte

    .  succeed             T  transient error (connection reset)
    P  permission denied   H  hang for HANG_S seconds, then succeed
    S  short read          C  corrupted read (one flipped bit)
    I  an internal server error (HTTP 500), as a server answers for an object it finds damaged

Operations: put (pipe_file), get (cat_file), delete (rm_file), list (find). As a process entry
point, ``python -m tests.support.faultyfs ARGS`` runs the CLI with a plan from
CKPTVAULT_TEST_FAULTS ("put:/packs/=TT;get=C"); faulty:// then starts empty in that process,
so it suits commands that create their repository (init, backup, demo).
"""

from __future__ import annotations

import os
import sys
import time

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

FAULTS: dict[str, list[str]] = {}
INJECTED: list[tuple[str, str, str]] = []  # (op, path, action) of every fault that fired
HANG_S = 2.0


def _next_action(op: str, path: str) -> str:
    for key, script in FAULTS.items():
        name, _, fragment = key.partition(":")
        if name == op and fragment in path and script:
            action = script.pop(0)
            if action != ".":
                INJECTED.append((op, path, action))
            return action
    return "."


class InternalServerError(OSError):
    status = 500  # read as aiohttp's ClientResponseError is


def _raise_or_wait(action: str, path: str) -> None:
    if action == "T":
        raise ConnectionResetError(104, "connection reset by peer (injected)", path)
    if action == "P":
        raise PermissionError(13, "permission denied (injected)", path)
    if action == "I":
        raise InternalServerError(121, "internal server error (injected)", path)
    if action == "H":
        time.sleep(HANG_S)


class FaultyMemoryFileSystem(MemoryFileSystem):
    protocol = ("faulty",)

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        _raise_or_wait(_next_action("put", path), path)
        return super().pipe_file(path, value, mode=mode, **kwargs)

    def cat_file(self, path, start=None, end=None, **kwargs):
        action = _next_action("get", path)
        _raise_or_wait(action, path)
        data = super().cat_file(path, start=start, end=end, **kwargs)
        if action == "S" and data:
            return data[:-1]
        if action == "C" and data:
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0x04
            return bytes(flipped)
        return data

    def rm_file(self, path):
        _raise_or_wait(_next_action("delete", path), path)
        return super().rm_file(path)

    def find(self, path, *args, **kwargs):
        _raise_or_wait(_next_action("list", path), path)
        return super().find(path, *args, **kwargs)


fsspec.register_implementation("faulty", FaultyMemoryFileSystem, clobber=True)


def plan_from_env(text: str) -> dict[str, list[str]]:
    plan = {}
    for part in filter(None, text.split(";")):
        key, _, script = part.partition("=")
        plan[key] = list(script)
    return plan


if __name__ == "__main__":
    from ckptvault.cli import main  # as the installed command runs: its logging, signals and exit codes

    FAULTS.update(plan_from_env(os.environ.get("CKPTVAULT_TEST_FAULTS", "")))
    sys.argv[0] = "ckptvault"
    main()
