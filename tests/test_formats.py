"""Header parsers: safetensors, .npy/.npz and torch zip checkpoints, read through ``read_at``."""

from __future__ import annotations

import io
import pickle
import struct
import sys
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save as st_save

from ckptvault.errors import FileFormatError
from ckptvault.formats import not_whole, read_layout


def layout_of(data: bytes, name: str = "file"):
    return read_layout(lambda o, n: data[o : o + n], len(data), name)


def test_safetensors_header_gives_names_dtypes_shapes_and_byte_ranges() -> None:
    arrays = {
        "a.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b.bias": np.arange(5, dtype=np.float16),
        "c.ids": np.arange(7, dtype=np.int64),
    }
    data = st_save(arrays, metadata={"format": "pt"})
    layout = layout_of(data)
    assert layout is not None and layout.format == "safetensors" and layout.metadata == {"format": "pt"}
    by_name = {t.name: t for t in layout.tensors}
    assert set(by_name) == set(arrays)
    for name, arr in arrays.items():
        t = by_name[name]
        assert t.shape == arr.shape and data[t.start : t.end] == arr.tobytes()
    assert by_name["a.weight"].dtype == "F32" and by_name["b.bias"].dtype == "F16" and by_name["c.ids"].dtype == "I64"
    assert layout.header_end == min(t.start for t in layout.tensors)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d[:8] + b"[" + d[9:],  # not an object
        lambda d: struct.pack("<Q", 1 << 40) + d[8:],  # header length past the end
        lambda d: d.replace(b'"F32"', b'"F16"'),  # shape no longer matches the byte range
        lambda d: d[:-1],  # data cut short
    ],
)
def test_damaged_safetensors_header_is_a_one_line_error(mutate) -> None:
    data = st_save({"x": np.zeros(4, dtype=np.float32)})
    try:
        result = layout_of(mutate(data), "m.safetensors")
    except FileFormatError as exc:
        assert "m.safetensors" in str(exc) and "\n" not in str(exc)
    else:
        assert result is None  # no longer recognisable as safetensors at all


def test_npy_and_npz(tmp_path: Path) -> None:
    arr = np.arange(24, dtype=np.float64).reshape(2, 3, 4)
    buf = io.BytesIO()
    np.save(buf, arr)
    layout = layout_of(buf.getvalue())
    assert layout is not None and layout.format == "npy"
    (t,) = layout.tensors
    assert (t.dtype, t.shape) == ("F64", (2, 3, 4)) and buf.getvalue()[t.start : t.end] == arr.tobytes()

    np.savez(tmp_path / "a.npz", w=arr.astype(np.float32), ids=np.arange(3, dtype=np.int32))
    data = (tmp_path / "a.npz").read_bytes()
    layout = layout_of(data)
    assert layout is not None and layout.format == "npz"
    by_name = {t.name: t for t in layout.tensors}
    assert (
        by_name["w"].dtype == "F32" and data[by_name["w"].start : by_name["w"].end] == arr.astype(np.float32).tobytes()
    )
    assert by_name["ids"].shape == (3,)

    np.savez_compressed(tmp_path / "c.npz", w=arr)
    layout = layout_of((tmp_path / "c.npz").read_bytes())
    assert layout is not None and [t.dtype for t in layout.tensors] == ["?"]  # compressed: listed, no dtype


def fake_torch_save(tensors: dict[str, tuple[str, np.ndarray]]) -> bytes:
    """Bytes shaped exactly like torch.save's (zip of data.pkl with persistent storage IDs and
    torch._utils._rebuild_tensor_v2 calls, one record per storage), made without torch."""
    torch = types.ModuleType("torch")
    utils = types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):  # pragma: no cover - only pickled, never called
        raise AssertionError

    _rebuild_tensor_v2.__module__ = "torch._utils"
    _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    storages: dict[str, type] = {}
    for storage_name, _ in tensors.values():
        cls = type(storage_name, (), {"__module__": "torch", "__qualname__": storage_name})
        setattr(torch, storage_name, cls)
        storages[storage_name] = cls

    class Storage:
        def __init__(self, key: str, cls: type, numel: int) -> None:
            self.key, self.cls, self.numel = key, cls, numel

    class Tensor:
        def __init__(self, storage: Storage, shape: tuple[int, ...]) -> None:
            self.storage, self.shape = storage, shape

        def __reduce__(self):
            stride = tuple(int(np.prod(self.shape[i + 1 :])) for i in range(len(self.shape)))
            return (_rebuild_tensor_v2, (self.storage, 0, self.shape, stride, False, {}))

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, Storage):
                return ("storage", obj.cls, obj.key, "cpu", obj.numel)
            return None

    state, records = {}, []
    for i, (name, (storage_name, arr)) in enumerate(tensors.items()):
        state[name] = Tensor(Storage(str(i), storages[storage_name], arr.size), arr.shape)
        records.append((str(i), arr.tobytes()))
    saved = {k: sys.modules.get(k) for k in ("torch", "torch._utils")}
    sys.modules.update({"torch": torch, "torch._utils": utils})
    try:
        pkl = io.BytesIO()
        Pickler(pkl, protocol=2).dump({"state_dict": state, "epoch": 3})
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl.getvalue())
        z.writestr("archive/byteorder", "little")
        for key, raw in records:
            z.writestr(f"archive/data/{key}", raw)
        z.writestr("archive/version", "3\n")
    return out.getvalue()


