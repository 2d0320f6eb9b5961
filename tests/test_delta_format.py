"""Codec 3 (delta) and the format-2 layouts that name delta bases: blobs, pack headers, index objects,
the config; and that everything format 1 wrote still reads the same."""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptvault import CompressionSettings, bytegroup
from ckptvault.blob import BlobCodec, ChecksumSealer, Kind
from ckptvault.bytegroup import ElementRun, Grouped
from ckptvault.codec import CODEC_DELTA, Compressor, delta_base
from ckptvault.crypto.aead import AesGcmSealer
from ckptvault.errors import IntegrityError, MalformedObjectError, UnsupportedFormatError
from ckptvault.repository.config import RepoConfig
from ckptvault.repository.index import ChunkIndex, decode_index, encode_index
from ckptvault.repository.pack import PackEntry, PackWriter, read_pack_header

COMP = Compressor(CompressionSettings(delta=True))
PLAIN = BlobCodec(COMP, ChecksumSealer())
SEALED = BlobCodec(COMP, AesGcmSealer(os.urandom(32)))


def weights(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.02, n).astype(np.float32)


def f32_pair() -> tuple[bytes, bytes]:
    old = weights(40_000, 1)
    new = old + np.random.default_rng(2).normal(0, 6e-5, old.size).astype(np.float32)
    return old.tobytes(), new.tobytes()


@pytest.mark.parametrize("codec", [PLAIN, SEALED], ids=["plain", "aes-gcm"])
def test_delta_blob_round_trips_and_is_smaller(codec: BlobCodec) -> None:
    base, data = f32_pair()
    runs = [ElementRun(0, len(data), 4)]
    base_id, chunk_id = os.urandom(32), os.urandom(32)
    blob = b"".join(codec.encode_delta(chunk_id, data, base_id, base, runs))
    plain = codec.encode(Kind.CHUNK, chunk_id, data, runs)
    assert len(blob) < 0.8 * len(plain)
    asked = []

    def give(wanted: bytes) -> bytes:
        asked.append(wanted)
        return base

    assert codec.decode_buffer(Kind.CHUNK, chunk_id, blob, len(data), give) == data
    assert asked == [base_id]  # the base ID travels inside the blob
    with pytest.raises(IntegrityError, match="without its base"):
        codec.decode_buffer(Kind.CHUNK, chunk_id, blob, len(data))


def test_base_id_is_authenticated() -> None:
    """The base reference sits inside the checksum / AEAD: changing it is damage, not a redirect."""
    base, data = f32_pair()
    for codec in (PLAIN, SEALED):
        chunk_id = os.urandom(32)
        blob = bytearray(b"".join(codec.encode_delta(chunk_id, data, os.urandom(32), base, ())))
        offset = 2 + 1 + (12 if codec is SEALED else 0)  # header, codec byte, nonce: then the base ID
        blob[offset] ^= 1
        with pytest.raises(IntegrityError):
            codec.decode_buffer(Kind.CHUNK, chunk_id, bytes(blob), len(data), lambda _b: base)


def test_wrong_base_length_and_bad_inner_codec_are_integrity_errors() -> None:
    base, data = f32_pair()
    chunk_id = os.urandom(32)
    blob = b"".join(PLAIN.encode_delta(chunk_id, data, os.urandom(32), base, ()))
    with pytest.raises(IntegrityError, match="holds"):
        PLAIN.decode_buffer(Kind.CHUNK, chunk_id, blob, len(data), lambda _b: base[:-4])
    payload = COMP.compress_delta(data, base, b"\1" * 32)
    head = bytearray(payload[0])
    head[32] = CODEC_DELTA  # a delta may not nest a delta inside one blob
    with pytest.raises(MalformedObjectError):
        COMP.decompress(CODEC_DELTA, bytes(head) + bytes(payload[1]), len(data), lambda _b: base)

    def no_base_named(wanted: bytes) -> bytes:
        raise IntegrityError(f"is a delta against chunk {wanted.hex()[:12]}, but its index entry names none")

    head[32] = 9  # an inner codec no ckptvault knows, in a chunk its index does not call a delta: damage first
    with pytest.raises(IntegrityError, match="index entry names none"):
        COMP.decompress(CODEC_DELTA, bytes(head) + bytes(payload[1]), len(data), no_base_named)
    with pytest.raises(MalformedObjectError):
        delta_base(b"short")


