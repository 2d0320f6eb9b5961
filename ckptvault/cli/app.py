"""The typer app, the options every command shares, and the error boundary."""

from __future__ import annotations

import contextlib
import errno
import functools
import getpass
import inspect
import io
import os
import shlex
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, BinaryIO, TypeVar

import typer

from ..crypto.keyfile import passphrase_from_env
from ..errors import (
    CkptVaultError,
    IntegrityError,
    PassphraseRequiredError,
    UsageError,
    VaultNotFoundError,
    name_command_line_options,
    read_data_hint,
    unused_keyfile_error,
    unused_keyfile_note,
)
from ..interruptions import Terminated, end_at_once_on_another, hold_back
from ..location import default_repo_url
from ..store.retrying import stop_retrying
from ..vault import Vault
from ..version import __version__
from .output import Output, VaultNaming, discard_stdout, name_the_vault_in_advice
from .params import parse_duration, parse_storage_options

EXIT_PIPE_CLOSED = 141  # what a shell reports for a program that SIGPIPE ended (128 + 13)

app = typer.Typer(
    name="ckptvault",
    help="Deduplicating, verified backups of ML training checkpoints.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,  # errors are one line; a bug's traceback goes to a file
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

RepoOpt = Annotated[
    str | None,
    typer.Option(
        "--repo",
        "-r",
        metavar="URL",
        envvar="CKPTVAULT_REPO",
        help="Repository URL (any fsspec URL). Default: a local folder.",
    ),
]
StorageOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--storage-option",
        "-o",
        metavar="KEY=VALUE",
        help="fsspec storage option key=value (repeatable; e.g. endpoint_url=...); never stored. See docs/backends.md.",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
QuietOpt = Annotated[
    bool,
    typer.Option("--quiet", "-q", help="No progress, notices or summaries: only what was asked for, warnings, errors."),
]
KeyfileOpt = Annotated[
    str | None,
    typer.Option("--keyfile", "-k", metavar="PATH", envvar="CKPTVAULT_KEYFILE", help="Keyfile of an encrypted vault."),
]
PassphraseFileOpt = Annotated[
    str | None,
    typer.Option(
        "--passphrase-file",
        metavar="PATH",
        help="Read the keyfile passphrase from this file, '-' for standard input "
        "(else CKPTVAULT_PASSPHRASE, else asked).",
    ),
]
LimitUploadOpt = Annotated[
    str | None,
    typer.Option(
        "--limit-upload",
        metavar="RATE",
        help="Upload at most this much per second, on average (e.g. 50MB, 20MiB, 400Mbit; 0: no limit;"
        " else CKPTVAULT_LIMIT_UPLOAD).",
    ),
]
LimitDownloadOpt = Annotated[
    str | None,
    typer.Option(
        "--limit-download",
        metavar="RATE",
        help="Download at most this much per second, on average (as --limit-upload; else CKPTVAULT_LIMIT_DOWNLOAD).",
    ),
]
RetryLockOpt = Annotated[
    str | None,
    typer.Option(
        "--retry-lock",
        metavar="DURATION",
        help="When another process holds the vault (a prune), keep trying this long, e.g. 30s, 5m, 2h"
        " (else CKPTVAULT_RETRY_LOCK; default: fail at once).",
    ),
]
TagOpt = Annotated[
    list[str] | None, typer.Option("--tag", "-t", metavar="KEY=VALUE", help="Tag key=value (repeatable).")
]
HostOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--host",
        "-H",
        metavar="NAME",
        help="Only snapshots of this host (repeatable: of any of them), as restic's --host.",
    ),
]
RecordHostOpt = Annotated[  # backup's and watch's: the host a snapshot records, where HostOpt selects
    str | None,
    typer.Option("--host", "-H", metavar="NAME", help="Hostname to record (default: this machine's)."),
]
ExcludeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--exclude",
        "-e",
        metavar="GLOB",
        help="Leave out files and folders matching this glob (repeatable): a name at any depth ('*.tmp', 'wandb';"
        " 'logs/': folders only), a path from the snapshot's root ('logs/*.txt', './tmp'); docs/usage.md.",
    ),
]

