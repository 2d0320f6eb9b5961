"""What a watch is given and what it gives back: its options, checked before anything starts, and
the checkpoints it shipped or lost."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import CheckpointLostError, CkptVaultError, SourceError, UsageError, spelled
from ..snapshot.model import WATCH_SIG_TAG, Snapshot
from .scan import NO_EXCLUDES, Excludes

RESERVED_TAGS = ("step", "checkpoint", WATCH_SIG_TAG)
MAX_INTERVAL_S = 3600.0
MAX_SETTLE_S = 86400.0


@dataclass(frozen=True)
class WatchOptions:
    interval: float = 0.1  # seconds between polls: a checkpoint must live at least this long
    settle: float = 2.0  # seconds without change before a checkpoint counts as complete
    include: tuple[str, ...] = ()  # globs on top-level names; empty means every name
    exclude: Excludes = NO_EXCLUDES  # left out of each checkpoint; a name pattern skips checkpoints too
    state_dir: str | None = None  # default: <folder>/.ckptvault-watch (same filesystem)
    once: bool = False
    grace: float = 0.0  # once stopped: seconds to go on shipping what is pinned and what the trainer still saves
    retry_lock: float = 0.0  # the Vault's: a backup waits this long for a prune's lock when over an hour


@dataclass(frozen=True)
class ShippedCheckpoint:
    name: str
    source: str
    step: int | None
    snapshot: Snapshot
    copied: bool  # the pin had to copy (no hard links possible)
    waited_s: float  # from first sight to durable
    in_place: bool = False  # no pin could be made (a full disk): read where it was


@dataclass(frozen=True)
class LostCheckpoint:
    """A checkpoint that will never ship: ``reason`` is "dropped" (to leave the trainer room for its
    next save), "deleted" (by the trainer while it shipped in place, unpinned, or while its pin lacked part
    of it) or "replaced" (by a new save under its name, likewise)."""

    name: str
    source: str
    step: int | None
    reason: str
    error: CheckpointLostError


@dataclass
class WatchResult:
    shipped: list[ShippedCheckpoint] = field(default_factory=list)
    left: int = 0  # pinned checkpoints left for the next run (not those shipping in place)
    dropped: list[str] = field(default_factory=list)  # checkpoints dropped unshipped to leave the trainer room
    errors: list[CkptVaultError] = field(default_factory=list)


def check_watch_args(
    directory: str,
    tags: dict[str, str],
    interval: float,
    settle: float,
    *,
    once: bool = False,
    include: Sequence[str] = (),
    grace: float = 0.0,
) -> str:
    """The watched folder's absolute path; fails on arguments watch cannot run with (the CLI calls
    this before it opens, and maybe creates, the default vault). A sidecar is often started before
    the trainer makes its folder: a missing folder is fine where its parent exists (the watch's state
    folder inside it creates it), but not for ``once``, which would ship nothing."""
    if not directory.strip():
        raise UsageError("the folder to watch is empty; name the folder the trainer saves into")
    path = os.path.abspath(os.path.expanduser(directory))
    if not os.path.exists(path):
        if once:
            raise SourceError(path, "no such directory")
        if not os.path.isdir(os.path.dirname(path)):
            raise SourceError(path, "no such directory, nor its parent", "check the path")
    elif not os.path.isdir(path):
        raise UsageError(f"{path} is not a directory; watch the folder the trainer saves into")
    if blank := [pattern for pattern in include if not pattern.strip()]:
        # --include "$PATTERN" with the variable unset, as restore and --exclude say it (' ' was taken as a name)
        raise UsageError(
            f"{spelled('--include', 'include')} pattern {blank[0]!r} is empty (is a variable unset?); give a glob "
            "of checkpoint folder names: 'step_*'"
        )
    for key in RESERVED_TAGS:
        if key in tags:
            raise UsageError(
                f"{spelled('--tag', 'tags:')} {key}=... is set by watch itself for each checkpoint; leave it out"
            )
    if not 0 < interval <= MAX_INTERVAL_S:  # NaN and infinity too (inf crashed the clock's arithmetic)
        why = " (a poll that rare would miss checkpoints a trainer rotates away)" if interval > MAX_INTERVAL_S else ""
        raise UsageError(
            f"{spelled('--interval', 'interval')} {interval:g} must be a number of seconds above 0 and at most "
            f"{MAX_INTERVAL_S:g}{why}"
        )
    if not 0 <= settle <= MAX_SETTLE_S:
        raise UsageError(
            f"{spelled('--settle', 'settle')} {settle:g} must be a number of seconds from 0 to {MAX_SETTLE_S:g}"
        )
    if not 0 <= grace <= MAX_SETTLE_S:
        raise UsageError(
            f"{spelled('--grace', 'grace')} {grace:g} must be a number of seconds from 0 to {MAX_SETTLE_S:g}"
        )
    if grace and once:
        raise UsageError(
            f"{spelled('--grace', 'grace')} is for a watch that is stopped; {spelled('--once', 'once')} ships what "
            "is there and waits for it by itself: leave one out"
        )
    return path
