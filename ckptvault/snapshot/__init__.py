"""Snapshots: the model, the manifest codec and snapshot selection (no storage here)."""

from .model import FileEntry, Snapshot, SnapshotSummary

__all__ = ["FileEntry", "Snapshot", "SnapshotSummary"]
