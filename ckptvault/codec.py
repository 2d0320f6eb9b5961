"""Compression codecs. A codec's ID is written into every blob, so IDs are never reused.

ID 0: raw (stored as is), ID 1: zstd, ID 2: bytegroup (dtype-aware byte grouping, then zstd per
stream; layout in ``bytegroup.py`` and docs/format.md), ID 3: delta (the chunk XOR another stored
chunk of the same length, its *base*, coded with one of IDs 0-2; docs/format.md "Codec 3").
``compress`` keeps whichever candidate is smallest and falls back to raw whenever nothing makes the
data smaller; ``compress_delta`` is only called by a writer that has the base's bytes at hand.
"""

from __future__ import annotations

import numbers
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zstandard

from . import bytegroup
from .bytegroup import ElementRun, Grouped, joined, xor
from .errors import IntegrityError, MalformedObjectError, UnsupportedFormatError, UsageError

CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_BYTEGROUP = 2
CODEC_DELTA = 3
MAX_DECODED_SIZE = 1 << 30  # no single blob (chunk, index, tree) decodes to more than 1 GiB
# Tombstones: none yet. A retired codec ID is listed here and never handed out again.

# Codec 3's payload starts with the base chunk's ID and the codec of the XORed bytes (0, 1 or 2: a
# delta never nests another delta inside one blob; chains go through the base chunk instead).
DELTA_HEAD = struct.Struct("<32sB")
DELTA_INNER = (CODEC_RAW, CODEC_ZSTD, CODEC_BYTEGROUP)

# base chunk ID -> its verified plaintext, or its streams where it is of codec 2 (``decompress_base``)
BaseReader = Callable[[bytes], bytes | memoryview | Grouped]

# Plain zstd is tried as well when grouping saved less than this fraction: data that is not
# float-like (repeats spanning whole elements) can do better ungrouped. Float tensors save more.
PLAIN_RETRY_SAVING = 0.10
PROBE_WIDTHS = (1, 2, 4, 8)

# Streams of grouped bytes have no long repeats; what pays is entropy coding. A tiny match table
# (hash_log 6) and min_match 7 make zstd spend its time on Huffman-coding literals: measured on
# BF16 exponent streams, 1.1 GB/s at ratio 2.94 versus 0.37 GB/s at 2.72 for level 1
# (benchmarks/codecs.py).
_STREAM_PARAMS = dict(
    window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0, strategy=zstandard.STRATEGY_FAST
)


@dataclass(frozen=True)
class CompressionSettings:
    codec: str = "zstd"
    level: int = 1  # measured: zstd-3 gains <0.1% over zstd-1 on checkpoint data at 1.3-3x the CPU
    bytegroup: bool = True  # group tensor bytes by element width where a file's header says it (codec 2)
    delta: bool = True  # code changed tensor pieces against the previous save's (codec 3; format version 2)

    def __post_init__(self) -> None:
        if self.codec not in ("zstd", "none"):
            raise UsageError(f"unknown compression {self.codec!r}; use zstd or none")
        if isinstance(self.level, numbers.Integral) and not isinstance(self.level, bool):
            object.__setattr__(self, "level", int(self.level))  # numpy's integers too, stored as a JSON number
        if self.codec == "zstd" and not -7 <= self.level <= 22:
            raise UsageError(f"compression level {self.level} is out of range for zstd; use -7..22")
        for flag in ("bytegroup", "delta"):  # fixed for the vault's life: "no" must not read as True
            if not isinstance(getattr(self, flag), bool):
                raise UsageError(f"CompressionSettings {flag} must be True or False; got {getattr(self, flag)!r}")

    def to_dict(self) -> dict[str, str | int | bool]:
        # frozen: an encrypted vault of format 3 authenticates this form of its config (docs/format.md)
        out: dict[str, str | int | bool] = {"codec": self.codec, "level": self.level, "bytegroup": self.bytegroup}
        if self.delta:  # only format-2 configs carry the key: a format-1 config stays byte-for-byte as before
            out["delta"] = True
        return out

    @classmethod
    def from_dict(cls, d: dict) -> CompressionSettings:
        # Repositories made before codec 2 have no "bytegroup" key: they keep writing plain zstd,
        # so an older ckptvault sharing the repository still reads everything new. Likewise a
        # config without "delta" (every repository made before codec 3) never gets delta chunks.
        return cls(
            codec=d["codec"],
            level=d["level"],
            bytegroup=bool(d.get("bytegroup", False)),
            delta=bool(d.get("delta", False)),
        )