F = TypeVar("F", bound=Callable[..., Any])

# What Ctrl-C leaves, by command; others say only "cancelled"
_UNCOMMITTED = "cancelled; nothing after the last completed snapshot was committed"
_CANCELLED = {
    "backup_cmd": _UNCOMMITTED,
    "watch_cmd": _UNCOMMITTED,
    "demo_cmd": _UNCOMMITTED,
    "restore_cmd": "cancelled; the files restored so far are whole and verified, and a rerun restores the rest",
    "copy_cmd": "cancelled; the snapshots copied so far stay, and a rerun copies the rest",
    "prune_cmd": "cancelled; the snapshots it removed stay removed, nothing kept was lost, and a rerun reclaims "
    "the space",
    "forget_cmd": "cancelled; the snapshots removed so far stay removed, nothing else was lost: a rerun with the "
    "same IDs skips them and goes on (not with 'latest', which names the next one now)",
    "repair_index_cmd": "cancelled; the index stays readable as it was, and a rerun repairs it",
    "tag_cmd": "cancelled; the snapshot has its old tags or its new ones, not both (see: ckptvault snapshots)",
    "ship_pins_cmd": "cancelled; the checkpoints shipped so far stay shipped, the others stay pinned: run the same "
    "command again to ship them",
}


def install_signal_handlers() -> None:
    """SIGTERM and Ctrl-C unwind as exceptions (``Terminated``, KeyboardInterrupt) that also stop the
    storage calls' retries, unless a step that must not stop half way runs (interruptions.py)."""

    def raise_terminated(signum: int, frame: object) -> None:
        end_at_once_on_another(signum)
        if hold_back(Terminated):  # a step that must not stop half way (interruptions.py) ends first
            return
        stop_retrying()
        raise Terminated

    def raise_interrupted(signum: int, frame: object) -> None:
        if hold_back(KeyboardInterrupt):
            return
        stop_retrying()  # the storage calls in flight end with their current attempt
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, raise_terminated)
    signal.signal(signal.SIGINT, raise_interrupted)


