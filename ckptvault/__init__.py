"""ckptvault: deduplicating, verified backups of ML training checkpoints to any fsspec store."""

# Names are imported on first use (PEP 562), so that ``import ckptvault.cli`` can set up the
# process (thread counts of numpy's BLAS) before numpy is loaded, and start-up stays short.
from __future__ import annotations

import importlib

from .version import __version__

# typing's own constant without loading typing (~8 ms that the CLI's Ctrl-C guard, cli/__init__.py, cannot cover)
TYPE_CHECKING = False

_HOMES = {
    "ChunkerParams": ".chunking",
    "CompressionSettings": ".codec",
    "CkptVaultError": ".errors",
    "UsageError": ".errors",
    "SourceError": ".errors",
    "VaultNotFoundError": ".errors",
    "VaultExistsError": ".errors",
    "ForeignRepositoryError": ".errors",
    "VaultLockedError": ".errors",
    "LockLostError": ".errors",
    "WrongPassphraseError": ".errors",
    "KeyfileMismatchError": ".errors",
    "KeyfileNotFoundError": ".errors",
    "KeyfileCorruptError": ".errors",
    "PassphraseRequiredError": ".errors",
    "UnsupportedFormatError": ".errors",
    "SnapshotNotFoundError": ".errors",
    "PathNotInSnapshotError": ".errors",
    "StorageError": ".errors",
    "StorageFullError": ".errors",
    "RestoreConflictError": ".errors",
    "RestoreIncompleteError": ".errors",
    "CopyIncompleteError": ".errors",
    "CopyNeedsUpgradeError": ".errors",
    "IntegrityError": ".errors",
    "MalformedObjectError": ".errors",
    "ConfigDowngradedError": ".errors",
    "UnsafePathError": ".errors",
    "FileFormatError": ".errors",
    "WatchLockedError": ".errors",
    "NotBackedUpError": ".errors",
    "DrillFailedError": ".errors",
    "BackupSupersededError": ".errors",
    "BackupCancelledError": ".errors",
    "CheckpointLostError": ".errors",
    "FlushTimeoutError": ".errors",
    "BackupTimeoutError": ".errors",
    "IndexRepair": ".ops.repair",
    "BackupHandle": ".ops.async_backup",
    "CheckReport": ".ops.check",
    "DrillReport": ".ops.drill",
    "FileChange": ".ops.inspect",
    "CopyResult": ".ops.copy",
    "FileContents": ".ops.inspect",
    "FileUsage": ".ops.inspect",
    "PruneResult": ".ops.prune",
    "SnapshotDiff": ".ops.inspect",
    "TensorChanges": ".ops.inspect",
    "TensorRow": ".ops.inspect",
    "RestoreResult": ".ops.restore",
    "SnapshotStats": ".ops.stats",
    "VaultStats": ".ops.stats",
    "BackupStatus": ".ops.status",
    "LostCheckpoint": ".ops.watch_options",
    "ShippedCheckpoint": ".ops.watch_options",
    "WatchResult": ".ops.watch_options",
    "LockInfo": ".repository.locks",
    "FileEntry": ".snapshot.model",
    "Snapshot": ".snapshot.model",
    "SnapshotSummary": ".snapshot.model",
    "Vault": ".vault",
    "default_repo_url": ".location",
    "keep_freed_memory": ".ops.memory",
    "Keyfile": ".crypto.keyfile",
    "Progress": ".ops.progress",
    "RepoConfig": ".repository.config",
    "SnapshotFile": ".ops.reader",
    "RetentionPlan": ".snapshot.retention",
    "Decision": ".snapshot.retention",
    "GcPlan": ".ops.gc",
    "Problem": ".ops.check",
    "TensorStats": ".ops.tensorstats",
    "LoadCheck": ".ops.load_checks",
    "ObjectNotFoundError": ".errors",
    "ShortReadError": ".errors",
    "ObjectExistsError": ".errors",
}

