"""Backup: scan -> chunk -> hash -> (dedup) -> compress -> pack, on a bounded pipeline.

With delta coding (codec 3) tensor files are cut into tensor-aligned pieces (ops/pieces.py) and a
new piece may be coded against its base in the previous save (ops/deltabase.py).

The calling thread reads and chunks each file (the chunker holds the GIL) and keeps the
whole-file hash; a pool hashes and compresses chunks (BLAKE3 and zstd release the GIL);
the repository uploads sealed packs on its own threads. Results are consumed in order, so
memory is bounded by the in-flight window (blocks + chunks + a few packs), never by file
size. The snapshot is written last, after the index that covers every chunk it names.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import secrets
import stat
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal, TypeVar, get_args

from ..blob import BlobParts, Kind, blob_size
from ..bytegroup import ElementRun
from ..errors import FileFormatError, SourceError, UsageError, spelled
from ..formats import FileLayout, pread_at, read_layout
from ..hashing import new_file_hasher
from ..parallel_chunking import ChunkHelpers
from ..repository import Repository
from ..snapshot.manifest import encode_snapshot, encode_tree
from ..snapshot.model import FileEntry, Snapshot, SnapshotSummary
from ..store.options import env_number
from .deltabase import BaseCandidate, DeltaPlanner
from .elements import ElementMap, element_map_of
from .memory import INFLIGHT_BYTES, releasing_freed_memory
from .names import source_name
from .pieces import iter_segments, plan_segments, tensor_widths
from .progress import NullProgress, Progress
from .scan import NO_EXCLUDES, Excludes, SourceItem, scan_sources, unreadable_hint

OnChange = Literal["warn", "skip", "fail"]  # what to do with a file that changed while read, twice
ON_CHANGE: tuple[OnChange, ...] = get_args(OnChange)
T = TypeVar("T")

MAX_OPEN_BASE_FILES = 32  # local copies of the previous save kept open for delta bases (a checkpoint of many shards)
# A file changed this recently when its read began may change again without its mtime or ctime moving: the
# kernel stamps files from a clock that ticks every 1-10 ms (before Linux 6.13, and on filesystems without
# fine-grained stamps), and some filesystems keep whole seconds (FAT: two; a network filesystem stamps by its
# server's clock, which this cannot judge). Such a file's entry gets no inode and ctime, so the next backup
# reads it again instead of trusting its stat.
RACY_NS = 20_000_000
RACY_WHOLE_SECONDS_NS = 2_000_000_000
ENV_CHUNK_PROCESSES = "CKPTVAULT_CHUNK_PROCESSES"


def chunk_processes() -> int:
    """Helper processes that cut big files by content (parallel_chunking.py): none on one core, else
    one, and two beyond four cores, where they keep ahead of the reading thread."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    default = 0 if cores < 2 else 1 if cores <= 4 else 2
    return int(env_number(ENV_CHUNK_PROCESSES, default, hi=64, whole=True))


def on_change_hint() -> str:
    """What to give for a file a backup with --on-change fail refused (spelled as the caller typed it)."""
    return f"use {spelled('--on-change warn or skip', 'on_change=warn or skip')}"


def check_on_change(on_change: str) -> OnChange:
    for known in ON_CHANGE:
        if on_change == known:
            return known
    raise UsageError(f"{spelled('--on-change', 'on_change')} {on_change!r} is not one of {', '.join(ON_CHANGE)}")


# The chunks of a file this small are coded by the reading thread: their hand-off to a worker and back
# cost more than hashing and compressing them (10,000 files of 1-60 KB on 2 cores, in-process: 2.5-2.6 s
# with hand-offs, 1.9-2.0 s without). A bigger file's chunks, however small, are coded on the pool.
INLINE_FILE_BYTES = 64 * 1024


@dataclass(frozen=True)
class BackupResult:
    snapshot: Snapshot
    warnings: list[str]


@dataclass(frozen=True, slots=True)
class _Prepared:
    chunk_id: bytes
    blob: BlobParts | None  # None: already stored
    base_id: bytes | None = None  # the blob is a delta against this chunk
    saved: int = 0  # estimated bytes the delta saved over the plain coding


