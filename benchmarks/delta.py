#!/usr/bin/env python3
"""What delta coding (codec 3) can gain on a series of saves, and which chain policy to use.

For every tensor piece (the repository's default 1 MiB, aligned to the tensor's start) that changed
between save 1 and save 2 of a workload made by make_workload.py, this codes the piece as the backup
would (byte-grouped zstd, ckptvault's own Compressor) three ways: whole ("plain"), XOR the same piece
of the previous save ("vs previous", what a chain of deltas stores), and XOR the piece of save 1 ("vs
keyframe", what coding always against a keyframe stores). Per save k it prints the stored share of the
raw bytes for each, then what each policy stores per save on average over a run of the given length:

- chain, max depth D: a keyframe every D + 1 saves, every other save a delta against the previous one;
  restoring the newest save decodes up to D + 1 blobs per piece;
- keyframe, interval n: a keyframe every n saves, the others deltas against it; any restore decodes at
  most 2 blobs per piece.

It also reports the order-0 entropy of the optimizer's exp_avg records, which make_workload draws
afresh at every save: no lossless coder can store them in fewer bytes than that.

    python benchmarks/delta.py WORK/workload            # saves step-1000, step-2000, ...
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from ckptvault.bytegroup import ElementRun
from ckptvault.codec import CompressionSettings, Compressor
from ckptvault.formats import read_layout

PIECE = 1 << 20


def load(path: str) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint8)


def coded(comp: Compressor, data: np.ndarray, width: int) -> int:
    n = len(data) - len(data) % width
    return len(comp.compress(data.data, [ElementRun(0, n, width)] if width > 1 else [])[1])


def drift(saves: list[np.ndarray], comp: Compressor) -> dict[str, list[tuple[int, int, int, int]]]:
    """dtype -> per save k >= 2: (raw, plain, vs previous, vs keyframe) bytes of the changed pieces."""
    first = saves[0]
    layout = read_layout(lambda o, n: first[o : o + n].tobytes(), len(first), "model.safetensors")
    out: dict[str, list[list[int]]] = {}
    for t in layout.tensors:
        if t.width == 0 or t.nbytes < (1 << 18):
            continue
        rows = out.setdefault(t.dtype, [[0, 0, 0, 0] for _ in saves[1:]])
        for a in range(t.start, t.end, PIECE):
            b = min(a + PIECE, t.end)
            pieces = [s[a:b] for s in saves]
            if np.array_equal(pieces[0], pieces[1]):
                continue  # frozen: deduplicated, no coding at all
            for k in range(1, len(saves)):
                row = rows[k - 1]
                row[0] += b - a
                row[1] += coded(comp, pieces[k], t.width)
                row[2] += coded(comp, np.bitwise_xor(pieces[k - 1], pieces[k]), t.width)
                row[3] += coded(comp, np.bitwise_xor(pieces[0], pieces[k]), t.width)
    return {d: [tuple(r) for r in rows] for d, rows in out.items()}  # type: ignore[misc]


def policies(rows: list[tuple[int, int, int, int]], run: int) -> dict[str, float]:
    """Average stored share per save over ``run`` saves for each policy, assuming the per-distance
    costs measured here (deltas against a keyframe k saves back cost like rows[k - 1])."""
    raw = rows[0][0]
    plain = sum(r[1] for r in rows) / len(rows) / raw
    prev = sum(r[2] for r in rows) / len(rows) / raw
    key = [r[3] / raw for r in rows]
    out = {}
    for depth in (1, 2, 3, 7):
        out[f"chain depth {depth}"] = (plain + depth * prev) / (depth + 1)
    for n in (2, 4, 8, len(rows) + 1):
        if n - 1 <= len(key):
            out[f"keyframe every {n}"] = (plain + sum(key[: n - 1])) / n
    return out


def optimizer_codings(prev_path: str, path: str, comp: Compressor) -> tuple[int, int, int]:
    """(raw, plain, XOR with the previous save) bytes of the optimizer's changed 1 MiB record pieces."""
    prev, data = load(prev_path), load(path)
    layout = read_layout(lambda o, n: data[o : o + n].tobytes(), len(data), "optimizer.pt")
    raw = plain = delta = 0
    for t in layout.tensors:
        if t.nbytes < (1 << 18):
            continue
        middle = t.start + (t.nbytes - 65536) // 2
        width = comp.best_width(data[middle - middle % 8 : middle - middle % 8 + 65536].data)
        for a in range(t.start, t.end, PIECE):
            b = min(a + PIECE, t.end)
            if np.array_equal(prev[a:b], data[a:b]):
                continue
            raw += b - a
            plain += coded(comp, data[a:b], width)
            delta += coded(comp, np.bitwise_xor(prev[a:b], data[a:b]), width)
    return raw, plain, delta


