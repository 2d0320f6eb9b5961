"""Index objects: which pack holds each chunk, where, and how big it is.

    index = n_packs:u32le | n_packs x (pack_id:32 | n_entries:u32le | n_entries x pack entry)

Several index objects may list the same chunk (two backups that raced); any of them is
valid since both packs hold the same verified bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import MalformedObjectError
from .pack import ENTRY, PackEntry

_COUNT = struct.Struct("<I")
_PACK = struct.Struct("<32sI")


@dataclass(frozen=True, slots=True)
class ChunkLocation:
    pack_id: bytes
    offset: int
    stored_len: int
    raw_len: int


def encode_index(packs: dict[bytes, list[PackEntry]]) -> bytes:
    parts = [_COUNT.pack(len(packs))]
    for pack_id, entries in packs.items():
        parts.append(_PACK.pack(pack_id, len(entries)))
        parts.extend(ENTRY.pack(e.chunk_id, e.offset, e.stored_len, e.raw_len) for e in entries)
    return b"".join(parts)


def decode_index(raw: bytes) -> dict[bytes, list[PackEntry]]:
    try:
        (n_packs,) = _COUNT.unpack_from(raw, 0)
        pos = _COUNT.size
        packs: dict[bytes, list[PackEntry]] = {}
        for _ in range(n_packs):
            pack_id, n = _PACK.unpack_from(raw, pos)
            pos += _PACK.size
            end = pos + n * ENTRY.size
            if end > len(raw):
                raise MalformedObjectError("index object is truncated")
            packs[pack_id] = [PackEntry(*f) for f in ENTRY.iter_unpack(raw[pos:end])]
            pos = end
    except struct.error as exc:
        raise MalformedObjectError(f"index object is truncated ({exc})") from exc
    if pos != len(raw):
        raise MalformedObjectError("index object has trailing bytes")
    return packs


class ChunkIndex:
    """The merged in-memory map chunk ID -> location."""

    def __init__(self) -> None:
        self._map: dict[bytes, ChunkLocation] = {}
        self.packs: set[bytes] = set()  # every pack some index object names

    def __contains__(self, chunk_id: bytes) -> bool:
        return chunk_id in self._map

    def __len__(self) -> int:
        return len(self._map)

    def get(self, chunk_id: bytes) -> ChunkLocation | None:
        return self._map.get(chunk_id)

    def add_pack(self, pack_id: bytes, entries: list[PackEntry]) -> None:
        self.packs.add(pack_id)
        for e in entries:
            self._map.setdefault(e.chunk_id, ChunkLocation(pack_id, e.offset, e.stored_len, e.raw_len))

    def items(self):
        return self._map.items()
