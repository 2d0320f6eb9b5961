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
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, ParamSpec, TypeVar

if TYPE_CHECKING:
    from ..repository import Repository

INFLIGHT_BYTES = 32 * 1024 * 1024
# Snapshot trees decoded and held at once by a walk over many (check, prune) on remote storage: a tree of
# 50,000 files takes ~32 MB decoded, and holding every one made memory grow with the snapshots walked.
TREES_AT_ONCE = 16

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


def keep_freed_memory(*, one_arena: bool = False) -> bool:
    """Have glibc's malloc keep freed buffers for reuse; opt-in for a process that backs up or restores
    through the API (the CLI does it itself). Returns False where there is nothing to tune (not glibc).

    glibc hands chunk-sized buffers (1-4 MiB) back to the kernel on free and faults fresh zeroed pages
    in on the next allocation, so a restore spends as much time in the kernel as in its own work: a
    1.06 GB restore in-process took 1.27-1.36 s with 310-330k page faults, and 0.73-0.89 s with ~6k
    after this call (a fixed mmap threshold of 32 MiB and a trim threshold of 128 MiB). The cost: up
    to 128 MiB of freed memory per arena stays with the process between operations (each backup and
    restore hands its own back when it returns), and buffers under 32 MiB come from the heap, which a
    long-running process with other large allocations may fragment more. Hence opt-in.
    ``one_arena``: one malloc arena for all threads, so that buffers freed by another thread than the
    one that made them do not pile up in per-thread arenas. Backups and restores did not need it (peaks
    within a few MB), but a copy, whose chunks are read on 8 download threads and freed on others,
    peaked at 195 MB for 256 MiB and 251 MB for 1 GiB without it, 190 MB for both with it (166-174 MB
    without this call). It suits a process that mainly runs ckptvault (the CLI uses it); a training
    loop's threads would contend for the one arena's lock. Call it early, before threads start
    allocating. The same holds for a whole process started with ``MALLOC_MMAP_THRESHOLD_=33554432
    MALLOC_TRIM_THRESHOLD_=134217728`` (and ``MALLOC_ARENA_MAX=1``) in its environment."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # not glibc-like (macOS, musl, Windows): nothing to tune
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    mallopt(m_mmap_threshold, 32 * 1024 * 1024)
    mallopt(m_trim_threshold, 128 * 1024 * 1024)
    if one_arena:
        mallopt(m_arena_max, 1)
    return True


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


def read_few_at_a_time(repo: Repository, read: Callable[[T], R], items: Sequence[T]) -> Iterator[tuple[T, R]]:
    """Each item with ``read`` of it, in order, at most ``TREES_AT_ONCE`` results held at once: that many
    read at once on remote storage (``Repository.read_each``: one round trip after another took 41 s for
    1,000 snapshots on a 20 ms link), one after another on a local disk (a batch would only hold more)."""
    step = TREES_AT_ONCE if repo.remote else 1
    for start in range(0, len(items), step):
        batch = items[start : start + step]
        yield from zip(batch, repo.read_each(read, batch), strict=True)