def command(func: F) -> F:
    """Error boundary: a CkptVaultError becomes one line on stderr and its exit code."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = Output(json_mode=kwargs.get("json_out", False), quiet=kwargs.get("quiet", False))
        name_the_vault_in_advice(
            VaultNaming.of(
                kwargs.get("url") or kwargs.get("repo"),  # init's vault may be its argument
                kwargs.get("keyfile"),
                kwargs.get("passphrase_file"),
                kwargs.get("storage_option"),
            )
        )
        try:
            return func(*args, **kwargs)
        except CkptVaultError as exc:
            message = str(exc)
            if isinstance(exc, IntegrityError) and exc.wants_read_data_hint and "ckptvault " not in message:
                # damage named without a way on (a chunk's checksum in cat, show, diff): a plain check
                # does not read chunks, so it would find nothing
                message += read_data_hint()
            out.error(message)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt as exc:
            said = _CANCELLED.get(func.__name__, "cancelled")
            if isinstance(exc, Terminated):
                out.error(said.replace("cancelled", "terminated (SIGTERM)", 1))
                raise typer.Exit(Terminated.exit_code) from None
            out.error(said)
            raise typer.Exit(130) from None
        except BrokenPipeError:  # the reader went away (`| head`): end quietly, as SIGPIPE ends other tools
            discard_stdout()
            sys.stderr.close()
            raise typer.Exit(EXIT_PIPE_CLOSED) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as exc:  # a bug: keep the traceback, show one line
            out.error(f"internal error: {type(exc).__name__}: {exc} ({_saved_traceback(exc)}; please report it)")
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def _saved_traceback(exc: BaseException) -> str:
    """Where a bug's traceback was saved, for its one line. Where it cannot be saved (a full or read-only
    temporary folder), where the bug was raised and why it was not saved: the OSError of the save escaped the
    error boundary as a traceback of its own, both bugs' (exit 1, the one-line promise broken)."""
    path = None
    try:
        fd, path = tempfile.mkstemp(prefix="ckptvault-crash-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            traceback.print_exception(exc, file=f)
        return f"traceback saved to {path}"
    except OSError as err:
        if path is not None:  # a cut traceback on a full disk helps no one and takes its last bytes
            with contextlib.suppress(OSError):
                os.unlink(path)
        frames = traceback.extract_tb(exc.__traceback__)
        last = frames[-1] if frames else None
        where = f"raised at {os.path.basename(last.filename)}:{last.lineno} in {last.name}; " if last else ""
        return f"{where}its traceback could not be saved in {tempfile.gettempdir()}: {err.strerror or err}"


def ask_passphrase(prompt: str, *, env: str = "CKPTVAULT_PASSPHRASE", option: str = "--passphrase-file") -> str:
    """The passphrase typed at a terminal prompt; Ctrl-D (end of input) there is no passphrase, not a crash.
    ``env`` and ``option``: the other ways to give this passphrase, for the message."""
    try:
        typed = getpass.getpass(f"{prompt}: ")
        if not typed.strip():  # Enter alone: no passphrase is that (a new one has 8 characters at least)
            raise UsageError(
                f"no {prompt} was typed (the line was empty); type it at the prompt, or give {option} FILE or {env}"
            )
        return typed
    except UnicodeDecodeError:  # its message would name a byte of the passphrase and where it is
        raise UsageError(
            f"the {prompt} typed is not valid in this terminal's encoding ({sys.getfilesystemencoding()}); give it "
            f"with {option} FILE or {env} instead (bytes that are not UTF-8 are used as they are there)"
        ) from None
    except EOFError:
        sys.stderr.write("\n")  # the prompt's line was left open
        raise PassphraseRequiredError(
            message="no passphrase was typed (the prompt got end of input, Ctrl-D); type it at the prompt, or give "
            f"{option} FILE or {env}"
        ) from None


MAX_PASSPHRASE_BYTES = 64 * 1024


def _bounded(f: BinaryIO, what: str) -> bytes:
    """A passphrase's bytes: a file or pipe of more than ``MAX_PASSPHRASE_BYTES`` is refused, not read whole
    (``--passphrase-file /dev/zero``, or a checkpoint named by a swapped argument, took all the memory)."""
    data = f.read(MAX_PASSPHRASE_BYTES + 1)
    if len(data) > MAX_PASSPHRASE_BYTES:
        raise UsageError(f"{what} holds more than {MAX_PASSPHRASE_BYTES // 1024} KiB: that is no passphrase file")
    return data


def passphrase_source(
    passphrase_file: str | None,
    *,
    env: str = "CKPTVAULT_PASSPHRASE",
    prompt: str = "passphrase",
    option: str = "--passphrase-file",
):
    """Where a passphrase comes from, in order: the file, the environment, a terminal prompt.
    Returned as a function so nobody is asked unless a keyfile really must be unlocked. The keyfile
    takes each the same way (a trailing newline dropped, bytes that are not UTF-8 kept as they are)."""

    piped: list[str] = []  # standard input is read once; a second unlock (a vault made meanwhile) reuses it

    def resolve() -> str:
        if passphrase_file == "-" and not sys.stdin.isatty():  # `secret-tool lookup ... | ckptvault ... -`
            if not piped:
                piped.append(
                    _bounded(sys.stdin.buffer, f"{option} -: standard input").decode("utf-8", "surrogateescape")
                )
            if not piped[0].rstrip("\r\n"):
                raise UsageError(f"{option} -: standard input is empty; pipe the passphrase into it")
            return piped[0]
        if passphrase_file == "-":  # a terminal: asked, as without the option
            return ask_passphrase(prompt, env=env, option=option)
        if passphrase_file:
            try:
                with open(os.path.expanduser(passphrase_file), "rb") as f:
                    raw = _bounded(f, f"{option} {passphrase_file}")
                # read as text, as it always was: its newlines (\r\n, \r) are \n, which the keyfile drops at its end
                passphrase = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8", errors="surrogateescape").read()
            except OSError as exc:
                # a bare word, or a "path" under no folder there is, or one too long to be a name: perhaps
                # the passphrase itself given by mistake, which must not reach a terminal log
                path = os.path.expanduser(passphrase_file)
                missing = isinstance(exc, (FileNotFoundError, NotADirectoryError))
                if exc.errno == errno.ENAMETOOLONG or (
                    missing and (os.sep not in path or not os.path.isdir(os.path.dirname(path)))
                ):
                    raise UsageError(
                        f"{option}: no file by the name given (not shown, in case it is the passphrase itself); "
                        "give the path of a file holding the passphrase, or '-' for standard input"
                    ) from None
                raise UsageError(f"{option} {passphrase_file}: {exc.strerror}") from None
            if not passphrase.rstrip("\r\n"):  # a file not written yet: not a wrong passphrase
                raise UsageError(f"{option} {passphrase_file} is empty; write the passphrase into it")
            return passphrase
        if env in os.environ:
            return passphrase_from_env(env)
        if sys.stdin.isatty():
            return ask_passphrase(prompt, env=env, option=option)
        raise PassphraseRequiredError(env=env, option=option)

    return resolve


@dataclass(frozen=True)
class VaultArgs:
    """The options every command that opens a vault shares (added by ``vault_options``)."""

    repo: str | None = None
    storage_option: list[str] | None = None
    keyfile: str | None = None
    passphrase_file: str | None = None
    limit_upload: str | None = None
    limit_download: str | None = None
    retry_lock: str | None = None
    # the command's parameters that typer took from their environment variables (CKPTVAULT_KEYFILE...)
    from_environment: frozenset[str] = frozenset()

    def open(
        self,
        out: Output,
        *,
        writing: bool = False,
        writes: bool = False,
        passphrase: Callable[[], str] | None = None,
    ) -> Vault:
        return open_vault(
            self.repo,
            self.storage_option,
            out,
            self.keyfile,
            self.passphrase_file,
            writing=writing,
            writes=writes,
            limit_upload=self.limit_upload,
            limit_download=self.limit_download,
            retry_lock=self.retry_lock,
            passphrase=passphrase,
            keyfile_from_env="keyfile" in self.from_environment,
        )


NO_VAULT_ARGS = VaultArgs()  # the default a command declares; the wrapper always passes the real one
_VAULT_OPTIONS = {
    "repo": RepoOpt,
    "storage_option": StorageOpt,
    "keyfile": KeyfileOpt,
    "passphrase_file": PassphraseFileOpt,
    "limit_upload": LimitUploadOpt,
    "limit_download": LimitDownloadOpt,
    "retry_lock": RetryLockOpt,
}


_CONTEXT = "vault_options_context"  # the name under which typer hands vault_options' wrapper the click context


def _source(ctx: typer.Context, name: str) -> str | None:
    """Where click took parameter ``name`` from: ``COMMANDLINE``, ``ENVIRONMENT``, ``DEFAULT``..."""
    source = ctx.get_parameter_source(name)
    return None if source is None else source.name


def vault_options(func: F) -> F:
    """Give a command --repo, -o, --keyfile, --passphrase-file, the bandwidth limits and --retry-lock; it
    receives them as ``vault_args: VaultArgs``. typer reads parameters from the signature, so the wrapper publishes the
    command's own parameters (minus ``vault_args``) followed by the shared ones, and the context, which says
    which parameters came from environment variables."""
    own = [p for p in inspect.signature(func, eval_str=True).parameters.values() if p.name != "vault_args"]
    shared = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
        for name, annotation in [*_VAULT_OPTIONS.items(), (_CONTEXT, typer.Context)]
    ]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx: typer.Context | None = kwargs.pop(_CONTEXT, None)
        from_env = frozenset() if ctx is None else frozenset(n for n in ctx.params if _source(ctx, n) == "ENVIRONMENT")
        vault = VaultArgs(**{name: kwargs.pop(name, None) for name in _VAULT_OPTIONS}, from_environment=from_env)
        return func(*args, vault_args=vault, **kwargs)

    wrapper.__signature__ = inspect.Signature([*own, *shared])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in [*own, *shared]}
    return wrapper  # type: ignore[return-value]


