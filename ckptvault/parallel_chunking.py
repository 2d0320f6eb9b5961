"""Content-defined chunking of one big file on more than one core, with the very same cut points.

fastcdc's compiled chunker holds the GIL, so threads cannot share its work: helper processes chunk
regions of the file instead, each from its region's start as if a chunk began there, and send back
the cut points; the reading thread then only reads and hashes. A cut point depends only on the
bytes from the cut before it on, so once the file's true cuts (those of chunking it from its first
byte) land on a cut of a region's list, every later cut of that list is true as well. The few
chunks before that meeting point are cut by the reading thread itself, and so is every chunk of a
region whose helper failed, stalled or died: the chunks are exactly those of ``iter_chunks`` (dedup
against saves chunked on one core is kept), and a helper can cost time, never a backup.
"""

from __future__ import annotations

import array
import contextlib
import itertools
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator

from .chunking import ChunkerParams, Readable, first_cut, iter_chunks
from .memcopy import empty

MiB = 1024 * 1024
# Bytes a helper chunks per request: ~64 chunks of the average size (of which the reading thread redoes one
# or two), within 4-64 MiB (a repository of tiny chunks would otherwise get replies of megabytes of cuts).
REGION_CHUNKS = 64
REGION_BOUNDS = (4 * MiB, 64 * MiB)
MIN_FILE = 128 * MiB  # a smaller file is chunked by the reading thread alone
HELPER_WAIT_S = 30.0  # a helper silent this long (stopped, swapping) is given up; its regions are cut here
_REQUEST = struct.Struct("<6Q")  # request id, start, stop, min, avg, max
_REPLY = struct.Struct("<QQ")  # request id, number of cuts (FAILED: the region could not be read)
FAILED = 2**64 - 1


class _Range:
    """File bytes ``[pos, end)`` of ``fd`` as a stream, read with ``pread``."""

    def __init__(self, fd: int, pos: int, end: int) -> None:
        self.fd, self.pos, self.end = fd, pos, end
        self.ended = False

    def readinto(self, buffer: memoryview, /) -> int:
        n = os.preadv(self.fd, [buffer[: self.end - self.pos]], self.pos) if self.pos < self.end else 0
        self.pos += n
        self.ended = n == 0
        return n


def region_cuts(fd: int, start: int, stop: int, params: ChunkerParams) -> list[int]:
    """The cuts of chunking ``fd`` from ``start`` as if a chunk began there: ``start``, then each cut
    after it up to the first at or past ``stop``. Only cuts that no later byte could move are listed:
    a chunk that ends where the file ends is left to the caller (the file may have grown meanwhile)."""
    cuts = [start]
    data_end = stop + params.max_size
    stream = _Range(fd, start, data_end)
    pos = start
    for chunk in iter_chunks(stream, params):
        if stream.ended and pos + len(chunk) == stream.pos and len(chunk) < params.max_size:
            break  # cut by the end of the file, not by its bytes
        pos += len(chunk)
        cuts.append(pos)
        if pos >= stop:
            break
    return cuts


class _Helper:
    """One helper process and the socket it serves; ``None`` replies once it has failed."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        if os.path.basename(sys.executable).startswith(("python", "pypy")):  # not an embedding binary (uWSGI)
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.process = subprocess.Popen(
                    [sys.executable, "-c", _START, str(theirs.fileno()), os.path.abspath(__file__)],
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=dict(os.environ, **_KEEP_FREED_MEMORY),
                )
                self.sock = ours
                self.sock.settimeout(HELPER_WAIT_S)
            except OSError:  # no process left to start, no such interpreter: the cuts are made here
                ours.close()
            finally:
                theirs.close()

    def ask(self, request_id: int, fd: int, start: int, stop: int, params: ChunkerParams) -> bool:
        if self.sock is None:
            return False
        head = _REQUEST.pack(request_id, start, stop, params.min_size, params.avg_size, params.max_size)
        try:
            socket.send_fds(self.sock, [head], [fd])
        except OSError:
            self.close(kill=True)
            return False
        return True

    def answer(self, request_id: int) -> list[int] | None:
        """The cuts asked for by ``request_id``; replies to older requests (of a file whose reading
        stopped early) are skipped."""
        while self.sock is not None:
            try:
                got_id, count = _REPLY.unpack(self._receive(_REPLY.size))
                cuts = array.array("Q", self._receive(8 * count)) if count != FAILED else None
            except (OSError, ValueError):  # EOF (it died, or could not start), a timeout
                self.close(kill=True)
                return None
            if got_id == request_id:
                return cuts.tolist() if cuts is not None else None
        return None

    def _receive(self, n: int) -> bytes:
        assert self.sock is not None
        buffer = bytearray(n)
        view = memoryview(buffer)
        while view:
            got = self.sock.recv_into(view)
            if not got:
                raise ValueError("the helper closed its socket")
            view = view[got:]
        return bytes(buffer)

    def close(self, *, kill: bool = False) -> None:
        """Ends the helper: at its next request (it reads EOF), or at once when it has failed (it may
        be stopped or stuck)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.process is not None:
            if kill:
                self.process.kill()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None


