"""Command-line mistakes: one line on stderr, the right exit code, and nothing created or touched."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import UsageError
from tests.conftest import one_file_vault

from .test_cli import one_line_error


@pytest.mark.parametrize(
    "args, code, fragment",
    [
        # click's own errors, as one line instead of a framed box
        (["prune", "--keep-latest", "abc", "--repo", "{tmp}/v"], 2, "'abc' is not a valid int"),
        (["backup"], 2, "Missing argument"),
        (["frobnicate"], 2, "No such command 'frobnicate'"),
        (["snapshot"], 2, "Did you mean 'snapshots'"),
        (["snapshots", "--bogus"], 2, "No such option: --bogus"),
        # a missing value names the command's help like every other usage error
        (["backup", "{tmp}/src", "--tag"], 2, "Option '--tag' requires an argument. (see: ckptvault backup --help)"),
        (["key", "passwd", "--keyfile"], 2, "requires an argument. (see: ckptvault key passwd --help)"),
        # an empty path must not fall back to the default vault or the current folder
        (["snapshots", "--repo", ""], 2, "--repo is empty"),
        (["init", ""], 2, "repository URL is empty"),
        (["backup", "", "--repo", "{tmp}/v"], 2, "source path is empty"),
        # options checked before the default vault would be created
        (["backup", "{tmp}/src", "--on-change", "bogus"], 2, "--on-change 'bogus' is not one of"),
        (["watch", "{tmp}/missing/ckpts"], 3, "no such directory, nor its parent"),
        (["watch", "{tmp}/missing", "--once"], 3, "no such directory"),
        (["watch", "{tmp}/src", "--interval", "-1"], 2, "--interval -1 must be a number of seconds above 0 and"),
        (["watch", "{tmp}/src", "--interval", "inf"], 2, "--interval inf must be a number of seconds above 0"),
        (["watch", "{tmp}/src", "--interval", "1e9", "--once"], 2, "at most 3600 (a poll that rare would miss"),
        (["watch", "{tmp}/src", "--settle", "-1"], 2, "--settle -1 must be a number of seconds from 0 to 86400"),
        (["watch", "{tmp}/src", "--settle", "inf", "--once"], 2, "--settle inf must be a number of seconds"),
        (["watch", "{tmp}/src", "--state-dir", ""], 2, "--state-dir is empty"),
        (["backup", "{tmp}/src", "--repo", "{tmp}/v", "--host", "  "], 2, "hostname '  ' is blank"),
        # a key file that is not there, named at once, not after minutes of retrying a host that does not answer
        (
            ["snapshots", "--repo", "sftp://u@127.0.0.1:9/x", "-o", "key_filename={tmp}/no-key"],
            2,
            "-o key_filename={tmp}/no-key: cannot read {tmp}/no-key (No such file or directory); give the path",
        ),
        # a file where the repository should be: refused at once, not retried for seconds
        (["snapshots", "--repo", "{tmp}/afile"], 10, "no vault at {tmp}/afile; {tmp}/afile is a file, not a folder"),
        (["snapshots", "--repo", "{tmp}/afile/v"], 10, "; {tmp}/afile is a file, not a folder; give the vault's"),
        (["init", "{tmp}/afile"], 2, "{tmp}/afile is a file, not a folder; create the vault in a new or empty"),
        (["init", "{tmp}/afile/v"], 2, "{tmp}/afile is a file, not a folder"),
        # control characters in a message are escaped
        (["backup", "{tmp}/no\nsuch"], 3, "no\\nsuch"),
        # only special files named: no empty snapshot that looks like a backup
        (["backup", "{tmp}/fifo", "--repo", "{tmp}/v"], 3, "nothing left to back up"),
        (["status", "{tmp}/fifo", "--repo", "{tmp}/v"], 3, "fifo: nothing left to compare"),  # status backs up nothing
        # nor of an empty folder (a wrong path, a checkpoint not written yet): it would become `latest`
        (["backup", "{tmp}/empty", "--repo", "{tmp}/v"], 3, "empty: it holds no files"),
        (["backup", "{tmp}/links", "--repo", "{tmp}/v"], 3, "links: it holds no files, only symlinks"),
        (["backup", "{tmp}/dangling", "--repo", "{tmp}/v"], 3, "a symlink to {tmp}/gone, which does not exist"),
        (["backup", "{tmp}/loop", "--repo", "{tmp}/v"], 3, "loop: a symlink loop"),
        (["init", "{tmp}/v2", "--pack-size-mib", "-1"], 2, "--pack-size-mib -1 is out of range"),
        (["prune", "--repo", "{tmp}/v", "--keep-latest", "1", "--repack-threshold", "2"], 2, "threshold': 2.0 is"),
        (["check", "--repo", "{tmp}/v", "--read-data", "--read-data-subset", "10%"], 2, "not both"),
        (["check", "--repo", "{tmp}/v", "--read-data-subset", "5"], 2, "'5' is ambiguous; write a percentage like 5%"),
        (["check", "--repo", "{tmp}/v", "--read-data-subset", "1"], 2, "'1' is ambiguous"),
        (["check", "--repo", "{tmp}/v", "--read-data-subset", "inf"], 2, "'inf' is not a percentage like 10%"),
        (["prune", "--repo", "{tmp}/v", "--keep-latest", "1", "--repack-threshold", "nan"], 2, "-threshold nan"),
        # a new vault would mix with other files: a checkpoint folder named by mistake, another vault
        (["init", "{tmp}/src"], 2, "is not empty and holds no vault"),
        # ... and where a vault is looked for there, the hint is not an init that would fail
        (["snapshots", "--repo", "{tmp}/src"], 10, "holds other files, not a vault; check the path"),
        (["snapshots", "--repo", "{tmp}/v/packs"], 10, "is inside the vault at {tmp}/v; name that folder"),
        (["init", "{tmp}/v/packs/v2"], 2, "is inside the vault at"),
        (["snapshots", "--repo", "{tmp}/v", "--keyfile", "{tmp}/src"], 14, "is a directory"),
        # a URL with a typo would be a local folder, and the checkpoints would never leave the machine
        (["init", "s3:/ckptvault-test/x"], 2, "'s3:/ckptvault-test/x' is not a URL (it lacks the '//' of s3://)"),
        (["backup", "{tmp}/src", "--repo", "gs:bucket/v"], 2, "write gs://bucket/v, or ./gs:bucket/v for a local"),
        # a local folder's URL: its path starts after a third '/' (file://tmp/x is ./tmp/x to fsspec)
        (["init", "file:{tmp}/v2"], 2, "write file://{tmp}/v2, or ./file:"),
        (["init", "local:{tmp}/v2"], 2, "write local://{tmp}/v2, or ./local:"),
        (["init", "file:/{tmp}/v2"], 2, "names no absolute folder (the path of a file:// URL starts after a third"),
        (["snapshots", "--repo", "file:/{tmp}/v"], 2, "write file://{tmp}/v for {tmp}/v, or the folder's plain"),
        # a mistyped key file would be sent to Google as an access token
        (["snapshots", "--repo", "gs://b/v", "-o", "token={tmp}/key.json"], 2, "key.json: no such file on this"),
        # a storage option the backend does not take: refused, not silently dropped
        (["init", "{tmp}/v2", "-o", "foo=bar"], 2, "a local folder takes no storage option 'foo'"),
        (["backup", "{tmp}/src", "--repo", "{tmp}/v", "-o", "auto_mkdr=1"], 2, "(did you mean auto_mkdir?)"),
        (["snapshots", "--repo", "sftp://u@127.0.0.1:1/x", "-o", "look_for_key=no"], 2, "did you mean look_for_keys?"),
        # fsspec's chains hide the storage whose retries, time limits and folder rules ckptvault sets
        (["init", "simplecache::{tmp}/v2"], 2, "chains fsspec filesystems (simplecache::...), which ckptvault does"),
        (["snapshots", "--repo", "filecache::s3://b/v"], 2, "give the storage's own URL: s3://b/v"),
    ],
)
def test_mistakes_are_one_line_and_create_nothing(cli, tmp_path: Path, args, code, fragment):
    cli("init", str(tmp_path / "v"))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"data")
    (tmp_path / "afile").write_bytes(b"not a vault")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    (tmp_path / "links").mkdir()
    os.symlink(tmp_path / "src" / "f", tmp_path / "links" / "f")
    started = time.monotonic()
    # a retry would wait 15-30 s (the delay with its jitter): far beyond a slow machine's start-up
    proc = cli(*[a.replace("{tmp}", str(tmp_path)) for a in args], check=False, CKPTVAULT_RETRY_DELAY="30")
    assert proc.returncode == code, proc.stderr
    assert fragment.replace("{tmp}", str(tmp_path)) in one_line_error(proc)
    assert time.monotonic() - started < 14, "a permanent error was retried"
    assert not (tmp_path / "xdg-data").exists(), "the default vault was created or used"
    assert (tmp_path / "afile").read_bytes() == b"not a vault"
    assert not (tmp_path / "v2").exists()
    assert not [p for p in (tmp_path / "v").rglob("*") if "snapshots" in p.parts and p.is_file()]


@pytest.mark.parametrize("form", ["{tmp}/run::1/vault", "file://{tmp}/run::1/vault"])
def test_a_folder_name_with_two_colons_is_that_folder(cli, tmp_path: Path, form: str):
    """fsspec reads "a::b" as a chain of filesystems: /data/run::1/vault was made in /data/run."""
    url = form.replace("{tmp}", str(tmp_path))
    cli("init", url)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"data")
    cli("backup", str(tmp_path / "src"), "--repo", url)
    assert (tmp_path / "run::1" / "vault" / "config").is_file() and not (tmp_path / "run").exists()
    cli("restore", "latest", str(tmp_path / "out"), "--repo", url)
    assert (tmp_path / "out" / "f").read_bytes() == b"data"


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_flags(cli, flag):
    out = cli("restore", flag).stdout.decode()
    assert "Usage:" in out and "restore [OPTIONS]" in out and "--overwrite" in out


def test_the_command_list_breaks_summaries_only_where_the_terminal_ends(cli):
    """Typer kept the docstrings' line breaks in the list of commands, so summaries broke mid-sentence
    ("those with" / "--tag, or the given ones.") whatever the terminal's width."""
    rows = [line for line in cli("--help").stdout.decode().splitlines() if line.startswith("│ ")]
    copy = [row for row in rows if row.split()[1:2] == ["copy"]]
    assert len(copy) == 1 and "those with --tag, or the given ones." in copy[0], rows
    assert "passwd    Change a keyfile's passphrase. The key" in cli("key", "--help").stdout.decode()


