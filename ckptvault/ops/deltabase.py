"""Delta bases: which stored chunk a new tensor piece is coded against, and where its bytes come from.

**Reference snapshot.** A piece's natural base is the same piece of the same tensor (same name,
dtype, shape) in the previous save's file at the same path. The previous save is the backup's
parent (same host, same paths) or, when there is none, the newest snapshot of the same host whose
tags equal this backup's apart from the per-checkpoint ones (``step``, ``checkpoint``,
``watch-sig``), or hold them and more (tags added later with ``ckptvault tag``): a series of
``step-N`` folders shares no paths, but it is one run.

**Chains: always against a keyframe.** A delta's base is always a chunk stored without delta (a
*keyframe*): when the previous save's piece is itself a delta, the new piece is coded against that
piece's keyframe. Any chunk therefore decodes with at most two blobs, so restoring any snapshot
costs at most one extra decode per piece, whatever the age of the run. Deltas against an older
keyframe grow slowly as training drifts (measured in docs/performance.md: 3-8 % per doubling of the
distance for F32, more for BF16), so after ``KEYFRAME_INTERVAL - 1`` deltas against one keyframe the
piece is stored whole again and becomes the next keyframe (counted from the index: how many chunks
name that base).

**Where base bytes come from.** When the reference snapshot's source file is still on disk,
unchanged (size, mtime, inode, ctime as recorded), the base is read from it and verified against
its chunk ID before use; otherwise it is read from the repository (fetched and decoded).

**When a delta is used.** Both codings of a 64 KiB sample from the middle of the piece are tried;
the delta is used when it is at most ``DELTA_MAX_SHARE`` of the plain coding, since it costs a second
decode on every restore. After two pieces of a tensor chose the plain coding and none the delta
(optimizer moments that change wholesale), the tensor's other pieces skip the trial and the base.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from ..blob import BlobParts, Kind, blob_size
from ..bytegroup import ElementRun, xor
from ..errors import CkptVaultError, IntegrityError, check_command
from ..formats import FileLayout, ReadAt, TensorInfo, pread_at, read_layout
from ..repository import Repository
from ..repository.repository import damage_log
from ..snapshot.model import WATCH_SIG_TAG, FileEntry, Snapshot
from .names import source_name
from .pieces import Segment, clip_runs
from .reader import ChunkedFile

log = logging.getLogger(__name__)
DAMAGED_BASES_NAMED = 3  # a backup names this many damaged bases; check --read-data names them all

PER_CHECKPOINT_TAGS = ("step", "checkpoint", WATCH_SIG_TAG)
KEYFRAME_INTERVAL = 8  # a keyframe serves at most 7 deltas; then the piece is stored whole again
DELTA_MAX_SHARE = 0.9  # a delta must save at least 10 % over the plain coding to be worth its decode
SAMPLE = 64 * 1024
PLAIN_VOTES = 2  # pieces of a tensor that chose the plain coding before the rest stop trying


def reference_snapshot(
    snapshots: Sequence[Snapshot],
    hostname: str,
    tags: dict[str, str],
    parent: Snapshot | None,
    taken_at: datetime | None = None,
) -> Snapshot | None:
    """The snapshot whose files give this backup's delta bases: the parent, else the previous save of
    the same host and the same run: its tags, apart from the per-checkpoint ones, equal this
    backup's, or hold them all and more (a ``keep=best`` added afterwards by ``ckptvault tag``).
    The previous save is the newest one up to ``taken_at`` (a watch snapshot's pin time), else the
    oldest after it: a backlog shipped newest first was all coded against the newest save, whose
    keyframe then served its 7 deltas and left the rest stored whole."""
    if parent is not None:
        return parent

    def run_of(t: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in t.items() if k not in PER_CHECKPOINT_TAGS}

    run = run_of(tags)

    def same_run(s: Snapshot) -> bool:
        theirs = run_of(s.tags)
        return theirs == run or (bool(run) and run.items() <= theirs.items())

    same_run_snapshots = [s for s in snapshots if s.hostname == hostname and same_run(s)]
    if not same_run_snapshots:
        return None
    earlier = [s for s in same_run_snapshots if taken_at is None or s.time <= taken_at]
    if earlier:
        return max(earlier, key=lambda s: s.time)
    return min(same_run_snapshots, key=lambda s: s.time)


def source_path(snapshot_paths: Sequence[str], tree_path: str) -> str | None:
    """Where a snapshot's file was read from (the inverse of ops/scan.py's naming): one directory
    source is the root; otherwise the first component names a source by its base name."""
    if len(snapshot_paths) == 1 and os.path.isdir(snapshot_paths[0]):
        return os.path.join(snapshot_paths[0], *tree_path.split("/"))
    first, _, rest = tree_path.partition("/")
    for src in snapshot_paths:
        if source_name(src) == first:
            return os.path.join(src, *rest.split("/")) if rest else src
    return None


@dataclass(frozen=True, slots=True)
class BaseCandidate:
    """The keyframe a piece may be coded against; ``local`` = (fd, offset) of a local copy of its
    bytes; ``given``: its bytes, already read and verified (a copy reads them from the source vault)."""

    base_id: bytes
    local: tuple[int, int] | None
    tensor: str  # "<path>:<tensor name>", for the per-tensor votes
    given: bytes | memoryview | None = None


@dataclass(frozen=True, slots=True)
class PieceBlob:
    blob: BlobParts
    base_id: bytes | None  # set when the blob is a delta
    saved: int  # estimated bytes the delta saved over the plain coding (0 for plain blobs)


class DeltaPlanner:
    """Finds delta bases for one backup. Opens local copies of the reference's files; ``close`` them."""

    def __init__(self, repo: Repository, reference: Snapshot | None, tree: list[FileEntry] | None) -> None:
        self.repo = repo
        self.reference = reference
        self.files = {e.path: e for e in (tree or []) if e.type == "file"}
        # How many deltas each keyframe already serves: the index names every delta's base.
        self.uses = Counter(loc.base_id for _, loc in repo.index.items() if loc.base_id is not None)
        self.votes: dict[str, list[int]] = {}  # tensor -> [plain choices, delta choices]
        self.damaged_bases = 0
        self._fds: list[int] = []

    @property
    def open_files(self) -> int:
        return len(self._fds)

    def close(self) -> None:
        """Close the local copies opened so far (no piece still being encoded may need them)."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def _local_copy(self, entry: FileEntry) -> int | None:
        """An fd of the reference file's source when it still holds the recorded bytes (by its stat)."""
        if self.reference is None:
            return None
        path = source_path(self.reference.paths, entry.path)
        if path is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        st = os.fstat(fd)
        if (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns) != (
            entry.size,
            entry.mtime_ns,
            entry.inode,
            entry.ctime_ns,
        ):
            os.close(fd)
            return None
        self._fds.append(fd)
        return fd

    def for_file(self, path: str, segments: list[Segment]) -> dict[int, BaseCandidate]:
        """Segment start -> the keyframe its piece may be coded against, for one file of the backup."""
        entry = self.files.get(path)
        if entry is None or not any(s.tensor for s in segments):
            return {}
        starts = self._chunk_starts(entry)
        if starts is None:
            return {}
        fd = self._local_copy(entry)
        read_at: ReadAt = pread_at(fd) if fd is not None else ChunkedFile(self.repo, entry).read_at
        try:
            layout = read_layout(read_at, entry.size, path)
        except (CkptVaultError, OSError) as exc:  # an unreadable old header only costs the delta
            log.debug("no delta bases for %s: %s", path, exc)
            return {}
        if layout is None:
            return {}
        return self._match(path, segments, layout, starts, fd)

    def _chunk_starts(self, entry: FileEntry) -> dict[int, tuple[bytes, int]] | None:
        """File offset -> (chunk ID, length) for every chunk of the reference file."""
        out, pos = {}, 0
        for chunk_id in entry.chunks:
            loc = self.repo.index.get(chunk_id)
            if loc is None:
                return None
            out[pos] = (chunk_id, loc.raw_len)
            pos += loc.raw_len
        return out

    def _match(
        self,
        path: str,
        segments: list[Segment],
        layout: FileLayout,
        starts: dict[int, tuple[bytes, int]],
        fd: int | None,
    ) -> dict[int, BaseCandidate]:
        old = {t.name: t for t in layout.tensors}
        out = {}
        for seg in segments:
            t = seg.tensor
            if t is None:
                continue
            was = old.get(t.name)
            if was is None or not _same_tensor(t, was):
                continue  # new, or its dtype or shape changed: no base
            offset = was.start + seg.start - t.start
            hit = starts.get(offset)
            if hit is None or hit[1] != seg.length:
                continue  # the old file was not cut at this piece (content-defined): no base
            chunk_id = hit[0]
            loc = self.repo.index.get(chunk_id)
            if loc is None:
                continue
            if loc.base_id is None:
                keyframe, local = chunk_id, (fd, offset) if fd is not None else None
            else:
                keyframe, local = loc.base_id, None  # the old piece is a delta: code against its keyframe
                kloc = self.repo.index.get(keyframe)
                if kloc is None or kloc.base_id is not None:
                    continue
            if self.uses[keyframe] >= KEYFRAME_INTERVAL - 1:
                continue  # this keyframe has served its deltas: store the piece whole, as the next one
            out[seg.start] = BaseCandidate(keyframe, local, f"{path}:{t.name}")
        return out

    # ---- in worker threads ----------------------------------------------------------------

    def encode(
        self, chunk_id: bytes, data: memoryview, runs: tuple[ElementRun, ...], cand: BaseCandidate | None
    ) -> PieceBlob:
        """The chunk's blob: a delta against ``cand`` when that pays (see the module doc), else plain."""
        codec = self.repo.codec
        votes = self.votes.setdefault(cand.tensor, [0, 0]) if cand else [0, 0]
        base = None
        if cand is not None and not (votes[0] >= PLAIN_VOTES and votes[1] == 0):
            lo = max(0, (len(data) - SAMPLE) // 2) // 64 * 64
            hi = min(len(data), lo + SAMPLE)
            sample, base = self._base_sample(cand, lo, hi)
            if sample is not None:
                sample_runs = clip_runs(runs, lo, hi)
                compressor = codec.compressor
                plain = len(compressor.compress(data[lo:hi], sample_runs)[1])
                delta = len(compressor.compress(xor(data[lo:hi], sample), sample_runs)[1])
                if delta <= DELTA_MAX_SHARE * plain:
                    base = base if base is not None else self._local_base(cand, len(data))
                    if base is not None:
                        votes[1] += 1
                        blob = codec.encode_delta(chunk_id, data, cand.base_id, base, runs)
                        # the plain coding's size scaled from its sample: the delta's sample may miss
                        # where the piece changed, and scaling the blob by it "saved" 25x the piece
                        whole_plain = min(len(data), round(plain * len(data) / (hi - lo)))
                        return PieceBlob(blob, cand.base_id, max(0, whole_plain - blob_size(blob)))
                else:
                    votes[0] += 1
        return PieceBlob(codec.encode_parts(Kind.CHUNK, chunk_id, data, runs), None, 0)

    def _base_sample(
        self, cand: BaseCandidate, lo: int, hi: int
    ) -> tuple[bytes | memoryview | None, bytes | memoryview | None]:
        """(the base's bytes [lo, hi), the whole base when it was read whole). A local copy gives the
        sample alone (the rest is read once a delta is chosen); the repository gives the whole base.
        (None, None) when it cannot be had: then no delta."""
        if cand.given is not None:
            return cand.given[lo:hi], cand.given
        if cand.local is not None:
            fd, offset = cand.local
            with contextlib.suppress(OSError):  # then the repository's copy
                sample = os.pread(fd, hi - lo, offset + lo)
                if len(sample) == hi - lo:
                    return sample, None
        base = self._repo_base(cand)
        return (base[lo:hi], base) if base is not None else (None, None)

    def _local_base(self, cand: BaseCandidate, length: int) -> bytes | memoryview | None:
        """The whole base from the local copy, verified against its chunk ID (else from the repository)."""
        assert cand.local is not None
        fd, offset = cand.local
        try:
            data = os.pread(fd, length, offset)
        except OSError:
            data = b""
        if len(data) == length and self.repo.chunk_id(data) == cand.base_id:
            return data  # the local copy holds exactly the stored base
        log.debug("local copy of base %s changed; reading it from the repository", cand.base_id.hex()[:12])
        return self._repo_base(cand)

    def _repo_base(self, cand: BaseCandidate) -> bytes | memoryview | None:
        try:
            return self.repo.read_chunk(cand.base_id)
        except IntegrityError as exc:  # damage this backup is the first to see: the CLI shows it
            self.damaged_bases += 1
            if self.damaged_bases <= DAMAGED_BASES_NAMED:
                more = " (further ones, if any, are not named)" if self.damaged_bases == DAMAGED_BASES_NAMED else ""
                damage_log.warning(
                    "delta base %s is damaged (%s): the new piece is stored whole, but older snapshots that hold "
                    "this chunk cannot restore it; run: %s%s",
                    cand.base_id.hex()[:12],
                    exc,
                    check_command(read_data=True),
                    more,
                )
            return None
        except CkptVaultError as exc:  # a base that cannot be read must not fail the backup: stored whole
            log.warning("delta base %s cannot be read (%s); storing the piece whole", cand.base_id.hex()[:12], exc)
            return None


def _same_tensor(a: TensorInfo, b: TensorInfo) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.nbytes == b.nbytes
