"""The CLI's process: what ``cli.main`` runs once it has its Ctrl-C guard (cli/__init__.py).

``main`` prepares the process before it loads the command it runs (only that one: ``_COMMAND_MODULES``)
and with it numpy and the rest of ckptvault: a CLI run is short, so what happens before the first byte
moves counts.
"""

from __future__ import annotations

import gc
import importlib
import io
import itertools
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from ..interruptions import Terminated, end_at_once_on_another
from ..ops.memory import keep_freed_memory

if TYPE_CHECKING:
    import typer

# Commands that never unlock a vault's keyfile (every other command opens a vault).
_NO_VAULT_COMMANDS = frozenset({"key"})
# Commands whose data path uses numpy (byte grouping, copies that release the GIL).
_DATA_COMMANDS = frozenset({"backup", "restore", "copy", "drill"})
# The module of each command (cli/commands.py loads them all). A run of one loads only its own, and with it only
# the operations it uses: ~0.1 s less before the command starts on a slow 2-core VM (about a quarter of it).
_COMMAND_MODULES = {
    "backup": "cmd_backup",
    "cat": "cmd_snapshots",
    "check": "cmd_check",
    "copy": "cmd_copy",
    "demo": "cmd_demo",
    "diff": "cmd_diff",
    "drill": "cmd_drill",
    "forget": "cmd_prune",
    "init": "cmd_init",
    "key": "cmd_key",
    "ls": "cmd_snapshots",
    "prune": "cmd_prune",
    "repair-index": "cmd_check",
    "restore": "cmd_restore",
    "ship-pins": "cmd_ship_pins",
    "show": "cmd_show",
    "snapshots": "cmd_snapshots",
    "stats": "cmd_stats",
    "status": "cmd_status",
    "tag": "cmd_tag",
    "unlock": "cmd_check",
    "watch": "cmd_watch",
}


def _derive_key_ahead(argv: list[str]) -> bool:
    """An encrypted vault's command spends ~0.2 s in scrypt, after ~0.2 s of loading ckptvault. When
    the keyfile and passphrase are known up front (--keyfile or CKPTVAULT_KEYFILE, and
    CKPTVAULT_PASSPHRASE: how training jobs run the CLI), scrypt starts now, on another core, while
    the rest loads. Only a head start: the command unlocks the key as always and finds it derived.
    Returns whether the derivation started."""
    passphrase = os.environ.get("CKPTVAULT_PASSPHRASE")
    if not argv or argv[0].startswith("-") or argv[0] in _NO_VAULT_COMMANDS or not passphrase:
        return False
    keyfile = os.environ.get("CKPTVAULT_KEYFILE")
    for flag, value in itertools.pairwise(argv):
        if flag in ("--keyfile", "-k"):
            keyfile = value
    for arg in argv:
        if arg.startswith("--keyfile="):
            keyfile = arg.partition("=")[2]
        elif arg.startswith("--passphrase-file"):  # that passphrase wins over the environment's
            return False
    if not keyfile:
        return False
    if not os.path.isfile(os.path.expanduser(keyfile)):
        return False  # a pipe (--keyfile <(...)) can be read once only: by the command itself
    from ..crypto.keyfile import Keyfile, passphrase_secret

    try:
        Keyfile.load(keyfile).kdf.derive_ahead(passphrase_secret(passphrase))
    except Exception:  # missing, damaged or unreadable: the command reports it itself
        return False
    return True


class _OneLineHandler(logging.Handler):
    """Library log records as the CLI's own lines ("warning: ...", "error: ..."), written to the
    sys.stderr of the moment, which a live progress bar redirects to above itself."""

    def emit(self, record: logging.LogRecord) -> None:
        from .output import with_vault_named  # loaded with the commands, before any record

        try:
            message = with_vault_named(record.getMessage())
            sys.stderr.write(f"{record.levelname.lower()}: {' '.join(message.split())}\n")
        except Exception:
            self.handleError(record)


def _quiet_foreign_threads(args: threading.ExceptHookArgs) -> None:
    """paramiko's prefetch threads die with EOFError when a server goes away in the middle of a read;
    the read that started them fails, and is retried or reported, so their tracebacks are noise.
    ckptvault's own threads keep the default report."""
    if args.thread is not None and args.thread.name.startswith("ckptvault"):
        threading.__excepthook__(args)


