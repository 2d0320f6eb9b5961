import contextlib
import mmap
import os
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptvault.blob import BlobCodec, ChecksumSealer, Kind
from ckptvault.codec import CompressionSettings, Compressor
from ckptvault.errors import IntegrityError, MalformedObjectError
from ckptvault.repository.format import PACK_MAGIC
from ckptvault.repository.index import ChunkIndex, decode_index, encode_index
from ckptvault.repository.pack import (
    ENTRY,
    TRAILER,
    PackEntry,
    PackWriter,
    buffer_in_use,
    decode_entries,
    decode_header,
    encode_entries,
    header_range,
    new_pack_buffer,
    read_pack_header,
)

codec = BlobCodec(Compressor(CompressionSettings()), ChecksumSealer())

entries_st = st.lists(
    st.builds(
        PackEntry,
        st.binary(min_size=32, max_size=32),
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**32 - 1),
    ),
    max_size=20,
)


@given(packs=st.dictionaries(st.binary(min_size=32, max_size=32), entries_st, max_size=5))
def test_index_round_trip(packs):
    assert decode_index(encode_index(packs)) == packs


@given(raw=st.binary(max_size=300))
def test_index_decoder_never_crashes_on_garbage(raw):
    with contextlib.suppress(MalformedObjectError):
        decode_index(raw)


def test_pack_header_round_trip_and_offsets():
    writer = PackWriter()
    blobs = [os.urandom(n) for n in (10, 1000, 5)]
    for i, b in enumerate(blobs):
        writer.add(bytes([i]) * 32, b, len(b) * 2)
    pack_id = os.urandom(32)
    data = bytes(writer.finish(codec, pack_id))
    entries = read_pack_header(codec, pack_id, data)
    assert [data[e.offset : e.offset + e.stored_len] for e in entries] == blobs
    assert [e.raw_len for e in entries] == [20, 2000, 10]


@pytest.mark.parametrize("platform", ["linux", "darwin"])
def test_a_pack_buffer_grows_for_blobs_past_its_size_and_tells_when_it_is_in_use(platform, monkeypatch):
    # Linux gives an anonymous mapping, grown with mremap; elsewhere a mapping cannot grow: a bytearray
    monkeypatch.setattr(sys, "platform", platform)
    buffer = new_pack_buffer(256 * 1024)
    assert isinstance(buffer, mmap.mmap if platform == "linux" else bytearray)
    writer = PackWriter(buffer)
    blobs = [os.urandom(n) for n in (200 * 1024, 1 << 20, 100)]  # the second runs far past the end
    for i, b in enumerate(blobs):
        writer.add(bytes([i]) * 32, b, len(b))
    pack_id = os.urandom(32)
    sent = writer.finish(codec, pack_id)
    data = bytes(sent)
    entries = read_pack_header(codec, pack_id, data)
    assert [data[e.offset : e.offset + e.stored_len] for e in entries] == blobs
    assert buffer_in_use(writer.buffer)  # ``sent`` still views it
    sent.release()
    assert not buffer_in_use(writer.buffer)
    assert len(writer.buffer) >= len(data)  # the test left it as big as it was


