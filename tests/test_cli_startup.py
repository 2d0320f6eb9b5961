"""What the CLI loads before an encrypted command's scrypt head start (cli/__init__.py).

scrypt is the longest step before an encrypted command moves data (~0.25 s here); it starts on
another core as soon as the keyfile module is loaded, so that module must not pull in the storage
layer (fsspec and friends took ~45 ms, which every encrypted command then waited for)."""

from __future__ import annotations

import subprocess
import sys


def test_the_keyfile_module_loads_without_the_storage_layer_or_numpy():
    heavy = ("fsspec", "numpy", "ckptvault.store")
    code = f"import sys, ckptvault.crypto.keyfile; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