def test_torch_zip_lists_storages_with_dtypes_without_torch() -> None:
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    h = np.arange(8, dtype=np.uint16)  # stands in for bf16 bits
    data = fake_torch_save({"layer.weight": ("FloatStorage", w), "layer.half": ("BFloat16Storage", h)})
    layout = layout_of(data)
    assert layout is not None and layout.format == "torch"
    by_name = {t.name: t for t in layout.tensors}
    assert set(by_name) == {"state_dict.layer.weight", "state_dict.layer.half"}
    weight, half = by_name["state_dict.layer.weight"], by_name["state_dict.layer.half"]
    assert (weight.dtype, weight.shape, data[weight.start : weight.end]) == ("F32", (2, 3), w.tobytes())
    assert (half.dtype, half.shape, half.width) == ("BF16", (8,), 2)


def test_torch_pickle_runs_no_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (eval, (f"open({str(marker)!r}, 'w')",))

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("a/data.pkl", pickle.dumps({"x": Evil()}, protocol=2))
        z.writestr("a/data/0", b"\0" * 64)
    layout = layout_of(out.getvalue())
    assert not marker.exists()
    assert layout is not None and [(t.name, t.dtype) for t in layout.tensors] == [("storage 0", "?")]


def test_other_files_are_not_tensor_files() -> None:
    assert layout_of(b'{"a": 1}') is None
    assert layout_of(b"") is None
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("readme.txt", "hi")
    assert layout_of(out.getvalue()) is None


def test_real_torch_save_when_torch_is_installed(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "x.pt"
    torch.save({"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "n": torch.ones(4)}, path)
    layout = layout_of(path.read_bytes())
    assert layout is not None
    assert {(t.name, t.dtype, t.shape) for t in layout.tensors} == {("w", "BF16", (2, 3)), ("n", "F32", (4,))}


def test_a_module_state_dict_saved_by_torch_lists_its_tensors(tmp_path: Path) -> None:
    """``torch.save(model.state_dict())``, the most common checkpoint, and a Lightning-style dict
    holding one: an OrderedDict with a ``_metadata`` attribute, which the pickle sets after building it."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    want = {("0.weight", "F32", (4, 8)), ("0.bias", "F32", (4,)), ("1.weight", "F32", (2, 4)), ("1.bias", "F32", (2,))}
    for name, obj, prefix in (
        ("model.bin", model.state_dict(), ""),
        ("x.ckpt", {"state_dict": model.state_dict()}, "state_dict."),
    ):
        torch.save(obj, tmp_path / name)
        layout = layout_of((tmp_path / name).read_bytes())
        assert layout is not None
        assert {(t.name, t.dtype, t.shape) for t in layout.tensors} == {(prefix + n, d, s) for n, d, s in want}


def test_a_header_that_does_not_parse_only_costs_the_tensor_coding(tmp_path: Path, vault, cli, repo_url) -> None:
    """A backup stores a file whose header is malformed like any other file (and the files beside it);
    ``show`` says what is wrong in one line, exit 23."""
    raw = b'{"x": {"dtype": [], "shape": [4], "data_offsets": [0, 16]}}'
    odd = struct.pack("<Q", len(raw)) + raw + bytes(16)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "odd.safetensors").write_bytes(odd)
    (tmp_path / "ckpt" / "good.safetensors").write_bytes(st_save({"w": np.ones(64, np.float32)}))
    snap = vault.backup(tmp_path / "ckpt")
    assert b"".join(vault.read_file(snap, "odd.safetensors")) == odd
    shown = cli("show", "latest", "odd.safetensors", "--repo", repo_url, check=False)
    assert shown.returncode == 23 and shown.stderr.decode().count("\n") == 1, shown.stderr
    assert "malformed dtype" in shown.stderr.decode()


def test_a_zip_or_safetensors_file_cut_anywhere_is_not_whole_and_a_whole_one_or_other_file_is() -> None:
    """What ``watch`` holds back (a trainer killed mid-save): every prefix of a torch-style zip, an .npz and
    a safetensors file long enough to tell its format (9 bytes) is named not whole; the whole files, and
    files of no such format, are not."""
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": 1}))
        z.writestr("archive/data/0", bytes(range(256)) * 8)
    npz = io.BytesIO()
    np.savez(npz, a=np.arange(300, dtype=np.float32))
    safe = st_save({"w": np.ones((8, 8), np.float32), "b": np.zeros(3, np.float16)})
    for whole in (archive.getvalue(), npz.getvalue(), safe):
        assert not_whole(lambda o, n, d=whole: d[o : o + n], len(whole)) is None
        for cut in range(9, len(whole)):
            part = whole[:cut]
            assert not_whole(lambda o, n, d=part: d[o : o + n], cut) is not None, cut
    for other in (b"", b"plain text, not a checkpoint\n", pickle.dumps(list(range(100))), b"\x00" * 4096):
        assert not_whole(lambda o, n, d=other: d[o : o + n], len(other)) is None
