"""Copy: snapshots of one vault into another (restic's ``copy``), e.g. a second location for the
same checkpoints, or a vault moved to new storage, to encryption, or to the newest format.

A copy keeps the snapshot's ID, time, host, paths, tags and description, so ``latest --tag run=x``
finds the same save in both vaults and a snapshot already in the destination is not copied again.
Its chunks keep their boundaries. Each is read (and verified) from the source only when the
destination may lack it: two vaults whose chunk IDs are computed alike (both unencrypted, or
encrypted under one key) name a chunk the same way, so one already in the destination is not even
downloaded; otherwise every chunk is read, since its ID in the destination is a keyed hash of its
bytes. Chunks are coded by the destination's own settings (compression, the tensor-aware byte
grouping, encryption, delta coding), never copied as stored blobs. A chunk the source stores as a
delta is coded against the destination's copy of its base, when the destination codes deltas and
holds that base as a keyframe (copied before it, oldest snapshot first), and the delta still pays
there: the base was read from the source anyway, to decode the chunk. So a copy of a delta-coded
series stays about as small as its source.

Memory is bounded as in a backup: a window of chunks being read (``INFLIGHT_BYTES``) and the
destination's pipeline of chunks being coded and packed. A copy stopped part way writes no
snapshot for the one it was copying (the chunks already stored are reused by the next run).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from ..errors import (
    CkptVaultError,
    IntegrityError,
    ObjectNotFoundError,
    SnapshotNotFoundError,
    UnsupportedFormatError,
    check_hint,
    spelled,
)
from ..hashing import new_file_hasher
from ..repository import Repository
from ..snapshot.manifest import decode_tree, encode_snapshot, encode_tree
from ..snapshot.model import FileEntry, Snapshot
from .backup import ChunkPipeline
from .catalog import decode_naming, select_snapshot, unreadable_named
from .deltabase import KEYFRAME_INTERVAL, BaseCandidate, DeltaPlanner
from .elements import ElementMap, element_map
from .memory import INFLIGHT_BYTES, releasing_freed_memory
from .progress import NullProgress, Progress
from .reader import ChunkedFile

MAX_AHEAD = 256  # chunks read ahead, when most are skipped (the bytes are capped too)
_PROBE = b"ckptvault: are chunk IDs computed alike in both vaults?"
_TREE_ID_DOMAIN = b"ckptvault copy: tree of snapshot\0"

Base = tuple[bytes, bytes | memoryview]  # a delta base: its ID in the destination, its bytes
Read = tuple[bytes | memoryview, Base | None]  # a chunk's bytes, and its base when the source stores a delta


@dataclass
class CopyResult:
    copied: list[Snapshot] = field(default_factory=list)  # as written to the destination (dry run: to copy)
    already_there: list[Snapshot] = field(default_factory=list)  # in both vaults before the copy
    gone: list[Snapshot] = field(default_factory=list)  # forgotten or retagged in the source while copying
    failed: dict[str, str] = field(default_factory=dict)  # snapshot ID -> why it could not be read in the source
    newer: list[str] = field(default_factory=list)  # of ``failed``, those holding what a newer ckptvault wrote
    read_bytes: int = 0  # chunk bytes read from the source (a few twice: a file's tensor header)
    new_bytes: int = 0  # raw bytes of the chunks the destination did not hold
    delta_chunks: int = 0  # of those chunks, how many were stored as deltas
    stored_bytes: int = 0  # bytes written to the destination (packs, index, trees)


def choose_snapshots(
    every: list[Snapshot],
    unreadable: Mapping[str, CkptVaultError],
    specs: Sequence[str | Snapshot] | None,
    tags: dict[str, str] | None,
    source_url: str,
) -> list[Snapshot]:
    """The snapshots of the source (``every``, oldest first) a copy takes: all (those with ``tags``),
    or the given ones. One given that names an object which cannot be read raises its error, not "no
    snapshot"; errors say that they are of the source vault."""
    if specs is None:
        return [s for s in every if s.matches(tags)]
    names = [s.id if isinstance(s, Snapshot) else s for s in specs]
    for name in names:
        if (bad := unreadable_named(name, every, unreadable)) is not None:
            error = unreadable[bad]
            see = spelled(f"ckptvault check --repo {source_url}", "check() of the source Vault")
            raise type(error)(f"in {source_url}: {error}; see: {see}")
    try:
        picked = [select_snapshot(every, name, tags, unreadable) for name in names]
    except SnapshotNotFoundError as exc:  # say which of the two vaults has none
        of_source = spelled(f"ckptvault snapshots --repo {source_url}", "source.snapshots()")
        listing = spelled("ckptvault snapshots", "Vault.snapshots()")  # as selection spells it
        exc.args = (f"in {source_url}: {exc}".replace(listing, of_source),)
        raise
    return list({s.id: s for s in picked}.values())