def _configure_logging() -> None:
    """The library logs notices such as "a read failed verification; reading it again"; the CLI
    reports outcomes itself, one line each, so only the library's errors pass through, and the
    storage layer's and the async shipper's retries (a stalled upload is otherwise silent for
    minutes), locks left behind and damaged index objects read around. Other libraries' records
    (paramiko's tracebacks of a dropped session, asyncio's) are dropped: the failures they log are
    retried or reported by ckptvault. CKPTVAULT_DEBUG=1 shows every record instead (but the SDKs'
    request headers)."""
    if os.environ.get("CKPTVAULT_DEBUG", "").lower() in ("1", "true", "yes"):
        logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
        for chatty in ("botocore", "aiobotocore", "urllib3", "azure"):  # their DEBUG logs request headers
            logging.getLogger(chatty).setLevel(logging.INFO)
        return
    logging.getLogger().addHandler(logging.NullHandler())  # no "last resort" printing of other libraries
    threading.excepthook = _quiet_foreign_threads
    library = logging.getLogger("ckptvault")
    library.setLevel(logging.ERROR)
    library.addHandler(_OneLineHandler())
    library.propagate = False
    # retries; locks left behind; damaged metadata read around
    for notices in ("ckptvault.store", "ckptvault.locks", "ckptvault.shipping", "ckptvault.damage"):
        logging.getLogger(notices).setLevel(logging.WARNING)


def main() -> None:
    """Run the command of sys.argv. A Ctrl-C or SIGTERM before the command's own handlers took over is
    raised (KeyboardInterrupt, Terminated) to ``cli.main``, which ends it with one line and 130 or 143."""
    # SIGTERM while ckptvault loads (~0.3 s; nothing is written yet) ended the process with no word
    signal.signal(signal.SIGTERM, _raise_terminated)
    _main()


def _raise_terminated(signum: int, frame: object) -> None:
    end_at_once_on_another(signum)
    raise Terminated


def _main() -> None:
    # Before numpy loads: the CLI does no linear algebra, and OpenBLAS's idle worker threads spin on
    # the cores that hashing and compression need (a few % of a backup's CPU, measured with perf).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if sys.argv[1:2] != ["watch"]:  # a sidecar that runs for days should hand memory back while it waits
        # before the key derivation's thread: a thread that has allocated keeps its arena
        keep_freed_memory(one_arena=True)
    deriving = _derive_key_ahead(sys.argv[1:])
    app = _app_for(sys.argv[1:])

    if deriving and sys.argv[1] in _DATA_COMMANDS:
        # The imports above end before scrypt does, and this thread would only wait for the key:
        # numpy, which the data path loads anyway, loads meanwhile (~0.05 s sooner to the first byte).
        import numpy  # noqa: F401

    _configure_logging()
    _whole_writes_to_stdout()
    _every_name_printable()
    # The pipelines allocate many short-lived objects (futures, tuples) per chunk: collecting
    # less often, and never scanning the modules loaded at start-up, saves a few % of the CPU.
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
    sys.exit(_run(app))


def _app_for(argv: list[str]) -> typer.Typer:
    """The app with the command ``argv`` names, or with every command when it names none (the help, a
    misspelled name that click suggests another for, ``--version``)."""
    module = _COMMAND_MODULES.get(argv[0]) if argv else None
    if module is None:
        from .commands import app
    else:
        importlib.import_module(f"{__package__}.{module}")
        from .app import app
    return app


def _every_name_printable() -> None:
    """A name the output's encoding cannot show (a Latin-1 locale, ``PYTHONIOENCODING=ascii`` in a cron
    job) raised UnicodeEncodeError: `ls` stopped half way with "internal error", and `restore` called a
    restore it had finished a failure. Such characters are written as escapes (``\\u540d``), as on stderr."""
    if isinstance(sys.stdout, io.TextIOWrapper) and sys.stdout.errors == "strict":
        sys.stdout.reconfigure(errors="backslashreplace")


def _whole_writes_to_stdout() -> None:
    """Under PYTHONUNBUFFERED (``python -u``) sys.stdout writes straight to the raw file, whose
    write() may take part of the bytes and say so (a full disk, a file size limit, a pipe), and
    TextIOWrapper ignores that: `cat` and --json output came out cut short with exit 0. A buffered
    layer between them writes everything or raises; line buffering keeps interactive output live."""
    raw = getattr(sys.stdout, "buffer", None)
    if isinstance(raw, io.RawIOBase):
        sys.stdout = io.TextIOWrapper(
            io.BufferedWriter(raw), encoding=sys.stdout.encoding, errors=sys.stdout.errors, line_buffering=True
        )


