"""Pack byte layout (no I/O): many chunk blobs in one object, a sealed header at the end.

    pack    = blob_0 | blob_1 | ... | blob_n-1 | header_blob | header_len:u32le | "CVP1"
    header  = n x (chunk_id:32 | offset:u32le | stored_len:u32le | raw_len:u32le)

The index normally tells where a chunk lives; the header makes every pack self-describing,
so `check` can verify packs against the index and a lost index can be rebuilt.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..blob import BlobCodec, Kind
from ..errors import MalformedObjectError
from .format import PACK_MAGIC

ENTRY = struct.Struct("<32sIII")
TRAILER = struct.Struct("<I4s")


@dataclass(frozen=True, slots=True)
class PackEntry:
    chunk_id: bytes
    offset: int
    stored_len: int
    raw_len: int


def encode_entries(entries: list[PackEntry]) -> bytes:
    return b"".join(ENTRY.pack(e.chunk_id, e.offset, e.stored_len, e.raw_len) for e in entries)


def decode_entries(raw: bytes | memoryview) -> list[PackEntry]:
    if len(raw) % ENTRY.size:
        raise MalformedObjectError("pack entry table has a partial entry")
    return [PackEntry(*fields) for fields in ENTRY.iter_unpack(raw)]


class PackWriter:
    """Collects chunk blobs until the pack is big enough, then seals the header."""

    def __init__(self, capacity: int = 0) -> None:
        # One buffer sized for the whole pack up front (calloc: untouched pages cost nothing): each
        # blob is copied once, and there is never a second copy of the pack, as growing would make.
        self.buffer = bytearray(capacity)
        self.size = 0
        self.entries: list[PackEntry] = []

    def __len__(self) -> int:
        return self.size

    def _append(self, data: bytes) -> None:
        end = self.size + len(data)
        self.buffer[self.size : end] = data  # overwrites the reserved zeros, or appends past them
        self.size = end

    def add(self, chunk_id: bytes, blob: bytes, raw_len: int) -> PackEntry:
        entry = PackEntry(chunk_id, self.size, len(blob), raw_len)
        self._append(blob)
        self.entries.append(entry)
        return entry

    def finish(self, codec: BlobCodec, pack_id: bytes) -> memoryview:
        header = codec.encode(Kind.PACK_HEADER, pack_id, encode_entries(self.entries))
        self._append(header)
        self._append(TRAILER.pack(len(header), PACK_MAGIC))
        return memoryview(self.buffer)[: self.size]


def header_range(trailer: bytes, pack_size: int) -> tuple[int, int]:
    """(start, length) of the header blob, from the pack's last TRAILER.size bytes."""
    if pack_size < TRAILER.size or len(trailer) != TRAILER.size:
        raise MalformedObjectError("pack is shorter than its trailer")
    header_len, magic = TRAILER.unpack(trailer)
    if magic != PACK_MAGIC:
        raise MalformedObjectError("pack trailer magic is wrong")
    start = pack_size - TRAILER.size - header_len
    if start < 0:
        raise MalformedObjectError("pack header length points before the start of the pack")
    return start, header_len


def decode_header(codec: BlobCodec, pack_id: bytes, header_blob: bytes | memoryview, data_end: int) -> list[PackEntry]:
    """Verify and parse a header blob; every entry must lie before ``data_end``."""
    entries = decode_entries(codec.decode(Kind.PACK_HEADER, pack_id, header_blob))
    for e in entries:
        if e.offset + e.stored_len > data_end:
            raise MalformedObjectError(f"pack header entry for chunk {e.chunk_id.hex()[:12]} points past the data")
    return entries


def read_pack_header(codec: BlobCodec, pack_id: bytes, pack: bytes | memoryview) -> list[PackEntry]:
    """Parse and verify the header of a whole pack held in memory."""
    view = memoryview(pack)
    start, length = header_range(bytes(view[len(view) - TRAILER.size :]), len(view))
    return decode_header(codec, pack_id, view[start : start + length], start)
