"""Pins: hard links into a staging folder, so a checkpoint outlives its trainer's rotation.

A hard link keeps a file's inode, and so its bytes, after the trainer deletes the name it
wrote; making one costs a metadata write (microseconds), not a copy. Where a hard link is
impossible (the staging folder is on another filesystem, or the filesystem has none) the file
is copied instead. A pin only ever adds or updates files, never removes them: a trainer's
rotation deletes a checkpoint file by file, and mirroring that would empty the pin.

A hard link pins the inode, not the bytes: a file rewritten *in place* (same inode) changes in
the pin too. Writers that publish by rename (write a temporary name, then rename it) and
writers that write each checkpoint to new files are pinned exactly.

Every file inside a checkpoint is pinned, dot-files included (torch.distributed.checkpoint's
``.metadata``), except names that end like one still being written (``*.tmp``: names.py) and what
the backup's exclude patterns leave out (``Pin.excluded``): a file the backup will not store must
not make the pin change (a log appended to while the checkpoint ships).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TypeVar

from ..durable import replace_with
from ..localtree import remove_tree
from .names import is_unfinished, source_name

log = logging.getLogger("ckptvault")

# link(2) failures that mean "no hard links here", as opposed to a real error
NO_LINK_ERRNOS = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY
DELETED_WHILE_PINNED = "deleted while it was being pinned"
META = "pin.json"
DATA = "data"
IN_PLACE = "-in-place"  # the name's end of a stand-in pin (``stand_in``: never made on disk)
OWNER_LOCK = "owner.lock"  # a POSIX lock on it is held by the process that owns the pin, while it lives

Signature = tuple[tuple[str, ...], ...]
PinHolder = TypeVar("PinHolder")  # what holds pins waiting to ship: a watched checkpoint, a queued backup
Excluded = Callable[[str, bool], bool]  # (path relative to the pinned source, is a folder) -> left out


class NoHardLinks(OSError):
    """Raised by ``link_only`` pins when the filesystem refuses hard links."""


def signature(path: str, excluded: Excluded | None = None) -> Signature:
    """What identifies a checkpoint's content without reading it: every file's relative path,
    size and mtime (ns), every symlink's target, every directory, but those ``excluded``. Names
    of files still being written inside (``*.tmp``...) are included, so their growth counts as
    activity. Raises FileNotFoundError when ``path`` is gone."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        return (_describe("", path, st),)
    out: list[tuple[str, ...]] = []
    for rel, entry in walk(path, excluded):
        try:
            out.append(_describe(rel, entry.path, entry.stat(follow_symlinks=False)))
        except FileNotFoundError:
            continue  # deleted while we looked: the next look sees the rest
    return tuple(sorted(out))


def walk(path: str, excluded: Excluded | None = None) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """Every entry below the folder ``path`` but those ``excluded`` (and what lies in them), with its
    path relative to ``path``; links are not followed. Folders are kept in a list, not walked by
    recursion: a checkpoint may nest deeper than Python's limit. What is deleted while it is walked is
    left out; ``path`` itself gone raises FileNotFoundError."""
    folders = [(path, "")]
    while folders:
        directory, prefix = folders.pop()
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except FileNotFoundError:
            if not prefix:
                raise
            continue
        for entry in entries:
            rel = prefix + entry.name
            try:
                is_dir = entry.is_dir(follow_symlinks=False)  # from the listing where it says: no stat
            except FileNotFoundError:
                continue
            if excluded is not None and excluded(rel, is_dir):
                continue
            yield rel, entry
            if is_dir:
                folders.append((entry.path, rel + "/"))


def _describe(rel: str, path: str, st: os.stat_result) -> tuple[str, ...]:
    if stat.S_ISLNK(st.st_mode):
        return (rel, "l", os.readlink(path))
    if stat.S_ISDIR(st.st_mode):
        return (rel, "d")
    return (rel, "f", str(st.st_size), str(st.st_mtime_ns))