def _prepare_chunk(
    repo: Repository,
    data: memoryview,
    runs: tuple[ElementRun, ...],
    planner: DeltaPlanner | None,
    cand: BaseCandidate | None,
) -> _Prepared:
    """Worker: hash, and encode only when the chunk is not stored yet."""
    chunk_id = repo.chunk_id(data)
    if repo.has_chunk(chunk_id):
        return _Prepared(chunk_id, None)
    if planner is None:
        return _Prepared(chunk_id, repo.codec.encode_parts(Kind.CHUNK, chunk_id, data, runs))
    piece = planner.encode(chunk_id, data, runs, cand)
    return _Prepared(chunk_id, piece.blob, piece.base_id, piece.saved)


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


class ChunkPipeline:
    """Chunks coded on a pool and added to the repository in the order they were submitted."""

    def __init__(self, repo: Repository, progress: Progress, workers: int, planner: DeltaPlanner | None) -> None:
        self.repo = repo
        self.progress = progress
        self.planner = planner  # None: delta coding is off (content-defined chunks, as before codec 3)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="ckptvault-chunk")
        self.window = workers * 4
        self.inflight: deque[tuple[FileEntry, Future[_Prepared], int, int]] = deque()  # ..., length, bytes held
        self.inflight_bytes = 0
        self.new_bytes = 0
        self.new_chunks = 0
        self.delta_chunks = 0
        self.delta_bytes = 0  # raw bytes of the new chunks stored as deltas
        self.delta_stored = 0  # their blobs' bytes
        self.delta_saved = 0  # estimated bytes the deltas saved over the plain coding

    def submit(
        self,
        entry: FileEntry,
        data: memoryview,
        runs: tuple[ElementRun, ...] = (),
        cand: BaseCandidate | None = None,
        *,
        inline: bool = False,
    ) -> None:
        """``inline``: code the chunk on this thread (see INLINE_FILE_BYTES)."""
        if inline:
            future: Future[_Prepared] = Future()
            future.set_result(_prepare_chunk(self.repo, data, runs, self.planner, cand))
        else:
            future = self.pool.submit(_prepare_chunk, self.repo, data, runs, self.planner, cand)
        held = len(data) + (len(cand.given) if cand is not None and cand.given is not None else 0)
        self.inflight.append((entry, future, len(data), held))
        self.inflight_bytes += held
        while len(self.inflight) > self.window or self.inflight_bytes > INFLIGHT_BYTES:
            self._drain_one()

    def add_stored(self, entry: FileEntry, chunk_id: bytes, size: int) -> None:
        """A chunk the repository holds already, in its place among those submitted (copy)."""
        done: Future[_Prepared] = Future()
        done.set_result(_Prepared(chunk_id, None))
        self.inflight.append((entry, done, 0, 0))
        self.progress.advance(size)
        while len(self.inflight) > self.window:
            self._drain_one()

    def _drain_one(self) -> None:
        entry, future, size, held = self.inflight.popleft()
        self.inflight_bytes -= held
        done = future.result()
        entry.chunks.append(done.chunk_id)
        if done.blob is not None and self.repo.add_chunk(done.chunk_id, done.blob, size, done.base_id):
            self.new_bytes += size
            self.new_chunks += 1
            if done.base_id is not None:
                if self.planner is not None:  # the keyframe serves one more delta (copy codes many saves)
                    self.planner.uses[done.base_id] += 1
                self.delta_chunks += 1
                self.delta_bytes += size
                self.delta_stored += blob_size(done.blob)
                self.delta_saved += done.saved
        self.progress.advance(size)

    def drain(self) -> None:
        while self.inflight:
            self._drain_one()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@releasing_freed_memory
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
    on_change: OnChange = "warn",
    progress: Progress | None = None,
    workers: int | None = None,
    before_commit: Callable[[], None] | None = None,
    reference: Snapshot | None = None,
    reference_tree: list[FileEntry] | None = None,
    unless_same_as: tuple[Snapshot, list[FileEntry]] | None = None,
    vault_folder: str | None = None,
    exclude: Excludes = NO_EXCLUDES,
    taken_at: datetime | None = None,
) -> BackupResult:
    """``before_commit`` runs just before the snapshot object is written (the lock check).
    ``reference``: the snapshot whose files give delta bases (ops/deltabase.py), when the
    repository codes deltas. ``unless_same_as``: a snapshot and its tree; when the sources hold
    what it holds (``same_contents``), no snapshot is written and that one is returned.
    ``vault_folder``: the repository's local folder, never backed up into itself, and ``exclude``:
    what to leave out (``scan_sources``). ``taken_at``: the snapshot's time when not now (a pin's: when
    the checkpoint was pinned, however long it waited to ship)."""
    check_on_change(on_change)
    helpers = ChunkHelpers(repo.config.chunker, chunk_processes())  # starts nothing until a big file comes
    progress = progress or NullProgress()
    started = time.monotonic()
    when = taken_at or datetime.now(timezone.utc)
    scan = scan_sources(sources, skip_unreadable=skip_unreadable, vault_folder=vault_folder, exclude=exclude)
    if scan.vanished and on_change == "fail":  # a rotation that took a file: no snapshot missing it
        raise SourceError(scan.vanished[0], "it was deleted during the backup", on_change_hint())
    warnings = list(scan.warnings)
    old_files = {e.path: e for e in (parent_tree or []) if e.type == "file"}
    files = [i for i in scan.items if i.kind == "file"]
    progress.start(sum(i.st.st_size for i in files), len(files))
    written_before = repo.bytes_written

    # Under the caller's lock: if anything fails, wait for the packs in flight and forget every chunk
    # that no index object made durable, so the next backup starts from what the repository holds.
    with repo.aborting_writes_on_error():
        entries: list[FileEntry] = []
        read_bytes = 0
        planner = DeltaPlanner(repo, reference, reference_tree) if repo.codec.compressor.deltas else None
        pipeline = ChunkPipeline(repo, progress, workers or os.cpu_count() or 2, planner)
        try:
            for item in scan.items:
                entry = FileEntry(item.path, item.kind, stat.S_IMODE(item.st.st_mode), item.st.st_mtime_ns)
                if item.kind == "symlink":
                    target = _read_link(item, warnings, skip_unreadable, on_change)
                    if target is None:
                        continue
                    entry.target = target
                elif item.kind == "file":
                    old = old_files.get(item.path)
                    if old is not None and not force_read and _unchanged(item, old, repo):
                        entry.size, entry.blake3, entry.chunks = old.size, old.blake3, list(old.chunks)
                        entry.inode, entry.ctime_ns = old.inode, old.ctime_ns
                        progress.advance(entry.size)
                    else:
                        read = _read_file(item, entry, pipeline, helpers, warnings, skip_unreadable, on_change)
                        if read is None:
                            continue
                        entry = read
                        read_bytes += entry.size
                        if planner is not None and planner.open_files >= MAX_OPEN_BASE_FILES:
                            pipeline.drain()  # every piece coded against those files is done: close them
                            planner.close()
                entries.append(entry)
            pipeline.drain()
            repo.flush()
        finally:
            helpers.close()
            pipeline.close()
            if planner is not None:
                planner.close()
            progress.finish()

        if files and not any(e.type == "file" for e in entries):
            # every file was left out while it was read (--on-change skip, --skip-unreadable): an
            # empty snapshot would become `latest`, and a resume would restore nothing
            raise SourceError(scan.source_paths[0], "nothing left to back up", "; ".join(warnings))
        if unless_same_as is not None and same_contents(entries, unless_same_as[1]):
            return BackupResult(unless_same_as[0], warnings)
        tree_id = repo.save_tree(encode_tree(entries))
        snapshot_id = secrets.token_bytes(32)
        # stored_bytes counts packs, index and tree; not the snapshot object (a few hundred bytes).
        summary = _summary(entries, pipeline, read_bytes, repo.bytes_written - written_before, started)
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
            excludes=list(exclude.patterns),
        )
        if before_commit:
            before_commit()
        repo.save_snapshot(snapshot_id, encode_snapshot(snapshot))
    return BackupResult(snapshot, warnings)


