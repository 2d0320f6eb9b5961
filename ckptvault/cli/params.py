"""Parsers for command-line values. Each raises UsageError naming the option and the fix."""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta, timezone

from ..arguments import TAG_TEXT_MAX, control_char, hosts_arg, tags_arg
from ..errors import UsageError


def _quoted(text: str, limit: int = 40) -> str:
    """``repr(text)`` for a one-line message (escapes control characters), cut short when long."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + "...'"


def _check_tag_text(option: str, what: str, text: str, limit: int | None) -> None:
    """``what`` names the text in the message: "key 'a'" or "the value of 'a' ('x')"."""
    bad = control_char(text)
    if bad:
        raise UsageError(f"{option}: {what} contains a control character ({bad}); use printable text")
    if limit is not None and len(text) > limit:
        raise UsageError(f"{option}: {what} is {len(text)} characters long; the limit is {limit}")


def _check_tag_key(option: str, key: str, limit: int | None) -> None:
    if not key.strip():
        raise UsageError(f"{option}: the key {key!r} is blank; give a name, e.g. {option} run=x")
    _check_tag_text(option, f"key {_quoted(key)}", key, limit)


def parse_tags(
    values: list[str] | None, option: str = "--tag", *, limit: int | None = TAG_TEXT_MAX, show_values: bool = True
) -> dict[str, str]:
    """``key=value`` pairs. Keys must not be blank; keys and values must hold no control
    characters and, with ``limit``, be at most that many characters. Messages quote a bad
    value only with ``show_values`` (storage options may be secrets)."""
    tags: dict[str, str] = {}
    for value in values or []:
        key, sep, val = value.partition("=")
        if not sep or not key:
            example = "endpoint_url=http://127.0.0.1:9000" if option == "-o" else "run=x"
            raise UsageError(f"{option}: {_quoted(value)} is not key=value, e.g. {option} {example}")
        _check_tag_key(option, key, limit)
        shown = f" ({_quoted(val)})" if show_values else ""
        _check_tag_text(option, f"the value of {_quoted(key)}{shown}", val, limit)
        if key in tags and tags[key] != val:
            raise UsageError(f"{option}: key {key!r} is given twice ({_quoted(tags[key])} and {_quoted(val)})")
        tags[key] = val
    return tags


def parse_hosts(values: list[str] | None) -> list[str] | None:
    """``--host`` values (repeatable: a snapshot of any of them is selected; None when none is given: every
    host); a blank one is refused (an unset variable, ``--host "$HOST"``), not taken as no filter."""
    return hosts_arg(values) if values else None


def parse_new_tags(values: list[str] | None, option: str = "--tag") -> dict[str, str]:
    """Tags a snapshot will carry, held to the API's rules for them (no empty value: what
    ``--tag run=$RUN_ID`` gives with the variable unset) before any vault is opened or made."""
    return tags_arg(parse_tags(values, option), "add" if option == "--add" else "tags", stored=True)


def parse_keep_tags(values: list[str] | None) -> tuple[str, ...]:
    """``--keep-tag`` values: ``key`` or ``key=value``, checked like ``--tag``."""
    specs: list[str] = []
    for spec in values or []:
        key, sep, val = spec.partition("=")
        if not key:
            raise UsageError(
                f"--keep-tag: {_quoted(spec)} has no key; give key or key=value, e.g. --keep-tag milestone"
            )
        _check_tag_key("--keep-tag", key, TAG_TEXT_MAX)
        if sep:
            _check_tag_text("--keep-tag", f"the value of {_quoted(key)} ({_quoted(val)})", val, TAG_TEXT_MAX)
        specs.append(spec)
    return tuple(specs)


def parse_storage_options(values: list[str] | None) -> dict[str, str]:
    return parse_tags(values, "-o", limit=None, show_values=False)  # values may be long secrets (tokens)


_AGE_UNITS = {
    "s": timedelta(seconds=1),
    "min": timedelta(minutes=1),
    "h": timedelta(hours=1),
    "d": timedelta(days=1),
    "w": timedelta(weeks=1),
}
_AGE_PART = re.compile(r"([0-9]{1,4000})([a-z]+)")  # int() refuses over 4,300 digits
_BEFORE_FORMATS = "use e.g. 2026-11-16, 2026-11-16T12:00 or 14d, 36h, 1h30min, 2w3d"


def parse_before(value: str | None, now: datetime) -> datetime | None:
    """An ISO date or time (UTC unless it says otherwise), or an age: 30min, 36h, 14d, 2w, 1h30min. A bare
    ``m`` is refused: restic's ``--keep-within 6m`` means 6 months, and a prune that read it as
    minutes would remove nearly everything."""
    if value is None:
        return None
    text = value.strip()
    parts = _AGE_PART.findall(text)
    if parts and "".join(number + unit for number, unit in parts) == text:
        for number, unit in parts:
            if unit == "m":
                raise UsageError(
                    f"--before: {_quoted(value)} is ambiguous (restic reads 'm' as months): write {number}min for "
                    f"minutes, or days, e.g. {int(number) * 30}d for {number} months"
                )
            if unit not in _AGE_UNITS:
                raise UsageError(
                    f"--before: {_quoted(value)} has the unit {unit!r}; an age is in s, min, h, d or w (months and "
                    "years in days: 90d, 365d)"
                )
        try:
            return now - sum((int(number) * _AGE_UNITS[unit] for number, unit in parts), timedelta())
        except OverflowError:  # further back than year 1
            raise UsageError(f"--before: {_quoted(value)} is too far back to be a date; {_BEFORE_FORMATS}") from None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(f"--before: {_quoted(value)} is not a date or a duration; {_BEFORE_FORMATS}") from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


_DURATION_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(min|[smhdw])")
DURATION_MAX_S = 366 * 86400


def parse_duration(value: str, option: str) -> float:
    """Seconds from '30s', '5m', '1h30m', '2d', '1w', as restic's --retry-lock reads them (m: minutes; 'min'
    too, as --before writes them); 0 alone is none. ``option``: where the value came from (flag or variable)."""
    text = value.strip()
    example = "use e.g. 30s, 5m, 1h30m or 2h"
    if text == "0":
        return 0.0
    if not text:
        raise UsageError(f"{option} is empty; give a duration ({example}), or 0 for none")
    parts = _DURATION.findall(text)
    if "".join(number + unit for number, unit in parts) != text:
        raise UsageError(f"{option}: {_quoted(value)} is not a duration; {example}")
    seconds = sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)
    if seconds > DURATION_MAX_S:
        raise UsageError(f"{option}: {_quoted(value)} is more than a year; {example}")
    return seconds


def parse_fraction(value: str, option: str) -> float:
    """'10%' or '0.1' -> 0.1; a bare number of 1 or more is refused as ambiguous."""
    text = value.strip()
    try:
        fraction = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise UsageError(f"{option}: {value!r} is not a percentage like 10%") from None
    if not math.isfinite(fraction):
        raise UsageError(f"{option}: {value!r} is not a percentage like 10%")
    if not text.endswith("%") and fraction >= 1:  # "5" may mean 5%, "1" 1% or all of it
        raise UsageError(f"{option}: {value!r} is ambiguous; write a percentage like {text}% or a fraction like 0.05")
    if not 0 < fraction <= 1:
        raise UsageError(f"{option}: {value!r} must be more than 0% and at most 100%")
    return fraction
