"""Command-line interface: a thin layer over ``ckptvault.Vault``. Importing a cmd_* module registers it."""

import gc
import logging
import os

# Before numpy loads: the CLI does no linear algebra, and OpenBLAS's idle worker threads spin on
# the cores that hashing and compression need (a few % of a backup's CPU, measured with perf).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from . import (  # noqa: F401
    cmd_backup,
    cmd_check,
    cmd_demo,
    cmd_diff,
    cmd_drill,
    cmd_init,
    cmd_key,
    cmd_prune,
    cmd_restore,
    cmd_show,
    cmd_snapshots,
    cmd_stats,
    cmd_status,
    cmd_watch,
)
from .app import app


def main() -> None:
    # The library logs notices such as "a read failed verification; reading it again"; the CLI
    # reports outcomes itself, one line each, so only the library's errors pass through.
    logging.getLogger("ckptvault").setLevel(logging.ERROR)
    # The pipelines allocate many short-lived objects (futures, tuples) per chunk: collecting
    # less often, and never scanning the modules loaded at start-up, saves a few % of the CPU.
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
    app()