def require_nonempty(option: str, value: str, what: str, *, default: str = "") -> None:
    """An explicitly empty path (an unset shell variable: ``-r "$VAULT"``) must not fall back to a
    default location, where it would back up, restore or prune something the user did not name.
    ``what`` the option takes; ``default``: what leaving it out means, where it means something."""
    if not value.strip():
        left_out = f", or leave the option out for {default}" if default else ""
        raise UsageError(f"{option} is empty; give {what}{left_out}")


@dataclass(frozen=True)
class VaultOptionNames:
    """How the options naming one vault are spelled, for messages: a command's own vault, or the
    other vault of ``copy`` (``--from-repo``...)."""

    repo: str = "--repo"
    repo_env: str = "CKPTVAULT_REPO"
    keyfile: str = "--keyfile"
    keyfile_env: str = "CKPTVAULT_KEYFILE"
    passphrase_file: str = "--passphrase-file"
    passphrase_env: str = "CKPTVAULT_PASSPHRASE"
    prompt: str = "passphrase"


THIS_VAULT = VaultOptionNames()


def refuse_blank_vault_settings(repo: str | None, keyfile: str | None, names: VaultOptionNames = THIS_VAULT) -> None:
    """typer takes an environment variable that is set but blank (an unset CI secret or shell
    variable) for an option left out: refused, rather than falling back to a default the user did
    not choose (the default vault; no encryption for the vault a backup creates)."""
    for value, env, what in (
        (repo, names.repo_env, "the vault's path or URL"),
        (keyfile, names.keyfile_env, "the keyfile's path"),
    ):
        if not (value or "").strip() and env in os.environ and not os.environ[env].strip():
            raise UsageError(f"{env} is set but empty; set it to {what}, or unset it")
    if keyfile is not None:
        require_nonempty(names.keyfile, keyfile, "the keyfile's path")


