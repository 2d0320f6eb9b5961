"""Argument checks at the public API's entry points (vault.py, integrations).

A wrong type must fail at once with a UsageError saying what was expected, not as a bare
TypeError/AttributeError from deep inside, and never be half-understood: a bare string where a
list is expected would be iterated character by character (keep_tags="milestone" protects
nothing; forget("bc") would forget snapshots "b" and "c").
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import threading
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from datetime import MAXYEAR, datetime, timedelta, timezone
from typing import Any

from .crypto.keyfile import Keyfile
from .errors import UsageError, spelled
from .snapshot.model import TAG_TEXT_MAX, Snapshot, step_number

PathLike = str | os.PathLike[str]
KeyfileArg = str | os.PathLike[str] | Keyfile | None  # a keyfile's path, a loaded one, or None: no encryption


def shown_value(value: object) -> str:
    """A wrong value as a message names it: its type and a short repr."""
    if value is None:
        return "None"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def wrong_arg(name: str, value: object, expected: str) -> UsageError:
    """The UsageError for an argument of the wrong kind: what was expected, what was given."""
    return UsageError(f"{name} must be {expected}; got {shown_value(value)}")


def url_arg(url: str | os.PathLike[str] | None) -> str | None:
    """A vault URL or local path (str or os.PathLike); None means the default vault."""
    if url is None:
        return None
    text = os.fspath(url) if isinstance(url, os.PathLike) else url
    if not isinstance(text, str):
        raise wrong_arg("url", url, "a path or URL (str or pathlib.Path), or None for the default vault")
    if not text.strip():
        raise UsageError("the vault URL is empty; give a path or URL, or None for the default vault")
    return text


def path_arg(name: str, value: object) -> str:
    """A path: a str or an os.PathLike (pathlib.Path), without NUL (no system call takes one)."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str) or "\0" in text:
        raise wrong_arg(name, value, "a path (a str or pathlib.Path, without NUL characters)")
    return text


def progress_arg(name: str, value: object) -> Any:
    """None, or an object with the Progress protocol's methods (start, advance, finish)."""
    if value is not None and not all(callable(getattr(value, m, None)) for m in ("start", "advance", "finish")):
        raise wrong_arg(name, value, "None or an object with start(), advance() and finish() methods")
    return value


def flag_arg(name: str, value: object) -> bool:
    """True or False (numpy's bools too), never a truthy string: ``dry_run="false"`` is refused."""
    numpy = sys.modules.get("numpy")  # not loaded: the value cannot be one of its bools
    if not isinstance(value, bool) and not (numpy is not None and isinstance(value, numpy.bool_)):
        raise wrong_arg(name, value, "True or False")
    return bool(value)


def callback_arg(name: str, value: object) -> None:
    """None, or something to call (checked before any work: a bad one failed after a commit)."""
    if value is not None and not callable(value):
        raise wrong_arg(name, value, "a function to call, or None")


def optional_path_arg(name: str, value: object) -> str | None:
    return None if value is None else path_arg(name, value)


def folder_or_default_arg(name: str, folder: object, what: str) -> str | None:
    """A folder argument where None means the default: an empty one is refused, not taken for None."""
    path = optional_path_arg(name, folder)
    if path is not None and not path.strip():
        raise UsageError(f"{name} is empty; give a folder for {what}, or None for the default")
    return path


def keyfile_arg(keyfile: KeyfileArg) -> Keyfile | None:
    """A keyfile's path (loaded here) or a loaded Keyfile; None for no encryption."""
    if keyfile is None or isinstance(keyfile, Keyfile):
        return keyfile
    if not isinstance(keyfile, str | os.PathLike):
        raise wrong_arg("keyfile", keyfile, "a keyfile's path (str or pathlib.Path), a Keyfile, or None")
    return Keyfile.load(keyfile)


def storage_options_arg(options: dict[str, Any] | None) -> dict[str, Any] | None:
    if options is not None and not isinstance(options, dict):  # its value is not shown: it may hold secrets
        raise UsageError(
            "storage_options must be a dict of fsspec options, e.g. {'endpoint_url': 'http://127.0.0.1:9000'}; "
            f"got {type(options).__name__}"
        )
    return options


def list_items(name: str, value: object, expected: str) -> list[Any]:
    """The items of a list-like argument; a bare str or bytes (or a dict) is refused, not iterated."""
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise wrong_arg(name, value, expected)
    return list(value)


