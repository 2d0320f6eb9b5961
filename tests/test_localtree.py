"""remove_tree: ``rm -rf`` that never follows a link, however the tree changes while it runs."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ckptvault import localtree
from ckptvault.localtree import remove_tree
from tests.test_unreadable_repo import NO_OVERRIDE


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "precious").write_text("keep me")
    folder.chmod(0o755)
    return folder


def untouched(outside: Path) -> bool:
    return (outside / "precious").read_text() == "keep me" and stat.S_IMODE(outside.stat().st_mode) == 0o755


def test_links_are_removed_never_followed(tmp_path: Path, outside: Path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f").write_bytes(b"x" * 10_000)
    (root / "to-folder").symlink_to(outside)
    (root / "sub" / "to-file").symlink_to(outside / "precious")
    assert remove_tree(str(root)) >= 10_000
    assert not root.exists() and untouched(outside)


def test_a_folder_swapped_for_a_link_while_the_walk_runs_is_not_followed(
    tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
):
    """The first version walked by path: a folder replaced by a link after it was listed had the link's
    target made 0o700 and emptied (a review's reproduction)."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f").write_text("x")

    swapped = []

    def swap_first(call):  # at the walk's first use of the folder after listing it
        def hooked(name, *args, **kwargs):
            if str(name).endswith("sub") and not swapped:
                swapped.append(name)
                shutil.rmtree(root / "sub")
                (root / "sub").symlink_to(outside)  # listed and stat'ed as a folder, now a link
            return call(name, *args, **kwargs)

        return hooked

    monkeypatch.setattr(localtree.os, "open", swap_first(os.open))
    monkeypatch.setattr(localtree.os, "chmod", swap_first(os.chmod))
    remove_tree(str(root))
    assert swapped and untouched(outside)


def test_folders_without_write_or_read_permission_are_removed_too(tmp_path: Path):
    """As a user without root's override of permissions: a folder restored 0o555, 0o333 or 0o000."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root ignores file permissions, and setpriv (util-linux) is not installed to drop that")
        prefix = NO_OVERRIDE
    root = tmp_path / "root"
    for name, mode in (("r-x", 0o555), ("-wx", 0o333), ("---", 0o000)):
        (root / name / "inner").mkdir(parents=True)
        (root / name / "inner" / "f").write_text("x")
        (root / name).chmod(mode)
    code = "import sys; from ckptvault.localtree import remove_tree; remove_tree(sys.argv[1])"
    subprocess.run([*prefix, sys.executable, "-c", code, str(root)], check=True, timeout=60)
    assert not root.exists()
