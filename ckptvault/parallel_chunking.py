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
import logging
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator

from .chunking import ChunkerParams, MiB, Readable, chunk_lengths, first_cut, iter_chunks, next_block, read_block

log = logging.getLogger(__name__)
# Bytes a helper chunks per request: ~64 chunks of the average size (the reading thread redoes one or two
# of them), within 4-64 MiB: a repository of tiny chunks would otherwise get replies of megabytes of cuts.
REGION_CHUNKS = 64
REGION_BOUNDS = (4 * MiB, 64 * MiB)
MIN_FILE = 128 * MiB  # a smaller file is chunked by the reading thread alone
HELPER_WAIT_S = 30.0  # a helper silent this long (stopped, swapping) is given up; its regions are cut here
PARENT_CHECK_S = 1.0  # how often an idle helper looks whether the process that started it is still there
_REQUEST = struct.Struct("<6Q")  # request id, start, stop, min, avg, max
_REPLY = struct.Struct("<QQ")  # request id, number of cuts (FAILED: the region could not be read)
FAILED = 2**64 - 1


def region_cuts(fd: int, start: int, stop: int, params: ChunkerParams, buffer: bytearray | None = None) -> list[int]:
    """The cuts of chunking ``fd`` from ``start`` as if a chunk began there: ``start``, then each cut
    after it up to the first at or past ``stop``. Only cuts that no later byte could move are listed:
    a chunk that ends where the file ends is left to the caller (the file may have grown meanwhile).
    ``buffer`` (at least ``read_block + max_size`` bytes) is reused: a helper allocates nothing per region."""
    view = memoryview(buffer if buffer is not None else bytearray(read_block(params) + params.max_size))
    cuts = [start]
    data_end = stop + params.max_size  # every chunk that starts before stop has its whole window in here
    pos = start  # the last cut; view[:held] holds the file's bytes from it on
    held = 0
    while True:
        file_ended = False
        while held < len(view) and pos + held < data_end:
            n = os.preadv(fd, [view[held : min(len(view), data_end - pos)]], pos + held)
            if n == 0:
                file_ended = True
                break
            held += n
        done = 0
        for length in chunk_lengths(view[:held], params):
            end = done + length
            if end == held and held - done < params.max_size:
                break  # cut by the end of the bytes in hand, not by the bytes themselves
            done = end
            cuts.append(pos + done)
            if pos + done >= stop:
                return cuts
        if file_ended or held == 0 or pos + held >= data_end:
            return cuts
        view[: held - done] = view[done:held]
        pos, held = pos + done, held - done


# Names of environment variables that hold secrets (parts of the name, upper case): a helper is given none of them
_SECRET_NAME_PARTS = ("PASSPHRASE", "PASSWORD", "SECRET", "TOKEN", "CREDENTIAL", "CONNECTION_STRING")
_SECRET_NAME_ENDS = ("_KEY", "_KEY_ID")
# ckptvault's own: the fsspec options may carry a key and a secret (-o key=... -o secret=...)
_SECRET_NAMES = frozenset({"CKPTVAULT_STORAGE_OPTIONS", "CKPTVAULT_KEYFILE", "CKPTVAULT_FROM_KEYFILE"})


def holds_a_secret(name: str) -> bool:
    """Whether the environment variable ``name`` is one a helper is not given: ckptvault's passphrases
    (``CKPTVAULT_PASSPHRASE``, ``..._NEW_...``, ``..._FROM_...``), keyfiles and storage options, and any
    variable named as a credential is (``AWS_SECRET_ACCESS_KEY``, ``AZURE_STORAGE_ACCOUNT_KEY``, ...)."""
    upper = name.upper()
    return (
        upper in _SECRET_NAMES or any(part in upper for part in _SECRET_NAME_PARTS) or upper.endswith(_SECRET_NAME_ENDS)
    )