# restic's spellings, typed from habit: click's closest-match suggestion is no equivalent for them
RESTIC_OPTIONS = {
    "--keep-within": "restic's --keep-within AGE is --before AGE here, e.g. --before 14d, with --keep-latest N",
    "--keep-last": "restic's --keep-last N is --keep-latest N here",
    **{
        f"--keep-{period}": "ckptvault keeps no calendar buckets: --keep-latest N, --before AGE and --keep-tag TAG"
        for period in ("hourly", "daily", "weekly", "monthly", "yearly")
    },
}


def _habit(command: str | None, option: str) -> str | None:
    """Where an option restic (or kopia) users type from habit is found here; ``command`` None: the
    option came before any command."""
    if command is None:
        return "options go after the command: ckptvault COMMAND [OPTIONS], e.g. ckptvault snapshots --repo URL"
    if command == "prune" and option in RESTIC_OPTIONS:
        return RESTIC_OPTIONS[option]
    if command == "forget" and option in RESTIC_OPTIONS:
        return "retention rules are prune's here: ckptvault prune --keep-latest N --before AGE; forget takes IDs"
    if command == "restore" and option in ("--target", "-t"):
        return "the folder to restore into is the second argument: ckptvault restore SNAPSHOT DIR"
    return None


# The commands that take no --host selection, though restic's forget and prune do: what they take instead.
# Said as the whole error, not as click's "No such option" (the option exists, on the commands that read).
NO_HOST = {
    "prune": "prune takes no --host: use --group-by host to apply the rules to each host's snapshots apart, or "
    "forget by ID what ckptvault snapshots --host NAME lists",
    "forget": "forget takes no --host: give the snapshot IDs (ckptvault snapshots --host NAME lists a host's), or "
    "use ckptvault prune --group-by host",
    "tag": "tag takes no --host: give the snapshot's ID (ckptvault snapshots --host NAME lists a host's)",
    "copy": "copy takes no --host: give snapshot IDs (ckptvault snapshots --repo SOURCE --host NAME lists a "
    "host's) or --tag",
}


def _unknown_option(command: str | None, option: str, message: str) -> str:
    """The error for an option ``command`` does not have (``message``: click's)."""
    if option in ("--host", "-H") and command in NO_HOST:
        return NO_HOST[command]
    habit = _habit(command, option)
    return f"No such option: {option} ({habit})" if habit else message


def _named_command(group: Any, argv: list[str]) -> tuple[Any, list[str], list[str]] | None:
    """The command argv names (``prune``, or ``key passwd``), its words, and the arguments after them."""
    command, i, path = group, 0, []
    while hasattr(command, "commands"):  # a group
        while i < len(argv) and argv[i].startswith("-"):
            i += 1
        if i == len(argv) or argv[i] not in command.commands:
            return None
        command, i = command.commands[argv[i]], i + 1
        path.append(argv[i - 1])
    return command, path, argv[i:]


def _repeated_option(group: Any, argv: list[str]) -> tuple[str, str] | None:
    """An option that takes one value, given twice (click keeps the last): a wrapper script that
    appends its defaults to ``prune --keep-latest 3`` would otherwise delete what the user kept.
    Returns (option, command); click's own parser tells options from their values."""
    named = _named_command(group, argv)
    if named is None:
        return None  # help, or an unknown command: click says so
    command, path, args = named
    # the group's settings (-h beside --help) reach the command's context through its parent: a command
    # keeps the help option it first makes, and the run that follows must find -h in it
    context = group.make_context("ckptvault", [], resilient_parsing=True)
    try:
        context = command.make_context(path[-1], list(args), parent=context, resilient_parsing=True)
        _, _, order = command.make_parser(context).parse_args(list(args))
    except Exception:  # what click refuses, it reports itself when the command runs
        return None
    for param in order:
        single = param.param_type_name == "option" and not param.multiple and not getattr(param, "is_flag", False)
        if single and order.count(param) > 1:
            return str(param.opts[0]), " ".join(path)
    return None


def _long_options(command: Any) -> set[str]:
    """Every long option of ``command`` and the commands under it (``--overwrite`` and ``--no-overwrite``)."""
    if hasattr(command, "commands"):  # a group
        return set().union(*(_long_options(sub) for sub in command.commands.values()))
    return {opt for param in command.params for opt in [*param.opts, *param.secondary_opts] if opt.startswith("--")}


