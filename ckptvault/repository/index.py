"""Index objects: which pack holds each chunk, where, and how big it is.

    v1: index = n_packs:u32le | n_packs x (pack_id:32 | n_entries:u32le | n_entries x v1 pack entry)
    v2: index = "CVI2" | n_packs:u32le | n_packs x (pack_id:32 | n_entries:u32le | n_entries x v2 pack entry)

v2 entries also name each chunk's delta base (pack.py), which is how garbage collection keeps a
base alive without decoding any chunk. An index object is written as v2 only when one of its
entries has a base. Several index objects may list the same chunk (two backups that raced); any
of them is valid since both packs hold the same verified bytes, and a reader falls back from one
copy to the next when a pack is missing or damaged.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, ItemsView
from dataclasses import dataclass

from ..errors import MalformedObjectError
from .format import INDEX_MAGIC_V2
from .pack import ENTRY, ENTRY_V2, PackEntry, decode_entries, entry_version, lies_whole_in, pack_entry

_COUNT = struct.Struct("<I")
_PACK = struct.Struct("<32sI")


@dataclass(frozen=True, slots=True)
class ChunkLocation:
    pack_id: bytes
    offset: int
    stored_len: int
    raw_len: int
    base_id: bytes | None = None  # the delta base the stored blob needs (codec 3), else None


def encode_index(packs: dict[bytes, list[PackEntry]]) -> bytes:
    version = max((entry_version(entries) for entries in packs.values()), default=1)
    parts = [INDEX_MAGIC_V2] if version == 2 else []
    parts.append(_COUNT.pack(len(packs)))
    for pack_id, entries in packs.items():
        parts.append(_PACK.pack(pack_id, len(entries)))
        parts.extend(pack_entry(e, version) for e in entries)
    return b"".join(parts)


def decode_index(raw: bytes | memoryview) -> dict[bytes, list[PackEntry]]:
    view = memoryview(raw)
    version, pos = (2, len(INDEX_MAGIC_V2)) if view[: len(INDEX_MAGIC_V2)] == INDEX_MAGIC_V2 else (1, 0)
    entry_size = (ENTRY if version == 1 else ENTRY_V2).size
    try:
        (n_packs,) = _COUNT.unpack_from(view, pos)
        pos += _COUNT.size
        packs: dict[bytes, list[PackEntry]] = {}
        for _ in range(n_packs):
            pack_id, n = _PACK.unpack_from(view, pos)
            pos += _PACK.size
            end = pos + n * entry_size
            if end > len(view):
                raise MalformedObjectError("index object is truncated")
            packs[pack_id] = decode_entries(view[pos:end], version)
            pos = end
    except struct.error as exc:
        raise MalformedObjectError(f"index object is truncated ({exc})") from exc
    if pos != len(view):
        raise MalformedObjectError("index object has trailing bytes")
    return packs


class ChunkIndex:
    """The merged in-memory map chunk ID -> location."""

    def __init__(self) -> None:
        self._map: dict[bytes, ChunkLocation] = {}
        # further copies of a chunk in other packs (rare: two backups that raced, a chunk stored again
        # because its pack was gone): a reader falls back to them when a copy is missing or damaged
        self._other_copies: dict[bytes, list[ChunkLocation]] = {}
        self.packs: set[bytes] = set()  # every pack some index object names
        self._pack_ends: dict[bytes, int] = {}  # pack -> where its last indexed chunk ends
        # deltas left out because their base is in no pack here: back in once it is (readmit_deltas)
        self._without_base: dict[bytes, list[ChunkLocation]] = {}

    def __contains__(self, chunk_id: bytes) -> bool:
        return chunk_id in self._map

    def __len__(self) -> int:
        return len(self._map)

    def get(self, chunk_id: bytes) -> ChunkLocation | None:
        return self._map.get(chunk_id)

    def add_pack(self, pack_id: bytes, entries: list[PackEntry]) -> None:
        """The first location seen wins, except that a copy stored without a base replaces one coded
        as a delta: reading it costs one decode, and (when two backups raced and coded the same
        chunks against each other's copies) it is what keeps a chain of bases from looping."""
        self.packs.add(pack_id)
        if entries:
            end = max(e.offset + e.stored_len for e in entries)
            self._pack_ends[pack_id] = max(end, self._pack_ends.get(pack_id, 0))
        for e in entries:
            new = ChunkLocation(pack_id, e.offset, e.stored_len, e.raw_len, e.base_id)
            old = self._map.get(e.chunk_id)
            if old is None:
                self._map[e.chunk_id] = new
                continue
            if old.pack_id == pack_id or any(o.pack_id == pack_id for o in self._other_copies.get(e.chunk_id, ())):
                continue  # the same copy, named by two index objects (a prune's consolidated one, say)
            if old.base_id is not None and e.base_id is None:
                self._map[e.chunk_id], new = new, old
            self._other_copies.setdefault(e.chunk_id, []).append(new)

    def locations(self, chunk_id: bytes) -> list[ChunkLocation]:
        """Every known copy of the chunk, the preferred one first; [] when it is in no index."""
        first = self._map.get(chunk_id)
        return [] if first is None else [first, *self._other_copies.get(chunk_id, ())]

    def forget_packs(self, pack_ids: Collection[bytes]) -> None:
        """Leave out every copy held by these packs (gone from the store): a chunk with a copy
        elsewhere keeps that one (a plain copy first), and deltas left without a base go too."""
        gone = set(pack_ids)
        self.packs -= gone
        for pack_id in gone:
            self._pack_ends.pop(pack_id, None)
        for chunk_id in [c for c, loc in list(self._map.items()) if loc.pack_id in gone]:
            del self._map[chunk_id]
        self._without_base = {
            c: kept for c, held in self._without_base.items() if (kept := [h for h in held if h.pack_id not in gone])
        }
        for chunk_id in list(self._other_copies):
            kept = sorted((o for o in self._other_copies.pop(chunk_id) if o.pack_id not in gone), key=_delta_last)
            if chunk_id not in self._map and kept:
                self._map[chunk_id], *kept = kept
            if kept:
                self._other_copies[chunk_id] = kept
        self.drop_deltas_without_base()

    def packs_shorter_than_indexed(self, sizes: dict[bytes, int]) -> set[bytes]:
        """Packs (of those in ``sizes``: pack ID -> stored bytes) that end before a chunk the index
        places in them: cut short (a truncated upload, a damaged disk)."""
        return {p for p, end in self._pack_ends.items() if p in sizes and not lies_whole_in(0, end, sizes[p])}

    def drop_deltas_without_base(self) -> None:
        """Leave out every delta chunk whose base (at any depth) is in no pack here."""
        while orphans := [
            c for c, loc in self._map.items() if loc.base_id is not None and loc.base_id not in self._map
        ]:
            for chunk_id in orphans:
                held = [self._map.pop(chunk_id), *self._other_copies.pop(chunk_id, ())]
                self._without_base.setdefault(chunk_id, []).extend(held)

    def readmit_deltas(self) -> None:
        """Deltas left out for a missing base whose base is here now (its pack read by its own header,
        or named by an index object merged since): back in, so they read again. Then every delta whose
        chain of bases is still broken is left out (packs read by their headers were not checked)."""
        while ready := [c for c, held in self._without_base.items() if any(h.base_id in self._map for h in held)]:
            for chunk_id in ready:
                held = self._without_base.pop(chunk_id)
                if still := [h for h in held if h.base_id not in self._map]:
                    self._without_base[chunk_id] = still
                for loc in (h for h in held if h.base_id in self._map):
                    if chunk_id not in self._map:
                        self._map[chunk_id] = loc
                    elif loc.pack_id not in {known.pack_id for known in self.locations(chunk_id)}:
                        self._other_copies.setdefault(chunk_id, []).append(loc)
        self.drop_deltas_without_base()

    def items(self) -> ItemsView[bytes, ChunkLocation]:
        return self._map.items()


def _delta_last(loc: ChunkLocation) -> bool:
    return loc.base_id is not None