def test_bare_command_still_prints_the_help(cli):
    proc = cli(check=False)
    assert proc.returncode == 2
    assert "Usage" in proc.stdout.decode() + proc.stderr.decode()
    assert "Traceback" not in proc.stderr.decode()


def test_retries_are_warned_and_other_libraries_print_no_tracebacks(cli):
    """A server that closes each connection without a word (no SSH greeting: an outage, retried; one that
    answers with other words is a wrong port, said at once, test_sftp_faults): paramiko logs its own
    traceback of each failed session; the CLI shows one warning per retry and one error line, nothing else."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def close_at_once() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=close_at_once, daemon=True).start()
    try:
        proc = cli(
            "snapshots", "-r", f"sftp://root@127.0.0.1:{port}/vault", "-o", "look_for_keys=false",
            "-o", "allow_agent=false", "-o", "password=x",
            check=False, CKPTVAULT_RETRIES="1", CKPTVAULT_RETRY_DELAY="0.01",
        )  # fmt: skip
    finally:
        server.close()
    err = proc.stderr.decode()
    assert proc.returncode == 20, err
    warning, error = err.splitlines()
    assert warning.startswith("warning: storage failed: GET config on sftp://") and "(attempt 2 of 2)" in warning, err
    assert error.startswith("error: storage failed: GET config on sftp://") and "(after 2 attempts)" in error, err


def test_the_cli_shows_retries_and_locks_left_behind_and_drops_other_libraries_records():
    script = (
        "import logging; from ckptvault.cli.process import _configure_logging; _configure_logging()\n"
        "logging.getLogger('ckptvault.store').warning('retrying  in 1 s')\n"
        "logging.getLogger('ckptvault.locks').warning('lock abc is left behind')\n"
        "logging.getLogger('ckptvault').warning('a notice the CLI reports itself')\n"
        "logging.getLogger('ckptvault').error('queued backups failed')\n"
        "logging.getLogger('paramiko.transport').error('Exception (client): Error reading SSH protocol banner')\n"
        "logging.getLogger('asyncio').error('Task exception was never retrieved')\n"
        "logging.getLogger('ckptvault.shipping').warning('async backup of x: y; retrying in 30 s')\n"
        "import threading\n"
        "def fail(): raise EOFError()\n"
        "for name in ('Thread-1 (_prefetch_thread)', 'ckptvault-lock'):\n"
        "    t = threading.Thread(target=fail, name=name); t.start(); t.join()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    lines = proc.stderr.splitlines()
    assert lines[:4] == [
        "warning: retrying in 1 s",
        "warning: lock abc is left behind",
        "error: queued backups failed",
        "warning: async backup of x: y; retrying in 30 s",
    ], proc.stderr
    # a dying thread of another library (paramiko's prefetch) prints nothing; one of ckptvault's does
    assert "_prefetch_thread" not in proc.stderr and "Exception in thread ckptvault-lock" in proc.stderr


def _run_with_stdout(args: list[str], stdout, *, fsize: int | None = None, env: dict[str, str]):
    """The CLI with stdout where given, under a file size limit, with Python's own stdout unbuffered
    (PYTHONUNBUFFERED, as on many CI and container setups: writes go straight to the raw file)."""
    import resource

    def limit() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run(
        [sys.executable, "-m", "ckptvault", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={**env, "PYTHONUNBUFFERED": "1"},
        preexec_fn=limit,
        timeout=120,
    )


def test_output_that_cannot_be_written_whole_is_an_error_not_a_short_success(cli, tmp_path: Path):
    # a raw stdout's write() takes what fits and says so: cat and --json output came out cut short, exit 0
    src, repo = tmp_path / "src", str(tmp_path / "repo")
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(3_000_000))
    for i in range(300):
        (src / f"file-{i:03d}.txt").write_text(str(i))
    cli("init", repo)
    cli("backup", str(src), "--repo", repo)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTVAULT_")}
    env["XDG_DATA_HOME"] = str(tmp_path / "xdg")
    for args, limit in ((["cat", "latest", "big.bin"], 1 << 20), (["ls", "latest", "--json"], 8192)):
        with open(tmp_path / "out", "wb") as sink:
            proc = _run_with_stdout([*args, "--repo", repo], sink, fsize=limit, env=env)
        message = one_line_error(proc)
        assert proc.returncode == 21 and "file size limit" in message, (args, proc.returncode, message)
    with open(tmp_path / "out", "wb") as sink:  # and with room, every byte
        proc = _run_with_stdout(["cat", "latest", "big.bin", "--repo", repo], sink, env=env)
    assert proc.returncode == 0 and (tmp_path / "out").read_bytes() == (src / "big.bin").read_bytes()


@pytest.mark.parametrize("args", [["snapshots"], ["snapshots", "--json"], ["stats", "--json"]])
def test_a_small_result_to_a_full_disk_is_exit_21_and_one_line(cli, tmp_path: Path, args: list[str]):
    # the text stayed in stdout's buffer and failed again at exit: "Exception ignored ...", exit 120
    repo = str(tmp_path / "repo")
    cli("init", repo)
    with open("/dev/full", "wb") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "ckptvault", *args, "--repo", repo],
            stdout=full,
            stderr=subprocess.PIPE,
            env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg")},
        )
    assert proc.returncode == 21 and "No space left" in one_line_error(proc)


def test_cat_to_a_closed_stdout_says_so(cli, tmp_path: Path):
    src, repo = tmp_path / "src", str(tmp_path / "repo")
    src.mkdir()
    (src / "f").write_bytes(b"data")
    cli("init", repo)
    cli("backup", str(src), "--repo", repo)
    proc = subprocess.run(
        [sys.executable, "-m", "ckptvault", "cat", "latest", "f", "--repo", repo],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg")},
        preexec_fn=lambda: os.close(1),
    )
    assert proc.returncode == 2 and "standard output is closed" in one_line_error(proc)


def test_a_file_size_limit_on_the_vault_fails_at_once_naming_it(cli, tmp_path: Path):
    src, repo = tmp_path / "src", str(tmp_path / "repo")
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(3_000_000))
    cli("init", repo, "--pack-size-mib", "1")
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg"), "CKPTVAULT_RETRY_DELAY": "30"}  # a retry: 15-30 s
    started = time.monotonic()
    proc = _run_with_stdout(["backup", str(src), "--repo", repo], subprocess.PIPE, fsize=256 * 1024, env=env)
    assert proc.returncode == 20 and "file size limit (ulimit -f)" in one_line_error(proc)
    assert time.monotonic() - started < 14  # not retried (a retry would wait 15-30 s)


def test_a_newline_in_a_file_name_keeps_ls_and_diff_to_one_line_per_file(cli, tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "line\nbreak.txt").write_bytes(b"x")
    repo = str(tmp_path / "v")
    cli("init", repo)
    cli("backup", str(src), "--repo", repo)
    (src / "line\nbreak.txt").write_bytes(b"changed")
    cli("backup", str(src), "--repo", repo)
    first, second = (s["id"] for s in json.loads(cli("snapshots", "--json", "--repo", repo).stdout))
    for shown in (cli("ls", second, "--repo", repo), cli("diff", first, second, "--repo", repo)):
        lines = shown.stdout.decode().splitlines()
        assert len([line for line in lines if "line\\nbreak.txt" in line]) == 1, lines
        assert not any(line.startswith("break.txt") for line in lines), lines


@pytest.mark.parametrize(
    "name, message",
    [
        ("restore_cmd", "cancelled; the files restored so far are whole and verified"),
        ("backup_cmd", "cancelled; nothing after the last completed snapshot was committed"),
        ("ls_cmd", "cancelled"),
    ],
)
def test_ctrl_c_says_what_the_command_leaves(name: str, message: str, capsys: pytest.CaptureFixture[str]):
    """A restore said "nothing after the last completed snapshot was committed", a backup's words."""
    import typer

    from ckptvault.cli.app import command

    def interrupted() -> None:
        raise KeyboardInterrupt

    interrupted.__name__ = name
    with pytest.raises(typer.Exit) as ended:
        command(interrupted)()
    assert ended.value.exit_code == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err
    if name == "ls_cmd":
        assert err == "error: cancelled"