if TYPE_CHECKING:
    from typing import Any

    from .chunking import ChunkerParams
    from .codec import CompressionSettings
    from .crypto.keyfile import Keyfile
    from .errors import (
        BackupCancelledError,
        BackupSupersededError,
        BackupTimeoutError,
        CheckpointLostError,
        CkptVaultError,
        ConfigDowngradedError,
        CopyIncompleteError,
        CopyNeedsUpgradeError,
        DrillFailedError,
        FileFormatError,
        FlushTimeoutError,
        ForeignRepositoryError,
        IntegrityError,
        KeyfileCorruptError,
        KeyfileMismatchError,
        KeyfileNotFoundError,
        LockLostError,
        MalformedObjectError,
        NotBackedUpError,
        ObjectExistsError,
        ObjectNotFoundError,
        PassphraseRequiredError,
        PathNotInSnapshotError,
        RestoreConflictError,
        RestoreIncompleteError,
        ShortReadError,
        SnapshotNotFoundError,
        SourceError,
        StorageError,
        StorageFullError,
        UnsafePathError,
        UnsupportedFormatError,
        UsageError,
        VaultExistsError,
        VaultLockedError,
        VaultNotFoundError,
        WatchLockedError,
        WrongPassphraseError,
    )
    from .location import default_repo_url
    from .ops.async_backup import BackupHandle
    from .ops.check import CheckReport, Problem
    from .ops.copy import CopyResult
    from .ops.drill import DrillReport
    from .ops.gc import GcPlan
    from .ops.inspect import FileChange, FileContents, FileUsage, SnapshotDiff, TensorChanges, TensorRow
    from .ops.load_checks import LoadCheck
    from .ops.memory import keep_freed_memory
    from .ops.progress import Progress
    from .ops.prune import PruneResult
    from .ops.reader import SnapshotFile
    from .ops.repair import IndexRepair
    from .ops.restore import RestoreResult
    from .ops.stats import SnapshotStats, VaultStats
    from .ops.status import BackupStatus
    from .ops.tensorstats import TensorStats
    from .ops.watch_options import LostCheckpoint, ShippedCheckpoint, WatchResult
    from .repository.config import RepoConfig
    from .repository.locks import LockInfo
    from .snapshot.model import FileEntry, Snapshot, SnapshotSummary
    from .snapshot.retention import Decision, RetentionPlan
    from .vault import Vault


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ckptvault' has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "BackupCancelledError",
    "BackupHandle",
    "BackupStatus",
    "BackupSupersededError",
    "BackupTimeoutError",
    "CheckReport",
    "CheckpointLostError",
    "ChunkerParams",
    "CkptVaultError",
    "CompressionSettings",
    "ConfigDowngradedError",
    "CopyIncompleteError",
    "CopyNeedsUpgradeError",
    "CopyResult",
    "Decision",
    "DrillFailedError",
    "DrillReport",
    "FileChange",
    "FileContents",
    "FileEntry",
    "FileFormatError",
    "FileUsage",
    "FlushTimeoutError",
    "ForeignRepositoryError",
    "GcPlan",
    "IndexRepair",
    "IntegrityError",
    "Keyfile",
    "KeyfileCorruptError",
    "KeyfileMismatchError",
    "KeyfileNotFoundError",
    "LoadCheck",
    "LockInfo",
    "LockLostError",
    "LostCheckpoint",
    "MalformedObjectError",
    "NotBackedUpError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "PassphraseRequiredError",
    "PathNotInSnapshotError",
    "Problem",
    "Progress",
    "PruneResult",
    "RepoConfig",
    "RestoreConflictError",
    "RestoreIncompleteError",
    "RestoreResult",
    "RetentionPlan",
    "ShippedCheckpoint",
    "ShortReadError",
    "Snapshot",
    "SnapshotDiff",
    "SnapshotFile",
    "SnapshotNotFoundError",
    "SnapshotStats",
    "SnapshotSummary",
    "SourceError",
    "StorageError",
    "StorageFullError",
    "TensorChanges",
    "TensorRow",
    "TensorStats",
    "UnsafePathError",
    "UnsupportedFormatError",
    "UsageError",
    "Vault",
    "VaultExistsError",
    "VaultLockedError",
    "VaultNotFoundError",
    "VaultStats",
    "WatchLockedError",
    "WatchResult",
    "WrongPassphraseError",
    "__version__",
    "default_repo_url",
    "keep_freed_memory",
]
