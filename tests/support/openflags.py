"""The flags of every ``os.open`` a test's code makes (to see which opens asked for O_DIRECT)."""

from __future__ import annotations

import os

import pytest


def open_flags_spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    real_open = os.open

    def spy(path, flags, *args):
        seen.append(flags)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", spy)
    return seen