def helper_environment() -> dict[str, str]:
    """The environment a helper starts with: this process's without its secrets. A helper only cuts the
    bytes of a file it is handed; it inherited the passphrase and the storage's credentials, readable in
    /proc/PID/environ by its user for as long as it ran, and in any crash report of it."""
    return {name: value for name, value in os.environ.items() if not holds_a_secret(name)}


class _Helper:
    """One helper process and the socket it serves; ``None`` replies once it has failed."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        if not os.path.basename(sys.executable).startswith(("python", "pypy")):
            return  # an embedding program's binary (uWSGI) is no interpreter to start
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError:  # out of file descriptors: the cuts are made here
            return
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _START, str(theirs.fileno()), os.path.abspath(__file__), str(os.getpid())],
                pass_fds=[theirs.fileno()],
                env=helper_environment(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C or a scheduler's signal to the job is the backup's to handle
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
        fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        try:  # MSG_NOSIGNAL: a host process that restored SIGPIPE's default must not die of a dead helper
            # (socket.send_fds drops its flags before Python 3.12)
            sent = self.sock.sendmsg([head], fds, getattr(socket, "MSG_NOSIGNAL", 0))
        except OSError:
            sent = 0
        if sent != len(head):
            self.close(kill=True)
            return False
        return True

    def answer(self, request_id: int) -> list[int] | None:
        """The cuts asked for by ``request_id``. Replies to older requests (those of a file whose reading
        stopped early) are skipped; a helper serves one file at a time."""
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
            # shutdown, not only close: a child forked meanwhile (a data loader's worker) holds a copy
            # of the socket, and the helper would never read EOF
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
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
    """Helper processes for the big files of one backup, started on the first such file; one file is
    read at a time."""

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
        self._request_ids = itertools.count(1)
        self.local_chunks = 0  # of the files given to helpers: chunks cut by the reading thread
        self.helper_chunks = 0  # and chunks a helper's cuts gave

    def chunks(self, stream: Readable, fd: int, size: int) -> Iterator[memoryview]:
        """The chunks of ``stream`` (the open file ``fd``, read from its start; ``size`` as its stat
        said), exactly as ``iter_chunks(stream, self.params)`` yields them."""
        if self.processes < 1 or size < self.min_file:
            yield from iter_chunks(stream, self.params, size_hint=size)
            return
        if not self._helpers:
            self._helpers = [_Helper() for _ in range(self.processes)]
        regions = _Regions(self._helpers, self._request_ids, self.params, self.region, fd, size)
        local, helped = self.local_chunks, self.helper_chunks
        yield from self._stitched(stream, regions)
        name = getattr(stream, "name", "a file")
        log.debug(
            "%s: %d chunks cut by helper processes, %d by the reading thread",
            name,
            self.helper_chunks - helped,
            self.local_chunks - local,
        )

    def _stitched(self, stream: Readable, regions: _Regions) -> Iterator[memoryview]:
        """``iter_chunks``'s reading (blocks, with the unfinished tail carried into the next), where
        each cut comes from a helper's list when it holds the cut before, and from ``first_cut`` else."""
        params = self.params
        carry: memoryview = memoryview(b"")
        base = 0  # file offset of data[0]
        eof = False
        while not eof:
            data, eof = next_block(stream, carry, read_block(params))
            filled = len(data)
            off = 0  # the last cut, in data
            while off < filled:
                known = regions.next_cut(base + off)
                if known is not None and known - base <= filled:
                    end = known - base
                    self.helper_chunks += 1
                elif not eof and (known is not None or off + params.max_size > filled):
                    break  # the chunk may end past the bytes in hand: read on
                else:  # no helper's cut here, or the file ends sooner than the helper saw it
                    end = off + first_cut(data[off : off + params.max_size], params)
                    self.local_chunks += 1
                yield data[off:end]
                off = end
            carry = data[off:filled]  # the block stays alive for the chunks yielded from it anyway
            base += off

    def close(self) -> None:
        for helper in self._helpers:
            helper.close()
        self._helpers = []


