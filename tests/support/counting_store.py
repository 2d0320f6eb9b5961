"""A Store wrapper that records every read, to prove what an operation fetched."""

from __future__ import annotations

from typing import Any


class CountingStore:
    """Delegates to a real store; ``reads`` lists (key, start, length) of every get/get_range."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.url = inner.url
        self.reads: list[tuple[str, int, int]] = []

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self.reads.append((key, 0, len(data)))
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self.reads.append((key, start, length))
        return self.inner.get_range(key, start, length)

    def pack_reads(self) -> list[tuple[str, int, int]]:
        return [r for r in self.reads if r[0].startswith("packs/")]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def count_reads(vault: Any) -> CountingStore:
    """Swap the vault's store for a counting one (after the index is loaded, so only data reads count)."""
    repo = vault._repo
    repo.index  # noqa: B018 - load it now, through the real store
    counting = CountingStore(repo.store)
    repo.store = counting
    return counting
