"""Removing a local folder tree, however deep.

``shutil.rmtree`` recurses once per folder level before Python 3.13 and raises RecursionError on a
tree ~1,000 levels deep, which a backup stores and a restore makes (a drill removes what it
restored; a pin, what it linked). This walk keeps its folders in a list instead.
"""

from __future__ import annotations

import contextlib
import os
import stat


def remove_tree(path: str) -> int:
    """``rm -rf path``, as far as it goes: what cannot be removed is left (callers sweep leftovers
    later), also through folders with a read-only mode. A link is removed, never followed. Returns
    the bytes the removed files held on the disk."""
    try:
        top = os.lstat(path)
    except OSError:
        return 0
    if not stat.S_ISDIR(top.st_mode):
        return _unlink(path, top)
    freed = 0
    folders: list[str] = []
    pending = [path]
    while pending:
        folder = pending.pop()
        with contextlib.suppress(OSError):
            os.chmod(folder, 0o700)  # a restored 0o555 folder: its entries could not go otherwise
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError:
            continue
        folders.append(folder)
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                pending.append(entry.path)
            else:
                freed += _unlink(entry.path, st)
    for folder in reversed(folders):  # inner folders first
        with contextlib.suppress(OSError):
            os.rmdir(folder)
    return freed


def _unlink(path: str, st: os.stat_result) -> int:
    try:
        os.unlink(path)
    except OSError:
        return 0
    return st.st_blocks * 512