def refuse_passphrase_without_keyfile(
    passphrase_file: str | None, keyfile: str | None, names: VaultOptionNames = THIS_VAULT
) -> None:
    """A passphrase unlocks a keyfile: given alone, nothing would be encrypted (a backup would even
    create the default vault unencrypted), and the user plainly meant something to be."""
    if passphrase_file is not None and not keyfile:
        raise UsageError(
            f"{names.passphrase_file} was given without {names.keyfile} (or {names.keyfile_env}): the passphrase "
            f"unlocks a keyfile, and nothing would be encrypted; add {names.keyfile} PATH (ckptvault key generate "
            "makes one)"
        )


def require_lasting_url(url: str) -> None:
    """A ``memory://`` vault lives inside one Python process: the CLI's would be gone when it exits,
    and the next command would find none."""
    if url.strip().lower().startswith("memory://"):
        raise UsageError(
            f"{url} would vanish when this command exits (memory:// vaults live inside one Python process); "
            "use a folder or a remote URL, or memory:// from the Python API"
        )


def retry_lock_setting(value: str | None) -> float:
    """--retry-lock, else CKPTVAULT_RETRY_LOCK (an empty one refused: it is usually meant to be unset)."""
    if value is not None:
        return parse_duration(value, "--retry-lock")
    env = os.environ.get("CKPTVAULT_RETRY_LOCK")
    return 0.0 if env is None else parse_duration(env, "CKPTVAULT_RETRY_LOCK")