def str_list_arg(name: str, value: Iterable[str] | None, example: str) -> list[str]:
    """A list (or tuple, ...) of strings; None is an empty one."""
    if value is None:
        return []
    expected = f"a list of strings, e.g. {example}"
    items = list_items(name, value, expected)
    for item in items:
        if not isinstance(item, str):
            raise wrong_arg(f"each item of {name}", item, f"a string ({name} must be {expected})")
    return items


def tag_keys_arg(name: str, value: Iterable[str] | None) -> list[str]:
    """Tag keys (``Vault.tag``'s ``remove``): no key is empty or holds "=" (``tags_arg``), so such a value
    would match nothing and change nothing, silently: ``--remove keep=best`` meant ``--remove keep``."""
    keys = str_list_arg(name, value, "['note']")
    for key in keys:
        if not key.strip() or "=" in key:
            wanted = key.partition("=")[0].strip()
            raise UsageError(
                f"{spelled(f'--{name}', name)} takes tag keys; {key!r} is "
                + ("empty (is a variable unset?)" if not key.strip() else "not one (a key holds no '=')")
                + (f": to take the tag away give {spelled(f'--{name} {wanted}', repr(wanted))}" if wanted else "")
            )
    return keys


def paths_arg(value: PathLike | Sequence[PathLike]) -> list[str]:
    """Backup sources: one path, or a list of them."""
    if isinstance(value, (str, os.PathLike)):
        return [path_arg("paths", value)]
    items = list_items("paths", value, "a path or a list of paths, e.g. './checkpoints' or ['a', 'b']")
    return [path_arg("paths", item) for item in items]


def snapshot_arg(value: str | Snapshot, name: str = "snapshot") -> str | Snapshot:
    if not isinstance(value, (str, Snapshot)):
        raise wrong_arg(name, value, "a snapshot ID (prefix), 'latest' or a Snapshot")
    return value


def snapshot_list_arg(value: Iterable[str | Snapshot]) -> list[str | Snapshot]:
    items = list_items("snapshots", value, "a list of snapshot IDs or Snapshots, e.g. ['7be0a1']")
    return [snapshot_arg(item, "each item of snapshots") for item in items]


def control_char(text: str) -> str | None:
    """The first character that would break a table row or a one-line message, as U+XXXX."""
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Zl", "Zp"):  # C0/C1 controls, DEL, line/paragraph separators
            return f"U+{ord(ch):04X}"
    return None


