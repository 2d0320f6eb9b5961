"""A small, deterministic sample checkpoint (for ``ckptvault demo`` and the docs).

Laid out like a Hugging Face Trainer save: a real safetensors file whose first half is
"frozen" (identical at every step) and second half changes, a torch-like optimizer blob
that changes completely, and small JSON files.
"""

from __future__ import annotations

import json
import os
import random
import struct

from ..errors import StorageError, StorageFullError
from ..store.failures import Kind, classify


def _safetensors(tensors: dict[str, bytes]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, data in tensors.items():
        header[name] = {"dtype": "F32", "shape": [len(data) // 4], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values())


ROOM_HINT = "free space there, or set TMPDIR to a folder with room (the demo writes about 80 MB)"


def write_sample_checkpoint(directory: str, step: int, *, layers: int = 8, layer_bytes: int = 2 << 20) -> int:
    """Write checkpoint ``step`` into ``directory``; returns the bytes written."""
    os.makedirs(directory, exist_ok=True)
    tensors = {}
    for i in range(layers):
        frozen = i < layers // 2
        rng = random.Random(f"layer{i}" if frozen else f"layer{i}-step{step}")
        tensors[f"model.layers.{i}.weight"] = rng.randbytes(layer_bytes)
    files = {
        "model.safetensors": _safetensors(tensors),
        "optimizer.pt": random.Random(f"optim-{step}").randbytes(layers * layer_bytes // 2),
        "config.json": json.dumps({"model_type": "demo", "layers": layers}, indent=2).encode(),
        "trainer_state.json": json.dumps({"global_step": step}, indent=2).encode(),
    }
    for name, data in files.items():
        try:
            with open(os.path.join(directory, name), "wb") as f:
                f.write(data)
        except OSError as exc:
            raise _write_error(exc, directory, name) from None
    return sum(len(d) for d in files.values())


def _write_error(exc: OSError, directory: str, name: str) -> StorageError:
    """A sample file that could not be written, said with where (the demo writes into the system's
    temporary folder, which the user may not think of) rather than as an internal error."""
    parent, written = os.path.split(os.path.normpath(directory))
    reason = exc.strerror or str(exc)
    if classify(exc).kind is Kind.FULL:
        return StorageFullError("write", f"{written}/{name}", parent, reason, hint=ROOM_HINT)
    message = (
        f"cannot write the sample checkpoint {written}/{name} in {parent}: {reason}; set TMPDIR to a writable folder"
    )
    return StorageError("write", f"{written}/{name}", parent, reason, message=message)
