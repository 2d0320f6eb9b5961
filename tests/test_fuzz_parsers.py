"""Every parser of stored bytes, fed arbitrary input, returns a value or raises the project's own
error: never another exception, a hang, or a huge allocation."""

import contextlib
import io
import json
import struct
import zipfile

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptvault.blob import BlobCodec, ChecksumSealer, Kind
from ckptvault.codec import CODEC_ZSTD, CompressionSettings, Compressor
from ckptvault.crypto.aead import AesGcmSealer
from ckptvault.crypto.keyfile import Keyfile
from ckptvault.errors import CkptVaultError, FileFormatError
from ckptvault.formats import read_layout
from ckptvault.repository.config import RepoConfig
from ckptvault.repository.index import decode_index
from ckptvault.repository.pack import decode_entries, read_pack_header
from ckptvault.snapshot.manifest import decode_snapshot, decode_tree

PLAIN = BlobCodec(Compressor(CompressionSettings()), ChecksumSealer())
SEALED = BlobCodec(Compressor(CompressionSettings()), AesGcmSealer(b"k" * 32))
OID = b"\x07" * 32

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


def own_error_or_value(parse, data) -> None:
    with contextlib.suppress(CkptVaultError):
        parse(data)


def mutate(valid: bytes, flips: list[int], cut: int) -> bytes:
    out = bytearray(valid[: max(cut, 0)] if cut >= 0 else valid)
    for f in flips:
        if out:
            out[f % len(out)] ^= 1 << (f % 8)
    return bytes(out)


parsers = {
    "config": lambda b: RepoConfig.from_json(b, "fuzz://"),
    "keyfile": lambda b: Keyfile.from_json(b, "fuzz.key"),
    "index": decode_index,
    "pack entries": decode_entries,
    "pack": lambda b: read_pack_header(PLAIN, OID, b),
    "tree": decode_tree,
    "snapshot": decode_snapshot,
    "plain blob": lambda b: PLAIN.decode(Kind.INDEX, OID, b),
    "sealed blob": lambda b: SEALED.decode(Kind.INDEX, OID, b),
}


@pytest.mark.parametrize("name", parsers)
@settings(max_examples=300)
@given(data=st.binary(max_size=400))
def test_random_bytes(name, data):
    own_error_or_value(parsers[name], data)


@pytest.mark.parametrize("name", ["config", "keyfile", "tree", "snapshot"])
@settings(max_examples=300)
@given(doc=json_values)
def test_random_json_documents(name, doc):
    own_error_or_value(parsers[name], json.dumps(doc).encode())


def valid_samples() -> dict[str, bytes]:
    key, _ = Keyfile.create("fuzz passphrase", scrypt_n=2**4)
    tree = (
        b'{"version":1,"entries":[{"path":"a/b","type":"file","mode":420,"mtime_ns":1,"size":3,'
        b'"blake3":"00","chunks":["' + b"ab" * 32 + b'"]},{"path":"l","type":"symlink","mode":511,'
        b'"mtime_ns":1,"target":"a"}]}'
    )
    return {
        "config": RepoConfig().to_json(),
        "keyfile": key.to_json(),
        "index": (1).to_bytes(4, "little") + OID + (1).to_bytes(4, "little") + OID + bytes(12),
        "tree": tree,
        "plain blob": PLAIN.encode(Kind.INDEX, OID, b"index bytes " * 20),
    }


@pytest.mark.parametrize("name", ["config", "keyfile", "index", "tree", "plain blob"])
@settings(max_examples=300)
@given(flips=st.lists(st.integers(0, 10_000), max_size=4), cut=st.integers(-1, 600))
def test_mutated_valid_structures(name, flips, cut):
    own_error_or_value(parsers[name], mutate(valid_samples()[name], flips, cut))


def layout_of(data: bytes) -> None:
    """Checkpoint headers (safetensors, .npy/.npz, torch zip) are untrusted input too: a backup that
    cannot parse one codes the file without its tensor layout, ``show`` exits 23."""
    read_layout(lambda offset, length: data[offset : offset + length], len(data), "fuzz")


def safetensors_file(header: object) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(64)


def torch_zip() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        archive.writestr("archive/data/0", bytes(64))
        archive.writestr("archive/version", b"3\n")
    return out.getvalue()


@settings(max_examples=300)
@given(
    spec=st.fixed_dictionaries({"dtype": json_values, "shape": json_values, "data_offsets": json_values}) | json_values
)
def test_safetensors_entries_of_any_json(spec):
    own_error_or_value(layout_of, safetensors_file({"x": spec}))


@settings(max_examples=300)
@given(flips=st.lists(st.integers(0, 10_000), max_size=4), cut=st.integers(-1, 600))
def test_mutated_torch_zip_archives(flips, cut):
    own_error_or_value(layout_of, mutate(torch_zip(), flips, cut))


def test_a_zip_needing_an_unknown_version_is_a_format_error():
    data = bytearray(torch_zip())
    central = data.find(b"PK\x01\x02")
    data[central + 6 : central + 8] = (99).to_bytes(2, "little")  # "version needed to extract": 9.9
    with pytest.raises(FileFormatError, match="is not a readable zip archive"):
        layout_of(bytes(data))
    for spec in ({"dtype": [], "shape": [4], "data_offsets": [0, 16]}, {"dtype": "F32", "shape": "abc"}):
        with pytest.raises(FileFormatError, match="malformed dtype"):
            layout_of(safetensors_file({"x": {"data_offsets": [0, 16], **spec}}))


def test_decompression_bomb_is_refused_before_allocating():
    """A 2 GiB frame of zeros is a few hundred KB; its declared size is checked before zstd allocates it."""
    cobj = zstandard.ZstdCompressor(level=1).compressobj(size=2 << 30)
    zeros = bytes(1 << 20)
    bomb = b"".join(cobj.compress(zeros) for _ in range(2048)) + cobj.flush()
    assert len(bomb) < 1 << 20 and zstandard.frame_content_size(bomb) == 2 << 30
    comp = Compressor(CompressionSettings())
    with pytest.raises(CkptVaultError, match="declares"):
        comp.decompress(CODEC_ZSTD, bomb)  # metadata objects: at most 1 GiB
    with pytest.raises(CkptVaultError, match="declares"):
        comp.decompress(CODEC_ZSTD, bomb, raw_size=1 << 20)  # chunks: exactly the indexed size
    with pytest.raises(CkptVaultError, match="declares 2147483648 bytes, more than the 1 GiB a blob may hold"):
        comp.decompress(CODEC_ZSTD, bomb)
    streamed = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(b"\0" * 1000)
    for raw_size in (None, 1000):  # no declared size: refused, not guessed (said "declares -1 bytes, expected fewer")
        with pytest.raises(CkptVaultError, match="zstd frame does not declare its content size"):
            comp.decompress(CODEC_ZSTD, streamed, raw_size=raw_size)
    with pytest.raises(CkptVaultError, match="zstd frame declares 1000 bytes, expected 0"):  # said "expected fewer"
        comp.decompress(CODEC_ZSTD, zstandard.ZstdCompressor().compress(b"\0" * 1000), raw_size=0)
