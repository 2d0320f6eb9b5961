import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptvault.blob import BlobCodec, ChecksumSealer, Kind
from ckptvault.codec import CODEC_RAW, CODEC_ZSTD, CompressionSettings, Compressor
from ckptvault.errors import IntegrityError, MalformedObjectError, UnsupportedFormatError, UsageError

codec = BlobCodec(Compressor(CompressionSettings()), ChecksumSealer())
OID = bytes(range(32))


@given(data=st.binary(max_size=5000), kind=st.sampled_from(list(Kind)))
def test_round_trip(data, kind):
    assert codec.decode(kind, OID, codec.encode(kind, OID, data)) == data


def test_incompressible_data_is_stored_raw_and_compressible_data_shrinks():
    c = Compressor(CompressionSettings())
    noise = os.urandom(100_000)
    assert c.compress(noise) == (CODEC_RAW, noise)
    codec_id, payload = c.compress(b"a" * 100_000)
    assert codec_id == CODEC_ZSTD and len(payload) < 1000


def test_every_single_bit_flip_is_detected():
    blob = bytearray(codec.encode(Kind.CHUNK, OID, b"checkpoint bytes " * 10))
    for i in range(len(blob)):
        for bit in (0, 7):
            bad = bytearray(blob)
            bad[i] ^= 1 << bit
            with pytest.raises((IntegrityError, UnsupportedFormatError)):
                codec.decode(Kind.CHUNK, OID, bytes(bad))


def test_blob_bound_to_its_id_and_kind():
    blob = codec.encode(Kind.INDEX, OID, b"index")
    with pytest.raises(IntegrityError):
        codec.decode(Kind.SNAPSHOT, OID, blob)
    with pytest.raises(IntegrityError):
        codec.decode(Kind.INDEX, bytes(32), blob)


def test_truncated_blob_is_detected():
    blob = codec.encode(Kind.CHUNK, OID, b"x" * 1000)
    for cut in (0, 1, 2, 10, len(blob) - 1):
        with pytest.raises((IntegrityError, UnsupportedFormatError)):
            codec.decode(Kind.CHUNK, OID, blob[:cut])


def test_unknown_envelope_version_is_damage():
    # a new envelope version would come with a new repository format version, checked at open
    blob = bytearray(codec.encode(Kind.CHUNK, OID, b"x"))
    blob[0] = 9
    with pytest.raises(MalformedObjectError, match="envelope version 9 is unknown"):
        codec.decode(Kind.CHUNK, OID, bytes(blob))


def test_bad_compression_settings():
    with pytest.raises(UsageError):
        CompressionSettings(level=99)
    with pytest.raises(UsageError):
        CompressionSettings(codec="lz77")