def tags_arg(value: Mapping[str, str] | None, name: str = "tags", *, stored: bool = False) -> dict[str, str]:
    """Tags: a dict of str to str (stored as text, so a non-str value would never match again).
    ``stored``: tags a snapshot will carry, held to the CLI's rules (no blank key, no control
    character, at most TAG_TEXT_MAX characters), so that ``--tag`` can select them again."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise wrong_arg(name, value, 'a dict like {"run": "x"}')
    for key, val in value.items():
        if not isinstance(key, str) or not isinstance(val, str):
            raise UsageError(
                f'{name} keys and values must be strings, like {{"step": "1200"}}; got {key!r}: {val!r} (use str())'
            )
        if not key or "=" in key:  # a snapshot's tags are key=value: such a key could never be read back
            raise UsageError(f"tag key {key!r} is invalid; tags look like run=x")
        if not stored:
            continue
        if not key.strip():
            raise UsageError(f"{name}: the key {key!r} is blank; give a name, e.g. {{'run': 'x'}}")
        if key != key.strip():  # a stray space from quoting: stored, no --tag run=x would select it
            raise UsageError(
                f"{spelled('--tag', name)}: the key {key!r} has spaces around it; write it without, e.g. "
                + spelled("--tag run=x", "{'run': 'x'}")
            )
        option = "--add" if name == "add" else "--tag"
        if not val.strip():  # run=$RUN_ID with the variable unset: no run tag would select it
            raise UsageError(
                f"{spelled(f'{option} {key}={val}', f'{name}: {key!r}')} has an empty value (is a variable unset?); "
                "give one, e.g. " + spelled(f"{option} {key}=x", "{" + repr(key) + ": 'x'}")
            )
        for text in (key, val):
            bad = control_char(text)
            if bad:
                raise UsageError(f"{name}: {key!r}: {text!r} contains a control character ({bad}); use printable text")
            if len(text) > TAG_TEXT_MAX:
                raise UsageError(f"{name}: {key!r} holds {len(text)} characters; the limit is {TAG_TEXT_MAX}")
        if val != val.strip():  # "run=x " from a shell line's quoting: no --tag run=x would select it
            fixed = val.strip()
            raise UsageError(
                f"{spelled(f'{option} {key}={val}', f'{name}: {key!r}')}: the value {val!r} has spaces around it; "
                "write it without, e.g. "
                + spelled(f"{option} {key}={fixed}", "{" + repr(key) + ": " + repr(fixed) + "}")
            )
    step = value.get("step") if stored else None
    if step is not None and (number := _not_whole(step)) is not None:
        # the step orders a run's saves (latest, prune): one step=1200.0 (a float formatted) took the run's
        # latest back to going by time, said only at a restore, and wrongly (cli49 #2). A label (step=final)
        # is the user's choice, said where latest then goes by time.
        given = spelled(f"{'--add' if name == 'add' else '--tag'} step={step}", f"{name}: 'step': {step!r}")
        whole = f"step={int(number)}" if number.is_integer() else "a whole number"
        raise UsageError(f"{given} is a number but not a whole one (the step orders a run's saves); give {whole}")
    return dict(value)


def _not_whole(text: str) -> float | None:
    """The number ``text`` spells when it is one that ``step_number`` does not read as a step: 1200.0, 1.5e2,
    1_000; else None (a step, or not a number at all)."""
    if step_number(text) is not None:
        return None
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def hostname_arg(value: str | None) -> str | None:
    """A hostname to record, or None for this machine's."""
    hostname = text_arg("hostname", value, optional=True)
    if hostname is None:
        return None
    if not hostname.strip() or not hostname.isprintable():
        raise UsageError(
            f"hostname {hostname!r} is blank or holds control characters; give a name, or none for this machine's"
        )
    # as tags: " nodeA" would be another host than nodeA to --host, and look the same in the tables
    problem = (
        f"is longer than {TAG_TEXT_MAX} characters ({len(hostname)})"
        if len(hostname) > TAG_TEXT_MAX
        else "has spaces at its ends"
        if hostname != hostname.strip()
        else None
    )
    if problem:
        shown = repr(hostname) if len(hostname) <= 60 else repr(hostname[:60])[:-1] + "...'"
        raise UsageError(f"{spelled('--host', 'hostname')} {shown} {problem}; give the name alone, e.g. nodeA")
    return hostname


def hosts_arg(value: Sequence[str] | None) -> list[str] | None:
    """Hosts to select snapshots of (restic's ``--host``): a list of hostnames, any of which a snapshot may be
    of; None selects every host. A bare string is refused (it would be iterated), and so is an empty list: any
    of no host would be no snapshot, and it is almost always a filtered list that ended empty, which taken
    for every host would restore or count another host's snapshots. (``tags={}``, unlike it, selects every
    snapshot as it says: each carries all of no tags.)"""
    if value is None:
        return None
    hosts = str_list_arg("hosts", value, "['nodeB']")
    if not hosts:
        raise UsageError(
            "hosts is an empty list, which would select no snapshot (a filtered list that ended empty?); "
            "pass hosts=None (or leave it out) for every host, or hostnames, e.g. hosts=['nodeB']"
        )
    for host in hosts:
        if not host.strip() or not host.isprintable():
            raise UsageError(
                f"{spelled('--host', 'hosts')}: {host!r} is blank or holds control characters (is a variable unset?); "
                "give a hostname as the snapshots list it, e.g. " + spelled("--host nodeB", "hosts=['nodeB']")
            )
    return hosts


def text_arg(name: str, value: str | None, *, optional: bool = False) -> Any:
    """A str (or, with ``optional``, None)."""
    if not isinstance(value, str) and not (optional and value is None):
        raise wrong_arg(name, value, "a string" + (" or None" if optional else ""))
    return value


def int_arg(name: str, value: int | None, *, optional: bool = False) -> Any:
    """An integer, not a bool (numpy's count; or, with ``optional``, None)."""
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise wrong_arg(name, value, "an int" + (" or None" if optional else ""))
    return int(value)


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def fraction_arg(name: str, value: float) -> float:
    """A number from 0 to 1."""
    if not _real(value):
        raise wrong_arg(name, value, "a number from 0 to 1 (e.g. 0.1 for 10%)")
    if not 0.0 <= value <= 1.0:
        raise UsageError(f"{name} {value} must be between 0 and 1")
    return float(value)


