"""Command-line interface: a thin layer over ``ckptvault.Vault``. Importing a cmd_* module registers it."""

import ctypes
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


def _keep_freed_memory() -> None:
    """glibc's malloc hands chunk-sized buffers (1-4 MiB) back to the kernel on free and faults
    fresh zeroed pages in on the next allocation; per-thread arenas make it worse. A fixed mmap
    threshold of 32 MiB and a trim threshold of 128 MiB keep them for reuse: a restore spends half
    the system time (perf: page faults and unmaps were ~10% of its CPU), for ~30 MB more peak RSS."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc-like: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 * 1024 * 1024)
    mallopt(m_trim_threshold, 128 * 1024 * 1024)


def main() -> None:
    # The library logs notices such as "a read failed verification; reading it again"; the CLI
    # reports outcomes itself, one line each, so only the library's errors pass through.
    logging.getLogger("ckptvault").setLevel(logging.ERROR)
    # The pipelines allocate many short-lived objects (futures, tuples) per chunk: collecting
    # less often, and never scanning the modules loaded at start-up, saves a few % of the CPU.
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
    _keep_freed_memory()
    app()
