"""PyTorch zip checkpoints (``torch.save``'s format), read without torch.

The archive holds ``<root>/data.pkl`` (the object tree, tensors pickled as
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` with each storage a
persistent ID ``("storage", <torch.XStorage>, key, location, numel)``) and each storage's raw
bytes as ``<root>/data/<key>``. The pickle is read with an unpickler that imports nothing:
every global becomes an inert stand-in, so loading a hostile file runs no code. When the
pickle is not of that shape the storages are still listed, with dtype "?".
"""

from __future__ import annotations

import builtins
import io
import pickle
from dataclasses import dataclass
from typing import Any

from ..errors import FileFormatError
from .dtypes import TORCH_STORAGES, item_size
from .model import FileLayout, ReadAt, TensorInfo
from .zipmembers import ZipMember, members

MAX_PICKLE = 64 * 1024 * 1024
_SAFE_BUILTINS = {
    ("builtins", n): getattr(builtins, n)
    for n in ("dict", "list", "set", "frozenset", "tuple", "int", "float", "complex", "bool", "str", "bytes", "slice")
}


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: str


@dataclass(frozen=True)
class _TensorRef:
    storage: _Storage
    offset: int
    shape: tuple[int, ...]


class _Inert:
    """Stand-in for any global the pickle names: accepts any arguments and state, does nothing."""

    qualname = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _rebuild_tensor(storage: Any, offset: Any = 0, size: Any = (), *_rest: Any) -> Any:
    if isinstance(storage, _Storage) and isinstance(offset, int) and isinstance(size, (tuple, list)):
        return _TensorRef(storage, offset, tuple(int(d) for d in size))
    return _Inert(storage, offset, size)


def _first_arg(data: Any = None, *_rest: Any) -> Any:
    return data


class _OrderedDict(dict):
    """An OrderedDict in a pickle. ``Module.state_dict()`` gives it a ``_metadata`` attribute, which the
    pickle sets once it is built (a plain ``dict`` has no attributes, and the whole pickle would fail)."""


_KNOWN = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _first_arg,
    ("torch._utils", "_rebuild_parameter_with_state"): _first_arg,
    ("collections", "OrderedDict"): _OrderedDict,
    ("_codecs", "encode"): lambda text, enc="latin1": str(text).encode(enc),  # protocol-2 bytes
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _KNOWN:
            return _KNOWN[(module, name)]
        if (module, name) in _SAFE_BUILTINS:
            return _SAFE_BUILTINS[(module, name)]
        if module == "torch" and name in TORCH_STORAGES:
            return TORCH_STORAGES[name]  # the storage type becomes our dtype name
        return type(name, (_Inert,), {"qualname": f"{module}.{name}"})

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage":
            dtype = pid[1] if isinstance(pid[1], str) and pid[1] in TORCH_STORAGES.values() else "?"
            return _Storage(str(pid[2]), dtype)
        return _Inert(pid)


def _walk(obj: Any, path: str, out: list[tuple[str, _TensorRef]], depth: int = 0) -> None:
    if depth > 64 or len(out) > 1_000_000:
        return
    if isinstance(obj, _TensorRef):
        out.append((path, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{path}.{k}" if path else str(k), out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{path}.{i}" if path else str(i), out, depth + 1)


def looks_like(zip_names: list[str]) -> bool:
    return any(n.endswith("/data.pkl") or n == "data.pkl" for n in zip_names)


def parse(read_at: ReadAt, size: int, name: str = "file", zip_members: list[ZipMember] | None = None) -> FileLayout:
    """One tensor per storage record, named after the first tensor that uses it (else ``storage <key>``)."""
    found = zip_members if zip_members is not None else members(read_at, size, name)
    pkl = next((m for m in found if m.name.endswith("data.pkl")), None)
    if pkl is None:
        raise FileFormatError(name, "is a zip archive but not a torch checkpoint (no data.pkl)")
    root = pkl.name[: -len("data.pkl")]
    refs: list[tuple[str, _TensorRef]] = []
    if pkl.stored and pkl.size <= MAX_PICKLE:
        try:
            _walk(_Unpickler(io.BytesIO(read_at(pkl.start, pkl.size))).load(), "", refs)
        except Exception:  # a pickle we cannot follow still lets us list the records
            refs = []
    by_key: dict[str, tuple[str, _TensorRef | None]] = {}
    for tensor_path, tensor_ref in refs:
        by_key.setdefault(tensor_ref.storage.key, (tensor_path, tensor_ref))
    tensors = []
    prefix = root + "data/"
    for m in found:
        if not m.name.startswith(prefix) or not m.stored:
            continue
        key = m.name[len(prefix) :]
        path, ref = by_key.get(key) or (f"storage {key}", None)
        dtype = ref.storage.dtype if ref else "?"
        width = item_size(dtype)
        shape = ref.shape if ref else ((m.size // width,) if width else None)
        tensors.append(TensorInfo(path, dtype, shape, m.start, m.start + m.size))
    return FileLayout("torch", size, tuple(sorted(tensors, key=lambda t: t.start)), {"root": root.rstrip("/")})