def open_vault(
    repo: str | None,
    storage_option: list[str] | None,
    out: Output,
    keyfile: str | None = None,
    passphrase_file: str | None = None,
    *,
    writing: bool = False,
    writes: bool = False,
    limit_upload: str | None = None,
    limit_download: str | None = None,
    retry_lock: str | None = None,
    names: VaultOptionNames = THIS_VAULT,
    passphrase: Callable[[], str] | None = None,
    keyfile_from_env: bool = False,
) -> Vault:
    """The named repository (which must exist), or the default one, which the first
    writing command creates (reading commands do not leave an empty one behind). ``writes``: the command writes
    into the vault (``writing`` does too): a keyfile given for a vault that is not encrypted refuses it at once,
    where a command that only reads says in a warning that the keyfile is not used, and goes on (naming
    ``names.keyfile_env`` when ``keyfile_from_env``: the keyfile came from it, not from the option).
    ``names``: how this vault's options are spelled, for messages; ``passphrase``: where the keyfile's
    passphrase comes from, if not from this vault's options (copy's two vaults under one keyfile)."""
    refuse_blank_vault_settings(repo, keyfile, names)
    refuse_passphrase_without_keyfile(passphrase_file, keyfile, names)
    options = parse_storage_options(storage_option)
    settings: dict[str, Any] = {
        "keyfile": keyfile,
        "passphrase": passphrase
        or passphrase_source(
            passphrase_file, env=names.passphrase_env, prompt=names.prompt, option=names.passphrase_file
        ),
        "limit_upload": limit_upload,
        "limit_download": limit_download,
        "retry_lock": retry_lock_setting(retry_lock),
    }
    if repo is not None:
        default = "the default vault" if names is THIS_VAULT else ""  # copy cannot go without its source
        require_nonempty(names.repo, repo, "the vault's path or URL", default=default)
        require_lasting_url(repo)
        vault = Vault.open(repo, storage_options=options, **settings)
    else:
        require_lasting_url(default_repo_url())  # CKPTVAULT_REPO
        # a passphrase without a keyfile (a CI secret whose keyfile is missing): the default vault made now
        # would hold everything in the clear, where the user plainly meant it to be encrypted
        unkeyed = bool(os.environ.get(names.passphrase_env)) and not keyfile
        try:
            vault = Vault.open(None, storage_options=options, create=writing and not unkeyed, **settings)
        except VaultNotFoundError as exc:
            if writing and unkeyed:
                raise UsageError(
                    f"{names.passphrase_env} is set but no keyfile was given ({names.keyfile} or {names.keyfile_env}): "
                    "the default vault, created now, would not be encrypted; give the keyfile, or create the vault "
                    f"first: ckptvault init --encrypt --keyfile PATH {shlex.quote(exc.url)} "
                    "(or without --encrypt, plain)"
                ) from None
            # a reader with no vault named is most often a new machine whose CKPTVAULT_REPO was not set: the
            # vault it means is elsewhere, and a backup (which would make an empty default one) is no answer
            hint = (
                "the default vault is created by the first backup: ckptvault backup DIR"
                if writing
                else "no --repo or CKPTVAULT_REPO was given, and the default vault (created by the first backup) "
                "is not on this machine: name the vault with --repo URL (or CKPTVAULT_REPO)"
            )
            raise VaultNotFoundError(exc.url, hint=hint) from None
    if vault.unused_keyfile is not None:  # the library refuses any write too, at its lock: this is sooner
        if writes or writing:
            vault.close()
            raise unused_keyfile_error(vault.url, vault.unused_keyfile)
        env = names.keyfile_env if keyfile_from_env else None
        out.warn(unused_keyfile_note(vault.url, vault.unused_keyfile, env))
        if names is THIS_VAULT:  # the commands its messages suggest would be refused with it (writers)
            name_the_vault_in_advice(VaultNaming.of(repo, None, None, storage_option))
    vault.on_warning = out.warn  # e.g. a snapshot object that cannot be read, left out of the listing
    if vault.created:
        kind = "encrypted vault" if vault.config.encrypted else "vault"
        out.info(f"created a new {kind} at {vault.url} (the default; choose another with --repo or CKPTVAULT_REPO)")
    return vault


def _version(value: bool) -> None:
    if value:
        print(f"ckptvault {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Deduplicating, verified backups of ML training checkpoints."""
    name_command_line_options()  # every way of running the app, not only cli.main
