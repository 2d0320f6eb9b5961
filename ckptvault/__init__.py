"""ckptvault: deduplicating, verified backups of ML training checkpoints to any fsspec store."""

from .chunking import ChunkerParams
from .codec import CompressionSettings
from .errors import CkptVaultError
from .ops.restore import RestoreResult
from .ops.stats import SnapshotStats, VaultStats
from .snapshot.model import FileEntry, Snapshot, SnapshotSummary
from .vault import Vault, default_repo_url
from .version import __version__

__all__ = [
    "ChunkerParams",
    "CkptVaultError",
    "CompressionSettings",
    "FileEntry",
    "RestoreResult",
    "Snapshot",
    "SnapshotStats",
    "SnapshotSummary",
    "Vault",
    "VaultStats",
    "__version__",
    "default_repo_url",
]