def mirror_gaps(unreadable: Mapping[str, CkptVaultError], dest: Repository) -> dict[str, str]:
    """For a copy of all snapshots: the source's damaged snapshot objects the destination lacks, with
    why (one it holds was copied before the damage; one of a newer ckptvault was warned about, and an
    upgrade copies it)."""
    return {
        snapshot_id: str(error)
        for snapshot_id, error in sorted(unreadable.items())
        if isinstance(error, IntegrityError) and not dest.has_snapshot(bytes.fromhex(snapshot_id))
    }


def same_chunk_ids(source: Repository, dest: Repository) -> bool:
    """Whether a chunk has one ID in both vaults (then the destination's index says what it lacks)."""
    return source.chunk_id(_PROBE) == dest.chunk_id(_PROBE)


@releasing_freed_memory
def run_copy(
    source: Repository,
    dest: Repository,
    snapshots: list[Snapshot],
    *,
    progress: Progress | None = None,
    workers: int | None = None,
    before_commit: Callable[[], None] | None = None,
    dry_run: bool = False,
) -> CopyResult:
    """Copy ``snapshots`` (oldest first) that the destination does not hold yet. Both vaults must be
    locked by the caller (the source to read, the destination as a backup locks it); ``before_commit``
    runs before each snapshot object is written."""
    progress = progress or NullProgress()
    result = CopyResult()
    todo: list[Snapshot] = []
    for snap in sorted(snapshots, key=lambda s: s.time):
        (result.already_there if dest.has_snapshot(bytes.fromhex(snap.id)) else todo).append(snap)
    if dry_run:
        result.copied = todo
        return result
    progress.start(sum(s.summary.logical_bytes for s in todo), sum(s.summary.files for s in todo))
    copier = _Copier(source, dest, result, progress, workers or os.cpu_count() or 2)
    try:
        for snap in todo:
            try:
                copied = copier.snapshot(snap, before_commit)
            except (IntegrityError, ObjectNotFoundError, UnsupportedFormatError) as exc:
                # damaged in the source, or written by a newer ckptvault (a chunk of a codec this one does not know,
                # which stopped the whole copy with the next snapshots not even tried): the others still go; the
                # advice to check names no vault: in a copy that would be the destination
                result.failed[snap.id] = str(exc).removesuffix(check_hint())
                if isinstance(exc, UnsupportedFormatError):
                    result.newer.append(snap.id)
                copier.start_again()
                continue
            (result.copied if copied is not None else result.gone).append(copied or snap)
    finally:
        copier.close()
        progress.finish()
    return result