class Compressor:
    """Thread-safe: each thread keeps its own zstd contexts (they are not shareable)."""

    def __init__(self, settings: CompressionSettings) -> None:
        self.settings = settings
        self._local = threading.local()

    def _contexts(self) -> tuple[zstandard.ZstdCompressor, zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = (
                zstandard.ZstdCompressor(level=self.settings.level),
                zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(**_STREAM_PARAMS)),
                zstandard.ZstdDecompressor(),
            )
            self._local.ctx = ctx
        return ctx

    @property
    def groups(self) -> bool:
        """Whether ``compress`` uses element runs (codec 2) at all."""
        return self.settings.codec != "none" and self.settings.bytegroup

    @property
    def deltas(self) -> bool:
        """Whether the writer codes tensor pieces against a base (codec 3)."""
        return self.settings.codec != "none" and self.settings.delta

    def compress_delta(
        self, data: bytes | memoryview, base: bytes | memoryview, base_id: bytes, runs: Sequence[ElementRun] = ()
    ) -> list[bytes | memoryview]:
        """Codec 3's payload, as parts (no copy of the coded bytes): ``data`` XOR ``base``, coded like
        any chunk (the XOR keeps element boundaries, so the same runs apply)."""
        codec, payload = self.compress(xor(data, base), runs)
        return [DELTA_HEAD.pack(base_id, codec), payload]

    def compress(self, data: bytes | memoryview, runs: Sequence[ElementRun] = ()) -> tuple[int, bytes | memoryview]:
        """Return (codec ID, payload). ``runs`` say where whole elements of a known width lie in
        ``data``; with them the grouped encoding is tried first (and plain zstd only when grouping
        saved little), without them plain zstd. Raw when nothing is smaller."""
        if self.settings.codec == "none" or len(data) == 0:
            return CODEC_RAW, data
        best: tuple[int, bytes | memoryview] = (CODEC_RAW, data)
        if runs and self.settings.bytegroup:
            grouped = self._grouped(data, bytegroup.segments(len(data), runs))
            if len(grouped) < len(data):
                best = (CODEC_BYTEGROUP, grouped)
            if len(grouped) <= len(data) * (1 - PLAIN_RETRY_SAVING):
                return best
        packed = self._contexts()[0].compress(data)
        if len(packed) < len(best[1]):
            best = (CODEC_ZSTD, packed)
        return best

    def _grouped(self, data: bytes | memoryview, segs: list[tuple[int, int]]) -> bytes | memoryview:
        plain, streams, _ = self._contexts()
        coded: list[tuple[int, bytes | memoryview]] = []
        for (width, _index), stream in zip(_stream_widths(segs), bytegroup.split(data, segs), strict=True):
            packed = (plain if width == 1 else streams).compress(stream)
            coded.append(
                (bytegroup.MODE_ZSTD, packed) if len(packed) < len(stream) else (bytegroup.MODE_STORED, stream)
            )
        return bytegroup.pack(segs, coded)

    def best_width(self, sample: bytes | memoryview) -> int:
        """The element width whose grouping compresses ``sample`` best (for tensor data whose
        dtype no header gives); 1 when grouping does not help."""
        usable = len(sample) - len(sample) % 8
        if usable < 8:
            return 1
        sizes = {}
        for width in PROBE_WIDTHS:
            run = [ElementRun(0, usable, width)] if width > 1 else []
            segs = bytegroup.segments(usable, run)
            sizes[width] = len(self._grouped(memoryview(sample)[:usable], segs))
        return min(PROBE_WIDTHS, key=lambda w: (sizes[w], w))

    def decompress(
        self, codec: int, payload: bytes | memoryview, raw_size: int | None = None, base: BaseReader | None = None
    ) -> bytes | memoryview:
        """``base`` fetches a delta's base chunk (codec 3 only; without it a delta does not decode)."""
        if codec == CODEC_RAW:
            return bytes(payload)
        if codec == CODEC_ZSTD:
            return self._zstd_decode(payload, raw_size, "zstd payload")
        if codec == CODEC_BYTEGROUP:
            return self._ungrouped(payload, raw_size).join()
        if codec == CODEC_DELTA:
            return self._undelta(payload, raw_size, base)
        # The codec byte sits inside the verified envelope: an ID this ckptvault does not know was
        # written by a newer one (or a bug), not by damage.
        raise UnsupportedFormatError(_unknown_codec(codec))

    def decompress_base(
        self, codec: int, payload: bytes | memoryview, raw_size: int | None = None, base: BaseReader | None = None
    ) -> bytes | memoryview | Grouped:
        """``decompress`` for a delta's base, whose plaintext no one reads: a codec-2 payload comes back
        as its streams, not joined."""
        if codec == CODEC_BYTEGROUP:
            return self._ungrouped(payload, raw_size)
        return self.decompress(codec, payload, raw_size, base)

    def _undelta(self, payload: bytes | memoryview, raw_size: int | None, base: BaseReader | None) -> memoryview:
        base_id, inner = delta_base(payload)
        if base is None or raw_size is None:
            raise IntegrityError(f"delta against chunk {base_id.hex()[:12]} cannot be decoded without its base")
        # first: a delta its index entry names no base for (or another) is damage, whatever its inner codec says
        base_data = base(base_id)  # raises IntegrityError naming the base when it is missing or damaged
        if inner == CODEC_DELTA:
            raise MalformedObjectError(f"delta payload names inner codec {inner} (a delta inside a delta)")
        if inner not in DELTA_INNER:
            raise UnsupportedFormatError(_unknown_codec(inner, "delta's inner codec"))
        xored = self.decompress_base(inner, memoryview(payload)[DELTA_HEAD.size :], raw_size)
        if len(base_data) != len(xored):
            raise IntegrityError(f"delta base {base_id.hex()[:12]} holds {len(base_data)} bytes, not {len(xored)}")
        if isinstance(xored, Grouped) and isinstance(base_data, Grouped) and xored.segs == base_data.segs:
            # the usual case (a tensor piece against the same piece of the previous save): one join
            pairs = zip(xored.streams, base_data.streams, strict=True)
            return bytegroup.join(xored.segs, [xor(a, b) for a, b in pairs])
        return xor(joined(xored), joined(base_data))

    def _zstd_decode(self, payload: bytes | memoryview, raw_size: int | None, what: str) -> bytes:
        try:
            # The frame declares its size; check it before zstd allocates it, so a damaged
            # or crafted blob cannot ask for gigabytes.
            declared = zstandard.frame_content_size(payload)
            limit = raw_size if raw_size is not None else MAX_DECODED_SIZE
            if declared < 0 or declared > limit or (raw_size is not None and declared != raw_size):
                raise IntegrityError(f"{what}: {_bad_frame_size(declared, raw_size)}")
            return self._contexts()[2].decompress(payload, max_output_size=max(declared, 1))
        except zstandard.ZstdError as exc:
            raise IntegrityError(f"{what} does not decode: {exc}") from exc

    def _ungrouped(self, payload: bytes | memoryview, raw_size: int | None) -> Grouped:
        segs, coded = bytegroup.unpack(payload)
        total = sum(n for _, n in segs)
        if total != (raw_size if raw_size is not None else total) or total > MAX_DECODED_SIZE:
            raise MalformedObjectError(f"bytegroup segments hold {total} bytes, not {raw_size}")
        streams: list[bytes | memoryview] = []
        for size, (mode, stored) in zip(bytegroup.stream_sizes(segs), coded, strict=True):
            body: bytes | memoryview = stored
            if mode == bytegroup.MODE_ZSTD:
                body = self._zstd_decode(stored, size, "bytegroup stream")
            if len(body) != size:
                raise MalformedObjectError(f"bytegroup stream holds {len(body)} bytes, not {size}")
            streams.append(body)
        return Grouped(segs, streams)