@pytest.mark.parametrize("command", ["backup", "prune"])
def test_sigterm_unwinds_like_ctrl_c_and_leaves_no_lock(cli, tmp_path: Path, command: str):
    """SIGTERM is how Kubernetes, SLURM and spot instances stop a job: the command used to die at once
    (exit 143, no message) and leave its lock, which keeps other hosts out of a shared vault for 30 minutes."""
    import signal

    repo, src = str(tmp_path / "v"), tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(24_000_000))
    cli("init", repo)
    if command == "prune":  # a prune that repacks: a pack holds the end of w.bin (dead) and x.bin's start
        (src / "x.bin").write_bytes(os.urandom(24_000_000))
        cli("backup", str(src), "--repo", repo)
        (src / "w.bin").unlink()
        cli("backup", str(src), "--repo", repo)
        args = ["prune", "--keep-latest", "1", "--repack-threshold", "0"]
    else:
        args = ["backup", str(src)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptvault", *args, "--repo", repo, "--limit-upload", "4MB", "--limit-download", "4MB"],
        stderr=subprocess.PIPE,
        text=True,
    )
    locks = tmp_path / "v" / "locks"
    deadline = time.monotonic() + 30
    while not (locks.exists() and any(locks.iterdir())):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.02)
    time.sleep(0.5)  # under way
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 143, err
    assert err.startswith("error: terminated (SIGTERM)") and "Traceback" not in err, err
    assert not any(locks.iterdir()), "the lock was left behind"
    cli("check", "--repo", repo)  # nothing damaged: what was cut short is only unindexed packs


