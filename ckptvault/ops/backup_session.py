"""One backup as the Vault runs it, under its lock: the snapshots it builds on, chosen from the vault's
(the parent whose unchanged files are not read again, the delta reference, the twin that
``skip_if_unchanged`` compares with), then ``run_backup``, then the index compaction."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from ..errors import CkptVaultError
from ..repository import Repository
from ..snapshot.model import FileEntry, Snapshot
from .backup import BackupResult, OnChange, run_backup, twin_snapshot
from .catalog import TreeLoader
from .compact import compact_or_warn
from .deltabase import reference_snapshot
from .progress import Progress
from .scan import Excludes


def vault_backup(
    repo: Repository,
    snapshots: list[Snapshot],
    load_tree: TreeLoader,
    sources: list[str],
    abs_paths: list[str],
    *,
    tags: dict[str, str],
    description: str,
    hostname: str,
    excludes: Excludes,
    skip_if_unchanged: bool,
    force_read: bool,
    skip_unreadable: bool,
    on_change: OnChange,
    progress: Progress | None,
    before_commit: Callable[[], None],
    vault_folder: str | None,
    taken_at: datetime | None,
) -> BackupResult:
    """``run_backup`` of ``sources`` (``abs_paths``: sorted, absolute) against the vault's ``snapshots``.
    The result's warnings name first the trees it went on without, last a failed index compaction."""
    same_source = [s for s in snapshots if s.hostname == hostname and sorted(s.paths) == abs_paths]
    parent = max(same_source, key=lambda s: s.time) if same_source else None
    # Delta coding's bases come from the previous save of the same run (ops/deltabase.py).
    deltas = repo.codec.compressor.deltas
    reference = reference_snapshot(snapshots, hostname, tags, parent, taken_at) if deltas else None
    twin = twin_snapshot(snapshots, hostname, tags, abs_paths, excludes) if skip_if_unchanged else None
    trees, unreadable = _trees_if_readable([parent, reference, twin], load_tree)
    try:
        result = run_backup(
            repo,
            sources,
            tags=tags,
            description=description,
            hostname=hostname,
            parent=parent,
            parent_tree=trees.get(parent.id) if parent else None,
            force_read=force_read,
            skip_unreadable=skip_unreadable,
            on_change=on_change,
            progress=progress,
            before_commit=before_commit,
            reference=reference if reference and reference.id in trees else None,
            reference_tree=trees.get(reference.id) if reference else None,
            unless_same_as=(twin, trees[twin.id]) if twin and twin.id in trees else None,
            vault_folder=vault_folder,
            exclude=excludes,
            taken_at=taken_at,
        )
    except BaseException:
        repo.reconcile_next_time()  # what it uploaded is adopted, not sent again
        raise
    result.warnings[:0] = unreadable
    result.warnings.extend(compact_or_warn(repo))
    return result


def _trees_if_readable(
    snapshots: list[Snapshot | None], load_tree: TreeLoader
) -> tuple[dict[str, list[FileEntry]], list[str]]:
    """The trees of ``snapshots`` by snapshot ID, and a warning for each that cannot be read: a
    backup goes on without it (it reads every file, codes no delta against it, writes a new
    snapshot) instead of failing at every run because an older tree is damaged."""
    trees: dict[str, list[FileEntry]] = {}
    warnings: list[str] = []
    for snap in {s.id: s for s in snapshots if s is not None}.values():
        try:
            trees[snap.id] = load_tree(snap)
        except CkptVaultError as exc:
            warnings.append(f"cannot read the tree of snapshot {snap.short_id} ({exc}); backing up without it")
    return trees, warnings
