"""Browse and compare snapshots without restoring them: ``ls --long``, ``show``, ``diff``.

``show`` parses a file's header through a ``ChunkedFile``, so it fetches only the chunks that
hold the header (and, for statistics, each tensor's bytes once). ``diff`` compares trees by
whole-file hash and, with ``tensors``, compares each tensor's byte range by the chunk IDs that
cover it: a piece covered in both snapshots by the same chunk at the same position is equal
without reading it, so only the (at most two) boundary chunks of a tensor are ever fetched
unless it really changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import FileFormatError, IntegrityError, spelled
from ..formats import FileLayout, TensorInfo, read_layout
from ..repository import Repository
from ..snapshot.model import FileEntry
from .reader import ChunkedFile
from .tensorstats import TensorStats, tensor_stats


@dataclass(frozen=True)
class FileUsage:
    path: str
    type: str
    size: int
    stored_bytes: int  # stored size of the file's distinct chunks (shared chunks count for every file using them)
    chunks: int
    blake3: str | None


@dataclass(frozen=True)
class TensorRow:
    name: str
    dtype: str
    shape: list[int] | None
    nbytes: int
    offset: int  # absolute byte offset in the file
    stats: TensorStats | None = None


@dataclass(frozen=True)
class FileContents:
    path: str
    format: str  # safetensors | npy | npz | torch
    size: int
    metadata: dict[str, str]
    tensors: list[TensorRow]
    fetched_chunks: int  # what showing it cost
    fetched_bytes: int


@dataclass(frozen=True)
class TensorChanges:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    unchanged: int = 0


@dataclass(frozen=True)
class FileChange:
    """One entry (a file, a folder or a symlink) that differs from a to b."""

    path: str
    status: str  # added | removed | changed (bytes, link target or type) | metadata (mode or mtime only)
    size_a: int | None
    size_b: int | None
    new_bytes: int  # bytes of this file in b held by chunks that a did not have
    tensors: TensorChanges | None = None
    type_a: str | None = "file"  # file | dir | symlink; None where the entry is not in that snapshot
    type_b: str | None = "file"
    details: tuple[str, ...] = ()  # what changed, e.g. "mode 0o644 -> 0o600", "target step-1 -> step-2"
    target_a: str | None = None  # a symlink's target in a, in b (else None)
    target_b: str | None = None


@dataclass(frozen=True)
class SnapshotDiff:
    a: str
    b: str
    files: list[FileChange]
    unchanged_files: int
    new_bytes: int  # raw bytes of the distinct chunks of b that a does not have


def file_usage(repo: Repository, tree: list[FileEntry]) -> list[FileUsage]:
    out = []
    for e in tree:
        stored = 0
        if e.type == "file":
            for chunk_id in set(e.chunks):
                loc = repo.find(chunk_id)
                stored += loc.stored_len if loc else 0
        out.append(FileUsage(e.path, e.type, e.size, stored, len(e.chunks), e.blake3))
    return out


def _layout(chunked: ChunkedFile) -> FileLayout | None:
    return read_layout(chunked.read_at, chunked.size, chunked.entry.path)


def show_file(repo: Repository, entry: FileEntry, *, stats: bool = False) -> FileContents:
    chunked = ChunkedFile(repo, entry)
    layout = _layout(chunked)
    if layout is None:
        raise FileFormatError(entry.path, "is not a safetensors, .npy/.npz or torch zip file; nothing to show")
    rows = [
        TensorRow(
            t.name,
            t.dtype,
            list(t.shape) if t.shape is not None else None,
            t.nbytes,
            t.start,
            tensor_stats(t, chunked.read_at) if stats else None,
        )
        for t in layout.tensors
    ]
    return FileContents(
        entry.path, layout.format, entry.size, layout.metadata, rows, chunked.fetched_chunks, chunked.fetched_bytes
    )


def _same_bytes(fa: ChunkedFile, ta: TensorInfo, fb: ChunkedFile, tb: TensorInfo) -> bool:
    """Whether two tensors' bytes are equal, reading only pieces that chunk IDs cannot decide."""
    if ta.nbytes != tb.nbytes:
        return False
    pa, pb = fa.pieces(ta.start, ta.end), fb.pieces(tb.start, tb.end)
    i = j = 0
    pos = 0  # tensor-relative
    while pos < ta.nbytes:
        a, b = pa[i], pb[j]
        end = min(a.end - ta.start, b.end - tb.start)
        off_a = a.offset_in_chunk + pos - (a.start - ta.start)
        off_b = b.offset_in_chunk + pos - (b.start - tb.start)
        same_place = a.chunk_id == b.chunk_id and off_a == off_b  # equal without reading either
        if (
            not same_place
            # as bytes: memoryviews compare element by element, ~10x slower than memcmp
            and bytes(fa.chunk(a.index)[off_a : off_a + end - pos])
            != bytes(fb.chunk(b.index)[off_b : off_b + end - pos])
        ):
            return False
        pos = end
        if pos == a.end - ta.start:
            i += 1
        if pos == b.end - tb.start:
            j += 1
    return True