def _bad_frame_size(declared: int, raw_size: int | None) -> str:
    """Why a zstd frame's declared content size is refused (it said "declares -1 bytes, expected fewer" of a
    frame without one, and "expected fewer" of a chunk of 0 bytes)."""
    if declared < 0:  # frame_content_size: -1 for a frame without it (it raises ZstdError for no frame)
        return "zstd frame does not declare its content size (the format requires it)"
    if raw_size is not None:
        return f"zstd frame declares {declared} bytes, expected {raw_size}"
    return f"zstd frame declares {declared} bytes, more than the 1 GiB a blob may hold"


def _unknown_codec(codec: int, what: str = "codec ID") -> str:
    return f"{what} {codec} is unknown to this ckptvault: it was written by a newer ckptvault, needed to read it"


def delta_base(payload: bytes | memoryview) -> tuple[bytes, int]:
    """(base chunk ID, inner codec) of a codec-3 payload."""
    if len(payload) < DELTA_HEAD.size:
        raise MalformedObjectError("delta payload is truncated")
    base_id, inner = DELTA_HEAD.unpack_from(payload, 0)
    return bytes(base_id), inner


def _stream_widths(segs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(segment width, stream index) for every stream, in payload order."""
    return [(width, i) for width, _ in segs for i in range(width)]