@pytest.mark.parametrize(
    ("signal_name", "module"),
    [
        ("SIGTERM", "ckptvault.cli.app"),
        ("SIGINT", "ckptvault.cli.app"),
        # cli49 #9: Ctrl-C while the CLI's own module loaded, before main() was called
        ("SIGINT", "ckptvault.cli.process"),
        ("SIGINT", "logging"),
        ("SIGINT", "ckptvault.ops.memory"),
    ],
)
def test_a_signal_while_the_cli_loads_ends_it_with_one_line(tmp_path: Path, signal_name: str, module: str):
    """A scheduler's SIGTERM in the first ~0.3 s (imports) ended the process by the default action, with
    no word (status -15), and Ctrl-C then printed the traceback of an import. The signal is sent by the
    process itself as it starts importing ``module``, so it lands there every time."""
    start = (
        "import os, signal, sys\n"
        "class Signal:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {module!r}:\n"
        f"            os.kill(os.getpid(), signal.{signal_name})\n"
        "        return None\n"
        "sys.meta_path.insert(0, Signal())\n"
        "sys.argv = ['ckptvault', 'snapshots', '--repo', sys.argv[1]]\n"
        "from ckptvault.cli import main\n"
        "main()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", start, str(tmp_path / "v")], capture_output=True, text=True, timeout=60
    )
    said = "terminated (SIGTERM)" if signal_name == "SIGTERM" else "cancelled"
    assert (proc.returncode, proc.stderr) == (143 if signal_name == "SIGTERM" else 130, f"error: {said}\n")
    assert not (tmp_path / "v").exists()


