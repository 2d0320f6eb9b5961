"""The storage contract the repository relies on.

Keys are '/'-separated names relative to the repository root. ``put`` is atomic: a reader
sees either no object or the whole object, never a prefix (temp file + rename locally, a
single PUT on object stores). Objects are immutable: the repository never overwrites one
with different content. Missing objects raise ``ObjectNotFoundError``; every other backend
failure raises ``StorageError`` naming the operation and the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


class Store(Protocol):
    url: str

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None: ...

    def get(self, key: str) -> bytes: ...

    def get_range(self, key: str, start: int, length: int) -> bytes: ...

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> list[ObjectInfo]: ...

    def delete(self, key: str) -> None: ...

    def remove_stale_temp_files(self, older_than_s: float) -> int: ...
