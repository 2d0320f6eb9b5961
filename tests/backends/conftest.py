"""Session-scoped real storage servers on 127.0.0.1 (tests/support/servers.py), started on first use.

A server that cannot be installed here is skipped loudly: the skip reason starts with "BACKEND NOT
TESTED", and the end of the run repeats every such backend with the reason. A server that is
installed but fails to start is an error, not a skip.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ..conftest import CKPTVAULT_ENV
from ..support import servers
from ..support.faultproxy import FaultProxy

ROOT = Path(__file__).resolve().parents[2]
UNAVAILABLE: dict[str, str] = {}

ServerGetter = Callable[[str], servers.RunningServer]


@pytest.fixture(scope="session", autouse=True)
def _client_environment() -> Iterator[None]:
    """What clients of the test servers need in this process (and inherit in CLI subprocesses)."""
    saved = {k: os.environ.get(k) for k in servers.CLIENT_ENV}
    os.environ.update(servers.CLIENT_ENV)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Remote repositories cache metadata; never in the user's cache folder."""
    monkeypatch.setenv("CKPTVAULT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerGetter]:
    """``server(name)``: the running server of that name (servers.STARTERS), started once per session."""
    running: dict[str, servers.RunningServer] = {}

    def get(name: str) -> servers.RunningServer:
        if name in UNAVAILABLE:
            pytest.skip(f"BACKEND NOT TESTED: {name}: {UNAVAILABLE[name]}")
        if name not in running:
            try:
                running[name] = servers.STARTERS[name](tmp_path_factory.mktemp(name))
            except servers.ServerUnavailable as exc:
                UNAVAILABLE[name] = str(exc)
                pytest.skip(f"BACKEND NOT TESTED: {name}: {exc}")
        return running[name]

    yield get
    for srv in running.values():
        srv.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if UNAVAILABLE:
        terminalreporter.section("BACKENDS NOT TESTED (server not installed)", sep="!", red=True, bold=True)
        for name, reason in sorted(UNAVAILABLE.items()):
            terminalreporter.write_line(f"{name}: {reason}", red=True, bold=True)


@pytest.fixture
def remote_cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """``remote_cli(backend, *args, **env)``: the real CLI in a subprocess, with the backend's
    credentials in the environment and its options as ``-o`` (added after the command's own args)."""
    base_env = {
        **os.environ,
        **servers.CLIENT_ENV,
        "XDG_DATA_HOME": str(tmp_path / "xdg-data"),
        "COLUMNS": "200",
    }
    for var in CKPTVAULT_ENV:
        base_env.pop(var, None)

    def run(
        backend: servers.Backend | None, *args: str, check: bool = True, timeout: float = 180, **env: str
    ) -> subprocess.CompletedProcess:
        extra = [*backend.cli_options] if backend else []
        proc = subprocess.run(
            [sys.executable, "-m", "ckptvault", *args, *extra],
            cwd=ROOT,
            env={**base_env, **(backend.env if backend else {}), **env},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"ckptvault {' '.join(args)} failed ({proc.returncode}): {proc.stderr.decode()}")
        return proc

    return run


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The CLI's error: exactly one line on stderr, no traceback (after any "warning:" lines of retries)."""
    err = proc.stderr.decode()
    assert proc.returncode != 0, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning: ")]
    assert len(lines) == 1, err
    return lines[0]


def make_checkpoint(root: Path, step: int, seed: int = 0, mb: float = 3.0) -> Path:
    """A small checkpoint folder: a frozen part shared by every step, a part that changes per step."""
    frozen = random.Random(f"frozen-{seed}").randbytes(int(mb * 600_000))
    moving = random.Random(f"moving-{seed}-{step}").randbytes(int(mb * 400_000))
    (root / "model").mkdir(parents=True, exist_ok=True)
    (root / "model" / "weights.bin").write_bytes(frozen + moving)
    (root / "trainer_state.json").write_text(f'{{"step": {step}, "seed": {seed}}}')
    (root / "empty.txt").write_bytes(b"")
    return root


@pytest.fixture
def fault_proxy() -> Iterator[Callable[[servers.RunningServer], FaultProxy]]:
    """``fault_proxy(srv)``: a FaultProxy started in front of the running server ``srv`` (clients reach
    it at ``proxy.port``), stopped after the test."""
    started: list[FaultProxy] = []

    def start(srv: servers.RunningServer) -> FaultProxy:
        started.append(FaultProxy(srv.port).start())
        return started[-1]

    yield start
    for proxy in started:
        proxy.stop()
