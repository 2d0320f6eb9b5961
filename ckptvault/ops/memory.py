"""Memory bounds of the data pipelines, whatever the machine.

Both pipelines scale their thread pools with the cores, and each chunk in flight holds its bytes
(and, while a worker codes it, a second and third copy). Counting the window in chunks alone let
memory grow with the machine: a 512 MiB restore peaked at 175 MB on 2 cores, 253 MB on 4 and
317 MB on 8. ``INFLIGHT_BYTES`` caps the bytes in flight near what 2 cores hold: 8-32 chunks of
the default 1-4 MiB, more than the stages that follow each pipeline (packing and uploads, or the
file-order hash, both serial) can take in while the workers code the next ones.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

INFLIGHT_BYTES = 32 * 1024 * 1024

P = ParamSpec("P")
R = TypeVar("R")


def release_freed_memory() -> None:
    """Hand the memory an operation freed back to the system (glibc keeps it in per-thread arenas).

    A training process backs up and restores inside its own long run: without this, a backup's
    ~100 MB of freed buffers stayed resident after it returned, and a restore that followed in the
    same process took fresh memory beside them (peak 250 MB, against 186 MB for either alone)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl, Windows): it returns memory itself
        return
    trim(0)


def releasing_freed_memory(operation: Callable[P, R]) -> Callable[P, R]:
    """``operation``, then ``release_freed_memory``, also when it fails (after its cleanup)."""

    @functools.wraps(operation)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return operation(*args, **kwargs)
        finally:
            release_freed_memory()

    return run
