"""Header parsers for checkpoint file formats: pure functions of a ``read_at`` callable, no I/O of their own.

Nouns:
- a *tensor* (``TensorInfo``) is a named byte range of a file holding elements of one dtype;
- a *layout* (``FileLayout``) is what a file's header says: its format, where the header ends,
  and its tensors (for torch zip checkpoints: one per stored storage record);
- ``read_at(offset, length) -> bytes`` is how a parser reads, so the same code reads a local
  file during a backup and a file inside a snapshot (fetching only the chunks it touches).

``read_layout`` recognises safetensors, ``.npy``/``.npz`` and PyTorch zip checkpoints
(``torch.save`` format) by their content, not their name.
"""

from __future__ import annotations

from .dtypes import DTYPES, element_width
from .model import FileLayout, ReadAt, TensorInfo
from .sniff import read_layout

__all__ = ["DTYPES", "FileLayout", "ReadAt", "TensorInfo", "element_width", "read_layout"]
