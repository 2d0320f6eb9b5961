"""What ``drill --load`` checks in files that are not weights alone, without running pickled code.

A resume also fails on the files around the weights: a torn ``trainer_state.json`` (a save killed
mid-write before the backup), a sharded checkpoint whose index names a shard that is not there, a
``torch.distributed.checkpoint`` folder whose ``.distcp`` file was cut short. The restore proves the
bytes are those backed up; these checks prove those bytes can be loaded:

- every ``*.json`` file parses (up to ``MAX_JSON`` bytes);
- a shard index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``): every shard its
  ``weight_map`` names is in the snapshot beside it, and a safetensors shard holds every tensor the
  index maps to it (read from its header);
- a DCP folder (``.metadata`` beside ``*.distcp``): ``.metadata`` is walked by the inert unpickler of
  legacy_torch.py (nothing it names is imported or called), every item it places in a ``.distcp``
  file lies inside that file, and each item stored as a torch archive passes its CRC-32.
"""

from __future__ import annotations

import io
import json
import os
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

from ..errors import FileFormatError
from ..formats import pread_at, safetensors
from ..formats.zipmembers import ReadAtFile
from .legacy_torch import InertUnpickler, StandIn

MAX_JSON = 64 * 1024 * 1024  # trainer_state.json of a long run is a few MB; a tokenizer.json tens
MAX_DCP_METADATA = 256 * 1024 * 1024  # walked in pure Python: a few MB for a model of thousands of tensors
DCP_METADATA = ".metadata"
DCP_SHARD = ".distcp"
_ZIP_HEAD = b"PK\x03\x04"


@dataclass(frozen=True)
class LoadCheck:
    path: str
    loader: str  # "safetensors" | "torch" | "torch-archive" | "torch-legacy" | "json" | "shard-index" | "dcp" | "link"
    ok: bool
    detail: str
    seconds: float
    partial: bool = False  # a lesser check, for want of the library that loads the file


def archive_crc_problem(read: Callable[[], zipfile.ZipFile]) -> str | None:
    """Why the zip archive that ``read`` opens fails (a record's CRC-32, its directory), or None.
    torch.load checks no CRC: a bit flipped in a tensor on the trainer's disk loads silently."""
    try:
        with read() as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, EOFError) as exc:  # as zipmembers.py
        return f"{type(exc).__name__}: {exc}"
    return None if bad is None else f"record {bad} fails its CRC"


def check_json(name: str, path: str) -> LoadCheck | str:
    """A LoadCheck, or why the file is skipped (a str)."""
    started = time.monotonic()
    if os.path.getsize(path) > MAX_JSON:
        return f"larger than {MAX_JSON // 2**20} MiB: not parsed"
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        return LoadCheck(name, "json", False, f"not valid JSON ({exc})", seconds_since(started))
    except RecursionError:
        return LoadCheck(name, "json", False, "not loadable JSON (nested too deep)", seconds_since(started))
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if isinstance(weight_map, dict):
        problem, detail = _shard_index_problem(os.path.dirname(path), weight_map)
        return LoadCheck(name, "shard-index", problem is None, problem or detail, seconds_since(started))
    return LoadCheck(name, "json", True, "parsed", seconds_since(started))


def _shard_index_problem(folder: str, weight_map: dict[Any, Any]) -> tuple[str | None, str]:
    by_shard: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or os.path.isabs(shard) or ".." in shard.split("/"):
            return f"its weight_map gives {tensor!r} the shard {shard!r}, which is no file name", ""
        by_shard.setdefault(shard, []).append(str(tensor))
    for shard, tensors in sorted(by_shard.items()):
        shard_path = os.path.join(folder, shard)
        if not os.path.isfile(shard_path):
            return f"names the shard {shard}, which the snapshot does not hold beside it", ""
        if shard.endswith(".safetensors"):
            try:
                with open(shard_path, "rb") as f:
                    layout = safetensors.parse(pread_at(f.fileno()), os.fstat(f.fileno()).st_size, shard)
            except FileFormatError:
                continue  # the shard's own load check says what is wrong with it
            held = {t.name for t in layout.tensors}
            missing = [t for t in tensors if t not in held]
            if missing:
                return f"maps {len(missing)} tensor(s) to {shard}, which lacks them (e.g. {missing[0]!r})", ""
    return None, f"{len(by_shard)} shard(s) present, {len(weight_map)} tensors mapped"