def _tensor_changes(repo: Repository, ea: FileEntry, eb: FileEntry) -> TensorChanges | None:
    fa, fb = ChunkedFile(repo, ea), ChunkedFile(repo, eb)
    try:
        la, lb = _layout(fa), _layout(fb)
    except FileFormatError:
        return None
    if la is None or lb is None:
        return None
    # in each file's own order, as `show` lists them (sorted as text, "storage 10" came before "storage 2")
    a_by, b_by = {t.name: t for t in la.tensors}, {t.name: t for t in lb.tensors}
    changed, unchanged = [], 0
    for name in (n for n in b_by if n in a_by):
        ta, tb = a_by[name], b_by[name]
        if ta.dtype == tb.dtype and ta.shape == tb.shape and _same_bytes(fa, ta, fb, tb):
            unchanged += 1
        else:
            changed.append(name)
    return TensorChanges([n for n in b_by if n not in a_by], [n for n in a_by if n not in b_by], changed, unchanged)


def _target(entry: FileEntry | None) -> str | None:
    return entry.target if entry is not None and entry.type == "symlink" else None


def diff_trees(
    repo: Repository, a_id: str, tree_a: list[FileEntry], b_id: str, tree_b: list[FileEntry], *, tensors: bool = False
) -> SnapshotDiff:
    """Every entry added, removed or changed from a to b, as restic's diff: files by content (BLAKE3),
    symlinks by target, any entry by type and mode, files by mtime too (a folder's mtime moves with
    what it holds, so it is not compared)."""
    entries_a = {e.path: e for e in tree_a}
    entries_b = {e.path: e for e in tree_b}
    chunks_a = {c for e in tree_a if e.type == "file" for c in e.chunks}

    def new_in(entry: FileEntry) -> int:
        return sum(repo.locate(c).raw_len for c in set(entry.chunks) if c not in chunks_a)

    def size(entry: FileEntry | None) -> int | None:
        return entry.size if entry is not None and entry.type == "file" else None

    changes: list[FileChange] = []
    unchanged = 0
    for path in sorted(entries_a.keys() | entries_b.keys()):
        ea, eb = entries_a.get(path), entries_b.get(path)
        types = (ea.type if ea else None, eb.type if eb else None)
        if eb is None:
            changes.append(
                FileChange(path, "removed", size(ea), None, 0, type_a=types[0], type_b=None, target_a=_target(ea))
            )
            continue
        if ea is None:
            new = new_in(eb) if eb.type == "file" else 0
            changes.append(
                FileChange(path, "added", None, size(eb), new, type_a=None, type_b=types[1], target_b=_target(eb))
            )
            continue
        details = _differences(ea, eb)
        if not details:
            unchanged += eb.type == "file"
            continue
        content = details[0].startswith(("content", "type", "target"))
        detail = None
        if tensors and content and types == ("file", "file"):
            try:  # reads each file's first chunk (its format), and the pieces chunk IDs cannot decide
                detail = _tensor_changes(repo, ea, eb)
            except IntegrityError as exc:  # the damage fails the diff (exit 30): named with the file it is in
                exc.args = (f"{path} (compared with {spelled('--tensors', 'tensors=True')}): {exc}",)
                raise
        changes.append(
            FileChange(
                path,
                "changed" if content else "metadata",
                size(ea),
                size(eb),
                new_in(eb) if content and eb.type == "file" else 0,
                detail,
                *types,
                tuple(details),
                _target(ea),
                _target(eb),
            )
        )
    new_chunks = {c for e in tree_b if e.type == "file" for c in e.chunks} - chunks_a
    new_bytes = sum(repo.locate(c).raw_len for c in new_chunks)
    return SnapshotDiff(a_id, b_id, changes, unchanged, new_bytes)


def _differences(ea: FileEntry, eb: FileEntry) -> list[str]:
    """What differs between two entries of one path, content first."""
    if ea.type != eb.type:
        return [f"type {ea.type} -> {eb.type}"]
    out = []
    if ea.type == "file" and (ea.blake3 != eb.blake3 or ea.size != eb.size):
        out.append("content")
    if ea.type == "symlink" and ea.target != eb.target:
        out.append(f"target {ea.target} -> {eb.target}")
    if ea.mode != eb.mode and ea.type != "symlink":  # a link's own mode means nothing on Linux
        out.append(f"mode {oct(ea.mode)} -> {oct(eb.mode)}")
    if ea.type == "file" and ea.mtime_ns != eb.mtime_ns and "content" not in out:
        out.append("mtime")
    return out
