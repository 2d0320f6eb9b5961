"""Parsers for command-line values. Each raises UsageError naming the option and the fix."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from ..errors import UsageError


def parse_tags(values: list[str] | None, option: str = "--tag") -> dict[str, str]:
    tags: dict[str, str] = {}
    for value in values or []:
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise UsageError(f"{option}: {value!r} is not key=value, e.g. {option} run=x")
        if key in tags and tags[key] != val:
            raise UsageError(f"{option}: key {key!r} is given twice ({tags[key]!r} and {val!r})")
        tags[key] = val
    return tags


def parse_storage_options(values: list[str] | None) -> dict[str, str]:
    return parse_tags(values, "-o")


_UNITS = {"m": timedelta(minutes=1), "h": timedelta(hours=1), "d": timedelta(days=1), "w": timedelta(weeks=1)}


def parse_before(value: str | None, now: datetime) -> datetime | None:
    """An ISO date or time (UTC unless it says otherwise), or an age: 30m, 36h, 14d, 2w."""
    if value is None:
        return None
    text = value.strip()
    if len(text) >= 2 and text[-1] in _UNITS and text[:-1].isdigit():
        return now - int(text[:-1]) * _UNITS[text[-1]]
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(
            f"--before: {value!r} is not a date or a duration; use e.g. 2026-11-16, 2026-11-16T12:00 or 14d, 36h"
        ) from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def parse_fraction(value: str, option: str) -> float:
    """'10%' or '0.1' -> 0.1."""
    text = value.strip()
    try:
        fraction = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise UsageError(f"{option}: {value!r} is not a percentage like 10%") from None
    if not 0 < fraction <= 1:
        raise UsageError(f"{option}: {value!r} must be more than 0% and at most 100%")
    return fraction