def digest(sig: Signature) -> str:
    """16 hex digits naming a signature: stored as the ``watch-sig`` tag, compared after a restart."""
    return hashlib.sha256(json.dumps(sig, separators=(",", ":")).encode()).hexdigest()[:16]


def files_of(sig: Signature) -> Iterator[tuple[str, int, int]]:
    """A signature's files: path (relative to the checkpoint; "" for a file checkpoint), size, mtime in ns."""
    for item in sig:
        if item[1] == "f":
            yield item[0], int(item[2]), int(item[3])


def bytes_of(sig: Signature) -> int:
    return sum(size for _, size, _ in files_of(sig))


# Free room kept on the checkpoints' disk, in saves: this many times the size of the next save expected.
ROOM_FOR_A_SAVE = 1.5


def free_bytes(folder: str) -> int | None:
    """Room left for an unprivileged writer (the trainer) on ``folder``'s disk; None when it cannot be told."""
    try:
        disk = os.statvfs(folder)
    except OSError:
        return None
    return disk.f_bavail * disk.f_frsize


def make_room(
    free: int,
    needed: float,
    waiting: Iterable[PinHolder],
    held: Callable[[PinHolder], int],
    drop: Callable[[PinHolder, int, int], bool],
) -> int:
    """Drop pins waiting to ship, in the order given (oldest first), until ``free`` bytes reach ``needed``:
    the one rule of the watcher and of ``backup_async`` for leaving the trainer room for its next save.
    ``held(w)`` is what dropping ``w`` would free, 0 for one that frees nothing or must stay (its source
    is still there, it is the newest); it is asked only while room is short, as it walks the pins.
    ``drop(w, free, held)`` drops it and says whether it could (a backup may have started meanwhile).
    What a dropped pin held counts as freed at once (some filesystems free space late), so the disk is
    not looked at again: returns the free room so counted."""
    for item in waiting:
        if free >= needed:
            break
        freed = held(item)
        if freed and drop(item, free, freed):
            free += freed
    return free


def is_subset(sig: Signature, of: Signature) -> bool:
    return set(sig) <= set(of)


def write_json(path: str, doc: object) -> None:
    """``doc`` as JSON at ``path``, whole or not at all."""

    def dump(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)

    replace_with(path, dump, f".{os.path.basename(path)}.")


@dataclass
class Pin:
    """``root/data/<name>`` mirrors the pinned source; ``root/pin.json`` says where it came from."""

    root: str
    name: str
    source: str
    source_ino: int
    copied: bool = False  # at least one file had to be copied
    skip_dir: tuple[int, int] | None = None  # (device, inode) of a folder never pinned: the vault
    excluded: Excluded | None = None  # what is never pinned inside: what the backup leaves out
    in_place: bool = False  # no pin could be made (``stand_in``): ``data`` is the source, nothing on disk
    owner_lock: int | None = field(default=None, repr=False, compare=False)  # the descriptor holding OWNER_LOCK

    @property
    def data(self) -> str:
        return self.source if self.in_place else os.path.join(self.root, DATA, self.name)

    @property
    def pin_id(self) -> str:
        return os.path.basename(self.root)

    @property
    def made_at(self) -> datetime | None:
        """When the pin was made (its name starts with the time, in ns), so when its checkpoint was
        captured; None for a name not made by ``new_pin_root``."""
        stamp = pinned_at_ns(self.pin_id.removesuffix(IN_PLACE))
        return None if stamp is None else datetime.fromtimestamp(stamp / 1e9, timezone.utc)

    def save_meta(self, **extra: object) -> None:
        if self.in_place:
            return
        doc = {"name": self.name, "source": self.source, "source_ino": self.source_ino, "copied": self.copied, **extra}
        write_json(os.path.join(self.root, META), doc)

    def hold_owner_lock(self) -> None:
        """Lock ``OWNER_LOCK`` in the pin for as long as this process lives or until ``release``: the
        kernel drops a dead process's POSIX locks, so a process that cannot look the owner up (another
        PID namespace: a container restarted) still tells a live owner from a dead one. POSIX locks,
        not flock: a forked child (a data loader's worker) does not inherit them. Where the filesystem
        has no locks, nothing is held and the owner is judged as before."""
        if self.owner_lock is not None or self.in_place:
            return
        try:
            fd = os.open(os.path.join(self.root, OWNER_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return
        self.owner_lock = fd

    def drop_owner_lock(self) -> None:
        fd, self.owner_lock = self.owner_lock, None
        if fd is not None:
            os.close(fd)

    def release(self) -> None:
        """Delete the pin (its snapshot is durable, or it is no longer wanted). The metadata goes
        first: a release killed half way leaves a pin without it, which ``load`` discards, never a
        pin whose data is partly deleted that a restart would ship as the checkpoint."""
        if self.in_place:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.root, META))
            remove_tree(self.root)
        finally:
            self.drop_owner_lock()
        parent = os.path.dirname(self.root)
        with contextlib.suppress(OSError):
            os.rmdir(parent)  # the staging folder goes when its last pin does


