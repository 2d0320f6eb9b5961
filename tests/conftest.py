from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from ckptvault import Vault

from .support import disk

settings.register_profile(
    "default", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# A suite started in the background by a non-interactive shell (`bash .ci/run &`, `nohup`) has SIGINT ignored, and
# so has every process it starts (an ignored signal stays ignored across exec): each Ctrl-C test then failed (11
# of them in a CI run started so). They test what Ctrl-C does in a terminal, so they get a terminal's handling.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_report_header(config: pytest.Config) -> str:
    # A full disk fails tests far from its cause (a CI run: SeaweedFS refused PUTs, then tmp_path
    # setups failed); the free space at the start says so at once. Passing tests' folders are removed
    # as they end (tmp_path_retention_policy), so the suite needs about its largest test (~3 GB; tests
    # needing over 500 MB skip loudly without it: support/disk.py) and the servers' data (~0.5 GB).
    temp = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    free = shutil.disk_usage(temp).free
    return f"free disk under {temp}: {free / 1e9:.1f} GB"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if disk.NOT_TESTED:
        terminalreporter.section("NOT TESTED: too little free disk", sep="!", red=True, bold=True)
        for test, why in sorted(disk.NOT_TESTED.items()):
            terminalreporter.write_line(f"{test}: {why}", red=True, bold=True)


CKPTVAULT_ENV = (
    "CKPTVAULT_REPO",
    "CKPTVAULT_CHUNK_PROCESSES",
    "CKPTVAULT_KEYFILE",
    "CKPTVAULT_PASSPHRASE",
    "CKPTVAULT_NEW_PASSPHRASE",
    "CKPTVAULT_LIMIT_UPLOAD",
    "CKPTVAULT_LIMIT_DOWNLOAD",
    "CKPTVAULT_RETRY_LOCK",
    "CKPTVAULT_FROM_REPO",
    "CKPTVAULT_FROM_KEYFILE",
    "CKPTVAULT_FROM_PASSPHRASE",
)
SMALL_PACK = 2 * 1024 * 1024  # several packs even for small test trees


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may touch the user's default repository, nor the boot IDs this machine lists (locks.py)."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    for var in CKPTVAULT_ENV:
        monkeypatch.delenv(var, raising=False)


def _ignored_and_blocked() -> tuple[int, int]:
    """The kernel's view of this process (a library can set SIG_IGN below Python, which signal.getsignal does
    not see): SigIgn and SigBlk, as masks of SIGINT and SIGTERM only."""
    ours = 1 << (signal.SIGINT - 1) | 1 << (signal.SIGTERM - 1)
    try:
        with open("/proc/self/status") as status:
            masks = dict(line.split(":") for line in status if line.startswith(("SigIgn", "SigBlk")))
    except OSError:
        return 0, 0
    return int(masks["SigIgn"], 16) & ours, int(masks["SigBlk"], 16) & ours


@pytest.fixture(autouse=True)
def _signals_left_as_found() -> Iterator[None]:
    """A test that leaves SIGINT ignored or blocked in its pytest worker makes every later Ctrl-C test of that
    worker fail, its child processes included (both survive exec): such a test fails here. Handlers a test
    installs (the trainer callbacks' SIGTERM handler) are put back."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    before = _ignored_and_blocked()
    yield
    after = _ignored_and_blocked()
    for sig, handler in handlers.items():
        if handler is not None:  # set again even when Python's record is unchanged: the kernel's may not be
            signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if after != before:
        pytest.fail(f"the test left SIGINT/SIGTERM ignored or blocked (SigIgn, SigBlk): {after}, was {before}")


@pytest.fixture
def repo_url(tmp_path: Path) -> str:
    return str(tmp_path / "repo")


@pytest.fixture
def vault(repo_url: str) -> Vault:
    from ckptvault.chunking import ChunkerParams

    v = Vault.init(
        repo_url,
        chunker=ChunkerParams(min_size=16 * 1024, avg_size=64 * 1024, max_size=256 * 1024),
        pack_size=SMALL_PACK,
    )
    yield v
    v.close()


@pytest.fixture
def two_hosts(vault: Vault, tmp_path: Path) -> dict[str, object]:
    """Four snapshots in ``vault`` (test_host_select, test_stats_select): run=x on nodeA (steps 1, 2) and nodeB
    (step 1, taken last); run=y on nodeB."""
    made = {}
    for name, host, tags, data in (
        ("a1", "nodeA", {"run": "x", "step": "1"}, b"a1" * 5000),
        ("a2", "nodeA", {"run": "x", "step": "2"}, b"a2" * 5000),
        ("b1", "nodeB", {"run": "x", "step": "1"}, b"b1" * 5000),
        ("y", "nodeB", {"run": "y"}, b"yy" * 5000),
    ):
        write_file(tmp_path / name / "w.bin", data)
        made[name] = vault.backup(tmp_path / name, tags=tags, hostname=host)
    return made


@pytest.fixture
def memory_vault() -> Vault:
    v = Vault.init(f"memory://ckptvault-test-{uuid.uuid4().hex}", pack_size=SMALL_PACK)
    yield v
    v.close()


def write_file(path: Path, data: bytes, mode: int = 0o644, mtime_ns: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


DEEP = 1100  # folder levels: past Python's recursion limit (pathlib's and os's makedirs recurse)


@contextmanager
def deep_tree(root: Path, data: bytes = b"deep") -> Iterator[Path]:
    """``root/d/d/.../d/w.bin`` ``DEEP`` folders down; yields the file's path. Removed on exit with
    ``rm -rf``: shutil.rmtree, which cleans up tmp_path, recurses too."""
    deepest = root
    deepest.mkdir()
    for _ in range(DEEP):
        deepest = deepest / "d"
        deepest.mkdir()
    (deepest / "w.bin").write_bytes(data)
    try:
        yield deepest / "w.bin"
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=True)


def tree_digest(root: Path) -> dict[str, tuple]:
    """Everything restore must reproduce: type, content, permission bits, mtime, link target."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", st.st_mode & 0o7777, st.st_mtime_ns)
            else:
                out[rel] = ("file", p.read_bytes(), st.st_mode & 0o7777, st.st_mtime_ns)
    return out


@pytest.fixture
def cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """Run the real CLI in a subprocess, with an isolated default repository location."""
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg-data"), "COLUMNS": "200"}
    for var in CKPTVAULT_ENV:
        env.pop(var, None)

    def run(
        *args: str, check: bool = True, input: bytes | None = None, **extra_env: str
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "ckptvault", *args],
            capture_output=True,
            env={**env, **extra_env},
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,  # never a terminal: no prompts
            timeout=300,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"ckptvault {' '.join(args)} failed ({proc.returncode}): {proc.stderr.decode()}")
        return proc

    return run


def one_file_vault(cli: Callable[..., subprocess.CompletedProcess], tmp_path: Path) -> str:
    """A vault at tmp_path/v holding one snapshot of tmp_path/src, a folder of one one-byte file (w.bin)."""
    src, repo = tmp_path / "src", str(tmp_path / "v")
    src.mkdir()
    (src / "w.bin").write_bytes(b"w")
    cli("init", repo)
    cli("backup", str(src), "--repo", repo)
    return repo