class _Copier:
    def __init__(self, source: Repository, dest: Repository, result: CopyResult, progress: Progress, workers: int):
        self.source = source
        self.dest = dest
        self.result = result
        self.progress = progress
        self.workers = workers
        self.shared_ids = same_chunk_ids(source, dest)
        self.planner = DeltaPlanner(dest, None, None) if dest.codec.compressor.deltas else None
        self.readers = ThreadPoolExecutor(source.download_concurrency, thread_name_prefix="ckptvault-copy")

    def close(self) -> None:
        self.readers.shutdown(wait=True, cancel_futures=True)

    def start_again(self) -> None:
        """After a snapshot failed (its writes aborted): the destination's index as stored, less what is
        gone or cut short there, as the copy began with (a plain reload brought such chunks back, and
        the next snapshot deduplicated against them), and a planner that counts no aborted delta."""
        self.dest.load_index_as_stored()
        self.dest.reconcile_with_stored_packs()
        if self.planner is not None:
            self.planner = DeltaPlanner(self.dest, None, None)

    def snapshot(self, snap: Snapshot, before_commit: Callable[[], None] | None) -> Snapshot | None:
        """``snap`` as written to the destination, after its tree and every chunk it names; None when
        the source no longer holds it (a forget or a retag there since it was listed)."""
        dest = self.dest
        try:
            raw_tree = self.source.load_tree(bytes.fromhex(snap.tree_id))  # its errors name the object
        except ObjectNotFoundError:
            if self.source.has_snapshot(bytes.fromhex(snap.id)):
                raise
            return None
        tree = decode_naming(f"tree object {snap.tree_id[:12]}", decode_tree, raw_tree)
        written_before = dest.bytes_written
        with dest.aborting_writes_on_error():
            pipeline = ChunkPipeline(dest, self.progress, self.workers, self.planner)
            try:
                entries = [self._file(entry, pipeline) if entry.type == "file" else entry for entry in tree]
                pipeline.drain()
                dest.flush()
            finally:
                pipeline.close()
            # Everything the copy writes under a name is fixed by the source snapshot, so that writing
            # it again (a copy after the destination forgot it, two copies at once) writes the same
            # object: every host's metadata cache keeps objects by name, as immutable. Hence a tree ID
            # derived from the tree (keyed in an encrypted vault, like chunk IDs) and the summary of the
            # backup as it was made (the delta figures left out: they depend on what the destination held).
            raw = encode_tree(entries)
            tree_id = dest.save_tree(raw, dest.chunk_id(_TREE_ID_DOMAIN + bytes.fromhex(snap.id) + raw))
            copied = replace(
                snap,
                tree_id=tree_id.hex(),
                summary=replace(snap.summary, delta_chunks=0, delta_bytes=0, delta_stored_bytes=0, delta_saved_bytes=0),
            )
            if before_commit:
                before_commit()
            dest.save_snapshot(bytes.fromhex(copied.id), encode_snapshot(copied))
        self.result.new_bytes += pipeline.new_bytes
        self.result.delta_chunks += pipeline.delta_chunks
        self.result.stored_bytes += dest.bytes_written - written_before
        return copied

    def _file(self, entry: FileEntry, pipeline: ChunkPipeline) -> FileEntry:
        """The file's entry in the destination, its chunks stored there. Chunks are read ahead on the
        source's download threads and handed to the pipeline in file order; the whole-file hash is
        checked when every chunk was read (each is also verified against its ID as it is read)."""
        copy = replace(entry, chunks=[])
        try:
            self._copy_chunks(entry, copy, pipeline)
        except (IntegrityError, ObjectNotFoundError) as exc:  # say which of the two vaults is damaged
            exc.args = (f"{entry.path} in {self.source.store.url}: {exc}",)
            raise
        return copy

    def _copy_chunks(self, entry: FileEntry, copy: FileEntry, pipeline: ChunkPipeline) -> None:
        emap: ElementMap | bool | None = self.dest.codec.compressor.groups  # True: not read yet
        hasher = new_file_hasher()
        read_all = True
        offset = 0
        for index, (chunk_id, length, read) in enumerate(self._chunks_in_order(entry)):
            if read is None:  # the destination holds it under the same ID: nothing to read or store
                read_all = False
                pipeline.add_stored(copy, chunk_id, length)
            else:
                data, base = read
                hasher.update(data)
                self.result.read_bytes += len(data)
                if emap is True:  # the file's tensor layout, for the destination's byte grouping
                    header = ChunkedFile(self.source, entry, cache_chunks=2, known={index: data})
                    emap = element_map(header.read_at, entry.size, entry.path, self.dest.codec.compressor)
                    self.result.read_bytes += header.fetched_bytes
                runs = emap.runs(offset, len(data)) if emap else ()
                pipeline.submit(copy, memoryview(data), runs, self._base_candidate(base, entry.path) if base else None)
            offset += length
        if read_all and hasher.hexdigest() != entry.blake3:
            raise IntegrityError("the bytes read do not match its file hash")

    def _base_candidate(self, base: Base, path: str) -> BaseCandidate | None:
        """The destination's keyframe to code a chunk against, which the source stores as a delta
        against the same bytes; None when the destination lacks it (its snapshot not copied), holds
        it as a delta itself, or it has served its deltas (chains stay as short as a backup's)."""
        assert self.planner is not None
        base_id, data = base
        loc = self.dest.index.get(base_id)
        if loc is None or loc.base_id is not None or self.planner.uses[base_id] >= KEYFRAME_INTERVAL - 1:
            return None
        return BaseCandidate(base_id, None, path, data)

    def _read(self, chunk_id: bytes) -> Read:
        """On a download thread: the chunk's bytes (verified), and its delta base when there is one
        the destination may code it against."""
        if self.planner is None:
            return self.source.read_chunk(chunk_id), None
        data, base_id, base = self.source.read_chunk_and_base(chunk_id)
        if base_id is None or base is None:
            return data, None
        return data, (base_id if self.shared_ids else self.dest.chunk_id(base), base)

    def _chunks_in_order(self, entry: FileEntry) -> Iterator[tuple[bytes, int, Read | None]]:
        """(chunk ID, length, what was read or None when the destination holds it already), in file
        order. The bytes read ahead are capped, a delta's base counted with it."""
        ahead: deque[tuple[bytes, int, int, Future[Read] | None]] = deque()  # ID, length, bytes held, read
        ahead_bytes = 0
        try:
            for chunk_id in entry.chunks:
                loc = self.source.locate(chunk_id)
                if self.shared_ids and self.dest.has_chunk(chunk_id):
                    ahead.append((chunk_id, loc.raw_len, 0, None))
                else:
                    held = loc.raw_len * (2 if self.planner and loc.base_id else 1)
                    ahead.append((chunk_id, loc.raw_len, held, self.readers.submit(self._read, chunk_id)))
                    ahead_bytes += held
                while ahead_bytes > INFLIGHT_BYTES or len(ahead) > MAX_AHEAD:
                    done_id, done_len, done_held, future = ahead.popleft()
                    ahead_bytes -= done_held
                    yield done_id, done_len, None if future is None else future.result()
            while ahead:
                done_id, done_len, _, future = ahead.popleft()
                yield done_id, done_len, None if future is None else future.result()
        finally:  # stopped part way (a damaged chunk, Ctrl-C): read no further
            for _, _, _, future in ahead:
                if future is not None:
                    future.cancel()
