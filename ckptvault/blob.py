"""The blob envelope: how one piece of data (a chunk, a pack header, an index, a tree,
a snapshot) is stored. The only place where compression and sealing meet.

    blob  = version:u8 | seal_mode:u8 | sealed
    inner = codec:u8 | payload                 (payload = codec(plaintext))
    seal_mode 0 (none):        sealed = inner | BLAKE3-128(aad | inner)
    seal_mode 1 (aes-256-gcm): sealed = nonce:12 | AES-GCM(inner, aad) | tag:16   (encryption issue)
    aad   = version | seal_mode | kind:u8 | object_id

Binding the kind and the object ID into the checksum (or the AEAD tag) means that a blob
moved to another name or slot fails verification, not only a flipped bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import Protocol

from .bytegroup import ElementRun, Grouped
from .codec import CODEC_DELTA, MAX_DECODED_SIZE, BaseReader, Compressor
from .errors import ConfigDowngradedError, IntegrityError, MalformedObjectError
from .hashing import checksum

ENVELOPE_VERSION = 1
SEAL_NONE = 0
SEAL_AES256GCM = 1
CHECKSUM_SIZE = 16
# The most a stored blob of a metadata object (an index, a tree, a snapshot, a lock) or a pack header can take:
# its payload decodes to at most MAX_DECODED_SIZE and is stored raw where compression would not shrink it, plus
# the envelope (2 + codec 1 + nonce 12 + tag 16). A listed object bigger than this is damage, refused unread: one
# planted in the bucket would otherwise be read whole into memory before its check failed.
MAX_METADATA_BLOB = MAX_DECODED_SIZE + 64

# An encoded blob as the pieces that make it up, in order: writing them straight into a pack
# buffer saves joining them first (one copy of every byte a backup stores).
BlobParts = Sequence[bytes | memoryview]


def blob_size(parts: BlobParts) -> int:
    return sum(len(part) for part in parts)


class Kind(IntEnum):
    CHUNK = 1
    PACK_HEADER = 2
    INDEX = 3
    TREE = 4
    SNAPSHOT = 5
    LOCK = 6


class Sealer(Protocol):
    mode: int

    def seal(self, aad: bytes, inner: list[bytes | memoryview]) -> list[bytes | memoryview]: ...

    def unseal(self, aad: bytes, sealed: memoryview) -> memoryview: ...


class ChecksumSealer:
    """No confidentiality; integrity through a BLAKE3 checksum over aad and inner."""

    mode = SEAL_NONE

    def seal(self, aad: bytes, inner: list[bytes | memoryview]) -> list[bytes | memoryview]:
        return [*inner, checksum(aad, *inner, size=CHECKSUM_SIZE)]

    def unseal(self, aad: bytes, sealed: memoryview) -> memoryview:
        if len(sealed) < 1 + CHECKSUM_SIZE:
            raise IntegrityError("blob is truncated")
        inner, tag = sealed[:-CHECKSUM_SIZE], sealed[-CHECKSUM_SIZE:]
        if checksum(aad, inner, size=CHECKSUM_SIZE) != tag:
            raise IntegrityError("checksum mismatch")
        return inner


DOWNGRADED = (
    "the vault's config says it is not encrypted, but its objects are: the config was altered or replaced; nothing "
    "was written; put back the config with its encryption section (from a copy) and give the keyfile"
)


class BlobCodec:
    """Encodes and decodes blobs for one repository (its compression and sealing)."""

    def __init__(self, compressor: Compressor, sealer: Sealer) -> None:
        self.compressor = compressor
        self.sealer = sealer
        self._header = bytes([ENVELOPE_VERSION, sealer.mode])
        # An encrypted object read under a config that says "none", and a plain one (not a lock, which any
        # client writes, this one too) that verified: only the first means the config was altered.
        self._encrypted_seen = False
        self._plain_seen = False

    def _aad(self, kind: Kind, object_id: bytes) -> bytes:
        return self._header + bytes([kind]) + object_id

    def _unseals(self, kind: Kind, object_id: bytes, view: memoryview) -> bool:
        try:
            self.sealer.unseal(self._aad(kind, object_id), view[2:])
        except IntegrityError:
            return False
        return True

    @property
    def plain_seen(self) -> bool:
        """Whether a plain object (not a lock) verified here: the config's "none" is borne out."""
        return self._plain_seen

    @property
    def downgraded(self) -> bool:
        """Whether objects read so far say the vault is encrypted though its config says not: encrypted
        ones, and not one plain one but locks (one stray encrypted pack in a plain vault is damage)."""
        return self._encrypted_seen and not self._plain_seen

    def refuse_if_downgraded(self) -> None:
        """Nothing more is written in the clear once ``downgraded``, whoever caught the first error (a
        reader that reads around damaged objects takes it for one)."""
        if self.downgraded:
            raise ConfigDowngradedError(DOWNGRADED)

    def encode(self, kind: Kind, object_id: bytes, data: bytes | memoryview, runs: Sequence[ElementRun] = ()) -> bytes:
        """``runs``: where whole tensor elements lie in ``data`` (chunks only), for codec 2."""
        return b"".join(self.encode_parts(kind, object_id, data, runs))

    def encode_parts(
        self, kind: Kind, object_id: bytes, data: bytes | memoryview, runs: Sequence[ElementRun] = ()
    ) -> BlobParts:
        self.refuse_if_downgraded()
        codec, payload = self.compressor.compress(data, runs)
        return [self._header, *self.sealer.seal(self._aad(kind, object_id), [bytes([codec]), payload])]

    def encode_delta(
        self,
        chunk_id: bytes,
        data: bytes | memoryview,
        base_id: bytes,
        base: bytes | memoryview,
        runs: Sequence[ElementRun],
    ) -> BlobParts:
        """A chunk blob of codec 3, as parts: ``data`` coded against ``base`` (the plaintext of chunk
        ``base_id``). The base ID sits in the payload, inside the checksum or the AEAD: it cannot be swapped."""
        self.refuse_if_downgraded()
        payload = self.compressor.compress_delta(data, base, base_id, runs)
        return [
            self._header,
            *self.sealer.seal(self._aad(Kind.CHUNK, chunk_id), [bytes([CODEC_DELTA]), *payload]),
        ]

    def decode(self, kind: Kind, object_id: bytes, blob: bytes | memoryview) -> bytes:
        """``decode_buffer`` for metadata objects, as ``bytes``."""
        data = self.decode_buffer(kind, object_id, blob)
        return data if isinstance(data, bytes) else bytes(data)

    def decode_unverified(self, blob: bytes | memoryview) -> bytes | None:
        """What a metadata object whose checksum fails still says, for salvage (None where it says
        nothing: an encrypted object, whose tag failing leaves no plaintext, or one that no longer
        decompresses). Nothing here is verified: every use must check what it takes against content
        that is (a chunk against its ID)."""
        view = memoryview(blob)
        if self.sealer.mode != SEAL_NONE or len(view) < 3 + CHECKSUM_SIZE or view[1] != SEAL_NONE:
            return None
        inner = view[2:-CHECKSUM_SIZE]
        try:
            data = self.compressor.decompress(inner[0], inner[1:], None, None)
        except Exception:  # garbage in any form
            return None
        return data if isinstance(data, bytes) else bytes(data)

    def decode_buffer(
        self,
        kind: Kind,
        object_id: bytes,
        blob: bytes | memoryview,
        raw_size: int | None = None,
        base: BaseReader | None = None,
    ) -> bytes | memoryview:
        """Verify and decode; raises IntegrityError for damage (an unknown envelope version included) and
        UnsupportedFormatError for a verified blob this ckptvault cannot read (an unknown codec), in
        both cases without naming the object: callers do. ``base`` fetches a delta chunk's base (codec 3).
        Chunks of codec 2 come back in the buffer they were joined in (no copy into ``bytes``, which
        would hold the GIL while the restore's other threads wait for it)."""
        inner = self._unsealed(kind, object_id, blob)
        return self.compressor.decompress(inner[0], inner[1:], raw_size, base)

    def decode_base(
        self, chunk_id: bytes, blob: bytes | memoryview, raw_size: int, base: BaseReader | None = None
    ) -> bytes | memoryview | Grouped:
        """``decode_buffer`` for a chunk that is a delta's base, whose plaintext no one reads but the
        delta: decoded only as far as ``Compressor.decompress_base`` goes."""
        inner = self._unsealed(Kind.CHUNK, chunk_id, blob)
        return self.compressor.decompress_base(inner[0], inner[1:], raw_size, base)

    def _unsealed(self, kind: Kind, object_id: bytes, blob: bytes | memoryview) -> memoryview:
        view = memoryview(blob)
        if len(view) < 2:
            raise MalformedObjectError("blob is truncated")
        if view[0] != ENVELOPE_VERSION:
            # A new envelope would come with a new repository format version, which opening the
            # repository already checked: in a repository this ckptvault reads, this is damage.
            raise MalformedObjectError(
                f"blob envelope version {view[0]} is unknown (this repository format uses {ENVELOPE_VERSION}): "
                "the object is damaged"
            )
        if view[1] != self.sealer.mode:
            # an encrypted object where the config says "none" (and not a plain object whose mode byte
            # flipped: that one still verifies as what it is)
            if self.sealer.mode == SEAL_NONE and view[1] == SEAL_AES256GCM and not self._unseals(kind, object_id, view):
                self._encrypted_seen = True
                raise ConfigDowngradedError(DOWNGRADED)
            raise IntegrityError(f"blob seal mode {view[1]} does not match the repository's ({self.sealer.mode})")
        inner = self.sealer.unseal(self._aad(kind, object_id), view[2:])
        if kind != Kind.LOCK:
            self._plain_seen = True  # (or sealed: then never downgraded)
        if len(inner) < 1:
            raise MalformedObjectError("blob has no codec byte")
        return inner