def test_copy_into_takes_any_contiguous_source():
    from ckptvault.memcopy import MIN_RELEASED, copy_into

    dst = bytearray(2 * MIN_RELEASED)
    for n in (16, MIN_RELEASED):  # below and above the size numpy copies
        src = np.arange(n // 4, dtype=np.float32)
        copy_into(dst, 8, memoryview(src))
        assert bytes(dst[8 : 8 + n]) == src.tobytes()


def test_damaged_pack_header_is_detected():
    writer = PackWriter()
    writer.add(b"\1" * 32, b"blob", 4)
    pack_id = os.urandom(32)
    data = bytearray(writer.finish(codec, pack_id))
    with pytest.raises(IntegrityError):
        read_pack_header(codec, os.urandom(32), bytes(data))  # header bound to its pack ID
    data[-12] ^= 0xFF
    with pytest.raises(IntegrityError):
        read_pack_header(codec, pack_id, bytes(data))
    with pytest.raises(MalformedObjectError):
        read_pack_header(codec, pack_id, b"xx")


def test_chunk_index_keeps_first_location():
    idx = ChunkIndex()
    idx.add_pack(b"A" * 32, [PackEntry(b"c" * 32, 0, 10, 20)])
    idx.add_pack(b"B" * 32, [PackEntry(b"c" * 32, 5, 10, 20)])
    assert idx.get(b"c" * 32).pack_id == b"A" * 32
    assert len(idx) == 1 and b"c" * 32 in idx


def test_deltas_whose_base_is_gone_are_left_out_at_any_depth():
    from ckptvault.repository.index import ChunkIndex
    from ckptvault.repository.pack import PackEntry

    a, b, c, d = (bytes([i]) * 32 for i in range(4))
    index = ChunkIndex()  # c is a delta against b, b against a (in a pack that is gone); d stands alone
    index.add_pack(b"p" * 32, [PackEntry(b, 0, 10, 10, a), PackEntry(c, 10, 10, 10, b), PackEntry(d, 20, 10, 10, None)])
    index.drop_deltas_without_base()
    assert b not in index and c not in index and d in index


def test_every_copy_of_a_chunk_is_kept_once_and_a_plain_copy_comes_first():
    from ckptvault.repository.index import ChunkIndex
    from ckptvault.repository.pack import PackEntry

    chunk, base = b"c" * 32, b"b" * 32
    index = ChunkIndex()
    index.add_pack(b"1" * 32, [PackEntry(chunk, 0, 10, 10, base)])  # a delta copy
    index.add_pack(b"1" * 32, [PackEntry(chunk, 0, 10, 10, base)])  # the same copy, in a second index object
    index.add_pack(b"2" * 32, [PackEntry(chunk, 5, 10, 10, None)])  # a plain copy elsewhere
    assert [(loc.pack_id[:1], loc.base_id) for loc in index.locations(chunk)] == [(b"2", None), (b"1", base)]
    assert index.locations(b"x" * 32) == []


def test_forgetting_a_pack_keeps_a_chunks_other_copy_and_drops_what_only_it_held():
    from ckptvault.repository.index import ChunkIndex
    from ckptvault.repository.pack import PackEntry

    shared, only, delta = b"s" * 32, b"o" * 32, b"d" * 32
    gone, kept = b"1" * 32, b"2" * 32
    index = ChunkIndex()
    index.add_pack(gone, [PackEntry(shared, 0, 10, 10), PackEntry(only, 10, 10, 10)])
    index.add_pack(kept, [PackEntry(shared, 0, 10, 10), PackEntry(delta, 10, 10, 10, only)])
    index.forget_packs([gone])
    assert [loc.pack_id for loc in index.locations(shared)] == [kept]
    assert only not in index and delta not in index and index.packs == {kept}  # the delta's base went with it


def test_a_fresh_machine_reads_the_index_objects_several_at_a_time(tmp_path, monkeypatch):
    """Each index object is a round trip on remote storage, and each backup adds one until a prune merges
    them: read one after another, 1,000 of them kept a fresh machine's first command ~40 s on a 20 ms link."""
    import threading
    import time

    from ckptvault import Vault
    from ckptvault.store.local import LocalStore

    url = str(tmp_path / "vault")
    src = tmp_path / "src"
    src.mkdir()
    with Vault.init(url) as vault:
        for step in range(6):
            (src / "model.bin").write_bytes(os.urandom(50_000))
            vault.backup(src, tags={"step": str(step)})
    running, most = [0], [0]
    lock = threading.Lock()
    real_get = LocalStore.get

    def get(self: LocalStore, key: str) -> bytes:
        if not key.startswith("index/"):
            return real_get(self, key)
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)  # a round trip
        try:
            return real_get(self, key)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(LocalStore, "get", get)
    monkeypatch.setenv("CKPTVAULT_NO_CACHE", "1")  # a fresh machine: nothing cached yet
    for remote in (False, True):  # a local disk: one at a time (a thread hand-off costs more than a read)
        monkeypatch.setattr(LocalStore, "remote", remote)
        most[0] = 0
        with Vault.open(url) as vault:
            out = tmp_path / f"out-{remote}"
            vault.restore("latest", out)
        assert (out / "model.bin").read_bytes() == (src / "model.bin").read_bytes()
        assert (most[0] > 1) == remote, (remote, most[0])


def test_pack_layouts_that_do_not_add_up_are_malformed_not_misread():
    """A header is checksummed, so these come from a writer's bug, not the disk; each is still refused
    by name instead of being read as something else (a partial entry escaped as struct.error)."""
    with pytest.raises(MalformedObjectError, match="partial entry"):
        decode_entries(bytes(ENTRY.size + 1))
    with pytest.raises(MalformedObjectError, match="points before the start of the pack"):
        header_range(TRAILER.pack(1_000, PACK_MAGIC), 100)
    runs_past = [PackEntry(b"\x01" * 32, offset=90, stored_len=20, raw_len=20)]  # starts inside the data
    blob = codec.encode(Kind.PACK_HEADER, b"\x02" * 32, encode_entries(runs_past))
    with pytest.raises(MalformedObjectError, match="points past the data"):
        decode_header(codec, b"\x02" * 32, blob, data_end=100)
