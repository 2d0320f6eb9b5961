"""Big files cut by content on helper processes (ckptvault/parallel_chunking.py): the very chunks of
one thread's chunking, whatever the data, the helpers' fate or the file's changes while it is read."""

from __future__ import annotations

import errno
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptvault import Vault
from ckptvault.chunking import ChunkerParams, iter_chunks
from ckptvault.ops import backup as backup_module
from ckptvault.parallel_chunking import ChunkHelpers, region_cuts

PARAMS = ChunkerParams(min_size=4096, avg_size=16384, max_size=65536)
REGION = 4 * PARAMS.max_size  # 256 KiB: a few dozen chunks per region


def _pieces(rng: random.Random, size: int, kinds: tuple[str, ...]) -> bytes:
    """``size`` bytes of runs of random bytes, zeros (cut only at max_size) and a repeated block (cuts
    at the same place of every repeat)."""
    pattern = rng.randbytes(20_000)
    out = bytearray()
    while len(out) < size:
        n = rng.randrange(1, 400_000)
        kind = rng.choice(kinds)
        if kind == "random":
            out += rng.randbytes(n)
        elif kind == "zeros":
            out += bytes(n)
        else:
            out += (pattern * (n // len(pattern) + 1))[:n]
    return bytes(out[:size])


def _serial(path: Path) -> list[bytes]:
    with open(path, "rb", buffering=0) as f:
        return [bytes(c) for c in iter_chunks(f, PARAMS)]


def _parallel(helpers: ChunkHelpers, path: Path) -> list[bytes]:
    with open(path, "rb", buffering=0) as f:
        return [bytes(c) for c in helpers.chunks(f, f.fileno(), os.fstat(f.fileno()).st_size)]


@pytest.fixture
def helpers():
    h = ChunkHelpers(PARAMS, 2, region=REGION, min_file=0)
    yield h
    h.close()


@pytest.mark.parametrize("kinds", [("random",), ("zeros",), ("repeat",), ("random", "zeros", "repeat")])
@pytest.mark.parametrize("size", [2 * REGION, 2 * REGION + 1, 7 * REGION - 1, 9 * REGION + 12_345])
def test_the_chunks_are_those_of_one_thread(tmp_path: Path, helpers: ChunkHelpers, kinds, size):
    path = tmp_path / "data"
    path.write_bytes(_pieces(random.Random(size), size, kinds))
    assert _parallel(helpers, path) == _serial(path)
    if kinds == ("random",) and size > 5 * REGION:  # the helpers did most of the work: the reading thread
        assert helpers.helper_chunks > 2 * helpers.local_chunks  # cut the first region and bridged the others


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32), size=st.integers(0, 12 * REGION))
def test_any_data_any_size(tmp_path: Path, helpers: ChunkHelpers, seed: int, size: int):
    path = tmp_path / "data"
    path.write_bytes(_pieces(random.Random(seed), size, ("random", "zeros", "repeat")))
    assert _parallel(helpers, path) == _serial(path)


def test_a_file_longer_than_a_read_block(tmp_path: Path, helpers: ChunkHelpers):
    path = tmp_path / "data"
    path.write_bytes(_pieces(random.Random(11), 20 << 20, ("random", "zeros", "repeat")))  # 8 MiB blocks
    assert _parallel(helpers, path) == _serial(path)


