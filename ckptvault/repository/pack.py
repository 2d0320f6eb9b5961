"""Pack byte layout (no I/O): many chunk blobs in one object, a sealed header at the end.

    pack     = blob_0 | blob_1 | ... | blob_n-1 | header_blob | header_len:u32le | magic
    magic "CVP1": header = n x (chunk_id:32 | offset:u32le | stored_len:u32le | raw_len:u32le)
    magic "CVP2": header = n x (chunk_id:32 | offset:u32le | stored_len:u32le | raw_len:u32le | base_id:32)

A v2 entry names the chunk's delta base (32 zero bytes: none), so garbage collection and
``check`` learn which chunks a delta needs without decoding it. A pack is written as v2 only when
one of its chunks has a base, so repositories without delta coding keep writing exactly v1.
The index normally tells where a chunk lives; the header makes every pack self-describing,
so `check` can verify packs against the index and a lost index can be rebuilt.
"""

from __future__ import annotations

import mmap
import struct
import sys
from dataclasses import dataclass

from ..blob import MAX_METADATA_BLOB, BlobCodec, BlobParts, Kind, blob_size
from ..errors import MalformedObjectError
from ..memcopy import copy_into
from .format import PACK_MAGIC, PACK_MAGIC_V2

ENTRY = struct.Struct("<32sIII")
ENTRY_V2 = struct.Struct("<32sIII32s")
TRAILER = struct.Struct("<I4s")


def lies_whole_in(offset: int, stored_len: int, pack_size: int) -> bool:
    """Whether a chunk at ``offset`` fits in a pack of ``pack_size`` bytes (before its trailer): not
    when the pack was cut short (a truncated upload, a damaged disk)."""
    return offset + stored_len <= pack_size - TRAILER.size


NO_BASE = bytes(32)
_MAGICS = {PACK_MAGIC: 1, PACK_MAGIC_V2: 2}


@dataclass(frozen=True, slots=True)
class PackEntry:
    chunk_id: bytes
    offset: int
    stored_len: int
    raw_len: int
    base_id: bytes | None = None  # the delta base this chunk's blob is coded against (codec 3)


def entry_version(entries: list[PackEntry]) -> int:
    """The entry layout a set of entries needs: 2 when one of them has a base."""
    return 2 if any(e.base_id for e in entries) else 1


def pack_entry(e: PackEntry, version: int) -> bytes:
    if version == 1:
        return ENTRY.pack(e.chunk_id, e.offset, e.stored_len, e.raw_len)
    return ENTRY_V2.pack(e.chunk_id, e.offset, e.stored_len, e.raw_len, e.base_id or NO_BASE)


def encode_entries(entries: list[PackEntry], version: int = 1) -> bytes:
    return b"".join(pack_entry(e, version) for e in entries)


def decode_entries(raw: bytes | memoryview, version: int = 1) -> list[PackEntry]:
    layout = ENTRY if version == 1 else ENTRY_V2
    if len(raw) % layout.size:
        raise MalformedObjectError("pack entry table has a partial entry")
    if version == 1:
        return [PackEntry(*fields) for fields in ENTRY.iter_unpack(raw)]
    return [PackEntry(c, o, s, r, None if b == NO_BASE else b) for c, o, s, r, b in ENTRY_V2.iter_unpack(raw)]


def new_pack_buffer(size: int) -> bytearray | mmap.mmap:
    """A buffer for one pack. On Linux an anonymous private mapping: unlike a bytearray it is not
    zero-filled while holding the GIL (~50 ms for 16 MiB of fresh pages on this project's machine,
    a stall of a training thread that ships from its process), and mremap lets it grow. Elsewhere
    a mapping cannot be resized, so a bytearray."""
    if sys.platform.startswith("linux"):
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return bytearray(size)


