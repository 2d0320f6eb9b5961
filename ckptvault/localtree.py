"""Removing a local folder tree, however deep, without following links.

``shutil.rmtree`` recurses once per folder level before Python 3.13 and raises RecursionError on a
tree ~1,000 levels deep, which a backup stores and a restore makes (a drill removes what it
restored; a pin, what it linked). This walk keeps its place in a list instead, and holds one folder
open at a time: each folder is entered from its parent's descriptor without following a link and
checked to be the folder that was listed, and left for its parent through ``..``, checked the same
way, so a folder swapped for a link (or moved) while the walk runs never leads it outside the tree.
"""

from __future__ import annotations

import contextlib
import os
import stat

_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OWNER_ALL = stat.S_IRWXU


def remove_tree(path: str) -> int:
    """``rm -rf path``, as far as it goes: what cannot be removed is left (callers sweep leftovers
    later), also through folders with a read-only mode. A link is removed, never followed. Returns
    the bytes the removed files held on the disk."""
    try:
        top = os.lstat(path)
    except OSError:
        return 0
    if not stat.S_ISDIR(top.st_mode):
        return _unlink(path, top, None)
    fd = _enter(path, None, top)
    if fd is None:
        return 0
    freed = 0
    # the folders from the top down to the one open: (identity, name in its parent, names not yet removed)
    path_down = [((top.st_dev, top.st_ino), path, _names(fd))]
    try:
        while path_down:
            names = path_down[-1][2]
            if names:
                name = names.pop()
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    freed += _unlink(name, st, fd)
                elif (child := _enter(name, fd, st)) is not None:
                    os.close(fd)
                    fd = child
                    path_down.append(((st.st_dev, st.st_ino), name, _names(fd)))
                continue
            _, name, _ = path_down.pop()
            if not path_down:
                break
            parent = _enter("..", fd, None, expect=path_down[-1][0])
            if parent is None:  # moved away meanwhile: what is left of it is not ours to follow
                return freed
            os.close(fd)
            fd = parent
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(path)
    return freed


def _enter(
    name: str, dir_fd: int | None, st: os.stat_result | None, *, expect: tuple[int, int] | None = None
) -> int | None:
    """A descriptor of folder ``name`` (in ``dir_fd``), opened without following a link, or None
    when it is not the folder ``st`` (or ``expect``) describes; its owner gets rwx, so that its
    entries can go (a folder restored 0o555)."""
    if st is not None:
        expect = (st.st_dev, st.st_ino)
    try:
        fd = os.open(name, _FOLDER, dir_fd=dir_fd)
    except PermissionError:  # no read permission (0o333): its mode is set through an O_PATH descriptor
        if not _give_owner_all(name, dir_fd, expect):
            return None
        try:
            fd = os.open(name, _FOLDER, dir_fd=dir_fd)
        except OSError:
            return None
    except OSError:
        return None
    own = os.fstat(fd)
    if (own.st_dev, own.st_ino) != expect:
        os.close(fd)
        return None
    if stat.S_IMODE(own.st_mode) & _OWNER_ALL != _OWNER_ALL:
        with contextlib.suppress(OSError):
            os.fchmod(fd, stat.S_IMODE(own.st_mode) | _OWNER_ALL)
    return fd


def _give_owner_all(name: str, dir_fd: int | None, expect: tuple[int, int] | None) -> bool:
    try:
        handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        own = os.fstat(handle)
        if (own.st_dev, own.st_ino) != expect:
            return False
        os.chmod(f"/proc/self/fd/{handle}", stat.S_IMODE(own.st_mode) | _OWNER_ALL)  # that inode, not a name
        return True
    except OSError:
        return False
    finally:
        os.close(handle)


def _names(fd: int) -> list[str]:
    try:
        return os.listdir(fd)
    except OSError:
        return []


def _unlink(name: str, st: os.stat_result, dir_fd: int | None) -> int:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        return 0
    return st.st_blocks * 512