# What an option's metavar stands for, in the error for its missing value
_VALUE_WORDS = {
    "KEY=VALUE": "a KEY=VALUE pair",
    "TEXT": "a text",
    "NAME": "a name",
    "GLOB": "a pattern",
    "URL": "a path or URL",
    "PATH": "a path",
    "DIR": "a folder",
    "KEY": "a key",
    "TAG": "a tag",
    "RATE": "a rate",
    "DURATION": "a duration",
    "SHARE": "a share",
    "N": "a number",
    "F": "a number",
    "S": "a number of seconds",
    "DATE|AGE": "a date or an age",
}
# the values that are free text, which could really be an option's name (a file called '--repo')
_FREE_TEXT = frozenset(["KEY=VALUE", "TEXT", "NAME", "GLOB", "URL", "PATH", "DIR", "KEY", "TAG"])


def _option_taken_as_value(group: Any, argv: list[str]) -> str | None:
    """The error for an option whose value was left out, so that the next option became its value:
    ``restore latest DIR --include --repo V`` took '--repo' for a pattern and V for an extra argument, and
    was refused for the vault path. A value that is one of our own options (``--repo``, ``--repo=V``, or
    this command's ``-r``) is that mistake; the ``--include=--repo`` form still gives it as a value."""
    named = _named_command(group, argv)
    if named is None:
        return None
    command, path, args = named
    ours = _long_options(group) | {"--help", "-h"}
    ours |= {opt for param in command.params for opt in param.opts if not opt.startswith("--")}
    takes_value = {
        opt: param
        for param in command.params
        if param.param_type_name == "option" and not getattr(param, "is_flag", False)
        for opt in param.opts
    }
    for arg, value in itertools.pairwise(args):
        if arg == "--":  # what follows is arguments, never options
            return None
        param = takes_value.get(arg)
        if param is None or value.partition("=")[0] not in ours:
            continue
        what = _VALUE_WORDS.get(param.metavar, f"a value ({param.metavar})")
        free = param.metavar in _FREE_TEXT
        literal = f" (for the text {value!r} itself, write {param.opts[0]}={value})" if free else ""
        return (
            f"{arg} needs {what}; got {value!r}, the next option: its value is missing{literal} "
            f"(see: ckptvault {' '.join(path)} --help)"
        )
    return None


def _run(app: typer.Typer) -> int:
    """The app, with click's own errors (an unknown command or option, a value of the wrong type, a
    missing argument) printed as one line like every other error instead of click's framed box."""
    import typer

    from .app import install_signal_handlers
    from .output import Output

    # click's exceptions, wherever this typer takes click from (newer releases carry their own copy)
    click_errors = sys.modules[typer.BadParameter.__module__]
    cli = typer.main.get_command(app)
    taken = _option_taken_as_value(cli, sys.argv[1:])
    if taken:
        Output().error(taken)
        return 2
    repeated = _repeated_option(cli, sys.argv[1:])
    if repeated:
        option, command = repeated
        Output().error(f"{option} is given more than once; give it once (see: ckptvault {command} --help)")
        return 2
    try:
        install_signal_handlers()  # they stop retries too (watch replaces them: it finishes its upload first)
        code = cli(standalone_mode=False)
    except Terminated:  # before click took over
        Output().error("terminated (SIGTERM)")
        return Terminated.exit_code
    except SystemExit as exc:
        # rich ends the help cut by a closed pipe (`--help | head`) with exit 1: 141, as for every
        # other closed stdout (docs/usage.md)
        if exc.code == 1 and isinstance(exc.__context__, BrokenPipeError):
            return 141
        raise
    except getattr(click_errors, "NoArgsIsHelpError", ()) as exc:  # bare `ckptvault`: the help
        exc.show()
        return exc.exit_code
    except click_errors.ClickException as exc:
        message = " ".join(exc.format_message().split())
        ctx = getattr(exc, "ctx", None)
        if isinstance(exc, click_errors.NoSuchOption) and ctx is not None:
            message = _unknown_option(ctx.info_name if ctx.parent is not None else None, exc.option_name, message)
        if ctx is not None:
            command_path = ctx.command_path
        elif named := _named_command(cli, sys.argv[1:]):  # "Option '--tag' requires an argument." has no ctx
            command_path = " ".join(["ckptvault", *named[1]])
        else:
            command_path = ""
        hint = f" (see: {command_path} --help)" if command_path else ""
        Output().error(f"{message}{hint}")
        return exc.exit_code
    except typer.Abort as exc:
        if isinstance(exc.__context__, Terminated):
            Output().error("terminated (SIGTERM)")
            return Terminated.exit_code
        Output().error("cancelled")
        return 130
    return code if isinstance(code, int) else 0
