"""safetensors headers: ``u64le header_len | JSON header | tensor bytes``.

The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative
to the end of the header, plus an optional ``"__metadata__"`` of strings.
"""

from __future__ import annotations

import json
import math
import struct

from ..errors import FileFormatError
from .dtypes import DTYPES, item_size
from .model import FileLayout, ReadAt, TensorInfo

MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


def looks_like(head: bytes, size: int) -> bool:
    """First bytes: a plausible header length, then a JSON object."""
    if len(head) < 9:
        return False
    (n,) = struct.unpack_from("<Q", head)
    return 2 <= n <= min(MAX_HEADER, size - 8) and head[8:9] == b"{"


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse(read_at: ReadAt, size: int, name: str = "file") -> FileLayout:
    if size < 8:
        raise FileFormatError(name, "is too short to be a safetensors file")
    (n,) = struct.unpack("<Q", read_at(0, 8))
    if not 2 <= n <= MAX_HEADER or 8 + n > size:
        raise FileFormatError(name, f"safetensors header length {n} does not fit a {size}-byte file")
    raw = read_at(8, n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FileFormatError(name, f"safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise FileFormatError(name, "safetensors header is not a JSON object")
    base = 8 + n
    metadata = header.pop("__metadata__", None) or {}
    tensors = []
    for tname, spec in header.items():
        try:
            dtype, shape, (begin, end) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise FileFormatError(name, f"safetensors entry {tname!r} lacks dtype, shape or data_offsets") from None
        if not isinstance(dtype, str) or not isinstance(spec["shape"], list) or not all(_count(d) for d in shape):
            raise FileFormatError(
                name, f"safetensors entry {tname!r} has a malformed dtype {dtype!r} or shape {spec['shape']!r}"
            )
        if not (_count(begin) and _count(end) and begin <= end and base + end <= size):
            raise FileFormatError(name, f"tensor {tname!r} has data_offsets {begin}..{end} outside the file")
        if dtype in DTYPES and math.prod(shape) * item_size(dtype) != end - begin:
            raise FileFormatError(name, f"tensor {tname!r}: shape {list(shape)} of {dtype} is not {end - begin} bytes")
        tensors.append(TensorInfo(tname, str(dtype), shape, base + begin, base + end))
    tensors.sort(key=lambda t: t.start)
    meta = {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else {}
    return FileLayout("safetensors", base, tuple(tensors), meta)
