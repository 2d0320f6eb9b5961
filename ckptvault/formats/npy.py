"""``.npy`` headers (magic, version, a Python-literal dict) and ``.npz`` archives of them."""

from __future__ import annotations

import ast
import math
import struct

from ..errors import FileFormatError
from .dtypes import NUMPY_NAMES
from .model import FileLayout, ReadAt, TensorInfo
from .zipmembers import ZipMember, members

MAGIC = b"\x93NUMPY"
MAX_HEADER = 1024 * 1024


def looks_like(head: bytes) -> bool:
    return head[:6] == MAGIC


def _dtype_name(descr: object) -> tuple[str, int]:
    """(our dtype name, bytes per element); structured and object dtypes keep numpy's name."""
    import numpy as np  # loaded by the first .npy file read, not by every command

    try:
        dt = np.lib.format.descr_to_dtype(descr)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"unknown dtype {descr!r} ({exc})") from None
    if dt.byteorder == ">":
        return f"{dt.str} (big-endian)", dt.itemsize
    return NUMPY_NAMES.get(dt.name, dt.str if dt.fields is None else "structured"), dt.itemsize


def parse_array(read_at: ReadAt, start: int, size: int, tensor_name: str, name: str) -> TensorInfo:
    """One .npy image stored at ``start`` (the whole file, or an npz member) of ``size`` bytes."""
    head = read_at(start, 12)
    if len(head) < 10 or head[:6] != MAGIC:
        raise FileFormatError(name, f"{tensor_name}: not an .npy array (bad magic)")
    major = head[6]
    if major == 1:
        (hlen,), hstart = struct.unpack_from("<H", head, 8), 10
    elif major in (2, 3):
        (hlen,), hstart = struct.unpack_from("<I", head, 8), 12
    else:
        raise FileFormatError(name, f"{tensor_name}: .npy version {major} is not supported")
    if hlen > MAX_HEADER or hstart + hlen > size:
        raise FileFormatError(name, f"{tensor_name}: .npy header length {hlen} does not fit")
    try:
        text = read_at(start + hstart, hlen).decode("utf-8" if major == 3 else "latin1")
        header = ast.literal_eval(text)  # a literal only: never code
        shape = tuple(int(d) for d in header["shape"])
        dtype, itemsize = _dtype_name(header["descr"])
    except (ValueError, SyntaxError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise FileFormatError(name, f"{tensor_name}: .npy header does not parse ({exc})") from None
    data = start + hstart + hlen
    nbytes = math.prod(shape) * itemsize
    if dtype != "|O" and data + nbytes > start + size:
        raise FileFormatError(name, f"{tensor_name}: {nbytes} bytes of data do not fit the file")
    return TensorInfo(tensor_name, dtype, shape, data, data + nbytes if dtype != "|O" else start + size)


def parse_npy(read_at: ReadAt, size: int, name: str = "file") -> FileLayout:
    tensor = parse_array(read_at, 0, size, "array", name)
    return FileLayout("npy", tensor.start, (tensor,))


def parse_npz(read_at: ReadAt, size: int, name: str = "file", zip_members: list[ZipMember] | None = None) -> FileLayout:
    """Arrays of stored (uncompressed) members; compressed members are listed with dtype "?"."""
    tensors = []
    for m in zip_members if zip_members is not None else members(read_at, size, name):
        key = m.name.removesuffix(".npy")
        if m.stored:
            tensors.append(parse_array(read_at, m.start, m.size, key, name))
        else:
            tensors.append(TensorInfo(key, "?", None, m.start, m.start + m.size))
    return FileLayout("npz", size, tuple(sorted(tensors, key=lambda t: t.start)))
