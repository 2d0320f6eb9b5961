"""Per-tensor statistics (min, max, mean, std, NaN count) computed piece by piece.

Memory stays bounded by one piece whatever the tensor's size: each piece gives (count, mean, M2)
over its finite values, and pieces are combined with Chan's parallel formula, which stays exact
where summing squares in float64 would lose digits on large tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..formats import TensorInfo

if TYPE_CHECKING:
    import numpy as np

PIECE = 16 * 1024 * 1024

# numpy's name of each dtype it has (native byte order, as the stored bytes are read on this host);
# numpy itself is loaded on the first statistics asked for, not by every command
_NUMPY = {
    "BOOL": "?",
    "U8": "u1",
    "I8": "i1",
    "I16": "i2",
    "U16": "u2",
    "F16": "f2",
    "BF16": "u2",  # widened to float32 below
    "I32": "i4",
    "U32": "u4",
    "F32": "f4",
    "I64": "i8",
    "U64": "u8",
    "F64": "f8",
}


@dataclass(frozen=True)
class TensorStats:
    min: float | None  # over finite values; None when there are none
    max: float | None
    mean: float | None
    std: float | None  # population standard deviation
    nan: int
    inf: int
    count: int


def supported(dtype: str) -> bool:
    return dtype in _NUMPY


def _values(raw: bytes, dtype: str) -> np.ndarray:
    import numpy as np

    arr: np.ndarray = np.frombuffer(raw, dtype=_NUMPY[dtype])
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


def tensor_stats(tensor: TensorInfo, read_at: Callable[[int, int], bytes]) -> TensorStats | None:
    """Statistics of one tensor, reading its bytes through ``read_at``; None for dtypes numpy lacks."""
    if not supported(tensor.dtype):
        return None
    import numpy as np

    itemsize = np.dtype(_NUMPY[tensor.dtype]).itemsize
    step = PIECE - PIECE % itemsize
    # mean and m2 are kept in units of ``scale`` (the largest magnitude so far), so that values near
    # the dtype's limits (float64 up to 1.8e308) cannot overflow their sums
    n, mean, m2, scale = 0, 0.0, 0.0, 0.0
    lo, hi = math.inf, -math.inf
    nan = inf = 0
    for pos in range(tensor.start, tensor.end, step):
        x = _values(read_at(pos, min(step, tensor.end - pos)), tensor.dtype)
        if x.dtype.kind == "f":
            finite = np.isfinite(x)
            nan += int(np.isnan(x).sum())
            inf += int(x.size - finite.sum()) - int(np.isnan(x).sum())
            x = x[finite]
        if x.size == 0:
            continue
        x64 = x.astype(np.float64)
        lo, hi = min(lo, float(x64.min())), max(hi, float(x64.max()))
        if max(-lo, hi) > scale:
            new_scale = max(-lo, hi)
            mean, m2, scale = mean * (scale / new_scale), m2 * (scale / new_scale) ** 2, new_scale
        y = x64 / scale if scale else x64
        k, piece_mean = y.size, float(y.mean())
        piece_m2 = float(((y - piece_mean) ** 2).sum())
        total = n + k
        delta = piece_mean - mean
        mean += delta * k / total
        m2 += piece_m2 + delta * delta * n * k / total
        n = total
    if n == 0:
        return TensorStats(None, None, None, None, nan, inf, 0)
    unit = scale or 1.0
    return TensorStats(lo, hi, mean * unit, math.sqrt(m2 / n) * unit, nan, inf, n)