def test_a_file_left_early_does_not_lend_its_cuts_to_the_next(tmp_path: Path, helpers: ChunkHelpers):
    """Replies to the regions asked for a file whose reading stopped (an error, a change) are dropped."""
    a = random.Random(1).randbytes(12 * REGION)
    b = bytearray(a)
    b[REGION + REGION // 2 : REGION + REGION // 2] = random.Random(2).randbytes(1000)  # inserted in region 1
    (tmp_path / "a").write_bytes(a)
    (tmp_path / "b").write_bytes(bytes(b))
    with open(tmp_path / "a", "rb", buffering=0) as f:
        it = helpers.chunks(f, f.fileno(), len(a))
        next(it)
        it.close()  # its requests stay in flight
    assert _parallel(helpers, tmp_path / "b") == _serial(tmp_path / "b")
    assert helpers.helper_chunks > 0


def test_a_small_file_starts_no_helper(tmp_path: Path):
    path = tmp_path / "data"
    path.write_bytes(os.urandom(3 * REGION))
    h = ChunkHelpers(PARAMS, 2, region=REGION, min_file=4 * REGION)
    try:
        assert _parallel(h, path) == _serial(path)
        assert h._helpers == [] and h.helper_chunks == 0
    finally:
        h.close()


def _helper_pids(h: ChunkHelpers) -> list[int]:
    return [helper.process.pid for helper in h._helpers if helper.process is not None]


def test_helpers_killed_mid_file_cost_time_not_chunks(tmp_path: Path, helpers: ChunkHelpers):
    path = tmp_path / "data"
    path.write_bytes(os.urandom(20 * REGION))
    with open(path, "rb", buffering=0) as f:
        it = helpers.chunks(f, f.fileno(), 20 * REGION)
        got = [bytes(next(it))]
        for pid in _helper_pids(helpers):
            os.kill(pid, signal.SIGKILL)
        got += [bytes(c) for c in it]
    assert got == _serial(path)
    assert helpers.local_chunks > len(got) // 2  # the rest was cut here, none lost
    assert _parallel(helpers, path) == _serial(path)  # and the next file goes on without them


def test_a_helper_stopped_mid_file_is_given_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from ckptvault import parallel_chunking

    monkeypatch.setattr(parallel_chunking, "HELPER_WAIT_S", 0.5)
    path = tmp_path / "data"
    path.write_bytes(os.urandom(20 * REGION))
    h = ChunkHelpers(PARAMS, 1, region=REGION, min_file=0)
    try:
        with open(path, "rb", buffering=0) as f:
            it = h.chunks(f, f.fileno(), 20 * REGION)
            got = [bytes(next(it))]
            (pid,) = _helper_pids(h)
            os.kill(pid, signal.SIGSTOP)
            started = time.monotonic()
            got += [bytes(c) for c in it]
        assert got == _serial(path)
        assert time.monotonic() - started < 5  # one wait of 0.5 s, not one per region (19 of them)
        assert h._helpers[0].process is None  # given up and reaped (a stopped process is killed)
    finally:
        h.close()


@pytest.mark.parametrize("executable", ["/nonexistent/python3", "python3-that-exits", "/bin/false", "no fds"])
def test_helpers_that_cannot_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, executable: str):
    """No interpreter there, one that exits at once, a program that is no Python (an embedding server's
    binary, which is never started), no file descriptor left for a socket: the file is cut by the
    backup's thread alone."""
    if executable == "python3-that-exits":
        executable = str(tmp_path / executable)
        Path(executable).write_text("#!/bin/sh\nexit 1\n")
        Path(executable).chmod(0o755)
    if executable == "no fds":

        def out_of_descriptors(*args: object) -> None:
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(socket, "socketpair", out_of_descriptors)
    else:
        monkeypatch.setattr(sys, "executable", executable)
    path = tmp_path / "data"
    path.write_bytes(os.urandom(6 * REGION))
    h = ChunkHelpers(PARAMS, 2, region=REGION, min_file=0)
    try:
        assert _parallel(h, path) == _serial(path)
        assert h.helper_chunks == 0
    finally:
        h.close()