def _summary(
    entries: list[FileEntry], pipeline: ChunkPipeline, read_bytes: int, stored_bytes: int, started: float
) -> SnapshotSummary:
    file_entries = [e for e in entries if e.type == "file"]
    return SnapshotSummary(
        files=len(file_entries),
        dirs=sum(e.type == "dir" for e in entries),
        symlinks=sum(e.type == "symlink" for e in entries),
        logical_bytes=sum(e.size for e in file_entries),
        read_bytes=read_bytes,
        new_bytes=pipeline.new_bytes,
        stored_bytes=stored_bytes,
        chunks=sum(len(e.chunks) for e in file_entries),
        new_chunks=pipeline.new_chunks,
        duration_s=round(time.monotonic() - started, 3),
        delta_chunks=pipeline.delta_chunks,
        delta_bytes=pipeline.delta_bytes,
        delta_stored_bytes=pipeline.delta_stored,
        delta_saved_bytes=pipeline.delta_saved,
    )


def twin_snapshot(
    snapshots: list[Snapshot], hostname: str, tags: dict[str, str], sources: list[str], exclude: Excludes
) -> Snapshot | None:
    """What ``skip_if_unchanged`` compares with: the newest snapshot from ``hostname`` that carries
    every one of ``tags`` and was taken of sources with the same names and the same exclude rules
    (the snapshot returned records them). Names, not paths: a pinned checkpoint is read from a new
    folder each time, under its own name."""

    def names(paths: list[str]) -> list[str]:
        return sorted(source_name(p) for p in paths)

    wanted = names(sources)
    twins = [
        s
        for s in snapshots
        if s.hostname == hostname
        and tags.items() <= s.tags.items()
        and names(s.paths) == wanted
        and _same_patterns(s.excludes, exclude)
    ]
    return max(twins, key=lambda s: s.time) if twins else None


