"""ckptvault: deduplicating, verified backups of ML training checkpoints to any fsspec store."""

from .chunking import ChunkerParams
from .codec import CompressionSettings
from .errors import CkptVaultError
from .ops.async_backup import BackupHandle
from .ops.drill import DrillReport
from .ops.inspect import FileChange, FileContents, FileUsage, SnapshotDiff, TensorChanges, TensorRow
from .ops.restore import RestoreResult
from .ops.stats import SnapshotStats, VaultStats
from .ops.status import BackupStatus
from .ops.watch import ShippedCheckpoint, WatchResult
from .snapshot.model import FileEntry, Snapshot, SnapshotSummary
from .vault import Vault, default_repo_url
from .version import __version__

__all__ = [
    "BackupHandle",
    "BackupStatus",
    "ChunkerParams",
    "CkptVaultError",
    "CompressionSettings",
    "DrillReport",
    "FileChange",
    "FileContents",
    "FileEntry",
    "FileUsage",
    "RestoreResult",
    "ShippedCheckpoint",
    "Snapshot",
    "SnapshotDiff",
    "SnapshotStats",
    "SnapshotSummary",
    "TensorChanges",
    "TensorRow",
    "Vault",
    "VaultStats",
    "WatchResult",
    "__version__",
    "default_repo_url",
]