def _python_m(tmp_path: Path, name: str, source: str) -> tuple[list[str], dict[str, str]]:
    """``python -m NAME`` of a module with ``source``, and its environment: the way ``python -m ckptvault`` runs
    (Py_RunMain, which ends with SIGINT after a KeyboardInterrupt it took for not handled), as a console script or
    ``-c`` (which end at once on SystemExit) do not."""
    (tmp_path / f"{name}.py").write_text(source)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    return [sys.executable, "-m", name], {**os.environ, "PYTHONPATH": path}


@pytest.mark.skipif(not hasattr(os, "pipe") or sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("way", ["console script", "python -m"])
def test_ctrl_c_at_any_moment_of_the_start_ends_with_one_line_and_130(tmp_path: Path, way: str):
    """cli49 #9: Ctrl-C in the first ~50 ms (SIGINT from a job scheduler) printed the traceback of an import and
    ended with status -2. A real process, run as the console script runs it, gets SIGINT from another process
    at delays from the moment the CLI starts loading what it needs (logging: the first of its imports that takes
    time, then ~50 ms more of them); before that come Python's own start-up (until its SIGINT handler is set, the
    signal's default action ends any process), site, the console script's own two lines and the import system
    finding ckptvault and ckptvault.cli, two modules that run nothing but a few assignments. ``python -m``: the
    same, and "error: cancelled" was followed by death by SIGINT (-2) when the signal came while dataclasses
    made their methods (test_ctrl_c_in_code_made_from_a_string_ends_with_130_under_python_m)."""
    repo = str(tmp_path / "v")
    Vault.init(repo).close()
    stub = (  # the console script pip writes for [project.scripts], with a word to the test at logging's import
        "import os, sys\n"
        "class Loading:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'logging':\n"
        "            os.write(ready, b'!')\n"
        "        return None\n"
        "ready = int(sys.argv.pop(1))\n"
        "sys.meta_path.insert(0, Loading())\n"
        "from ckptvault.cli import main\n"
        "if __name__ == '__main__':\n"
        "    sys.exit(main())\n"
    )
    run, env = [sys.executable, "-c", stub], None
    if way == "python -m":
        run, env = _python_m(tmp_path, "ckptvault_start", stub)
    finished = 0
    for delay in (0.0, 0.001, 0.002, 0.003, 0.005, 0.008, 0.012, 0.02, 0.03, 0.04, 0.05, 0.065, 0.08) * 2:
        started, ready = os.pipe()
        proc = subprocess.Popen(
            [*run, str(ready), "snapshots", "--repo", repo],
            pass_fds=(ready,),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        os.close(ready)
        assert os.read(started, 1) == b"!"
        os.close(started)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        if delay >= 0.1 and (proc.returncode, out, err) == (0, "no snapshots\n", ""):
            finished += 1  # on a busy machine the run (~0.2 s from logging's import) can end before the signal
            continue
        assert "Traceback" not in err and "Exception ignored" not in err, (delay, err)
        # (an extension module stopped in its initialisation may warn, e.g. Cython's "failed to patch module")
        assert (proc.returncode, err.endswith("error: cancelled\n"), out) == (130, True, ""), (delay, err)
    assert finished <= 4


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_in_code_made_from_a_string_ends_with_130_under_python_m(tmp_path: Path):
    """``python -m ckptvault`` interrupted ~0.1 s in said "error: cancelled" and then died of SIGINT (status -2, 5-11
    runs in 70): the KeyboardInterrupt had come out of code that exec() ran from a string (dataclasses make their
    methods so, while the commands load), which CPython notes, caught or not, as one left uncaught; ``python -m``
    then ends with SIGINT. Here the signal comes as the first dataclass's methods run, every time."""
    repo = str(tmp_path / "v")
    Vault.init(repo).close()
    start = (
        "import builtins, sys\n"
        "exec_ = builtins.exec\n"
        "def exec_with_ctrl_c(source, *args):\n"  # Ctrl-C as the code dataclasses wrote starts running
        "    if isinstance(source, str) and '__create_fn__' in source:\n"
        "        builtins.exec = exec_\n"
        "        source = 'import os, signal; os.kill(os.getpid(), signal.SIGINT)\\n' + source\n"
        "    return exec_(source, *args)\n"
        "builtins.exec = exec_with_ctrl_c\n"
        "from ckptvault.cli import main\n"
        "sys.argv[0] = 'ckptvault'\n"
        "sys.exit(main())\n"
    )
    run, env = _python_m(tmp_path, "ckptvault_start", start)
    proc = subprocess.run([*run, "snapshots", "--repo", repo], capture_output=True, text=True, timeout=60, env=env)
    assert (proc.returncode, proc.stderr, proc.stdout) == (130, "error: cancelled\n", "")


def test_ctrl_c_in_a_class_s_set_name_ends_with_130(tmp_path: Path):
    """ci7: Python 3.11 wraps a KeyboardInterrupt raised in a class's ``__set_name__`` (platform's
    ``uname_result``, which typer's import defines) in RuntimeError("Error calling __set_name__ ..."), which the
    start-up guard let through as a traceback. Here the signal comes in such a ``__set_name__``, every time."""
    start = (
        "import os, signal, sys\n"
        "import ckptvault.cli.process as process\n"
        "class Named:\n"
        "    def __set_name__(self, owner, name):\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        sum(range(100_000))\n"  # Python's handler runs in here
        "def loading():\n"
        "    class Loaded:\n"
        "        attribute = Named()\n"
        "process.main = loading\n"
        "from ckptvault.cli import main\n"
        "sys.exit(main())\n"
    )
    proc = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr, proc.stdout) == (130, "error: cancelled\n", "")


@pytest.mark.parametrize(
    "repeated",
    [
        ["--keep-latest", "3", "--keep-latest", "1"],
        ["--keep-latest", "1", "--group-by", "run", "--group-by=host"],
        ["--keep-latest", "1", "--before", "1d", "--before", "0min"],
    ],
)
def test_an_option_given_twice_is_refused_not_resolved_to_the_last(cli, tmp_path: Path, repeated: list[str]):
    """click keeps the last value: a wrapper appending its defaults made prune delete what the user kept."""
    repo, src = str(tmp_path / "v"), tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x")
    cli("init", repo)
    for run in ("x", "y", "z"):
        cli("backup", str(src), "--repo", repo, "-t", f"run={run}")
    proc = cli("prune", *repeated, "--repo", repo, check=False)
    name = next(arg.split("=")[0] for arg in repeated if repeated.count(arg) > 1 or "=" in arg)
    assert proc.returncode == 2, proc.stderr
    assert one_line_error(proc) == f"error: {name} is given more than once; give it once (see: ckptvault prune --help)"
    assert len(json.loads(cli("snapshots", "--json", "--repo", repo).stdout)) == 3
    cli("backup", str(src), "--repo", repo, "-t", "run=x", "-t", "step=4")  # a multiple option stays multiple
    cli("backup", str(src), "--repo", repo, "--description=--host", "--host", "h1")  # a value that looks like an option
    proc = cli("snapshots", f"-r{repo}", "-r/nonexistent", check=False)  # a short option with its value attached
    assert proc.returncode == 2 and "--repo is given more than once" in proc.stderr.decode()


@pytest.mark.parametrize(
    "args, said",
    [
        (
            ["restore", "latest", "{tmp}/out", "--include", "--repo", "{tmp}/v"],
            "--include needs a pattern; got '--repo', the next option: its value is missing (for the text '--repo' "
            "itself, write --include=--repo) (see: ckptvault restore --help)",
        ),
        (["backup", "{tmp}/src", "--tag", "--repo", "{tmp}/v"], "--tag needs a KEY=VALUE pair; got '--repo'"),
        (["backup", "{tmp}/src", "-e", "-r", "{tmp}/v"], "-e needs a pattern; got '-r', the next option"),
        (["snapshots", "--repo", "--json"], "--repo needs a path or URL; got '--json', the next option"),
        (["prune", "--keep-latest", "--repo", "{tmp}/v"], "--keep-latest needs a number; got '--repo'"),
        (["check", "--read-data-subset", "--repo={tmp}/v"], "--read-data-subset needs a share; got '--repo={tmp}/v'"),
        (["copy", "--from-repo", "--repo", "{tmp}/v"], "--from-repo needs a path or URL; got '--repo'"),
        (["key", "passwd", "--keyfile", "--kdf-cost", "18"], "(see: ckptvault key passwd --help)"),
        (["backup", "{tmp}/src", "--repo", "{tmp}/v", "--on-change", "--quiet"], "--on-change needs a value (warn"),
    ],
)
def test_an_option_taken_as_the_value_of_the_one_before_is_named_as_the_missing_value(cli, tmp_path: Path, args, said):
    """`restore latest DIR --include --repo V` took '--repo' for a pattern and V for an extra argument: the
    refusal blamed the vault's path; `snapshots --repo --json` looked for a vault called --json."""
    cli("init", str(tmp_path / "v"))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"data")
    cli("backup", str(tmp_path / "src"), "--repo", str(tmp_path / "v"))
    proc = cli(*[a.replace("{tmp}", str(tmp_path)) for a in args], check=False)
    assert proc.returncode == 2, proc.stderr
    assert said.replace("{tmp}", str(tmp_path)) in one_line_error(proc)
    assert not (tmp_path / "out").exists() and len(Vault.open(tmp_path / "v").snapshots()) == 1


