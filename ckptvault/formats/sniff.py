"""Which format a file is in, from its first bytes (names can lie; headers cannot)."""

from __future__ import annotations

import struct
import zipfile

from ..errors import FileFormatError
from . import npy, safetensors, torchzip
from .model import FileLayout, ReadAt
from .zipmembers import ReadAtFile, members
from .zipmembers import looks_like as looks_like_zip

HEAD = 16


# What parsing a crafted or damaged header can raise beyond the checks of the parsers: a header is
# untrusted input, and one the parsers did not foresee is damage too, never a failed backup or a crash.
_PARSE_ERRORS = (
    ValueError, TypeError, KeyError, IndexError, AttributeError, NotImplementedError, EOFError,
    OverflowError, RecursionError, struct.error,
)  # fmt: skip


def read_layout(read_at: ReadAt, size: int, name: str = "file") -> FileLayout | None:
    """The layout of a safetensors, .npy, .npz or torch zip file; None for anything else.

    Raises FileFormatError when a file starts like one of them but its header is damaged."""
    try:
        return _read_layout(read_at, size, name)
    except _PARSE_ERRORS as exc:
        raise FileFormatError(name, f"has a header that does not parse ({type(exc).__name__}: {exc})") from None


def _read_layout(read_at: ReadAt, size: int, name: str) -> FileLayout | None:
    head = read_at(0, min(HEAD, size)) if size else b""
    if safetensors.looks_like(head, size):
        return safetensors.parse(read_at, size, name)
    if npy.looks_like(head):
        return npy.parse_npy(read_at, size, name)
    if not head.startswith(b"PK\x03\x04"):
        return None
    found = members(read_at, size, name)
    names = [m.name for m in found]
    if torchzip.looks_like(names):
        return torchzip.parse(read_at, size, name, found)
    if names and all(n.endswith(".npy") for n in names):
        return npy.parse_npz(read_at, size, name, found)
    return None


def not_whole(read_at: ReadAt, size: int) -> str | None:
    """Why a file whose format says where it ends (a zip archive, as ``torch.save`` and numpy's
    ``savez`` write them, directory last; a safetensors file, its header first) is not whole, as a writer
    killed while saving it leaves it; None for a whole one, and for every other kind of file."""
    head = read_at(0, min(HEAD, size)) if size else b""
    try:
        if looks_like_zip(head):
            if not zipfile.is_zipfile(ReadAtFile(read_at, size)):  # no end-of-directory record
                return "it has no zip directory at its end, which torch.save and numpy write last"
            members(read_at, size)
        elif len(head) >= 9 and head[8:9] == b"{":
            (n,) = struct.unpack_from("<Q", head)
            if 2 <= n <= safetensors.MAX_HEADER:  # the length of a safetensors header, then its JSON
                safetensors.parse(read_at, size)
    except FileFormatError as exc:
        return exc.reason
    except _PARSE_ERRORS as exc:
        return f"its header does not parse ({type(exc).__name__}: {exc})"
    return None
