"""BLAKE3 hashing: chunk IDs (plain, or keyed in an encrypted repository) and whole-file hashes."""

from __future__ import annotations

from blake3 import blake3


class ChunkIdFunction:
    """Maps chunk plaintext to its 32-byte ID: BLAKE3, keyed when ``key`` is given so that
    IDs in an encrypted repository reveal nothing and are not linkable across repositories."""

    def __init__(self, key: bytes | None = None) -> None:
        if key is not None and len(key) != 32:
            raise ValueError("chunk-ID key must be 32 bytes")
        self._key = key

    def __call__(self, data: bytes | memoryview) -> bytes:
        if self._key is None:
            return blake3(data).digest()
        return blake3(data, key=self._key).digest()


def new_file_hasher() -> blake3:
    """Whole-file BLAKE3 (always unkeyed, so it can be compared with ``b3sum``)."""
    return blake3()


def checksum(*parts: bytes | memoryview, size: int = 16) -> bytes:
    h = blake3()
    for part in parts:
        h.update(part)
    return h.digest(length=size)
