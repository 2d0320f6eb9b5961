"""What a parsed header describes: tensors as byte ranges of the file."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from .dtypes import element_width

ReadAt = Callable[[int, int], bytes]  # (offset, length) -> exactly those bytes, or fewer at EOF


def pread_at(fd: int) -> ReadAt:
    """``ReadAt`` over an open file: positioned reads, so one descriptor serves every reader of it."""
    return lambda offset, length: os.pread(fd, length, offset)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors vocabulary (F32, BF16, ...); "?" when the header does not say
    shape: tuple[int, ...] | None  # None when unknown
    start: int  # absolute byte offset of the first element in the file
    end: int  # one past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def width(self) -> int:
        """Element width for byte grouping; 0 when unknown."""
        return element_width(self.dtype)


@dataclass(frozen=True)
class FileLayout:
    format: str  # "safetensors" | "npy" | "npz" | "torch"
    header_end: int  # the header (everything needed to list the tensors) lies in [0, header_end)
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str] = field(default_factory=dict)

    def tensor(self, name: str) -> TensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)