def test_an_option_s_name_given_with_equals_is_its_value(cli, tmp_path: Path):
    repo = one_file_vault(cli, tmp_path)
    proc = cli("restore", "latest", str(tmp_path / "out"), "--include=--repo", "--repo", repo, check=False)
    assert proc.returncode == 2 and "--include '--repo' matched no path" in one_line_error(proc), proc.stderr
    cli("backup", str(tmp_path / "src"), "--repo", repo, "--description=--json")
    assert json.loads(cli("snapshots", "latest", "--json", "--repo", repo).stdout)[0]["description"] == "--json"


@pytest.mark.parametrize("others", [(), ("--include", "w.bin")], ids=["alone", "beside-a-glob"])
def test_an_empty_include_is_refused_as_an_unset_variable_not_as_matching_nothing(cli, tmp_path: Path, others):
    """`restore --include "$PATTERN"` with the variable unset said "--include '' matched no path" (or, beside
    another glob, restored that one with a warning), where `-e ''` names the empty pattern itself."""
    repo = one_file_vault(cli, tmp_path)
    proc = cli("restore", "latest", str(tmp_path / "out"), "--include", "", *others, "--repo", repo, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "--include pattern '' is empty (is a variable unset?)" in one_line_error(proc), proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_error_tree_in_the_docs_names_every_error_and_its_exit_code():
    """The tree in ckptvault/errors.py is how a user (and a script) learns the exit codes; five classes
    added after it was drawn were missing from it."""
    import inspect
    import re

    from ckptvault import errors

    drawn = {m[1]: int(m[2]) for m in re.finditer(r"(?m)^\s*[│ ]*[├└]?─* ?(\w+Error)\s+(\d+)\s", errors.__doc__)}
    defined = {
        name: cls.exit_code
        for name, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.CkptVaultError)
    }
    assert drawn == defined


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ({"CKPTVAULT_RETRIES": "1.5"}, "CKPTVAULT_RETRIES='1.5' is not a whole number"),  # was 1 retry
        ({"CKPTVAULT_RETRIES": "-1"}, "CKPTVAULT_RETRIES='-1' must be"),
        ({"CKPTVAULT_RETRY_DELAY": "nan"}, "CKPTVAULT_RETRY_DELAY='nan' must be a finite number"),  # was taken
        ({"CKPTVAULT_OP_TIMEOUT": "inf"}, "CKPTVAULT_OP_TIMEOUT='inf' must be a finite number"),
        ({"CKPTVAULT_RETRY_FOR": "-5"}, "CKPTVAULT_RETRY_FOR='-5' must be"),
        ({"CKPTVAULT_UPLOADS": "0"}, "CKPTVAULT_UPLOADS='0' must be between 1 and 256"),
        ({"CKPTVAULT_READAHEAD_MIB": "x"}, "CKPTVAULT_READAHEAD_MIB='x' is not a number"),
    ],
)
def test_a_bad_number_setting_in_the_environment_is_refused_naming_it(cli, setting, said):
    proc = cli("snapshots", "--repo", "s3://bucket/v", "-o", "endpoint_url=http://127.0.0.1:9", check=False, **setting)
    assert proc.returncode == 2 and said in one_line_error(proc), proc.stderr