def test_a_helper_never_runs_another_ckptvault_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helpers: ChunkHelpers
):
    other = tmp_path / "cwd" / "ckptvault"
    other.mkdir(parents=True)
    marker = tmp_path / "imported"
    (other / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (other / "parallel_chunking.py").write_text("")
    monkeypatch.chdir(tmp_path / "cwd")
    path = tmp_path / "data"
    path.write_bytes(os.urandom(6 * REGION))
    assert _parallel(helpers, path) == _serial(path)
    assert helpers.helper_chunks > 0 and not marker.exists()


def test_a_cut_where_the_file_ended_is_not_listed():
    """A helper that reached the end of the file leaves the last chunk to the reading thread: the
    file may have grown since, and the chunk end there would then be no cut of the longer file."""
    data = random.Random(3).randbytes(5 * REGION)
    with tempfile.TemporaryFile() as f:
        f.write(data[: 3 * REGION + 1000])
        f.flush()
        short = region_cuts(f.fileno(), 2 * REGION, 4 * REGION, PARAMS)
        f.write(data[3 * REGION + 1000 :])
        f.flush()
        whole = region_cuts(f.fileno(), 2 * REGION, 4 * REGION, PARAMS)
    assert 2 * REGION < short[-1] < 3 * REGION + 1000  # the end of the short file is not listed
    assert whole[: len(short)] == short  # and every cut that is listed holds in the longer file
    assert whole[-1] >= 4 * REGION


@pytest.mark.parametrize("change", ["grown", "shrunk", "rewritten"])
def test_a_file_that_changed_after_the_helpers_read_it(tmp_path: Path, helpers: ChunkHelpers, change: str):
    """The helpers chunk one version of the file (their fd) and the reading thread reads another (the
    stream): the chunks hold exactly the bytes read, and a file that only grew or shrank is cut as
    one thread cuts what was read (a helper's cut where its file ended is never trusted)."""
    old = os.urandom(9 * REGION + 777)
    new = {
        "grown": old + os.urandom(3 * REGION),
        "shrunk": old[: 6 * REGION + 999],
        "rewritten": old[: 4 * REGION] + os.urandom(REGION) + old[5 * REGION :],
    }[change]
    (tmp_path / "old").write_bytes(old)
    (tmp_path / "new").write_bytes(new)
    with open(tmp_path / "old", "rb") as helpers_file, open(tmp_path / "new", "rb", buffering=0) as read:
        got = [bytes(c) for c in helpers.chunks(read, helpers_file.fileno(), len(old))]
    assert b"".join(got) == new
    assert all(0 < len(c) <= PARAMS.max_size for c in got)
    if change != "rewritten":  # a rewrite is read again by the backup (its stat moved): no claim on its cuts
        assert got == _serial(tmp_path / "new")


def test_a_backup_with_helpers_stores_the_chunks_of_one_without(
    tmp_path: Path, vault: Vault, monkeypatch: pytest.MonkeyPatch
):
    made: list[ChunkHelpers] = []

    def small_regions(params: ChunkerParams, processes: int) -> ChunkHelpers:
        made.append(ChunkHelpers(params, processes, region=1 << 20, min_file=0))
        return made[-1]

    monkeypatch.setattr(backup_module, "ChunkHelpers", small_regions)
    src = tmp_path / "src"
    (src / "model").mkdir(parents=True)
    (src / "model" / "weights.bin").write_bytes(_pieces(random.Random(7), 24 << 20, ("random", "zeros")))
    (src / "small.txt").write_text("a small file")
    monkeypatch.setenv("CKPTVAULT_CHUNK_PROCESSES", "0")
    serial = vault.backup(str(src))
    monkeypatch.setenv("CKPTVAULT_CHUNK_PROCESSES", "2")
    os.utime(src / "model" / "weights.bin")  # read again
    parallel = vault.backup(str(src))
    assert made[-1].helper_chunks > 0
    assert parallel.summary.new_bytes == 0
    assert {e.path: e.chunks for e in vault.files(parallel)} == {e.path: e.chunks for e in vault.files(serial)}
    vault.restore(parallel.id, str(tmp_path / "out"))
    assert (tmp_path / "out" / "model" / "weights.bin").read_bytes() == (src / "model" / "weights.bin").read_bytes()
    assert all(h._helpers == [] for h in made)  # closed with the backup


SECRETS = {
    "CKPTVAULT_PASSPHRASE": "the passphrase of the vault",
    "CKPTVAULT_NEW_PASSPHRASE": "a new passphrase",
    "CKPTVAULT_FROM_PASSPHRASE": "the source's passphrase",
    "CKPTVAULT_STORAGE_OPTIONS": '{"secret": "s3cr3t"}',
    "AWS_SECRET_ACCESS_KEY": "an s3 secret",
    "AZURE_STORAGE_CONNECTION_STRING": "an azure secret",
}


def test_helpers_start_without_the_passphrase_or_other_secrets_of_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Helpers inherited the whole environment, CKPTVAULT_PASSPHRASE included: readable in /proc/PID/environ for as
    long as they ran, though they only cut bytes. A real encrypted backup's helpers, read while they run: none of
    the secrets is there, and what they need (PATH, PYTHONPATH, the helper count) is."""
    from ckptvault.crypto.keyfile import Keyfile

    keyfile = Keyfile.create("the passphrase of the vault", scrypt_n=2**10)[0].save(tmp_path / "k.key")
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CKPTVAULT_STORAGE_OPTIONS", "{}")  # read by the vault: a local one takes no options
    monkeypatch.setenv("CKPTVAULT_CHUNK_PROCESSES", "2")
    seen: dict[int, dict[str, str]] = {}

    class Observed(ChunkHelpers):
        def chunks(self, stream, fd: int, size: int):
            for n, chunk in enumerate(super().chunks(stream, fd, size)):
                if n == 0:  # the helpers run now: their environment as the kernel holds it
                    for helper in self._helpers:
                        assert helper.process is not None
                        raw = Path(f"/proc/{helper.process.pid}/environ").read_bytes()
                        seen[helper.process.pid] = dict(v.split("=", 1) for v in raw.decode().split("\0") if v)
                yield chunk

    monkeypatch.setattr(
        backup_module, "ChunkHelpers", lambda params, processes: Observed(params, processes, region=1 << 20, min_file=0)
    )
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(_pieces(random.Random(3), 8 << 20, ("random",)))
    url = str(tmp_path / "vault")
    small = ChunkerParams(min_size=16 * 1024, avg_size=64 * 1024, max_size=256 * 1024)  # 1 MiB regions
    with Vault.init(url, keyfile=keyfile.path, passphrase=os.environ["CKPTVAULT_PASSPHRASE"], chunker=small) as vault:
        monkeypatch.setenv("CKPTVAULT_STORAGE_OPTIONS", SECRETS["CKPTVAULT_STORAGE_OPTIONS"])
        vault.backup(str(src))
    assert len(seen) == 2, seen
    for env in seen.values():
        assert not set(SECRETS) & set(env), sorted(set(SECRETS) & set(env))
        assert env["PATH"] == os.environ["PATH"] and env["CKPTVAULT_CHUNK_PROCESSES"] == "2"
        assert env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")


def _gone(pid: int) -> bool:
    """Exited: no process, or a zombie that nobody reaps (PID 1 of some containers does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _run_until_helpers_started(tmp_path: Path, extra: str = "") -> tuple[subprocess.Popen, list[int]]:
    path = tmp_path / "data"
    path.write_bytes(os.urandom(40 * REGION))
    script = (
        textwrap.dedent(
            f"""
        import os, signal, sys, time
        from ckptvault.chunking import ChunkerParams
        from ckptvault.parallel_chunking import ChunkHelpers
        h = ChunkHelpers(ChunkerParams({PARAMS.min_size}, {PARAMS.avg_size}, {PARAMS.max_size}), 2,
                         region={REGION}, min_file=0)
        f = open({str(path)!r}, "rb", buffering=0)
        it = h.chunks(f, f.fileno(), {40 * REGION})
        for _ in range(30):  # past the first region, cut here: the helpers have answered
            next(it)
        print(*[x.process.pid for x in h._helpers], flush=True)
        """
        )
        + textwrap.dedent(extra)
        + "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2
    return proc, pids


FORK_A_CHILD = """
    child = os.fork()
    if child == 0:  # a data loader's worker, forked meanwhile: it holds a copy of every socket
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
"""


@pytest.mark.parametrize("forked", [False, True])
def test_helpers_end_with_a_killed_backup(tmp_path: Path, forked: bool):
    """A backup process killed mid-file leaves no helper behind: its socket closes, or, while a child it
    forked holds the socket open, the helper sees that its parent is gone."""
    proc, pids = _run_until_helpers_started(tmp_path, FORK_A_CHILD if forked else "")
    child = int(proc.stdout.readline()) if forked else None
    try:
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(pid) for pid in pids)
    finally:
        proc.kill()
        proc.wait()
        if child is not None:
            os.kill(child, signal.SIGKILL)


def test_closing_does_not_wait_on_a_forked_child(tmp_path: Path, helpers: ChunkHelpers):
    path = tmp_path / "data"
    path.write_bytes(os.urandom(6 * REGION))
    assert _parallel(helpers, path) == _serial(path)
    pids = _helper_pids(helpers)
    child = os.fork()
    if child == 0:  # a data loader's worker forked by the trainer meanwhile
        time.sleep(60)
        os._exit(0)
    try:
        started = time.monotonic()
        helpers.close()
        assert time.monotonic() - started < 4  # the helpers saw EOF: not 5 s each of waiting, then a kill
        assert all(_gone(pid) for pid in pids)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_dead_helper_never_kills_a_process_with_default_sigpipe(tmp_path: Path):
    """A program may restore SIGPIPE's default (to end quietly in a pipe): asking a helper that died
    must not kill it."""
    proc, _ = _run_until_helpers_started(
        tmp_path,
        """
        for x in h._helpers:
            os.kill(x.process.pid, signal.SIGKILL)
        time.sleep(0.5)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        f.seek(0)
        print(sum(len(c) for c in h.chunks(f, f.fileno(), os.fstat(f.fileno()).st_size)), flush=True)
        """,
    )
    try:
        assert proc.stdout.readline().strip() == str(40 * REGION)
    finally:
        proc.kill()
        proc.wait()


def test_the_number_of_helpers_is_checked(tmp_path: Path, cli):
    (tmp_path / "f").write_bytes(b"x")
    cli("init", "--repo", str(tmp_path / "repo"))
    proc = cli(
        "backup", str(tmp_path / "f"), "--repo", str(tmp_path / "repo"), check=False, CKPTVAULT_CHUNK_PROCESSES="many"
    )
    assert proc.returncode != 0
    message = "error: CKPTVAULT_CHUNK_PROCESSES='many' is not a whole number"
    assert proc.stderr.decode().strip().splitlines() == [message]


def test_a_big_file_through_the_cli(tmp_path: Path, cli):
    """At the default sizes (64 MiB regions, files of 128 MiB and more), helpers on and off store the
    same chunks: a second backup with the other setting adds nothing."""
    src = tmp_path / "big.bin"
    with open(src, "wb") as f:
        for _ in range(140):
            f.write(os.urandom(1 << 20))
    repo = str(tmp_path / "repo")
    cli("init", "--repo", repo)
    cli("backup", str(src), "--repo", repo, CKPTVAULT_CHUNK_PROCESSES="0")
    os.utime(src)
    out = cli("backup", str(src), "--repo", repo, "--json", CKPTVAULT_CHUNK_PROCESSES="2", CKPTVAULT_DEBUG="1")
    assert '"new_bytes": 0' in out.stdout.decode()
    helped = re.search(r"big.bin: (\d+) chunks cut by helper processes", out.stderr.decode())
    assert helped and int(helped.group(1)) > 0  # the first 64 MiB are cut by the reading thread


def test_helpers_started_by_the_shipping_thread_inherit_its_lower_priority(tmp_path: Path):
    """backup_async ships at nice +10 (docs/training.md): the helpers it starts must not compete with
    the trainer at its own priority."""
    from ckptvault.ops.async_backup import lower_this_threads_priority

    path = tmp_path / "data"
    path.write_bytes(os.urandom(6 * REGION))
    seen: list[tuple[int, int]] = []

    def ship() -> None:
        lower_this_threads_priority(10)
        h = ChunkHelpers(PARAMS, 1, region=REGION, min_file=0)
        try:
            assert _parallel(h, path) == _serial(path)
            (pid,) = _helper_pids(h)
            seen.append((os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, pid)))
        finally:
            h.close()

    thread = threading.Thread(target=ship)
    thread.start()
    thread.join()
    (mine, helpers), main = seen[0], os.getpriority(os.PRIO_PROCESS, 0)
    assert helpers == mine == min(19, main + 10)
