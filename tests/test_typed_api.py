"""The typed API promise: a user's script that uses ckptvault's public names passes mypy --strict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "fixtures" / "typed_user_script.py"


def test_a_users_resume_script_type_checks_strictly(tmp_path: Path):
    pytest.importorskip("mypy")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--follow-imports=silent",
            "--cache-dir",
            str(tmp_path),
            str(SCRIPT),
        ],
        capture_output=True,
        text=True,
        env={"MYPYPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_package_itself_type_checks(tmp_path: Path):
    """Its own annotations hold: a wrong one would mislead the users' checkers above."""
    pytest.importorskip("mypy")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path), "ckptvault"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