def _same_patterns(recorded: list[str], exclude: Excludes) -> bool:
    try:
        return Excludes.parse(recorded).key() == exclude.key()
    except UsageError:  # patterns this ckptvault does not take
        return False


def same_contents(a: list[FileEntry], b: list[FileEntry]) -> bool:
    """Whether two trees restore to the same files: the same paths, types, modes, mtimes, sizes,
    content hashes and link targets (not inodes or ctimes, which a pin's hard link changes)."""

    def restored(entries: list[FileEntry]) -> list[tuple[object, ...]]:
        return sorted((e.path, e.type, e.mode, e.mtime_ns, e.size, e.blake3, e.target) for e in entries)

    return restored(a) == restored(b)


def _read_file(
    item: SourceItem,
    base: FileEntry,
    pipeline: ChunkPipeline,
    helpers: ChunkHelpers,
    warnings: list[str],
    skip_unreadable: bool,
    on_change: OnChange,
) -> FileEntry | None:
    """Chunk one file into the pipeline; returns its entry, or None when it is left out.

    A file whose size, mtime or ctime moved while it was read is read once more (a writer
    may just have finished); if it moves again, ``on_change`` decides."""
    for _attempt in (1, 2):
        entry = FileEntry(base.path, base.type, base.mode, base.mtime_ns)
        try:
            changed = _read_once(item, entry, pipeline, helpers)
        except _NotTheSource as wrapped:  # fails the backup whatever skip_unreadable says, as before
            exc = wrapped.error
            raise SourceError(item.abs_path, exc.strerror or str(exc)) from exc
        except OSError as exc:
            _left_out(item, exc, warnings, skip_unreadable, on_change)
            return None
        if not changed:
            return entry
    if on_change == "fail":
        raise SourceError(item.abs_path, "it changed while it was read, twice", on_change_hint())
    if on_change == "skip":
        warnings.append(f"skipped {item.abs_path}: it changed while it was read, twice")
        return None
    warnings.append(f"{item.abs_path} changed while it was read, twice; the snapshot holds the bytes read last")
    return entry


