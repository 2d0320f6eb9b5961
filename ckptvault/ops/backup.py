"""Backup: scan -> chunk -> hash -> (dedup) -> compress -> pack, on a bounded pipeline.

The calling thread reads and chunks each file (the chunker holds the GIL) and keeps the
whole-file hash; a pool hashes and compresses chunks (BLAKE3 and zstd release the GIL);
the repository uploads sealed packs on its own threads. Results are consumed in order, so
memory is bounded by the in-flight window (blocks + chunks + a few packs), never by file
size. The snapshot is written last, after the index that covers every chunk it names.
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone

from ..blob import Kind
from ..bytegroup import ElementRun
from ..chunking import iter_chunks
from ..errors import SourceError, UsageError
from ..hashing import new_file_hasher
from ..repository import Repository
from ..snapshot.manifest import encode_snapshot, encode_tree
from ..snapshot.model import FileEntry, Snapshot, SnapshotSummary
from .elements import ElementMap, element_map
from .progress import NullProgress, Progress
from .scan import SourceItem, scan_sources

ON_CHANGE = ("warn", "skip", "fail")  # what to do with a file that changed while read, twice


@dataclass(frozen=True)
class BackupResult:
    snapshot: Snapshot
    warnings: list[str]


def _prepare_chunk(repo: Repository, data: memoryview, runs: tuple[ElementRun, ...]) -> tuple[bytes, bytes | None]:
    """Worker: hash, and encode only when the chunk is not stored yet."""
    chunk_id = repo.chunk_id(data)
    if repo.has_chunk(chunk_id):
        return chunk_id, None
    return chunk_id, repo.codec.encode(Kind.CHUNK, chunk_id, data, runs)


def _unchanged(item: SourceItem, old: FileEntry, repo: Repository) -> bool:
    st = item.st
    return (
        old.type == "file"
        and old.size == st.st_size
        and old.mtime_ns == st.st_mtime_ns
        and old.inode == st.st_ino
        and old.ctime_ns == st.st_ctime_ns
        and all(c in repo.index for c in old.chunks)
    )


class _Pipeline:
    def __init__(self, repo: Repository, progress: Progress, workers: int) -> None:
        self.repo = repo
        self.progress = progress
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="ckptvault-chunk")
        self.window = workers * 4
        self.inflight: deque[tuple[FileEntry, Future[tuple[bytes, bytes | None]], int]] = deque()
        self.new_bytes = 0
        self.new_chunks = 0

    def submit(self, entry: FileEntry, data: memoryview, runs: tuple[ElementRun, ...] = ()) -> None:
        self.inflight.append((entry, self.pool.submit(_prepare_chunk, self.repo, data, runs), len(data)))
        while len(self.inflight) > self.window:
            self._drain_one()

    def _drain_one(self) -> None:
        entry, future, size = self.inflight.popleft()
        chunk_id, blob = future.result()
        entry.chunks.append(chunk_id)
        if blob is not None and self.repo.add_chunk(chunk_id, blob, size):
            self.new_bytes += size
            self.new_chunks += 1
        self.progress.advance(size)

    def drain(self) -> None:
        while self.inflight:
            self._drain_one()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def run_backup(
    repo: Repository,
    sources: list[str],
    *,
    tags: dict[str, str],
    description: str,
    hostname: str,
    parent: Snapshot | None,
    parent_tree: list[FileEntry] | None,
    force_read: bool = False,
    skip_unreadable: bool = False,
    on_change: str = "warn",
    progress: Progress | None = None,
    workers: int | None = None,
    before_commit: Callable[[], None] | None = None,
) -> BackupResult:
    """``before_commit`` runs just before the snapshot object is written (the lock check)."""
    if on_change not in ON_CHANGE:
        raise UsageError(f"--on-change {on_change!r} is not one of {', '.join(ON_CHANGE)}")
    progress = progress or NullProgress()
    started = time.monotonic()
    when = datetime.now(timezone.utc)
    scan = scan_sources(sources, skip_unreadable=skip_unreadable)
    warnings = list(scan.warnings)
    old_files = {e.path: e for e in (parent_tree or []) if e.type == "file"}
    files = [i for i in scan.items if i.kind == "file"]
    progress.start(sum(i.st.st_size for i in files), len(files))
    written_before = repo.bytes_written

    entries: list[FileEntry] = []
    read_bytes = 0
    pipeline = _Pipeline(repo, progress, workers or os.cpu_count() or 2)
    try:
        for item in scan.items:
            entry = FileEntry(item.path, item.kind, stat.S_IMODE(item.st.st_mode), item.st.st_mtime_ns)
            if item.kind == "symlink":
                entry.target = os.readlink(item.abs_path)
            elif item.kind == "file":
                old = old_files.get(item.path)
                if old is not None and not force_read and _unchanged(item, old, repo):
                    entry.size, entry.blake3, entry.chunks = old.size, old.blake3, list(old.chunks)
                    entry.inode, entry.ctime_ns = old.inode, old.ctime_ns
                    progress.advance(entry.size)
                else:
                    read = _read_file(item, entry, pipeline, warnings, skip_unreadable, on_change)
                    if read is None:
                        continue
                    entry = read
                    read_bytes += entry.size
            entries.append(entry)
        pipeline.drain()
        repo.flush()
    finally:
        pipeline.close()
        progress.finish()

    tree_id = repo.save_tree(encode_tree(entries))
    file_entries = [e for e in entries if e.type == "file"]
    snapshot_id = secrets.token_bytes(32)
    # stored_bytes counts packs, index and tree; not the snapshot object (a few hundred bytes).
    summary = SnapshotSummary(
        files=len(file_entries),
        dirs=sum(e.type == "dir" for e in entries),
        symlinks=sum(e.type == "symlink" for e in entries),
        logical_bytes=sum(e.size for e in file_entries),
        read_bytes=read_bytes,
        new_bytes=pipeline.new_bytes,
        stored_bytes=repo.bytes_written - written_before,
        chunks=sum(len(e.chunks) for e in file_entries),
        new_chunks=pipeline.new_chunks,
        duration_s=round(time.monotonic() - started, 3),
    )
    snapshot = Snapshot(
        id=snapshot_id.hex(),
        time=when,
        hostname=hostname,
        paths=scan.source_paths,
        tags=dict(tags),
        description=description,
        parent=parent.id if parent else None,
        tree_id=tree_id.hex(),
        summary=summary,
    )
    if before_commit:
        before_commit()
    repo.save_snapshot(snapshot_id, encode_snapshot(snapshot))
    return BackupResult(snapshot, warnings)


def _read_file(
    item: SourceItem, base: FileEntry, pipeline: _Pipeline, warnings: list[str], skip_unreadable: bool, on_change: str
) -> FileEntry | None:
    """Chunk one file into the pipeline; returns its entry, or None when it is left out.

    A file whose size, mtime or ctime moved while it was read is read once more (a writer
    may just have finished); if it moves again, ``on_change`` decides."""
    for _attempt in (1, 2):
        entry = FileEntry(base.path, base.type, base.mode, base.mtime_ns)
        try:
            changed = _read_once(item, entry, pipeline)
        except PermissionError as exc:
            if not skip_unreadable:
                raise SourceError(
                    item.abs_path, exc.strerror or str(exc), "use --skip-unreadable to back up the rest"
                ) from exc
            warnings.append(f"skipped unreadable file {item.abs_path}: {exc.strerror}")
            return None
        except FileNotFoundError:
            warnings.append(f"skipped {item.abs_path}: it was deleted during the backup")
            return None
        except OSError as exc:
            raise SourceError(item.abs_path, exc.strerror or str(exc)) from exc
        if not changed:
            return entry
    if on_change == "fail":
        raise SourceError(item.abs_path, "it changed while it was read, twice", "use --on-change warn or skip")
    if on_change == "skip":
        warnings.append(f"skipped {item.abs_path}: it changed while it was read, twice")
        return None
    warnings.append(f"{item.abs_path} changed while it was read, twice; the snapshot holds the bytes read last")
    return entry


def _element_map(fd: int, size: int, path: str, repo: Repository) -> ElementMap | None:
    """Tensor element widths from the file's header, for the dtype-aware codec (chunks only)."""
    if not repo.codec.compressor.groups:
        return None
    return element_map(lambda offset, length: os.pread(fd, length, offset), size, path, repo.codec.compressor)


def _read_once(item: SourceItem, entry: FileEntry, pipeline: _Pipeline) -> bool:
    """Read, hash and submit the file's chunks; True when it changed meanwhile."""
    hasher = new_file_hasher()
    size = 0
    with open(item.abs_path, "rb", buffering=0) as f:
        before = os.fstat(f.fileno())
        emap = _element_map(f.fileno(), before.st_size, item.path, pipeline.repo)
        for data in iter_chunks(f, pipeline.repo.config.chunker):
            hasher.update(data)
            pipeline.submit(entry, data, emap.runs(size, len(data)) if emap else ())
            size += len(data)
        after = os.fstat(f.fileno())
    entry.size = size
    entry.blake3 = hasher.hexdigest()
    entry.mtime_ns, entry.inode, entry.ctime_ns = before.st_mtime_ns, before.st_ino, before.st_ctime_ns
    moved = (before.st_size, before.st_mtime_ns, before.st_ctime_ns) != (
        after.st_size,
        after.st_mtime_ns,
        after.st_ctime_ns,
    )
    return moved or size != before.st_size