class _Regions:
    """The helpers' cuts of one file, asked for a few regions ahead of the reading thread."""

    def __init__(
        self,
        helpers: list[_Helper],
        request_ids: Iterator[int],
        params: ChunkerParams,
        region: int,
        fd: int,
        size: int,
    ) -> None:
        self.helpers = helpers
        self.request_ids = request_ids
        self.params = params
        self.region = region
        self.fd = fd
        self.count = -(-size // region)
        self.asked: dict[int, tuple[_Helper, int]] = {}  # region -> helper and request id
        self.next_ask = 1  # the first region is cut by the reading thread while the helpers start (~0.1-0.2 s)
        self.current = -1
        self.successor: dict[int, int] = {}  # of the current region: cut -> next cut

    def next_cut(self, pos: int) -> int | None:
        """The true cut after ``pos``, a true cut, when a helper's list holds ``pos``; else None.
        ``pos`` only grows, by at most ``max_size`` (a region is at least twice that)."""
        index = pos // self.region
        if index != self.current:
            self._load(index)
        return self.successor.get(pos)

    def _load(self, index: int) -> None:
        ahead = 2 * len(self.helpers)  # a helper always has its next region queued
        while self.next_ask < min(self.count, index + ahead):
            region, request_id = self.next_ask, next(self.request_ids)
            helper = self.helpers[region % len(self.helpers)]
            start = region * self.region
            if helper.ask(request_id, self.fd, start, start + self.region, self.params):
                self.asked[region] = (helper, request_id)
            self.next_ask += 1
        self.current = index
        asked = self.asked.pop(index, None)
        cuts = asked[0].answer(asked[1]) if asked is not None else None
        self.successor = dict(itertools.pairwise(cuts)) if cuts else {}


# How a helper starts: this very file, wherever the parent found it (a path the parent added at run time
# is appended, never put before the interpreter's own), and not a module of the same name from the
# working directory ("-c" puts it first). Any other module, or none: the helper ends at once.
_START = (
    "import os, sys; sys.path = [p for p in sys.path if p]; "
    "sys.path.append(os.path.dirname(os.path.dirname(sys.argv[2]))); "
    "import ckptvault.parallel_chunking as m; m.serve(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))"
)


def serve(fd: int, expected_file: str, parent: int) -> None:
    """A helper's life: requests on the socket ``fd``, one at a time, until the parent closes it or is
    gone (a process it forked may keep the socket open after it was killed)."""
    sock = socket.socket(fileno=fd)
    if not os.path.samefile(__file__, expected_file):
        return
    sock.settimeout(PARENT_CHECK_S)
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError, ConnectionResetError):
        _serve(sock, parent)


def _serve(sock: socket.socket, parent: int) -> None:
    buffer: bytearray | None = None
    while True:
        try:
            head, fds, _flags, _addr = socket.recv_fds(sock, _REQUEST.size, 1)
        except TimeoutError:
            if os.getppid() != parent:
                return
            continue
        if not head:
            return
        while len(head) < _REQUEST.size:
            more = sock.recv(_REQUEST.size - len(head))
            if not more:
                return
            head += more
        request_id, start, stop, min_size, avg_size, max_size = _REQUEST.unpack(head)
        params = ChunkerParams(min_size, avg_size, max_size)
        if buffer is None or len(buffer) < read_block(params) + max_size:
            buffer = bytearray(read_block(params) + max_size)
        try:
            cuts: list[int] | None = region_cuts(fds[0], start, stop, params, buffer)
        except OSError:
            cuts = None
        finally:
            for fd in fds:
                os.close(fd)
        sock.settimeout(None)  # a reply is sent whole however long the parent takes to read it
        if cuts is None:
            sock.sendall(_REPLY.pack(request_id, FAILED))
        else:
            sock.sendall(_REPLY.pack(request_id, len(cuts)) + array.array("Q", cuts).tobytes())
        sock.settimeout(PARENT_CHECK_S)