def owner_lock_held(root: str) -> bool | None:
    """Whether a live process holds the pin's ``OWNER_LOCK`` (``Pin.hold_owner_lock``); None when the
    pin has none (made by a version without it, or on a filesystem without locks). Only for a pin
    this process does not own: closing any descriptor of a file drops this process's POSIX locks
    on it."""
    try:
        fd = os.open(os.path.join(root, OWNER_LOCK), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return True if exc.errno in (errno.EACCES, errno.EAGAIN) else None
    finally:
        os.close(fd)  # a lock it got goes with it
    return False


# A pin folder's name: when it was made (ns), so that names sort in creation order (the watcher ships the
# newest first) and tell how old a pin is, and a random part.
PIN_NAME = re.compile(r"^(\d{20})-[0-9a-f]{6}$")


def new_pin_name() -> str:
    return f"{time.time_ns():020d}-{secrets.token_hex(3)}"


def pinned_at_ns(name: str) -> int | None:
    """When the pin named ``name`` was made (ns since the epoch); None for a name no pin has."""
    made = PIN_NAME.match(name)
    return int(made.group(1)) if made else None


def new_pin_root(staging: str) -> str:
    """A fresh pin folder."""
    os.makedirs(staging, exist_ok=True)
    root = os.path.join(staging, new_pin_name())
    try:
        os.makedirs(os.path.join(root, DATA))
    except BaseException:
        remove_tree(root)  # ENOSPC between the two folders
        raise
    return root


def create(
    source: str,
    staging: str,
    *,
    link_only: bool = False,
    meta: Callable[[Pin], dict[str, object]] | None = None,
    skip_dir: tuple[int, int] | None = None,
    excluded: Excluded | None = None,
) -> Pin:
    """Pin ``source`` (a file or a directory) under ``staging``; ``meta(pin)``, called once the
    files are pinned, goes into its metadata, which is written last: a pin is never seen complete
    without it.

    With ``link_only``, a filesystem that refuses hard links raises NoHardLinks (and leaves
    nothing behind) instead of copying: a caller on a training loop's thread must not copy."""
    source = os.path.abspath(source)
    st = os.stat(source)  # a symlinked source means what it points at
    name = source_name(source)
    root = new_pin_root(staging)
    pin = Pin(root=root, name=name, source=source, source_ino=st.st_ino, skip_dir=skip_dir, excluded=excluded)
    try:
        if not sync(pin, link_only=link_only) and not source_alive(pin):
            # files listed went before they were linked, and the folder went too: it was being
            # deleted (or replaced and deleted) while it was pinned, so the pin holds part of it
            raise FileNotFoundError(errno.ENOENT, DELETED_WHILE_PINNED, source)
        pin.save_meta(**(meta(pin) if meta else {}))
    except BaseException:
        remove_tree(root)
        pin.drop_owner_lock()
        raise
    return pin


def stand_in(source: str, staging: str, *, excluded: Excluded | None = None) -> Pin:
    """A pin that holds nothing: the source read where it is, for a checkpoint no pin could be made
    for (its disk is full). It protects nothing, so it is never saved: a restart sees the source
    again, if it is still there."""
    source = os.path.abspath(source)
    st = os.stat(source)
    name = source_name(source)
    root = os.path.join(staging, new_pin_name() + IN_PLACE)  # never made: a name
    return Pin(root=root, name=name, source=source, source_ino=st.st_ino, excluded=excluded, in_place=True)


def load(root: str) -> tuple[Pin, dict[str, object]] | None:
    """A pin left by an earlier run, with its metadata; None when it never got complete metadata (then
    it is removed: its source was never pinned before a crash, so it was never promised)."""
    loaded = read(root)
    if loaded is None:
        remove_tree(root)
    return loaded


def read(root: str) -> tuple[Pin, dict[str, object]] | None:
    """A pin and its whole metadata document; None when the metadata is missing or unreadable."""
    try:
        with open(os.path.join(root, META), encoding="utf-8") as f:
            doc = json.load(f)
        pin = Pin(root, str(doc["name"]), str(doc["source"]), int(doc["source_ino"]), bool(doc.get("copied")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pin, doc


def source_alive(pin: Pin) -> bool:
    """The pinned source still exists under its name as the same file or directory."""
    try:
        return os.stat(pin.source).st_ino == pin.source_ino
    except OSError:
        return False


def bytes_held(pin: Pin) -> int:
    """The disk space that releasing the pin would free: its files no other name links to."""
    if pin.in_place:
        return 0
    try:
        if not os.path.isdir(pin.data):
            return _held(os.lstat(pin.data))
        return sum(_held(entry.stat(follow_symlinks=False)) for _rel, entry in walk(pin.data))
    except FileNotFoundError:  # released meanwhile, or a file of it (a pin is only ever cut by hand)
        return 0


def _held(st: os.stat_result) -> int:
    return st.st_blocks * 512 if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 else 0


def shares_a_file(pin: Pin) -> bool | None:
    """Whether the pinned folder still holds one of the pin's files (the same inode, a hard link)
    under the same path. False when it holds files but none of the pin's: the folder it was pinned
    from keeps sharing them until all its files are replaced (or deleted) between two syncs, as when
    the folder itself was replaced. None when that cannot tell: the pin or the folder holds no file,
    or the pin holds copies (another filesystem, links refused)."""
    if pin.in_place or pin.copied:
        return None
    differs = False
    stack = [""]  # relative folders (a stack, not os.walk's recursion: checkpoints can nest deep)
    while stack:
        rel = stack.pop()
        try:
            with os.scandir(os.path.join(pin.data, rel)) as it:
                entries = list(it)
        except OSError:
            continue
        for entry in entries:
            path = os.path.join(rel, entry.name)
            if entry.is_dir(follow_symlinks=False):
                stack.append(path)
                continue
            try:
                mine = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(mine.st_mode):
                continue
            try:
                theirs = os.lstat(os.path.join(pin.source, path))
            except OSError:
                differs = True  # gone from the folder (the pin keeps it)
                continue
            if mine.st_dev != theirs.st_dev:
                return None
            if os.path.samestat(mine, theirs):
                return True
            differs = True
    if not differs:
        return None
    try:
        with os.scandir(pin.source) as it:
            return False if any(True for _ in it) else None  # an emptied folder: nothing to tell by yet
    except OSError:
        return None


def sync(pin: Pin, *, link_only: bool = False) -> bool:
    """Bring the pin up to date with its source: link (or copy) new files, relink files that
    were replaced by a rename. Files gone from the source stay pinned. A source that vanished
    meanwhile leaves the pin as it is. False when entries listed in the source went before they
    were pinned (the folder, or part of it, was being deleted).

    A folder is walked through a descriptor of the folder pinned, not by its path: a trainer that
    publishes a save by renaming a new folder over the name (``latest/``) while the walk runs must
    not get the new save's files linked into the old one's pin."""
    if pin.in_place:
        return True
    try:
        st = os.stat(pin.source)
    except FileNotFoundError:
        return True
    if st.st_ino != pin.source_ino:
        return True  # the name now holds another checkpoint; this pin keeps the old one
    copied = pin.copied
    whole = True
    if stat.S_ISDIR(st.st_mode):
        try:
            top = os.open(pin.source, FOLDER_FLAGS)
        except FileNotFoundError:
            return True
        try:
            st = os.fstat(top)
            if st.st_ino != pin.source_ino:
                return True  # replaced since the stat above
            with contextlib.suppress(FileExistsError):
                os.mkdir(pin.data)  # not makedirs: a pin released meanwhile (FileNotFoundError) is not made again
            whole = _sync_tree(pin, top, st, link_only)
        finally:
            os.close(top)
    elif pin.excluded is not None and pin.excluded("", False):
        # a file source the backup leaves out (one of several): an empty stand-in keeps the job's
        # sources, and so the snapshot's paths, as given, and its changes count for nothing
        if not os.path.lexists(pin.data):
            _replace_with(pin.data, lambda tmp: open(tmp, "xb").close())
    else:
        _sync_file(pin, pin.source, pin.data, link_only)
    if pin.copied and not copied:
        # a pin made of links now holds copies (a folder pinned empty whose files came from another
        # filesystem): a restart must not take copies for a replaced folder
        update_meta(pin, copied=True)
    return whole


def update_meta(pin: Pin, **fields: object) -> None:
    """Change fields of a pin's metadata (nothing before ``create`` writes it, with the fields it is given)."""
    path = os.path.join(pin.root, META)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return
    if isinstance(doc, dict) and any(doc.get(k) != v for k, v in fields.items()):
        write_json(path, {**doc, **fields})


@dataclass
class _Folder:
    """A folder of the source being synced: opened by its path relative to the pinned folder's
    descriptor (so inside the folder pinned, wherever it is renamed), and its pin's counterpart."""

    rel: str  # "" for the pinned folder itself
    st: os.stat_result
    dst: str


def _sync_tree(pin: Pin, top: int, top_st: os.stat_result, link_only: bool) -> bool:
    """Bring the pin's folder tree up to date with the source folder open as ``top`` (a stack, not
    recursion: a checkpoint may nest deeper than Python's limit). False when something listed went
    before it was pinned."""
    folders = [_Folder("", top_st, pin.data)]
    synced: list[_Folder] = []
    whole = True
    while folders:
        folder = folders.pop()
        try:
            fd = top if not folder.rel else os.open(folder.rel, FOLDER_FLAGS | os.O_NOFOLLOW, dir_fd=top)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                raise
            whole = False  # deleted, or replaced by a file or a link, since it was listed
            continue
        if fd != top and not os.path.samestat(os.fstat(fd), folder.st):
            os.close(fd)  # a folder above it became a link since the listing: not the checkpoint's
            whole = False
            continue
        try:
            with os.scandir(fd) as it:
                entries = list(it)
            synced.append(folder)
            whole &= _sync_entries(pin, fd, entries, folder, folders, link_only)
        finally:
            if fd != top:
                os.close(fd)
    # the backup of the pin stores its folders' mode and mtime: the source's (the owner keeps rwx:
    # this process links into the pin and removes it); set last, inner folders first, as each link
    # or folder made moves the mtime
    for folder in reversed(synced):
        os.chmod(folder.dst, stat.S_IMODE(folder.st.st_mode) | stat.S_IRWXU)
        os.utime(folder.dst, ns=(folder.st.st_atime_ns, folder.st.st_mtime_ns))
    return whole


def _sync_entries(
    pin: Pin, fd: int, entries: list[os.DirEntry[str]], folder: _Folder, folders: list[_Folder], link_only: bool
) -> bool:
    """Link or copy the files and links among ``entries`` (listed from the folder open as ``fd``);
    its subfolders, made in the pin, go on ``folders`` for the caller to fill. False when an entry
    went before it was pinned."""
    whole = True
    for entry in entries:
        if is_unfinished(entry.name):
            continue  # still being written: it is pinned under its final name once renamed
        dst = os.path.join(folder.dst, entry.name)
        rel = f"{folder.rel}/{entry.name}" if folder.rel else entry.name
        try:
            st = entry.stat(follow_symlinks=False)
            if pin.excluded is not None and pin.excluded(rel, stat.S_ISDIR(st.st_mode)):
                continue
            if stat.S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) == pin.skip_dir:
                    continue
                os.makedirs(dst, exist_ok=True)
                folders.append(_Folder(rel, st, dst))
            elif stat.S_ISLNK(st.st_mode):
                target = os.readlink(entry.name, dir_fd=fd)
                if not os.path.islink(dst) or os.readlink(dst) != target:
                    _replace_with(dst, functools.partial(_symlink_to, target))
            elif stat.S_ISREG(st.st_mode):
                _sync_file(pin, entry.name, dst, link_only, st, fd, shown=os.path.join(pin.source, rel))
        except FileNotFoundError:
            whole = False  # deleted while we looked
    return whole


def _sync_file(
    pin: Pin,
    src: str,
    dst: str,
    link_only: bool,
    st: os.stat_result | None = None,
    dir_fd: int | None = None,
    shown: str | None = None,
) -> None:
    """``src`` is a path, or with ``dir_fd`` a name in the folder open as ``dir_fd`` (``shown``: its path,
    for messages)."""
    shown = shown or src
    st = st or os.stat(src)
    try:
        have = os.lstat(dst)
    except FileNotFoundError:
        have = None
    if have is not None:
        if have.st_ino == st.st_ino:
            return  # the same inode: nothing can differ
        if pin.copied and have.st_size == st.st_size and have.st_mtime_ns == st.st_mtime_ns:
            return  # our own copy of this version
    if not pin.copied:
        try:
            if dir_fd is not None:
                _replace_with(dst, lambda tmp: os.link(src, tmp, src_dir_fd=dir_fd, follow_symlinks=False))
            else:
                # a source that is a link (Lightning's save_last="link") pins what it points at: Linux
                # link() hard-links the symlink itself, whatever os.link's follow_symlinks says
                target = os.path.realpath(src) if os.path.islink(src) else src
                _replace_with(dst, lambda tmp: os.link(target, tmp))
            return
        except OSError as exc:
            if exc.errno not in NO_LINK_ERRNOS:
                raise
            if link_only:
                raise NoHardLinks(exc.errno, f"cannot hard-link {shown} into {pin.root}: {exc.strerror}") from exc
            log.info("hard links are impossible from %s into %s (%s); copying instead", shown, pin.root, exc.strerror)
            pin.copied = True
    _replace_with(dst, functools.partial(_copy_file, src, dir_fd))


def _copy_file(src: str, dir_fd: int | None, dst: str) -> None:
    """``shutil.copy2`` of ``src`` (a name in ``dir_fd`` when given): content, then mode and times."""
    flags = os.O_RDONLY | (os.O_NOFOLLOW if dir_fd is not None else 0)
    with open(os.open(src, flags, dir_fd=dir_fd), "rb") as fin, open(dst, "xb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
        st = os.fstat(fin.fileno())
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def _symlink_to(target: str, path: str) -> None:
    os.symlink(target, path)


def _replace_with(dst: str, make: Callable[[str], object]) -> None:
    """The pin never holds a half-made file."""
    replace_with(dst, make, ".pin-")