def test_a_blank_number_setting_is_the_default(monkeypatch):
    """`CKPTVAULT_RETRIES=` (set, empty) failed as "'' is not a number", while a blank
    CKPTVAULT_UPLOADS meant its default."""
    from ckptvault.store.retrying import RETRY_FOR_S, RetryPolicy

    for name in ("CKPTVAULT_RETRIES", "CKPTVAULT_RETRY_DELAY", "CKPTVAULT_OP_TIMEOUT", "CKPTVAULT_RETRY_FOR"):
        monkeypatch.setenv(name, " ")
    assert RetryPolicy.from_env() == RetryPolicy(retry_for=RETRY_FOR_S)
    monkeypatch.setenv("CKPTVAULT_OP_TIMEOUT", "0")  # deadlines off (docs/backends.md)
    assert RetryPolicy.from_env().op_timeout == 0


def test_a_retry_count_given_is_the_whole_budget(monkeypatch):
    """An outage is retried for CKPTVAULT_RETRY_FOR seconds past the attempts (audit 31a F1), unless a count
    of retries is given: CKPTVAULT_RETRIES=0 means one attempt, as it did."""
    from ckptvault.store.retrying import RETRY_FOR_S, RetryPolicy

    assert RetryPolicy.from_env().retry_for == RETRY_FOR_S == 120
    monkeypatch.setenv("CKPTVAULT_RETRIES", "2")
    assert RetryPolicy.from_env() == RetryPolicy(retries=2, retry_for=0)
    monkeypatch.setenv("CKPTVAULT_RETRY_FOR", "600")
    assert RetryPolicy.from_env().retry_for == 600


