"""Header parsers for checkpoint file formats: pure functions of a ``read_at`` callable, no I/O of their own.

Nouns:
- a *tensor* (``TensorInfo``) is a named byte range of a file holding elements of one dtype;
- a *layout* (``FileLayout``) is what a file's header says: its format, where the header ends,
  and its tensors (for torch zip checkpoints: one per stored storage record);
- ``read_at(offset, length) -> bytes`` is how a parser reads, so the same code reads a local
  file during a backup (``pread_at(fd)``) and a file inside a snapshot (fetching only the chunks it
  touches).

``read_layout`` recognises safetensors, ``.npy``/``.npz`` and PyTorch zip checkpoints
(``torch.save`` format) by their content, not their name; ``not_whole`` says when such a file ends
before its format says it does.
"""

from __future__ import annotations

from .dtypes import DTYPES, element_width
from .model import FileLayout, ReadAt, TensorInfo, pread_at
from .sniff import not_whole, read_layout

__all__ = ["DTYPES", "FileLayout", "ReadAt", "TensorInfo", "element_width", "not_whole", "pread_at", "read_layout"]
