"""Walking backup sources into a flat, sorted list of entries to store.

One directory source is stored as the snapshot root (``backup ./checkpoints`` gives
``model/config.json``, not ``checkpoints/model/config.json``); several sources, or a file
source, are stored under their base names. A source that is itself a symlink is followed
(``backup ./latest`` means the checkpoint it points at); links inside are stored as links.

``--exclude`` patterns leave files and folders out (a folder with all it holds). Close to
``.gitignore``: a pattern without a ``/`` matches the name of a file or folder at any depth
(``*.tmp``, ``wandb``), and so does one starting with ``**/``; one with a ``/`` inside, or
starting with ``./``, matches the path from the snapshot's root (``model/*.bin``, ``./logs``); a
trailing ``/`` matches folders only. Globs are ``fnmatch``'s: ``*``, ``?``, ``[abc]``; in a path
pattern ``*`` matches ``/`` too, as in restore's ``--include``. Absolute patterns and ``..`` are
refused: patterns name paths inside the backup.
"""

from __future__ import annotations

import errno
import fnmatch
import functools
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import SourceError, UsageError, elided, spelled
from .names import STATE_FOLDERS, is_unfinished, source_name


@dataclass(frozen=True, slots=True)
class SourceItem:
    path: str  # snapshot path, '/'-separated
    abs_path: str
    kind: str  # "file" | "dir" | "symlink"
    st: os.stat_result
    root: str = ""  # the source folder it was found in; "" for a source named itself


@dataclass
class ScanResult:
    items: list[SourceItem]
    warnings: list[str]
    source_paths: list[str]  # absolute, as recorded in the snapshot
    excluded: int = 0  # files and folders left out by exclude patterns (a folder counts once)
    vanished: list[str] = field(default_factory=list)  # deleted between their folder's listing and their stat


@dataclass(frozen=True)
class ExcludeRule:
    glob: str
    anchored: bool  # matched against the path from the snapshot's root, else against the name
    dirs_only: bool  # the pattern ended with "/"


@dataclass(frozen=True)
class Excludes:
    """Exclude patterns, checked (``Excludes.parse``) before any work (see the module docstring)."""

    rules: tuple[ExcludeRule, ...] = ()
    patterns: tuple[str, ...] = field(default=(), compare=False)  # as given
    # Also names still being written (names.is_unfinished): what a pin leaves out, for a backup read
    # in place. Not a pattern: a snapshot records only what the user asked to leave out.
    unfinished: bool = False

    @classmethod
    def parse(cls, patterns: Sequence[str]) -> Excludes:
        rules: list[ExcludeRule] = []
        for pattern in patterns:
            rules += _rules(pattern)
        return cls(tuple(rules), tuple(patterns))

    def __bool__(self) -> bool:
        return bool(self.rules) or self.unfinished

    def key(self) -> tuple[str, ...]:
        """The rules, normalised and sorted: equal for patterns that select the same files."""
        return tuple(sorted({("./" if r.anchored else "") + r.glob + ("/" if r.dirs_only else "") for r in self.rules}))

    def match(self, path: str, is_dir: bool, *, names_only: bool = False) -> bool:
        """Whether the file or folder at the snapshot path ``path`` is left out. ``names_only``:
        by the patterns without a ``/`` alone."""
        name = path.rsplit("/", 1)[-1]
        if self.unfinished and is_unfinished(name):
            return True
        return any(
            fnmatch.fnmatchcase(path if rule.anchored else name, rule.glob)
            for rule in self.rules
            if (is_dir or not rule.dirs_only) and not (names_only and rule.anchored)
        )