def buffer_in_use(buffer: bytearray | mmap.mmap) -> bool:
    """Whether a view of ``buffer`` is alive (a PUT given up on may still be sending it): resizing
    is refused then. The test leaves its size and copies nothing (a same-size mremap; a bytearray
    keeps its memory when it shrinks by a byte, so growing it back reallocates nothing), but may
    zero a bytearray's last byte: for a spare buffer, whose bytes are overwritten."""
    try:
        if isinstance(buffer, mmap.mmap):
            buffer.resize(len(buffer))
        else:
            del buffer[-1]
            buffer.append(0)
    except BufferError:
        return True
    return False


class PackWriter:
    """Collects chunk blobs until the pack is big enough, then seals the header."""

    def __init__(self, buffer: bytearray | mmap.mmap | None = None) -> None:
        # One buffer sized for the whole pack (new_pack_buffer), each blob copied into it once, off
        # the GIL. The repository recycles them: a fresh one costs page faults, a reused one nothing.
        self.buffer = buffer if buffer is not None else bytearray()
        self.size = 0
        self.entries: list[PackEntry] = []

    def __len__(self) -> int:
        return self.size

    def _append(self, data: bytes | memoryview) -> None:
        end = self.size + len(data)
        if end > len(self.buffer):
            if isinstance(self.buffer, mmap.mmap):
                self.buffer.resize(end + len(self.buffer) // 8)
            else:
                self.buffer.extend(bytes(end - len(self.buffer)))
        copy_into(self.buffer, self.size, data)  # off the GIL: a training thread runs meanwhile
        self.size = end

    def add(self, chunk_id: bytes, blob: bytes | BlobParts, raw_len: int, base_id: bytes | None = None) -> PackEntry:
        parts = (blob,) if isinstance(blob, bytes | bytearray | memoryview) else blob
        entry = PackEntry(chunk_id, self.size, blob_size(parts), raw_len, base_id)
        for part in parts:
            self._append(part)
        self.entries.append(entry)
        return entry

    def finish(self, codec: BlobCodec, pack_id: bytes) -> memoryview:
        version = entry_version(self.entries)
        header = codec.encode(Kind.PACK_HEADER, pack_id, encode_entries(self.entries, version))
        self._append(header)
        self._append(TRAILER.pack(len(header), PACK_MAGIC if version == 1 else PACK_MAGIC_V2))
        return memoryview(self.buffer)[: self.size]


def header_range(trailer: bytes, pack_size: int) -> tuple[int, int]:
    """(start, length) of the header blob, from the pack's last TRAILER.size bytes."""
    if pack_size < TRAILER.size or len(trailer) != TRAILER.size:
        raise MalformedObjectError("pack is shorter than its trailer")
    header_len, _ = TRAILER.unpack(trailer)
    trailer_version(trailer)
    if header_len > MAX_METADATA_BLOB:  # a u32 from the clear trailer: up to 4 GiB read into memory
        raise MalformedObjectError(f"pack header length {header_len} is more than a header can be")
    start = pack_size - TRAILER.size - header_len
    if start < 0:
        raise MalformedObjectError("pack header length points before the start of the pack")
    return start, header_len


def trailer_version(trailer: bytes) -> int:
    """The header's entry layout (1 or 2), from the trailer's magic."""
    version = _MAGICS.get(bytes(trailer[-4:]))
    if version is None:
        raise MalformedObjectError("pack trailer magic is wrong")
    return version


def decode_header(
    codec: BlobCodec, pack_id: bytes, header_blob: bytes | memoryview, data_end: int, version: int = 1
) -> list[PackEntry]:
    """Verify and parse a header blob; every entry must lie before ``data_end``."""
    entries = decode_entries(codec.decode(Kind.PACK_HEADER, pack_id, header_blob), version)
    for e in entries:
        if e.offset + e.stored_len > data_end:
            raise MalformedObjectError(f"pack header entry for chunk {e.chunk_id.hex()[:12]} points past the data")
    return entries


def read_pack_header(codec: BlobCodec, pack_id: bytes, pack: bytes | memoryview) -> list[PackEntry]:
    """Parse and verify the header of a whole pack held in memory."""
    view = memoryview(pack)
    trailer = bytes(view[len(view) - TRAILER.size :])
    start, length = header_range(trailer, len(view))
    return decode_header(codec, pack_id, view[start : start + length], start, trailer_version(trailer))