def is_dcp_metadata(path: str, names: set[str]) -> bool:
    """Whether ``path`` (a file of a snapshot whose files are ``names``) is the ``.metadata`` of a
    torch.distributed.checkpoint folder: so named, a pickle, beside a ``.distcp`` file (another tool's
    ``.metadata`` is not loaded)."""
    folder, _, base = path.rpartition("/")
    prefix = f"{folder}/" if folder else ""
    return base == DCP_METADATA and any(
        n.startswith(prefix) and "/" not in n[len(prefix) :] and n.endswith(DCP_SHARD) for n in names
    )


def check_dcp(name: str, path: str) -> LoadCheck | str:
    """``path``: the ``.metadata`` file of a torch.distributed.checkpoint folder. A LoadCheck, or why
    the folder is skipped (a str)."""
    started = time.monotonic()
    if os.path.getsize(path) > MAX_DCP_METADATA:
        return f"larger than {MAX_DCP_METADATA // 2**20} MiB: not walked"
    problem, detail = _dcp_problem(os.path.dirname(path), path)
    return LoadCheck(name, "dcp", problem is None, problem or detail, seconds_since(started))


def _dcp_problem(folder: str, path: str) -> tuple[str | None, str]:
    try:
        with open(path, "rb") as f:
            metadata = InertUnpickler(f).load()
    except Exception as exc:  # whatever damage makes of the opcodes (RecursionError, MemoryError too)
        return f"its .metadata does not unpickle ({type(exc).__name__}: {str(exc)[:200]})", ""
    storage = _fields(metadata).get("storage_data")
    if not isinstance(storage, dict):
        return "its .metadata holds no storage_data (not a torch.distributed.checkpoint?)", ""
    items_by_file: dict[str, list[tuple[str, int, int, bool]]] = {}
    for index, info in storage.items():
        # nothing out of the pickle is shown but checked strings: shared references make a repr exponential
        fqn = _fields(index).get("fqn")
        item = fqn[:200] if isinstance(fqn, str) else "an item"
        fields = _fields(info)
        relative, offset, length = fields.get("relative_path"), fields.get("offset"), fields.get("length")
        if not isinstance(relative, str) or not _count(offset) or not _count(length):
            lacks = [n for n, ok in (("relative_path", isinstance(relative, str)), ("offset", _count(offset)),
                                     ("length", _count(length))) if not ok]  # fmt: skip
            return f"its .metadata gives {item!r} no valid {' or '.join(lacks)}", ""
        relative = relative[:1000]
        if os.path.isabs(relative) or ".." in relative.split("/"):
            return f"its .metadata places {item!r} in {relative!r}, outside its folder", ""
        items_by_file.setdefault(relative, []).append((item, offset, length, not fields.get("transform_descriptors")))
    for relative, items in sorted(items_by_file.items()):
        file_path = os.path.join(folder, relative)
        if not os.path.isfile(file_path):
            return f"its .metadata places {items[0][0]!r} in {relative}, which the snapshot does not hold", ""
        with open(file_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            read_at = pread_at(f.fileno())
            for item, offset, length, plain in items:
                if offset + length > size:
                    return f"cut short: {relative} has {size} bytes, {item!r} lies at {offset}..{offset + length}", ""
                if plain and read_at(offset, 4) == _ZIP_HEAD:  # torch.save'd (tensors, pickled objects)
                    window = _window(read_at, offset, length)
                    problem = archive_crc_problem(lambda: zipfile.ZipFile(window))  # noqa: B023 - called at once
                    if problem:
                        return f"{item!r} in {relative}: {problem}", ""
    files = len(items_by_file)
    return None, f"{len(storage)} items in {files} file(s), each whole (bounds, CRC-32 of its archive)"


def _fields(obj: object) -> dict[str, Any]:
    """The fields an inert stand-in was given (a dataclass's ``__dict__``), else none."""
    state = obj.state if isinstance(obj, StandIn) else None
    if isinstance(state, tuple) and len(state) == 2 and all(isinstance(p, dict | None) for p in state):
        state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots) of a class with __slots__
    return state if isinstance(state, dict) else {}


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _window(read_at: Callable[[int, int], bytes], start: int, length: int) -> io.BufferedReader:
    """The ``length`` bytes at ``start`` as a seekable file, read as needed (a shard may be GBs)."""
    return io.BufferedReader(ReadAtFile(lambda offset, n: read_at(start + offset, n), length), 64 * 1024)


def seconds_since(started: float) -> float:
    return round(time.monotonic() - started, 3)
