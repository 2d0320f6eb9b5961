"""Parsers for command-line values. Each raises UsageError naming the option and the fix."""

from __future__ import annotations

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