def _rules(pattern: str) -> list[ExcludeRule]:
    def refuse(why: str) -> UsageError:
        return UsageError(
            f"{spelled('--exclude', 'exclude')} pattern {pattern!r} {why}; give a name or glob "
            "(e.g. '*.tmp', 'wandb', 'logs/*.txt', './tmp' for the top level only)"
        )

    if pattern.startswith("/"):
        raise refuse("is absolute: patterns match paths inside the backup, not on this machine")
    body, any_depth = pattern, False
    while body.startswith("**/"):  # .gitignore's "at any depth"
        body, any_depth = body[3:], True
    parts = [part for part in body.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise refuse("holds '..'; patterns match paths inside the backup")
    if not pattern.strip():  # -e "$PATTERN" with the variable unset
        raise refuse("is empty (is a variable unset?)")
    if not parts or not "".join(parts).strip():
        raise refuse("names no file")
    glob, dirs_only = "/".join(parts), pattern.endswith("/")
    if any_depth and len(parts) > 1:  # "*" matches "/" too: "*/a/b" is a/b below the top level
        return [ExcludeRule(glob, True, dirs_only), ExcludeRule(f"*/{glob}", True, dirs_only)]
    anchored = not any_depth and (len(parts) > 1 or body.startswith("./"))
    return [ExcludeRule(glob, anchored, dirs_only)]


def check_sources(sources: list[str]) -> list[str]:
    """Absolute source paths; fails before any work when one does not exist."""
    if not sources:
        raise UsageError("nothing to back up: name at least one file or directory")
    if any(not s.strip() for s in sources):
        # os.path.abspath("") is the current folder: an unset shell variable must not back it up
        raise UsageError("a source path is empty; name the file or directory to back up")
    # a path given twice is backed up once
    abs_sources = list(dict.fromkeys(os.path.abspath(os.path.expanduser(s)) for s in sources))
    for src in abs_sources:
        try:
            os.stat(src)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SourceError(src, "a symlink loop") from None
            if os.path.islink(src):
                raise SourceError(src, f"a symlink to {os.readlink(src)}, which does not exist") from None
            missing = exc.errno == errno.ENOENT or not exc.strerror
            raise SourceError(src, "no such file or directory" if missing else str(exc.strerror)) from None
    return abs_sources


def source_names(abs_sources: list[str]) -> list[str]:
    """The names several sources (or one file) are stored under in a snapshot: their base names,
    which must differ."""
    names = [source_name(s) for s in abs_sources]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise UsageError(f"two sources share the name {sorted(dupes)[0]!r}; back them up separately")
    return names


NO_EXCLUDES = Excludes()


def scan_sources(
    sources: list[str],
    *,
    skip_unreadable: bool,
    vault_folder: str | None = None,
    exclude: Excludes = NO_EXCLUDES,
    purpose: str = "back up",
) -> ScanResult:
    """``vault_folder``: the local folder of the vault being written. A source inside it (or the
    vault itself) is refused, and the vault is left out of a source that holds it: its objects are
    stored already, and its lock and the packs it is writing change while they are read.
    ``exclude``: what to leave out (the module docstring); a source named is subject to it too.
    ``purpose``: what the caller does with the files, for the error when there are none."""
    abs_sources = check_sources(sources)
    vault = refuse_sources_in_vault(abs_sources, vault_folder)
    result = ScanResult(items=[], warnings=[], source_paths=abs_sources)
    walk = functools.partial(_walk, result=result, skip_unreadable=skip_unreadable, vault=vault, exclude=exclude)
    if len(abs_sources) == 1 and os.path.isdir(abs_sources[0]):
        walk(abs_sources[0], "")
    else:
        for src, name in zip(abs_sources, source_names(abs_sources), strict=True):
            st = os.stat(src)
            if exclude.match(name, stat.S_ISDIR(st.st_mode)):
                result.excluded += 1
                continue
            if stat.S_ISDIR(st.st_mode):
                result.items.append(SourceItem(name, src, "dir", st))
                walk(src, name)
            else:
                _add(src, name, st, result)
    if not any(item.kind == "file" for item in result.items):
        # an empty snapshot would look like a backup and become `latest`: a resume would restore nothing
        if result.excluded and not exclude.patterns:  # only names still being written (a backup in place)
            raise SourceError(abs_sources[0], f"nothing left to {purpose}: its files are all still being written")
        if result.excluded:
            patterns = ", ".join(repr(p) for p in exclude.patterns)
            raise UsageError(
                f"{spelled('--exclude', 'exclude')} {patterns} leaves no file of {abs_sources[0]} to {purpose}; "
                "check the patterns (a name without '/' matches at any depth)"
            )
        if result.warnings:  # only special or unreadable files
            raise SourceError(abs_sources[0], f"nothing left to {purpose}", "; ".join(result.warnings))
        if any(item.kind == "symlink" for item in result.items):
            raise SourceError(
                abs_sources[0],
                "it holds no files, only symlinks (links inside a folder are stored as links)",
                "name the folders they point to",
            )
        raise SourceError(abs_sources[0], "it holds no files", "check the path")
    result.items.sort(key=lambda i: i.path)
    return result


def unreadable_hint() -> str:
    """What to do about a source file or folder a backup cannot read."""
    return f"use {spelled('--skip-unreadable', 'skip_unreadable=True')} to back up the rest"


def _identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of what ``path`` names, links followed; None when it cannot be found."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def refuse_sources_in_vault(abs_sources: list[str], vault_folder: str | None) -> tuple[int, int] | None:
    """UsageError for a source that is the vault at ``vault_folder`` or lies inside it (through
    links too); else the vault's identity, for the walks to leave it out (None: no local vault)."""
    vault = _identity(vault_folder) if vault_folder else None
    for src in abs_sources if vault is not None else ():
        probe = os.path.realpath(src)
        while True:
            if _identity(probe) == vault:
                where = "the vault" if probe == os.path.realpath(src) else "inside the vault"
                raise UsageError(f"{src} is {where} at {vault_folder}; name the checkpoints, not the vault")
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
    return vault


def _walk(
    top: str,
    prefix: str,
    *,
    result: ScanResult,
    skip_unreadable: bool,
    vault: tuple[int, int] | None,
    exclude: Excludes,
) -> None:
    """Depth first, each folder's entries by name, a folder before what it holds. Not recursive: a
    tree 1,000 folders deep is deeper than Python's recursion (it was an internal error)."""
    listing = _listing(top, result, skip_unreadable)
    pending = [(iter(listing), prefix)] if listing is not None else []
    while pending:
        entries, prefix = pending[-1]
        entry = next(entries, None)
        if entry is None:
            pending.pop()
            continue
        rel = f"{prefix}/{entry.name}" if prefix else entry.name
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # deleted since its folder was listed: as one deleted after the scan
            result.vanished.append(entry.path)
            result.warnings.append(f"skipped {entry.path}: it was deleted during the backup")
            continue
        except OSError as exc:  # a folder that can be listed but not entered (no x), a path over PATH_MAX
            _unreadable(entry.path, exc, result, skip_unreadable)
            continue
        if exclude and exclude.match(rel, stat.S_ISDIR(st.st_mode)):
            result.excluded += 1
            continue
        if stat.S_ISDIR(st.st_mode):
            if entry.name in STATE_FOLDERS:  # hard-linked copies of checkpoints (pins), a lock
                result.warnings.append(f"skipped {entry.path}: {STATE_FOLDERS[entry.name]}, not a checkpoint")
                continue
            if (st.st_dev, st.st_ino) == vault:
                result.warnings.append(f"skipped {entry.path}: the vault this backup writes to")
                continue
            inner = _listing(entry.path, result, skip_unreadable)
            if inner is None:  # unreadable, left out whole (it was stored as an empty folder: restored so)
                continue
            result.items.append(SourceItem(rel, entry.path, "dir", st, top))
            pending.append((iter(inner), rel))
        else:
            _add(entry.path, rel, st, result, top)


def _listing(directory: str, result: ScanResult, skip_unreadable: bool) -> list[os.DirEntry[str]] | None:
    """A folder's entries by name; None when it cannot be read and ``skip_unreadable`` (said in a warning)."""
    try:
        with os.scandir(directory) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError as exc:
        _unreadable(directory, exc, result, skip_unreadable, "directory ")
        return None


def _unreadable(path: str, exc: OSError, result: ScanResult, skip_unreadable: bool, what: str = "") -> None:
    """Fails the scan (``SourceError``), or with ``skip_unreadable`` says in a warning that ``path`` is left out."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENAMETOOLONG:
        reason += f" (a path of {len(os.fsencode(path)):,} bytes, over the system's limit)"
    shown = elided(path)
    if not skip_unreadable:
        raise SourceError(shown, reason, unreadable_hint()) from exc
    result.warnings.append(f"skipped unreadable {what}{shown}: {reason}")


def _add(abs_path: str, rel: str, st: os.stat_result, result: ScanResult, root: str = "") -> None:
    if stat.S_ISREG(st.st_mode):
        result.items.append(SourceItem(rel, abs_path, "file", st, root))
    elif stat.S_ISLNK(st.st_mode):
        result.items.append(SourceItem(rel, abs_path, "symlink", st, root))
    else:
        result.warnings.append(f"skipped special file {abs_path} (fifo, socket or device)")
