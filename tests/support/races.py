"""A race made deterministic: something happens to the files at an exact point of a walk."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ckptvault.ops import pin as pins


def at_file_linked(monkeypatch: pytest.MonkeyPatch, n: int, happen: Callable[[], None]) -> list[str]:
    """``happen()`` runs just before a pin's sync links (or copies) its ``n``-th file; the names of the
    files it was asked to link are returned, as they come."""
    real, calls = pins._sync_file, []

    def sync_file(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == n:
            happen()
        return real(*args, **kwargs)

    monkeypatch.setattr(pins, "_sync_file", sync_file)
    return calls