def _read_link(item: SourceItem, warnings: list[str], skip_unreadable: bool, on_change: OnChange) -> str | None:
    """The link's target, read where the scan found it (no link on the way followed); None when it is
    left out: gone or no longer a link (a trainer's ``latest`` link rotated), or unreadable."""
    try:
        return _at_source(item, lambda name, folder: os.readlink(name, dir_fd=folder))
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # readlink of what is no link (any more)
            exc = _NotALinkAnyMore()
        _left_out(item, exc, warnings, skip_unreadable, on_change)
        return None


def _left_out(item: SourceItem, exc: OSError, warnings: list[str], skip_unreadable: bool, on_change: OnChange) -> None:
    """A source file or link that could not be read after the scan: left out with a warning, or the
    backup fails (``SourceError``): gone or replaced as ``on_change`` says, unreadable as
    ``skip_unreadable`` says."""
    what = "link" if item.kind == "symlink" else "file"
    if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError, _NotAFileAnyMore, _NotALinkAnyMore)):
        # gone, replaced, or its folder by a file: the snapshot would miss it (a rotated checkpoint)
        if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
            why = "it was deleted during the backup"
        else:
            why = f"it was replaced by something that is not a {what} during the backup"
        if on_change == "fail":
            raise SourceError(item.abs_path, why, on_change_hint()) from exc
        warnings.append(f"skipped {item.abs_path}: {why}")
        return
    # EACCES; EIO from a failing disk, ESTALE on NFS...: skipped alike, as restic does
    reason = exc.strerror or str(exc)
    if not skip_unreadable:
        raise SourceError(item.abs_path, reason, unreadable_hint()) from exc
    warnings.append(f"skipped unreadable {what} {item.abs_path}: {reason}")


def _element_map(fd: int, size: int, path: str, repo: Repository, layout: FileLayout | None) -> ElementMap | None:
    """Tensor element widths from the file's ``layout``, for the dtype-aware codec (chunks only)."""
    compressor = repo.codec.compressor
    if not compressor.groups:
        return None
    return element_map_of(layout, pread_at(fd), size, path, compressor, sample_unknown=True)


def _layout(fd: int, size: int, path: str) -> FileLayout | None:
    try:
        return read_layout(pread_at(fd), size, path)
    except FileFormatError:  # a damaged header only costs the tensor-aware coding (read as no known format)
        return None


class _NotAFileAnyMore(OSError):
    """The path was replaced by something that is not a regular file (a FIFO, whose reads would
    block forever; a folder) after the scan."""


class _NotALinkAnyMore(OSError):
    """The path was replaced by something that is not a symlink after the scan."""