@pytest.mark.parametrize("base_width", [4, 2, 1], ids=["grouped-alike", "grouped-otherwise", "ungrouped"])
def test_a_base_given_as_its_streams_decodes_the_delta(monkeypatch: pytest.MonkeyPatch, base_width: int) -> None:
    """A restore hands a delta its base decoded only as far as its streams (``decode_base``): the delta is
    undone on the streams where both are grouped alike, joining once; otherwise on the joined bytes."""
    base, data = f32_pair()
    base_id, chunk_id = os.urandom(32), os.urandom(32)
    base_runs = [ElementRun(0, len(base), base_width)] if base_width > 1 else []
    given = PLAIN.decode_base(base_id, PLAIN.encode(Kind.CHUNK, base_id, base, base_runs), len(base))
    assert isinstance(given, Grouped) == (base_width > 1)
    blob = b"".join(PLAIN.encode_delta(chunk_id, data, base_id, base, [ElementRun(0, len(data), 4)]))
    joins = []
    real_join = bytegroup.join
    monkeypatch.setattr(bytegroup, "join", lambda *a: joins.append(1) or real_join(*a))
    assert PLAIN.decode_buffer(Kind.CHUNK, chunk_id, blob, len(data), lambda _b: given) == data
    assert len(joins) == {4: 1, 2: 2, 1: 1}[base_width]  # the delta's streams, then (unlike) the base's


@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_any_bytes_round_trip_as_delta(a: bytes, b: bytes) -> None:
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    payload = b"".join(bytes(p) for p in COMP.compress_delta(a, b, b"\7" * 32))
    assert COMP.decompress(CODEC_DELTA, payload, n, lambda _b: b) == a


def entries(with_bases: bool) -> list[PackEntry]:
    return [
        PackEntry(os.urandom(32), 0, 10, 20, os.urandom(32) if with_bases else None),
        PackEntry(os.urandom(32), 10, 5, 7),
    ]


@pytest.mark.parametrize("with_bases", [False, True])
def test_pack_header_names_bases_only_when_needed(with_bases: bool) -> None:
    writer = PackWriter()
    for e in entries(with_bases):
        writer.add(e.chunk_id, os.urandom(e.stored_len), e.raw_len, e.base_id)
    pack_id = os.urandom(32)
    data = bytes(writer.finish(PLAIN, pack_id))
    assert data[-4:] == (b"CVP2" if with_bases else b"CVP1")  # no base: byte-for-byte format 1
    assert read_pack_header(PLAIN, pack_id, data) == writer.entries


@given(
    packs=st.dictionaries(
        st.binary(min_size=32, max_size=32),
        st.lists(
            st.builds(
                PackEntry,
                st.binary(min_size=32, max_size=32),
                st.integers(0, 2**32 - 1),
                st.integers(0, 2**32 - 1),
                st.integers(0, 2**32 - 1),
                st.one_of(st.none(), st.binary(min_size=32, max_size=32).filter(any)),
            ),
            max_size=10,
        ),
        max_size=4,
    )
)
def test_index_round_trip_with_bases(packs: dict[bytes, list[PackEntry]]) -> None:
    raw = encode_index(packs)
    has_base = any(e.base_id for es in packs.values() for e in es)
    assert raw.startswith(b"CVI2") == has_base
    assert decode_index(raw) == packs


@given(raw=st.binary(max_size=300))
def test_v2_index_decoder_never_crashes_on_garbage(raw: bytes) -> None:
    with contextlib.suppress(MalformedObjectError):
        decode_index(b"CVI2" + raw)


