"""A local filesystem whose reads, listings and deletes take a while: it stretches a real
process's timeline so that a SIGKILL at a random moment lands between its storage calls.

Use as a process entry point: ``python -m tests.support.slowfs ckptvault-args...`` runs the
CLI with the ``slowfile://`` protocol registered (``SLOWFS_DELAY`` seconds per call)."""

from __future__ import annotations

import os
import sys
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem

DELAY = float(os.environ.get("SLOWFS_DELAY", "0.02"))


class SlowLocalFileSystem(LocalFileSystem):
    """``delay`` (a storage option, e.g. ``storage_options={"delay": "0.5"}``) overrides SLOWFS_DELAY."""

    protocol = ("slowfile",)

    def __init__(self, *args, delay=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay = DELAY if delay is None else float(delay)

    def cat_file(self, path, start=None, end=None, **kwargs):
        time.sleep(self.delay)
        return super().cat_file(path, start=start, end=end, **kwargs)

    def rm_file(self, path):
        time.sleep(self.delay)
        return super().rm_file(path)

    def find(self, path, *args, **kwargs):
        time.sleep(self.delay)
        return super().find(path, *args, **kwargs)


fsspec.register_implementation("slowfile", SlowLocalFileSystem, clobber=True)

if __name__ == "__main__":
    from ckptvault.cli import main  # as the installed command runs: its logging, signals and exit codes

    sys.argv[0] = "ckptvault"
    main()
