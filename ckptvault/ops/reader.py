"""Random access to one file of a snapshot: only the chunks a read touches are fetched.

A file's chunk sizes come from the index (no fetch), so any byte offset maps to a chunk by a
binary search. Every fetched chunk is verified against its ID (``Repository.read_chunk``); the
whole-file hash is not checked, since a random reader never sees the whole file. A small LRU
cache of decoded chunks makes sequential reads of small pieces cost one fetch per chunk.
"""

from __future__ import annotations

import bisect
import io
import operator
import posixpath
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

from ..errors import IntegrityError, ObjectNotFoundError, PathNotInSnapshotError, SnapshotNotFoundError
from ..repository import Repository
from ..snapshot.model import FileEntry, Snapshot, stored_name

DEFAULT_CACHE_CHUNKS = 8  # chunks are at most 4 MiB: at most 32 MiB per open file, about 8 MiB on average


@dataclass(frozen=True)
class ChunkPiece:
    """The part of chunk ``index`` that covers file bytes ``[start, end)``."""

    index: int
    chunk_id: bytes
    start: int
    end: int
    offset_in_chunk: int


def find_file(tree: list[FileEntry], path: str, snapshot_id: str) -> FileEntry:
    wanted = posixpath.normpath(path).lstrip("/")  # "./model/x", "/model/x" and "model//x" mean "model/x"
    entry = next((e for e in tree if e.path == wanted), None)
    if entry is None and (stored := stored_name(wanted)):  # as listings show it (w\xffx.bin, new\nline)
        entry = next((e for e in tree if e.path == stored), None)
    if entry is None or entry.type != "file":
        raise PathNotInSnapshotError(path, snapshot_id, entry.type if entry else None)
    return entry


class ChunkedFile:
    """Thread-safe random reads of one snapshot file."""

    def __init__(
        self,
        repo: Repository,
        entry: FileEntry,
        *,
        cache_chunks: int = DEFAULT_CACHE_CHUNKS,
        snapshot: Snapshot | None = None,
        known: dict[int, bytes | memoryview] | None = None,
    ) -> None:
        """``snapshot``: the one ``entry`` is of, for a file kept open without a lock: a chunk that a
        forget or prune removed meanwhile is then named as such, not as damage. ``known``: chunks the
        caller has read already (verified), by index, so that they are not fetched again."""
        self.repo = repo
        self.entry = entry
        self.snapshot = snapshot
        self.starts = [0]
        for chunk_id in entry.chunks:
            self.starts.append(self.starts[-1] + repo.locate(chunk_id).raw_len)
        if self.starts[-1] != entry.size:
            raise IntegrityError(f"{entry.path}: its chunks hold {self.starts[-1]} bytes, the tree says {entry.size}")
        self.size = entry.size
        self._cache: OrderedDict[int, bytes | memoryview] = OrderedDict(known or {})
        self._cache_chunks = max(1, cache_chunks)
        self._lock = threading.Lock()
        self.fetched_chunks = 0  # chunk fetches so far (cache misses): what a read cost
        self.fetched_bytes = 0

    def pieces(self, start: int, end: int) -> list[ChunkPiece]:
        """The chunks covering file bytes ``[start, end)``, clipped to that range."""
        end = min(end, self.size)
        out: list[ChunkPiece] = []
        if start >= end:
            return out
        i = bisect.bisect_right(self.starts, start) - 1
        while i < len(self.entry.chunks) and self.starts[i] < end:
            lo, hi = max(start, self.starts[i]), min(end, self.starts[i + 1])
            out.append(ChunkPiece(i, self.entry.chunks[i], lo, hi, lo - self.starts[i]))
            i += 1
        return out

    def chunk(self, index: int) -> bytes | memoryview:
        with self._lock:
            data = self._cache.get(index)
            if data is not None:
                self._cache.move_to_end(index)
                return data
        try:
            data = self.repo.read_chunk(self.entry.chunks[index])
        except (IntegrityError, ObjectNotFoundError) as exc:
            snap = self.snapshot
            if snap is not None and not self.repo.has_snapshot(bytes.fromhex(snap.id)):
                raise SnapshotNotFoundError(
                    f"snapshot {snap.short_id} was removed by another process (a forget or prune) while "
                    f"{self.entry.path} was open; open it from a snapshot still stored"
                ) from exc
            raise
        with self._lock:
            self.fetched_chunks += 1
            self.fetched_bytes += len(data)
            self._cache[index] = data
            while len(self._cache) > self._cache_chunks:
                self._cache.popitem(last=False)
        return data

    def read_at(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` (fewer only at the end of the file)."""
        parts = [
            self.chunk(p.index)[p.offset_in_chunk : p.offset_in_chunk + p.end - p.start]
            for p in self.pieces(max(0, offset), offset + max(0, length))
        ]
        return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)


if TYPE_CHECKING:  # typed as a binary file too, as typeshed types io.BufferedReader: torch.load(f) type-checks

    class _BinaryFile(io.RawIOBase, BinaryIO):
        pass

else:
    _BinaryFile = io.RawIOBase


class SnapshotFile(_BinaryFile):
    """A seekable, read-only binary file over a ``ChunkedFile`` (what ``Vault.open_file`` returns)."""

    def __init__(self, chunked: ChunkedFile) -> None:
        super().__init__()
        self.chunked = chunked
        self._pos = 0

    @property
    def name(self) -> str:  # the path in the snapshot, as a file object's name is its path
        return self.chunked.entry.path

    @property
    def size(self) -> int:
        return self.chunked.size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        offset = operator.index(offset)  # as a real file: 1.5 is refused here, not at the next read
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self.chunked.size + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos = pos
        return pos

    def read(self, size: int | None = -1) -> bytes:
        if self.closed:
            raise ValueError("read of a closed file")
        if size is None or size < 0:
            size = self.chunked.size - self._pos
        data = self.chunked.read_at(self._pos, size)
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")  # bytes, whatever the buffer's item size and shape
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)
