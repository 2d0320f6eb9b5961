"""A small real filesystem for a test: a tmpfs mounted under the test's folder (needs root; the test
is skipped, saying so, where it cannot be mounted), unmounted afterwards."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(mount: Path, size: str, what: str) -> Iterator[Path]:
    """``size`` as mount takes it ("6m"); ``what``: the test, named in the skip reason."""
    mount.mkdir(parents=True, exist_ok=True)
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {what} did not run")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