def test_index_prefers_a_copy_without_base() -> None:
    idx = ChunkIndex()
    chunk, base = b"c" * 32, b"b" * 32
    idx.add_pack(b"A" * 32, [PackEntry(chunk, 0, 10, 20, base)])
    idx.add_pack(b"B" * 32, [PackEntry(chunk, 5, 12, 20)])
    idx.add_pack(b"C" * 32, [PackEntry(chunk, 9, 9, 20, base)])
    loc = idx.get(chunk)
    assert loc is not None and loc.pack_id == b"B" * 32 and loc.base_id is None


def test_config_version_follows_delta() -> None:
    assert RepoConfig().version == 2  # new repositories code deltas by default
    assert RepoConfig(compression=CompressionSettings(delta=False)).version == 1
    on = RepoConfig(compression=CompressionSettings(delta=True))
    assert on.version == 2
    doc = json.loads(on.to_json())
    assert doc["version"] == 2 and doc["compression"]["delta"] is True
    assert RepoConfig.from_json(on.to_json(), "x").compression.delta
    off = json.loads(RepoConfig(compression=CompressionSettings(delta=False)).to_json())
    assert off["version"] == 1 and "delta" not in off["compression"]  # format 1 configs are unchanged
    doc["version"] = 1
    with pytest.raises(MalformedObjectError, match="format 2"):
        RepoConfig.from_json(json.dumps(doc).encode(), "x")
    doc["version"] = 3  # only ever made encrypted
    with pytest.raises(MalformedObjectError, match="config was altered"):
        RepoConfig.from_json(json.dumps(doc).encode(), "x")
    doc["version"] = 4
    with pytest.raises(UnsupportedFormatError, match="newer"):
        RepoConfig.from_json(json.dumps(doc).encode(), "x")


# BLAKE3 of the two saves the fixture holds (make_fixtures.safetensors_save at the time it was written)
FROZEN_V2_SAVES = {
    "1": "1403374b07e4cd65b6ac7f9e0e39c52bd1974ef8bce66820f32eba52bd69ebd2",
    "2": "11ba4f7cd88ffb35b9c4a8539fa5e4794ea575cfedf3c09b1c9105dada7bc2c1",
}


def test_a_frozen_format_2_repository_of_grouped_and_delta_chunks_still_restores(tmp_path):
    """Frozen data for codec 2 (byte grouping), codec 3 (deltas), CVP2 packs and CVI2 index objects, which
    the round trips above only check against the same code that writes them (fm48 M5)."""
    import shutil
    from pathlib import Path

    import blake3

    from ckptvault import Vault
    from ckptvault.codec import CODEC_BYTEGROUP
    from ckptvault.repository.format import pack_key

    repo = tmp_path / "repo"
    shutil.copytree(Path(__file__).parent / "fixtures" / "repo-v2-tensors", repo)
    with Vault.open(str(repo)) as vault:
        r = vault._repo
        assert r.config.version == 2
        locations = [loc for _, loc in r.index.items()]
        # a plain blob is: envelope version, seal mode, then the codec byte
        codecs = {r.store.get_range(pack_key(loc.pack_id), loc.offset, loc.stored_len)[2] for loc in locations}
        assert {CODEC_BYTEGROUP, CODEC_DELTA} <= codecs, codecs
        assert any(loc.base_id is not None for loc in locations)
        magics = {r.store.get(pack_key(pack_id))[-4:] for pack_id in {loc.pack_id for loc in locations}}
        assert b"CVP2" in magics, magics
        assert sorted(snap.tags["step"] for snap in vault.snapshots()) == ["1", "2"]
        for snap in vault.snapshots():
            out = tmp_path / snap.tags["step"]
            vault.restore(snap, out)
            got = blake3.blake3((out / "model.safetensors").read_bytes()).hexdigest()
            assert got == FROZEN_V2_SAVES[snap.tags["step"]]