def exp_avg_entropy(path: str) -> tuple[int, float]:
    """(bytes, order-0 entropy in bytes) of the optimizer's exp_avg records (make_workload's layout:
    per parameter a step record, then exp_avg, then exp_avg_sq)."""
    data = load(path)
    layout = read_layout(lambda o, n: data[o : o + n].tobytes(), len(data), "optimizer.pt")
    records = sorted((t for t in layout.tensors if t.name.startswith("storage ")), key=lambda t: int(t.name.split()[1]))
    raw = bits = 0
    comp = Compressor(CompressionSettings())
    for t in records[1::3]:
        body = data[t.start : t.end]
        middle = len(body) // 2 - (len(body) // 2) % 8
        width = comp.best_width(body[middle : middle + 65536].data)
        if width == 2:
            values = body.view(np.uint16)
            h = _entropy(values)
        else:  # F32: the top 16 bits counted, the low 16 mantissa bits taken as uniform (16 bits)
            h = _entropy(body.view(np.uint32) >> 16) + 16
        raw += len(body)
        bits += h * len(body) / width
    return raw, bits / 8


def _entropy(values: np.ndarray) -> float:
    counts = np.bincount(values.astype(np.int64))
    p = counts[counts > 0] / len(values)
    return float(-(p * np.log2(p)).sum())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", help="a make_workload.py output folder (step-1000, step-2000, ...)")
    a = ap.parse_args(argv)
    steps = sorted((d for d in os.listdir(a.workload) if d.startswith("step-")), key=lambda d: int(d[5:]))
    if len(steps) < 2:
        ap.error("need at least two saves")
    comp = Compressor(CompressionSettings())
    saves = [load(os.path.join(a.workload, s, "model.safetensors")) for s in steps]
    for dtype, rows in drift(saves, comp).items():
        raw = rows[0][0]
        print(f"\n{dtype}: {raw / 1e6:.1f} MB of changed tensor pieces per save (stored share of raw bytes)")
        print("| save | plain | vs previous | vs keyframe (save 1) |\n|---|---|---|---|")
        for k, (_, plain, prev, key) in enumerate(rows, start=2):
            print(f"| {k} | {plain / raw:.3f} | {prev / raw:.3f} | {key / raw:.3f} ({key / plain:.2f} of plain) |")
        print("| policy | average stored share per save |\n|---|---|")
        for name, share in policies(rows, len(saves)).items():
            print(f"| {name} | {share:.3f} |")
    opt = os.path.join(a.workload, steps[1], "optimizer.pt")
    raw, plain, delta = optimizer_codings(os.path.join(a.workload, steps[0], "optimizer.pt"), opt, comp)
    print(
        f"\noptimizer.pt of {steps[1]}: {raw / 1e6:.1f} MB changed; plain {plain / 1e6:.1f} MB ({raw / plain:.3f}x), "
        f"XOR with {steps[0]} {delta / 1e6:.1f} MB ({raw / delta:.3f}x)"
    )
    raw, floor = exp_avg_entropy(opt)
    print(f"optimizer exp_avg records of {steps[1]}: {raw / 1e6:.1f} MB, order-0 entropy {floor / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