def interval_arg(name: str, value: float) -> float:
    """A number of seconds (its range is the caller's to check)."""
    if not _real(value):
        raise wrong_arg(name, value, "a number of seconds")
    return float(value)


def seconds_arg(name: str, value: float | None) -> float | None:
    """A time limit in seconds: a number from 0 up, or None (or infinity) for no limit. Beyond what a
    thread's wait takes (``threading.TIMEOUT_MAX``), the wait would raise an OverflowError."""
    if value is None:
        return None
    if not _real(value) or not value >= 0:  # NaN too: "waiting up to nan s" waited without a bound
        unbounded = spelled("leave it out", "None")  # the CLI's options have no None to give
        expected = f"a number of seconds (0 or more), or {unbounded} to wait as long as it takes"
        # an option's value is text the user typed, not a Python object: "got -5", not "got float -5.0"
        typed = format(value, "g") if isinstance(value, float) else repr(value)
        raise UsageError(f"{name} must be {expected}; got {spelled(typed, shown_value(value))}")
    return None if math.isinf(value) else min(float(value), threading.TIMEOUT_MAX)


def retry_lock_arg(value: float | timedelta) -> float:
    """How long to wait for a lock: seconds (0 or more) or a non-negative timedelta."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if not _real(seconds) or not 0 <= seconds < math.inf:  # NaN fails both
        raise wrong_arg("retry_lock", value, "a number of seconds (0 or more) or a timedelta, e.g. 300")
    return float(seconds)


def before_arg(before: datetime | timedelta | None, now: datetime | None) -> datetime | None:
    """prune's cutoff: a time, or an age (a non-negative timedelta) counted back from ``now``."""
    if now is not None and (not isinstance(now, datetime) or now.tzinfo is None):
        raise wrong_arg("now", now, "a timezone-aware datetime or None")
    if isinstance(before, datetime) and before.tzinfo is not None:
        try:
            ahead = before.astimezone(timezone.utc) - (now or datetime.now(timezone.utc))
        except OverflowError:  # no UTC equivalent: past year 9999 is the future; before year 1, RetentionPolicy says
            ahead = timedelta.max if before.year == MAXYEAR else timedelta(0)
        if ahead > timedelta(days=1):
            # every snapshot is older than it, so only the newest of each group would stay: a mistyped
            # year, not a cutoff (a few hours ahead is one: "before the end of today")
            raise UsageError(
                f"{spelled('--before', 'before')} {before.isoformat()} is more than a day in the future, so every "
                f"snapshot is older than it; give a past date, or an age such as {spelled('14d', 'timedelta(days=14)')}"
            )
    if before is None or isinstance(before, datetime):
        return before
    if not isinstance(before, timedelta):
        raise wrong_arg("before", before, "a timezone-aware datetime or an age as a timedelta, e.g. timedelta(days=14)")
    if before < timedelta(0):
        raise UsageError(f"before={before!r} is a negative age, a cutoff in the future; give e.g. timedelta(days=14)")
    try:
        return (now or datetime.now(timezone.utc)) - before
    except OverflowError:
        raise UsageError(f"before={before!r} reaches back before year 1; give a shorter age") from None


ID_PREFIX_MIN = 4  # characters of a snapshot ID prefix that every command and API method takes


def is_snapshot_id(spec: str) -> bool:
    """Whether ``spec`` is a whole snapshot ID (64 hex digits), not a prefix or ``latest``."""
    return len(spec) == 64 and all(c in "0123456789abcdefABCDEF" for c in spec)


def refuse_short_id_prefix(spec: object, what: str, listing: str | None = None) -> None:
    """``forget 3`` meant "three snapshots" as often as "the one whose ID starts with 3", ``tag 2 --add
    keep=best`` protected whichever snapshot began with 2, and ``restore 1 ./resume`` wrote whichever began
    with 1 where step 1 was meant. One rule for every command and method that takes a prefix (``Vault.snapshot``
    and so ls, cat, show, diff, drill): a script that works with ``ls 1`` must not fail with ``restore 1``."""
    if isinstance(spec, str) and spec != "latest" and len(spec.strip()) < ID_PREFIX_MIN:
        listing = listing or spelled("ckptvault snapshots", "Vault.snapshots()")  # (copy's: its source's)
        raise UsageError(
            f"{spec!r} is too short an ID prefix to {what} a snapshot by: give at least "
            f"{ID_PREFIX_MIN} characters of its ID (as {listing} shows them)"
        )
