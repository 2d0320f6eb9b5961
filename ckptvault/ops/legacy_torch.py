"""Whether a legacy (not zip) ``torch.save`` file is whole, without running any of its pickled code.

``torch.save(..., _use_new_zipfile_serialization=False)`` writes four pickles (a magic number, the
protocol version, the saving system's info, the object itself, whose tensors' storages are persistent
IDs ``("storage", <storage class>, key, location, numel, view)``), a fifth with the sorted storage keys, then
each storage in that order: its element count as a little-endian int64 and its raw bytes. A file cut
short (a save killed mid-write) ends before its last storage; ``torch.load`` then fails, while a
weights-only load of one holding other objects (numpy's RNG state) stops at the first global it does
not allow, before it reaches the cut. The pickles are walked by an unpickler whose every global is an
inert stand-in, so nothing the file names is imported or called: Python's own implementation, whose memo
is a dict (the C one grows an array to the largest memo index, which a flipped bit makes gigabytes), with
at most ``MAX_GLOBALS`` distinct globals (each is a class).
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any, BinaryIO

# bytes per element of the storage classes a legacy save names (torch.<Name>Storage)
_ELEMENT_SIZES = {
    "DoubleStorage": 8,
    "FloatStorage": 4,
    "HalfStorage": 2,
    "BFloat16Storage": 2,
    "LongStorage": 8,
    "IntStorage": 4,
    "ShortStorage": 2,
    "CharStorage": 1,
    "ByteStorage": 1,
    "BoolStorage": 1,
    "ComplexDoubleStorage": 16,
    "ComplexFloatStorage": 8,
    "QInt8Storage": 1,
    "QUInt8Storage": 1,
    "QInt32Storage": 4,
    "QUInt4x2Storage": 1,
    "QUInt2x4Storage": 1,
    "UntypedStorage": 1,
}
_PICKLES_BEFORE_THE_OBJECT = 3  # magic number, protocol version, system info
MAX_GLOBALS = 10_000  # distinct classes a checkpoint names: a few dozen in practice


class StandIn:
    """What every global of the file unpickles to: takes any arguments and any state (kept as
    ``state``, for a reader of the object's fields), runs nothing."""

    qualname = ""
    state: Any = None

    def __new__(cls, *_args: Any, **_kwargs: Any) -> StandIn:
        return super().__new__(cls)

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, _key: Any, _value: Any) -> None:
        pass

    def append(self, _item: Any) -> None:
        pass

    def extend(self, _items: Any) -> None:
        pass


class InertUnpickler(pickle._Unpickler):  # the Python one: see the module docstring
    def __init__(
        self, f: BinaryIO, storages: dict[str, tuple[str, int]] | None = None, classes: dict[str, type] | None = None
    ) -> None:
        super().__init__(f)
        self._storages = {} if storages is None else storages
        self._classes = {} if classes is None else classes

    def find_class(self, module: str, name: str) -> type:
        qualname = f"{module}.{name}"
        if qualname not in self._classes:
            if len(self._classes) >= MAX_GLOBALS:
                raise pickle.UnpicklingError(f"more than {MAX_GLOBALS} distinct classes named")
            self._classes[qualname] = type("StandIn", (StandIn,), {"qualname": qualname})
        return self._classes[qualname]

    def persistent_load(self, pid: Any) -> StandIn:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":  # then a view's, in older files
            storage_class, key, numel = pid[1], pid[2], pid[4]
            self._storages[str(key)] = (getattr(storage_class, "qualname", ""), numel)
        return StandIn()


def legacy_torch_problem(f: BinaryIO) -> str | None:
    """What makes the legacy torch file ``f`` (seekable) unloadable (cut short, a storage of another
    length than its tensors say), or None when every storage it names is there whole."""
    try:
        return _problem(f)
    except (Exception, RecursionError) as exc:  # whatever damage makes of the opcodes: the file does not load
        return f"its pickled part is damaged or cut short ({type(exc).__name__}: {exc})"


def _problem(f: BinaryIO) -> str | None:
    storages: dict[str, tuple[str, int]] = {}
    classes: dict[str, type] = {}
    for _ in range(_PICKLES_BEFORE_THE_OBJECT + 1):
        InertUnpickler(f, storages, classes).load()
    keys = InertUnpickler(f, storages, classes).load()
    if not isinstance(keys, list) or sorted(map(str, keys)) != sorted(storages):
        return "its list of storages does not match the tensors it holds"
    for key in map(str, keys):
        storage_class, numel = storages[key]
        size = _ELEMENT_SIZES.get(storage_class.rpartition(".")[2])
        head = f.read(8)
        if len(head) < 8:
            return f"cut short: storage {key} of {len(keys)} is missing"
        (stored_numel,) = struct.unpack("<q", head)
        if size is None:
            return f"storage {key} is of a kind this check does not know ({storage_class})"
        if stored_numel < 0 or stored_numel != numel:
            return f"storage {key} holds {stored_numel} elements, its tensors say {numel}"
        if _skip(f, stored_numel * size) < stored_numel * size:
            return f"cut short: storage {key} of {len(keys)} ends past the end of the file"
    return None


def _skip(f: BinaryIO, n: int) -> int:
    """Move ``n`` bytes on without reading them; returns how many were there."""
    here = f.tell()
    end = f.seek(0, io.SEEK_END)
    f.seek(min(here + n, end))
    return min(n, end - here)
