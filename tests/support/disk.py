"""Tests that write large files check the free disk first: on a nearly full machine they are skipped
loudly, named in a section of their own at the end of the run, instead of failing with ENOSPC (and
filling the disk under every test after them, as a CI run once did)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

MARGIN = 256 * 1024 * 1024  # slack: what the session's servers keep writing (SeaweedFS keeps deleted data)
NOT_TESTED: dict[str, str] = {}  # test id -> why


def need_free_disk(path: Path, nbytes: int) -> None:
    free = shutil.disk_usage(path).free
    if free < nbytes + MARGIN:
        why = f"needs {(nbytes + MARGIN) / 1e9:.2f} GB of free disk, {free / 1e9:.2f} GB free under {path}"
        NOT_TESTED[os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]] = why
        pytest.skip(f"NOT TESTED (disk full): {why}")
