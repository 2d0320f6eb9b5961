"""The one terminal object: results to stdout (text or JSON), messages to stderr, progress bars."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, is_dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..errors import StorageError, StorageFullError
from ..snapshot.model import WATCH_SIG_TAG, format_tags
from ..store.options import display_url
from ..units import counted as counted
from ..units import format_bytes as format_bytes  # the CLI's commands take it from here
from ..units import format_rate as format_rate

if TYPE_CHECKING:
    from rich.progress import TaskID

PIPED_WIDTH = 1 << 16  # tables size to their content: box=None, not expanded


def one_line(message: str) -> str:
    """Control characters (a newline in a file name) escaped: an error, a warning or a listed path
    stays one line."""
    if message.isprintable():
        return message
    return "".join(c if c.isprintable() else _escaped(c) for c in message)


def _escaped(char: str) -> str:
    """A byte of a file name that is not UTF-8 (a lone surrogate, from surrogateescape) as ``\\xNN``, the
    spelling --json uses, and a character that is not printable from U+0080 up as ``\\uNNNN`` (Python
    writes U+0085 as ``\\x85`` too, which would read as the byte), both of which ``cat``/``show`` take;
    an ASCII control character as Python writes it (``\\n``)."""
    if "\udc80" <= char <= "\udcff":
        return f"\\x{ord(char) - 0xDC00:02x}"
    if ord(char) >= 0x80:
        return f"\\u{ord(char):04x}" if ord(char) <= 0xFFFF else f"\\U{ord(char):08x}"
    return repr(char)[1:-1]


# The commands that act on a vault: one that a message suggests must name the vault the failing command
# was given, or a pasted `ckptvault forget ID` acts on the default vault (a copy has the same IDs).
VAULT_COMMANDS = (
    "backup", "restore", "snapshots", "ls", "cat", "show", "diff", "stats", "tag", "forget", "prune", "check",
    "repair-index", "unlock", "status", "drill", "watch", "copy",
)  # fmt: skip
# not "another ckptvault watch (pid N) is already watching": a statement about another process
_SUGGESTED = re.compile(rf"(?<!another )\bckptvault (?:{'|'.join(map(re.escape, VAULT_COMMANDS))})(?![\w-])")
# names its vault: the URL it creates, a quoted word whole (errors.init_command quotes one that ends in what a
# sentence adds), else one without the ')' or '.' of the sentence around it
_SUGGESTED_INIT = re.compile(
    r"\bckptvault init (?!-)(?:'[^']*'(?:\"'\"'[^']*')*(?![^\s).,;])|\S+?(?=[).,;]*(?:\s|$)))(?!.*--encrypt)"
)


@dataclass(frozen=True)
class VaultNaming:
    """How suggested commands name a vault: ``options`` (" --repo URL --keyfile PATH", as the user gave
    them, credentials left out), ``init_options`` (what creates the vault they were meant for: an encrypted
    one when a keyfile was given) and ``note`` (what they must add that a message does not show)."""

    options: str = ""
    note: str = ""
    init_options: str = ""

    @classmethod
    def of(
        cls, repo: str | None, keyfile: str | None, passphrase_file: str | None, storage_options: list[str] | None
    ) -> VaultNaming:
        shown = display_url(repo) if repo else None  # no password, no query string: they may be secrets
        given = [("--repo", shown), ("--keyfile", keyfile), ("--passphrase-file", passphrase_file)]
        left_out = ["the same -o options"] if storage_options else []
        if shown != repo:
            left_out.append("the --repo URL as you gave it, credentials and all")
        note = f" (each with {' and '.join(left_out)})" if left_out else ""
        repo_option, *key_options = (f" {option} {shlex.quote(value)}" if value else "" for option, value in given)
        return cls(repo_option + "".join(key_options), note, " --encrypt" + "".join(key_options) if keyfile else "")

    def named(self, message: str) -> str:
        """``message`` with these options added to every ckptvault command it suggests, unless it names
        a vault itself (copy's advice names the source's)."""
        if not (self.options or self.note) or "--repo " in message or "--from-repo" in message:
            return message
        named, count = _SUGGESTED.subn(lambda m: m.group(0) + self.options, message)
        named, inits = _SUGGESTED_INIT.subn(lambda m: m.group(0) + self.init_options, named)
        return named + self.note if count or inits else message


_naming = VaultNaming()  # this command's vault


def name_the_vault_in_advice(naming: VaultNaming) -> None:
    """Make the commands that messages suggest name the vault this command was given: a pasted
    `ckptvault forget ID` would act on the default vault (a copy has the same IDs)."""
    global _naming
    _naming = naming


def with_vault_named(message: str) -> str:
    return _naming.named(message)


def _jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {k: _jsonable(v) for k, v in asdict(value).items()}
    if isinstance(value, dict):
        return {_jsonable(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN or Infinity; strict parsers (jq) refuse Python's spelling of them
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, str) and not value.isascii():
        # a file name that is not UTF-8 holds lone surrogates (surrogateescape), which strict JSON
        # parsers refuse: its odd bytes are written as \xNN text instead
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return value


@contextmanager
def writing_stdout() -> Iterator[None]:
    """The command's output written and flushed, or one error line: a full disk, a quota or a file
    size limit (``ulimit -f``) is StorageFullError (exit 21), another failure StorageError (exit 20).
    A closed pipe stays BrokenPipeError: the command boundary ends quietly."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        discard_stdout()
        reason = exc.strerror or str(exc)
        if exc.errno == errno.EFBIG:
            hint = "the output reached a file size limit (ulimit -f); raise it or write elsewhere"
            raise StorageFullError("write", "standard output", "this machine", reason, hint=hint) from None
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFullError("write", "standard output", "this machine", reason) from None
        raise StorageError(
            "write", "standard output", "this machine", reason, message=f"writing to standard output failed: {reason}"
        ) from None