def test_only_a_known_protocol_before_two_colons_makes_a_chain():
    from ckptvault.store.opening import _refuse_chained_url

    _refuse_chained_url("run::1/vault")  # a relative folder named run::1
    with pytest.raises(UsageError, match=re.escape("give the storage's own URL: s3://b/run::1")):
        _refuse_chained_url("simplecache::s3://b/run::1")


def test_azure_without_any_credentials_names_the_ways_to_give_them(tmp_path: Path):
    """audit gz45 #7: it said "a storage option has a value of the wrong kind ...; check the -o options", where
    no option was given at all."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AZURE_", "CKPTVAULT_"))}
    env["XDG_DATA_HOME"] = str(tmp_path / "xdg-data")
    proc = subprocess.run(
        [sys.executable, "-m", "ckptvault", "snapshots", "--repo", "az://container/vault"],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "no Azure credentials found; set AZURE_STORAGE_CONNECTION_STRING" in one_line_error(proc)


SIGNALLED_TWICE = """
import os, signal, sys, time
from ckptvault.interruptions import end_at_once_on_another

def first(signum, frame):
    end_at_once_on_another(signum)
    print("first", flush=True)

signal.signal(signal.SIGTERM, first)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.05)
os.kill(os.getpid(), signal.SIGTERM)  # the same request again, as `timeout` delivers it: not "stop at once"
time.sleep(0.05)
print("still here", flush=True)
time.sleep(float(sys.argv[1]))
os.kill(os.getpid(), signal.SIGTERM)  # a second request
time.sleep(1)
print("not stopped", flush=True)
"""


def test_sigterm_delivered_twice_is_one_request_and_a_later_one_stops_at_once():
    """GNU ``timeout`` signals the process and then its process group: the first SIGTERM unwinds a command
    (or ships a trainer's queued checkpoints), and its second copy, milliseconds later, ended the process at
    once. Only a SIGTERM that comes later means "stop now"."""
    import signal

    proc = subprocess.run([sys.executable, "-c", SIGNALLED_TWICE, "0.6"], capture_output=True, text=True, timeout=60)
    assert proc.stdout == "first\nstill here\n" and proc.returncode == -signal.SIGTERM, (proc.stdout, proc.stderr)


def test_names_the_output_encoding_cannot_show_are_escaped(cli, tmp_path: Path):
    """A Latin-1 locale or ``PYTHONIOENCODING=ascii`` (a cron job, a minimal container): `ls` stopped half
    way with "internal error", and `restore` called a restore it had finished a failure (exit 1)."""
    src, repo = tmp_path / "src", str(tmp_path / "v")
    src.mkdir()
    (src / "wü名.txt").write_text("hi")
    cli("init", repo)
    cli("backup", str(src), "--repo", repo)
    listed = cli("ls", "latest", "--repo", repo, PYTHONIOENCODING="ascii")
    assert "w\\xfc\\u540d.txt" in listed.stdout.decode("ascii")
    restored = cli("restore", "latest", str(tmp_path / "out-名"), "--repo", repo, PYTHONIOENCODING="ascii")
    assert "restored snapshot" in restored.stdout.decode("ascii") and not restored.stderr
    assert (tmp_path / "out-名" / "wü名.txt").read_text() == "hi"


def test_a_name_that_is_not_utf8_is_shown_by_its_bytes_when_not_in_the_snapshot(cli, tmp_path: Path):
    """`cat latest $'model/\\xff'` said "'model/\\udcff' is not in snapshot ...": Python's stand-in for the byte,
    which names nothing the user typed or `ls` shows (it writes the byte as \\xff)."""
    repo = one_file_vault(cli, tmp_path)
    for command in ("cat", "show"):
        proc = cli(command, "latest", "model/\udcff", "--repo", repo, check=False)
        assert proc.returncode == 19, proc.stderr
        assert one_line_error(proc).startswith("error: 'model/\\xff' is not in snapshot "), proc.stderr
