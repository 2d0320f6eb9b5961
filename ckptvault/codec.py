"""Compression codecs. A codec's ID is written into every blob, so IDs are never reused.

ID 0: raw (stored as is), ID 1: zstd. ``compress`` falls back to raw whenever the codec
does not make the data smaller (float weights often do not shrink).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import zstandard

from .errors import IntegrityError, UsageError

CODEC_RAW = 0
CODEC_ZSTD = 1
MAX_DECODED_SIZE = 1 << 30  # no single blob (chunk, index, tree) decodes to more than 1 GiB
# Tombstones: none yet. A retired codec ID is listed here and never handed out again.


@dataclass(frozen=True)
class CompressionSettings:
    codec: str = "zstd"
    level: int = 1  # measured: zstd-3 gains <0.1% over zstd-1 on checkpoint data at 1.3-3x the CPU

    def __post_init__(self) -> None:
        if self.codec not in ("zstd", "none"):
            raise UsageError(f"unknown compression {self.codec!r}; use zstd or none")
        if self.codec == "zstd" and not -7 <= self.level <= 22:
            raise UsageError(f"zstd level {self.level} is out of range; use -7..22")

    def to_dict(self) -> dict[str, str | int]:
        return {"codec": self.codec, "level": self.level}

    @classmethod
    def from_dict(cls, d: dict) -> CompressionSettings:
        return cls(codec=d["codec"], level=d["level"])


class Compressor:
    """Thread-safe: each thread keeps its own zstd contexts (they are not shareable)."""

    def __init__(self, settings: CompressionSettings) -> None:
        self.settings = settings
        self._local = threading.local()

    def _contexts(self) -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = (zstandard.ZstdCompressor(level=self.settings.level), zstandard.ZstdDecompressor())
            self._local.ctx = ctx
        return ctx

    def compress(self, data: bytes | memoryview) -> tuple[int, bytes | memoryview]:
        """Return (codec ID, payload)."""
        if self.settings.codec == "none" or len(data) == 0:
            return CODEC_RAW, data
        packed = self._contexts()[0].compress(data)
        if len(packed) >= len(data):
            return CODEC_RAW, data
        return CODEC_ZSTD, packed

    def decompress(self, codec: int, payload: bytes | memoryview, raw_size: int | None = None) -> bytes:
        if codec == CODEC_RAW:
            return bytes(payload)
        if codec == CODEC_ZSTD:
            try:
                # The frame declares its size; check it before zstd allocates it, so a damaged
                # or crafted blob cannot ask for gigabytes.
                declared = zstandard.frame_content_size(payload)
                limit = raw_size if raw_size is not None else MAX_DECODED_SIZE
                if declared < 0 or declared > limit or (raw_size is not None and declared != raw_size):
                    raise IntegrityError(
                        f"zstd frame declares {declared} bytes, expected {limit if raw_size else 'fewer'}"
                    )
                return self._contexts()[1].decompress(payload, max_output_size=max(declared, 1))
            except zstandard.ZstdError as exc:
                raise IntegrityError(f"zstd payload does not decode: {exc}") from exc
        raise IntegrityError(f"unknown codec ID {codec}; this blob was written by a newer ckptvault")