def discard_stdout() -> None:
    """What stays in stdout's buffer after a failed write would fail again when Python flushes it
    at exit ("Exception ignored ...", exit 120): send it to /dev/null instead."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real file behind stdout: nothing will flush to it
        pass


class _RichProgress:
    """Adapts the ops Progress protocol to a rich progress bar on stderr."""

    def __init__(self, console: Console, label: str) -> None:
        # loaded for a bar only: a run whose stderr is no terminal shows none (~10 ms of start-up)
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self._label = label
        self._task: TaskID | None = None

    def start(self, total_bytes: int, total_files: int) -> None:
        self._bar.start()
        self._task = self._bar.add_task(f"{self._label} {counted(total_files, 'file')}", total=total_bytes)

    def advance(self, nbytes: int) -> None:
        if self._task is not None:
            self._bar.advance(self._task, nbytes)

    def finish(self) -> None:
        self._bar.stop()


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """A closed pipe is a BrokenPipeError, for the command (or the watch sidecar) to handle:
        rich's own handling exits at once and points stdout at /dev/null, whichever stream broke."""
        self.quiet = True
        if self.file is sys.stdout:
            discard_stdout()
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


class Output:
    def __init__(self, *, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        self.err = _Console(stderr=True, highlight=False, soft_wrap=True)
        self.out = _Console(highlight=False, soft_wrap=True)
        if not self.out.is_terminal:
            self.out.width = PIPED_WIDTH  # piped output (`ls > files.txt`): no cell is wrapped or cut

    def info(self, message: str) -> None:
        """A human message (stderr), hidden by --quiet."""
        if not self.quiet:
            self.err.print(with_vault_named(message), markup=False)

    def warn(self, message: str) -> None:
        self.err.print(f"warning: {one_line(with_vault_named(message))}", markup=False, style="yellow")

    def error(self, message: str) -> None:
        self.err.print(f"error: {one_line(with_vault_named(message))}", markup=False, style="red")

    def result(self, data: Any, text: str | Table | None = None, *, asked: bool = False) -> None:
        """The command's result: JSON on stdout with --json, else the text. --quiet hides summaries
        of work done, not what was ``asked`` for: a listing, the problems check found."""
        if sys.stdout is None:  # closed (``>&-``): the result has nowhere to go, the command still did its work
            return
        if self.json_mode:
            with writing_stdout():
                sys.stdout.write(json.dumps(_jsonable(data), indent=2) + "\n")
        elif text is not None and (asked or not self.quiet):
            with writing_stdout():
                if isinstance(text, str):  # a summary may suggest a command; a listing is left as it is
                    self.out.print(text if asked else with_vault_named(text), markup=False)
                elif isinstance(text, _PlainTable) and (lines := text.aligned(self.out.width)) is not None:
                    self.out.print(Text(lines[0], style="bold"))
                    if len(lines) > 1:
                        self.out.print("\n".join(lines[1:]), markup=False)
                else:
                    self.out.print(text)

    @contextmanager
    def progress(self, label: str) -> Iterator[_RichProgress | None]:
        # A dumb terminal (TERM=dumb: an editor's shell, some CI logs) cannot redraw a line: a bar there left
        # empty lines before the summary.
        if self.quiet or self.json_mode or not self.err.is_terminal or self.err.is_dumb_terminal:
            yield None
            return
        bar = _RichProgress(self.err, label)
        try:
            yield bar
        finally:  # a failure too: the bar is taken down (and the cursor shown) before its error line
            bar.finish()

    @staticmethod
    def table(*columns: str) -> Table:
        table = _PlainTable(box=None, pad_edge=False, header_style="bold")
        for col in columns:
            right = col in ("size", "files", "new", "stored", "logical", "chunks", "bytes", "offset", *_TENSOR_FIGURES)
            # A long path, tag list or description wraps on a narrow terminal, never "…"; an ID, a time, a host
            # or a number stays whole (an ID cut in two cannot be copied; a date and its time fell on two lines).
            whole = right or col in ("id", "time (UTC)", "host", "type", "mode")
            table.add_column(col, justify="right" if right else "left", overflow="fold", no_wrap=whole)
        return table


def listed_tags(tags: dict[str, str]) -> str:
    """A snapshot's tags as listings show them: without the watch's internal signature (in --json only)."""
    return format_tags({k: v for k, v in tags.items() if k != WATCH_SIG_TAG})


_TENSOR_FIGURES = ("min", "max", "mean", "std", "nan", "inf")  # show --stats
MIN_FOLDED = 12  # a column of tags or a description folded narrower than this reads as noise


class _PlainTable(Table):
    """Cells shown as they are: never read as rich markup (a tag ``ds=[/data]``, a file named ``[red]x``,
    a tensor named ``x[/]``), and one line each (a description with a newline, escape characters in a
    checkpoint's tensor names)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._plain_rows: list[list[str]] | None = []

    def add_row(self, *cells: Any, **kwargs: Any) -> None:
        lines = [one_line(c) if isinstance(c, str) else c for c in cells]
        if self._plain_rows is not None and all(isinstance(c, str) for c in lines) and not kwargs:
            self._plain_rows.append(lines)
        else:
            self._plain_rows = None
        super().add_row(*(Text(c) if isinstance(c, str) else c for c in lines), **kwargs)

    def aligned(self, width: int) -> list[str] | None:
        """The header and the rows as lines of text, laid out as rich lays this table out, when every
        cell is plain text and the table fits in ``width`` or cannot be folded into it; else None (rich
        folds it). Rich took ~0.5 s to lay out the 1,000 rows of a vault's snapshots; this takes milliseconds."""
        if self._plain_rows is None:
            return None
        header = [str(c.header) for c in self.columns]
        rows = [header, *self._plain_rows]
        widths = [max(cell_len(row[i]) for row in rows) for i in range(len(header))]
        gaps = 2 * (len(widths) - 1)
        whole = sum(w for w, c in zip(widths, self.columns, strict=True) if c.no_wrap)
        folded = sum(min(w, MIN_FOLDED) for w, c in zip(widths, self.columns, strict=True) if not c.no_wrap)
        if gaps + whole + folded <= width < sum(widths) + gaps:
            return None  # rich folds the long cells in the room the others leave
        # Fits, or there is no room to fold in (rich would drop columns, or cut IDs and numbers): one line a
        # row, as long as it takes, for the terminal to wrap.
        right = [c.justify == "right" for c in self.columns]

        def line(row: list[str]) -> str:
            cells = (
                " " * (w - cell_len(c)) + c if r else c + " " * (w - cell_len(c))
                for c, w, r in zip(row, widths, right, strict=True)
            )
            return "  ".join(cells).rstrip()

        return [line(row) for row in rows]
