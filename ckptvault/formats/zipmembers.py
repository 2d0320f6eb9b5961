"""Where each member of a zip archive (npz, torch.save) keeps its bytes, through ``zipfile``.

``zipfile`` reads the central directory (ZIP64 included) through a small file object over
``read_at``; the data offset of a member is then its local header's offset plus that header's
30 fixed bytes, name and extra field (which PyTorch uses to pad records to 64 bytes).
"""

from __future__ import annotations

import io
import struct
import zipfile
from dataclasses import dataclass

from ..errors import FileFormatError
from .model import ReadAt

_LOCAL = struct.Struct("<4s2B4HL2L2H")  # zipfile's own sizeFileHeader layout (30 bytes)
_LOCAL_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class ZipMember:
    name: str
    start: int  # absolute offset of the member's (stored) data
    size: int  # stored size
    stored: bool  # True when not compressed (ZIP_STORED): the bytes are the member's content


class ReadAtFile(io.RawIOBase):
    """A read-only, seekable file object over ``read_at``, for ``zipfile``."""

    def __init__(self, read_at: ReadAt, size: int) -> None:
        self._read_at = read_at
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = max(0, min(len(buffer), self._size - self._pos))
        data = self._read_at(self._pos, n) if n else b""
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


def looks_like(head: bytes) -> bool:
    return head[:4] == _LOCAL_MAGIC


def members(read_at: ReadAt, size: int, name: str = "file") -> list[ZipMember]:
    """Every member of the archive, in central-directory order."""
    try:
        with zipfile.ZipFile(io.BufferedReader(ReadAtFile(read_at, size), 64 * 1024)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, struct.error, NotImplementedError, EOFError) as exc:
        raise FileFormatError(name, f"is not a readable zip archive ({exc})") from None
    out = []
    for info in infos:
        local = read_at(info.header_offset, _LOCAL.size)
        if len(local) != _LOCAL.size or local[:4] != _LOCAL_MAGIC:
            raise FileFormatError(name, f"zip member {info.filename!r} has no local header at {info.header_offset}")
        fields = _LOCAL.unpack(local)
        start = info.header_offset + _LOCAL.size + fields[10] + fields[11]
        if start + info.compress_size > size:
            raise FileFormatError(name, f"zip member {info.filename!r} runs past the end of the file")
        out.append(ZipMember(info.filename, start, info.compress_size, info.compress_type == zipfile.ZIP_STORED))
    return out
