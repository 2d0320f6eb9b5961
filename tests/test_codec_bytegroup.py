"""Codec 2 (bytegroup): lossless for every element width, odd lengths and chunks straddling tensors;
chosen by the backup for tensor data and read back by restore."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptvault import CompressionSettings, Vault, bytegroup
from ckptvault.bytegroup import ElementRun, join, segments, split
from ckptvault.codec import CODEC_BYTEGROUP, CODEC_RAW, CODEC_ZSTD, Compressor
from ckptvault.errors import IntegrityError
from ckptvault.ops.elements import WHOLE_FILE_MIN, ElementMap, element_map

COMP = Compressor(CompressionSettings())


def floats(n: int, dtype: str, seed: int = 0) -> bytes:
    """Weights-like data: N(0, 0.02) in the given width (bf16 as the top half of f32)."""
    x = np.random.default_rng(seed).normal(0, 0.02, n).astype(np.float32)
    if dtype == "bf16":
        return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return x.astype({"f16": np.float16, "f32": np.float32, "f64": np.float64, "i8": np.int8}[dtype]).tobytes()


def roundtrip(data: bytes, runs: list[ElementRun]) -> int:
    codec, payload = COMP.compress(data, runs)
    assert COMP.decompress(codec, payload, len(data)) == data
    return codec


@pytest.mark.parametrize("width,dtype", [(1, "i8"), (2, "bf16"), (2, "f16"), (4, "f32"), (8, "f64")])
@pytest.mark.parametrize("lead,tail", [(0, 0), (1, 3), (3, 1), (7, 5)])
def test_every_width_roundtrips_with_odd_lengths(width: int, dtype: str, lead: int, tail: int) -> None:
    body = floats(5003, dtype)  # an odd element count
    data = b"\x01" * lead + body + b"\x02" * tail
    run = ElementRun(lead, lead + len(body) - len(body) % width, width)
    codec = roundtrip(data, [run])
    if width > 1:
        assert codec == CODEC_BYTEGROUP


@given(
    data=st.binary(min_size=0, max_size=4000),
    cuts=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 4000), st.sampled_from([1, 2, 4, 8])), max_size=5),
)
def test_any_runs_roundtrip(data: bytes, cuts: list[tuple[int, int, int]]) -> None:
    runs, pos = [], 0
    for a, b, width in sorted((min(a, b), max(a, b), w) for a, b, w in cuts):
        start = max(a, pos)
        end = start + (min(b, len(data)) - start) // width * width
        if end > start:
            runs.append(ElementRun(start, end, width))
            pos = end
    roundtrip(data, runs)


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("lead", range(8))
def test_streams_are_byte_i_of_every_element_at_any_alignment(width: int, lead: int) -> None:
    """The format's definition of a stream (docs/format.md), checked against a plain transpose for
    every start alignment: the fast paths (shifts and casts on whole elements) must not change it."""
    body = np.random.default_rng(lead).integers(0, 256, width * 1001, dtype=np.uint8).tobytes()
    data = b"\x07" * lead + body + b"\x09" * 3
    segs = segments(len(data), [ElementRun(lead, lead + len(body), width)])
    streams = split(data, segs)
    grid = np.frombuffer(body, dtype=np.uint8).reshape(-1, width)
    expected = [data[:lead]] * (lead > 0) + [grid[:, i].tobytes() for i in range(width)] + [b"\x09" * 3]
    assert [bytes(s) for s in streams] == expected
    assert join(segs, streams) == data  # the output is misaligned for every lead that is not a multiple of width


@pytest.mark.parametrize("width", [2, 4])
def test_a_big_endian_element_view_still_groups_and_joins(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    """On a big-endian host numpy byte-swaps the little-endian views; viewing the elements as big-endian
    here takes the same byte-swapping path: the streams come out in reverse order and still join back."""
    monkeypatch.setattr(bytegroup, "_ELEMENT", {2: np.dtype(">u2"), 4: np.dtype(">u4")})
    body = np.random.default_rng(width).integers(0, 256, width * 999, dtype=np.uint8).tobytes()
    data = b"\x05" + body
    segs = segments(len(data), [ElementRun(1, len(data), width)])
    streams = split(data, segs)
    grid = np.frombuffer(body, dtype=np.uint8).reshape(-1, width)
    assert [bytes(s) for s in streams[1:]] == [grid[:, i].tobytes() for i in reversed(range(width))]
    assert join(segs, streams) == data


def test_grouping_beats_plain_zstd_on_float_weights() -> None:
    plain = Compressor(CompressionSettings(bytegroup=False))
    for dtype, width in (("bf16", 2), ("f32", 4)):
        data = floats(1 << 18, dtype, seed=1)
        codec, grouped = COMP.compress(data, [ElementRun(0, len(data), width)])
        assert codec == CODEC_BYTEGROUP
        _, zstd_only = plain.compress(data)
        assert len(grouped) < 0.95 * len(zstd_only), dtype


def test_plain_zstd_is_kept_when_it_wins() -> None:
    text = b"the same sentence over and over. " * 4000  # not float-like: long repeats across elements
    codec, payload = COMP.compress(text, [ElementRun(0, len(text) // 4 * 4, 4)])
    assert codec in (CODEC_ZSTD, CODEC_BYTEGROUP) and len(payload) < len(text) / 50
    assert COMP.decompress(codec, payload, len(text)) == text
    noise = np.random.default_rng(3).bytes(10_000)
    assert COMP.compress(noise, [ElementRun(0, 10_000, 4)]) == (CODEC_RAW, noise)


def safetensors_bytes(tensors: list[tuple[str, str, bytes]]) -> bytes:
    header, offset = {}, 0
    for name, dtype, raw in tensors:
        width = {"F32": 4, "BF16": 2}[dtype]
        header[name] = {"dtype": dtype, "shape": [len(raw) // width], "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(raw for _, _, raw in tensors)


def test_chunk_straddling_a_tensor_boundary_roundtrips() -> None:
    a, b = floats(30_001, "f32"), floats(50_001, "bf16")  # b starts at an offset that is not 4-aligned
    blob = safetensors_bytes([("a", "F32", a), ("b", "BF16", b)])
    emap = element_map(lambda o, n: blob[o : o + n], len(blob), "x.safetensors", COMP)
    assert emap is not None and [w for _, _, w in emap.regions] == [4, 2]
    boundary = emap.regions[1][0]
    for start in (boundary - 100_001, boundary - 7777):  # odd phases relative to both tensors
        chunk = blob[start : boundary + 60_003]
        runs = emap.runs(start, len(chunk))
        assert [r.width for r in runs] == [4, 2]
        assert (runs[0].start + start - emap.regions[0][0]) % 4 == 0 and runs[1].start == boundary - start
        assert [w for w, _ in segments(len(chunk), runs)] == [1, 4, 2, 1]  # partial elements stay ungrouped
        assert roundtrip(chunk, list(runs)) == CODEC_BYTEGROUP
    tail_only = emap.runs(boundary - 3, 1000)  # 3 bytes of "a": no whole element of it
    assert [r.width for r in tail_only] == [2]


def test_element_map_clips_to_whole_elements() -> None:
    emap = ElementMap([(10, 50, 4), (50, 60, 2), (100, 104, 8)])  # the last is shorter than one element
    assert emap.runs(0, 200) == (ElementRun(10, 50, 4), ElementRun(50, 60, 2))
    assert emap.runs(13, 20) == (ElementRun(1, 17, 4),)  # elements at 14, 18, ..., 30 (absolute)
    assert emap.runs(60, 40) == ()


def test_damaged_payload_is_an_integrity_error() -> None:
    data = floats(4096, "bf16")
    codec, coded = COMP.compress(data, [ElementRun(0, len(data), 2)])
    payload = bytes(coded)
    assert codec == CODEC_BYTEGROUP
    for bad in (payload[:-1], payload[:3], payload + b"x", b"\xff" + payload[1:]):
        with pytest.raises(IntegrityError):
            COMP.decompress(codec, bad, len(data))
    with pytest.raises(IntegrityError):
        COMP.decompress(codec, payload, len(data) + 1)


def test_best_width_finds_the_element_width() -> None:
    assert COMP.best_width(floats(32_768, "bf16")) == 2
    assert COMP.best_width(floats(16_384, "f32")) == 4
    assert COMP.best_width(np.random.default_rng(0).bytes(65_536)) == 1


def test_backup_stores_tensors_grouped_and_restores_them(tmp_path, repo_url) -> None:
    src = tmp_path / "ckpt"
    src.mkdir()
    blob = safetensors_bytes([("w", "F32", floats(400_000, "f32")), ("e", "BF16", floats(700_001, "bf16"))])
    (src / "model.safetensors").write_bytes(blob)
    sizes = {}
    for label, settings in (("plain", CompressionSettings(bytegroup=False)), ("grouped", CompressionSettings())):
        url = f"{repo_url}-{label}"
        with Vault.init(url, compression=settings) as vault:
            snap = vault.backup(src)
            sizes[label] = snap.summary.stored_bytes
            vault.restore(snap, tmp_path / f"out-{label}")
        assert (tmp_path / f"out-{label}" / "model.safetensors").read_bytes() == blob
    assert sizes["grouped"] < 0.9 * sizes["plain"]


def test_repository_without_bytegroup_setting_keeps_plain_zstd() -> None:
    assert CompressionSettings.from_dict({"codec": "zstd", "level": 1}).bytegroup is False
    assert CompressionSettings().to_dict()["bytegroup"] is True


def _read_at(data: bytes):
    return lambda offset, length: data[offset : offset + length]


MIB = 1024 * 1024
BIG = 65 * MIB  # just over WHOLE_FILE_MIN


@pytest.mark.parametrize("dtype,width", [("f32", 4), ("bf16", 2), ("f64", 8)])
def test_a_big_file_of_no_known_format_is_measured_as_a_whole(dtype: str, width: int) -> None:
    data = floats(BIG // {"f32": 4, "bf16": 2, "f64": 8}[dtype], dtype)
    emap = element_map(_read_at(data), len(data), "weights.bin", COMP, sample_unknown=True)
    assert emap is not None and emap.regions == [(0, len(data), width)]
    assert element_map(_read_at(data), len(data), "weights.bin", COMP) is None  # copy: each chunk read once


def test_a_file_of_no_known_format_is_left_ungrouped_unless_every_sample_agrees() -> None:
    rng = np.random.default_rng(0)
    frame = floats(64 * 1024, "f32")  # 256 KiB, repeated: plain zstd finds the repeats, grouped it stores 0.8
    for name, data in (
        ("compressed or encrypted", rng.bytes(BIG)),
        ("text", b"step,loss\n" * (BIG // 10)),
        ("text, then floats", b"step,loss\n" * (MIB // 2) + floats(15 * MIB, "f32")),  # 1/16 in: text
        ("repeating floats", frame * (BIG // len(frame))),
        ("floats under the size", floats(WHOLE_FILE_MIN // 4 - 1024, "f32")),
    ):
        emap = element_map(_read_at(data), len(data), "data.bin", COMP, sample_unknown=True)
        assert emap is None, name


def test_backup_groups_a_raw_float_dump(tmp_path, repo_url) -> None:
    data = floats(BIG // 4, "f32")  # float32 with no header
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "weights.bin").write_bytes(data)
    with Vault.init(repo_url) as vault:
        snap = vault.backup(tmp_path / "src")
        vault.restore(snap, tmp_path / "out")
    assert (tmp_path / "out" / "weights.bin").read_bytes() == data
    assert snap.summary.stored_bytes < 0.88 * len(data)  # ungrouped zstd stores ~0.93 of it


@pytest.mark.parametrize("delta", [True, False])
@pytest.mark.parametrize(
    "tensors",
    [
        [("w", 10_000)],  # 40 KB: one chunk, coded by the reading thread
        [(f"layer{i}", 25_000) for i in range(8)],  # 100 KB each: under the smallest piece, cut by content
    ],
    ids=["small-file", "small-tensors"],
)
def test_tensors_too_small_for_pieces_are_stored_grouped_with_or_without_deltas(
    tmp_path, repo_url, delta: bool, tensors: list[tuple[str, int]]
) -> None:
    """The header parsed once serves both the pieces (delta coding) and the element map: a file whose tensors
    are all cut by content still has its tensors grouped, whether or not the vault codes deltas, and however
    small the file."""
    blob = safetensors_bytes([(name, "F32", floats(n, "f32", seed=i)) for i, (name, n) in enumerate(tensors)])
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.safetensors").write_bytes(blob)
    stored = {}
    for grouped in (True, False):
        with Vault.init(f"{repo_url}-{grouped}", compression=CompressionSettings(bytegroup=grouped, delta=delta)) as v:
            snap = v.backup(src)
            stored[grouped] = snap.summary.stored_bytes
            v.restore(snap, tmp_path / f"out-{grouped}")
        assert (tmp_path / f"out-{grouped}" / "model.safetensors").read_bytes() == blob
    assert stored[True] < 0.95 * stored[False], stored  # grouped: ~0.90 of plain zstd's