class ChunkHelpers:
    """Helper processes for the big files of one backup, started on the first such file."""

    def __init__(
        self, params: ChunkerParams, processes: int, *, region: int | None = None, min_file: int = MIN_FILE
    ) -> None:
        self.params = params
        self.processes = processes
        if region is None:
            region = min(max(REGION_CHUNKS * params.avg_size, REGION_BOUNDS[0]), REGION_BOUNDS[1])
        self.region = max(region, 2 * params.max_size)
        self.min_file = max(min_file, 2 * self.region)
        self._helpers: list[_Helper] = []
        self._next_id = 0
        self.local_chunks = 0  # chunks cut by the reading thread in files given to helpers (tests, benchmarks)
        self.helper_chunks = 0

    def chunks(self, stream: Readable, fd: int, size: int) -> Iterator[memoryview]:
        """The chunks of ``stream`` (the open file ``fd``, read from its start; ``size`` as its stat
        said), exactly as ``iter_chunks(stream, self.params)`` yields them."""
        if self.processes < 1 or size < self.min_file:
            yield from iter_chunks(stream, self.params)
            return
        if not self._helpers:
            self._helpers = [_Helper() for _ in range(self.processes)]
        yield from self._stitched(stream, _Regions(self, fd, size))

    def _stitched(self, stream: Readable, regions: _Regions) -> Iterator[memoryview]:
        params = self.params
        block = max(8 * MiB, 2 * params.max_size)
        carry: bytes | memoryview = b""
        base = 0  # file offset of data[0]
        eof = False
        while not eof:
            view = empty(len(carry) + block)
            view[: len(carry)] = carry
            filled = len(carry)
            while filled < len(view):
                n = stream.readinto(view[filled:])
                if not n:
                    eof = True
                    break
                filled += n
            data = view[:filled]
            off = 0
            while off < filled:
                cut = regions.next_cut(base + off)
                if cut is not None and cut - base > filled:
                    if not eof:
                        break  # a helper's cut past the bytes in hand: read on
                    cut = None  # the file ends sooner than the helper saw it
                if cut is None:
                    if off + params.max_size > filled and not eof:
                        break
                    cut = base + off + first_cut(data[off : off + params.max_size], params)
                    self.local_chunks += 1
                else:
                    self.helper_chunks += 1
                yield data[off : cut - base]
                off = cut - base
            carry = data[off:filled]  # the block stays alive for the chunks yielded from it anyway
            base += off

    def close(self) -> None:
        for helper in self._helpers:
            helper.close()
        self._helpers = []


class _Regions:
    """The helpers' cuts of one file, asked for a few regions ahead of the reading thread."""

    def __init__(self, owner: ChunkHelpers, fd: int, size: int) -> None:
        self.owner = owner
        self.fd = fd
        self.count = -(-size // owner.region)
        self.asked: dict[int, tuple[_Helper, int]] = {}  # region -> helper and request id
        self.next_ask = 1  # the first region is cut here while the helpers start (~0.1-0.2 s)
        self.current = -1
        self.successor: dict[int, int] = {}  # of the current region: cut -> next cut

    def next_cut(self, pos: int) -> int | None:
        """The true cut after ``pos``, a true cut, when a helper's list holds ``pos``; else None."""
        index = pos // self.owner.region
        if index != self.current:
            self._load(index)
        return self.successor.get(pos)

    def _load(self, index: int) -> None:
        owner = self.owner
        helpers = owner._helpers
        ahead = 2 * len(helpers)
        while self.next_ask < min(self.count, index + ahead):
            region = self.next_ask
            helper = helpers[region % len(helpers)]
            owner._next_id += 1
            start = region * owner.region
            if helper.ask(owner._next_id, self.fd, start, start + owner.region, owner.params):
                self.asked[region] = (helper, owner._next_id)
            self.next_ask += 1
        self.current = index
        asked = self.asked.pop(index, None)
        cuts = asked[0].answer(asked[1]) if asked is not None else None
        self.successor = dict(itertools.pairwise(cuts)) if cuts else {}
        for region in [r for r in self.asked if r < index]:  # skipped over: their replies are dropped
            del self.asked[region]


# The helper's start: this very file, wherever the parent found it (a path the parent added at run
# time is appended, never put before the interpreter's own), and not a module of the same name from
# the working directory ("-c" puts it first). Any other module, or none: the helper ends at once.
# glibc's malloc keeps freed buffers for reuse (ops/memory.py, keep_freed_memory): a helper reads each
# region into fresh 8 MiB blocks, and faulting fresh pages in cost it ~0.15-0.25 s of system time per GB.
_KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(32 * MiB), "MALLOC_TRIM_THRESHOLD_": str(128 * MiB)}
_START = (
    "import os, sys; sys.path = [p for p in sys.path if p]; "
    "sys.path.append(os.path.dirname(os.path.dirname(sys.argv[2]))); "
    "import ckptvault.parallel_chunking as m; m.serve(int(sys.argv[1]), sys.argv[2])"
)


def serve(fd: int, expected_file: str) -> None:
    """The helper's loop on the socket ``fd``: one request at a time, until the parent closes it."""
    sock = socket.socket(fileno=fd)
    if not os.path.samefile(__file__, expected_file):
        return
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError, ConnectionResetError):
        _serve(sock)


def _serve(sock: socket.socket) -> None:
    """The helper's loop: one request at a time, until the parent closes the socket."""
    while True:
        head, fds, _flags, _addr = socket.recv_fds(sock, _REQUEST.size, 1)
        if not head:
            return
        while len(head) < _REQUEST.size:
            more = sock.recv(_REQUEST.size - len(head))
            if not more:
                return
            head += more
        request_id, start, stop, min_size, avg_size, max_size = _REQUEST.unpack(head)
        try:
            cuts: list[int] | None = region_cuts(fds[0], start, stop, ChunkerParams(min_size, avg_size, max_size))
        except OSError:
            cuts = None
        finally:
            for fd in fds:
                os.close(fd)
        if cuts is None:
            sock.sendall(_REPLY.pack(request_id, FAILED))
        else:
            sock.sendall(_REPLY.pack(request_id, len(cuts)) + array.array("Q", cuts).tobytes())