class _NotTheSource(Exception):
    """An OSError of the pipeline (no memory for a pack buffer, the vault's own disk), carried past
    ``_read_file``'s handlers: it must fail the backup, never be skipped as an unreadable source file
    (an earlier file's entry may already name the chunk that was not stored)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error)
        self.error = error


@contextlib.contextmanager
def _not_the_source() -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise _NotTheSource(exc) from exc


def _open_source(item: SourceItem) -> io.FileIO:
    """The file at the item's path (``_at_source``). O_NONBLOCK: a FIFO swapped in must not wait for a
    writer."""
    flags = os.O_RDONLY | os.O_NONBLOCK | (os.O_NOFOLLOW if item.root else 0)
    fd = _at_source(item, lambda name, folder: os.open(name, flags, dir_fd=folder))
    reached = open(fd, "rb", buffering=0)  # noqa: SIM115 - the caller closes it
    reached.name = item.abs_path  # for messages, as if opened by it
    return reached


def _at_source(item: SourceItem, act: Callable[[str, int | None], T]) -> T:
    """``act(name, folder)`` on the item: ``folder`` is an fd of the folder holding it (None for the working
    folder), reached from its source folder one name at a time, none of them followed if it is a symlink
    by now: a folder on the way, or the file itself, swapped for a link after the scan would store what the
    link points to (as root, another user's files), or open a device. A source named itself may be a link:
    it is followed, as the scan did."""
    if not item.root:
        return act(item.abs_path, None)
    *folders, name = _below(item.abs_path, item.root).split(os.sep)
    fd = os.open(item.root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for folder in folders:
            inner = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        return act(name, fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a link where the scan saw a file or a folder
            raise (_NotALinkAnyMore() if item.kind == "symlink" else _NotAFileAnyMore()) from exc
        raise
    finally:
        os.close(fd)


def _below(path: str, root: str) -> str:
    """``os.path.relpath(path, root)`` for a path the scan found under ``root``: its tail, without
    relpath's normalising (~6 µs of the ~190 a small file takes in an incremental backup here)."""
    if path.startswith(root) and path[len(root) : len(root) + 1] == os.sep:
        return path[len(root) + 1 :]
    return os.path.relpath(path, root)


def changed_too_recently(st: os.stat_result, now_ns: int) -> bool:
    """Whether a change made now could leave the file's stat as it is (``RACY_NS``): a file's stamps
    are at most one tick of the kernel's coarse clock behind ``time.time_ns()``, or whole seconds."""
    last = max(st.st_mtime_ns, st.st_ctime_ns)
    whole_seconds = st.st_mtime_ns % 1_000_000_000 == 0 and st.st_ctime_ns % 1_000_000_000 == 0
    return now_ns - last < (RACY_WHOLE_SECONDS_NS if whole_seconds else RACY_NS)


def _read_once(item: SourceItem, entry: FileEntry, pipeline: ChunkPipeline, helpers: ChunkHelpers) -> bool:
    """Read, hash and submit the file's chunks; True when it changed meanwhile."""
    hasher = new_file_hasher()
    size = 0
    repo = pipeline.repo
    with _open_source(item) as f:
        fd = f.fileno()
        started_ns = time.time_ns()  # a change made since, in the tick of the file's stamps, leaves them as they are
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise _NotAFileAnyMore
        entry.mode = stat.S_IMODE(before.st_mode)  # of the file read (one saved again by a rename has its own)
        # With delta coding, a file holding tensors big enough for aligned pieces is cut into them;
        # every other file is cut by content, exactly as without delta coding.
        needs_layout = pipeline.planner is not None or repo.codec.compressor.groups
        layout = _layout(fd, before.st_size, item.path) if needs_layout else None
        segments = plan_segments(layout, before.st_size, repo.config.chunker) if layout and pipeline.planner else []
        if pipeline.planner is None or not any(s.tensor for s in segments):
            emap = _element_map(fd, before.st_size, item.path, repo, layout)
            inline = before.st_size <= INLINE_FILE_BYTES
            for data in helpers.chunks(f, fd, before.st_size):
                hasher.update(data)
                with _not_the_source():
                    pipeline.submit(entry, data, emap.runs(size, len(data)) if emap else (), inline=inline)
                size += len(data)
        else:
            emap = tensor_widths(layout, pread_at(fd), repo.codec.compressor)
            with _not_the_source():
                bases = pipeline.planner.for_file(item.path, segments)
            for data, seg in iter_segments(f, segments, repo.config.chunker):
                hasher.update(data)
                cand = bases.get(size) if seg is not None else None
                with _not_the_source():
                    pipeline.submit(entry, data, emap.runs(size, len(data)) if emap else (), cand)
                size += len(data)
        after = os.fstat(fd)
    entry.size = size
    entry.blake3 = hasher.hexdigest()
    entry.mtime_ns = before.st_mtime_ns
    if not changed_too_recently(before, started_ns):
        entry.inode, entry.ctime_ns = before.st_ino, before.st_ctime_ns
    moved = (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns)
    # A ctime of its own changes with no byte written when the name is taken by a newer save (a rename
    # over it: its last link goes): the bytes read are then one whole save, not a torn one.
    replaced = after.st_nlink == 0
    return moved or (before.st_ctime_ns != after.st_ctime_ns and not replaced) or size != before.st_size
