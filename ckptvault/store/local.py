"""``LocalStore``: the Store contract on a folder of this machine, with os calls only.

The default repository is a local folder, and every CLI command opens one: going through fsspec
would load it, and with it asyncio and ssl, which took ~0.1 s of each command's ~0.6 s here
(`python -X importtime`). Puts write a temp file in the target folder, fsync it (packs bypass the
page cache: localwrite.py; so do large range reads: localread.py), then rename it over the final
name (or link it, for a create-if-absent: the link fails when another writer was first) and fsync
the folder. A URL with a protocol
(``file://``, ``local://``) goes through fsspec's local filesystem, with the same puts and reads.

Deletes are made durable in the order they were made with respect to other kinds of objects: before
a put or delete in another top-level folder (``trees/`` after ``snapshots/``, ``packs/`` after ``index/``),
the folders of the deletes made so far are fsynced. Prune and forget rely on that order (a snapshot gone
before its tree and packs, index objects before the packs they name); journaling filesystems keep it by
themselves, others need not, and deletes of one kind still cost no fsync each.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ..durable import fsync_dir
from ..errors import CkptVaultError, ShortReadError, StorageError
from .base import TEMP_PREFIX, ObjectInfo, TempFiles
from .failures import storage_error
from .localread import LocalReader
from .localwrite import LocalWriter
from .options import TransferLimits


def vault_gone_error(op: str, key: str, url: str) -> StorageError:
    # retryable: a network mount that drops for a moment comes back; nothing is made in its place
    reason = "the vault's folder is gone or empty (moved, deleted, or its disk unmounted?)"
    return StorageError(op, key, url, reason, retryable=True)


class LocalStore:
    remote = False
    supports_if_absent = True
    # Calls run without a watchdog thread: a new thread per chunk read costs a restore ~10% of its
    # CPU, and a read blocked in the kernel could not be cancelled anyway. The price: a repository on
    # a hung network mount (NFS, FUSE) waits instead of failing.
    needs_deadline = False
    enforces_deadline = False

    def __init__(self, folder: str, *, url: str | None = None) -> None:
        """``url``: how messages name the vault (fsspec's ``file://`` URL for its local filesystem)."""
        self.url = url or folder
        self.root = folder.rstrip("/") or "/"
        self.local_folder = self.root
        self.transfers = TransferLimits.from_env(remote=False)
        self._writer = LocalWriter()
        self._reader = LocalReader()
        self._made_dirs: set[str] = set()
        self._deleted_in: set[str] = set()  # folders whose deletes are not durable yet
        self._deleted_kind = ""  # the top-level folder of those deletes
        self._deletes_mutex = threading.Lock()
        self._seen = False  # whether an object was read or written here: the vault's folder existed

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    @contextmanager
    def _translate_errors(self, op: str, key: str, *, if_absent: bool = False) -> Iterator[None]:
        try:
            yield
        except CkptVaultError:
            raise
        except OSError as exc:
            raise storage_error(op, key, self.url, exc, if_absent=if_absent) from exc

    # ---- the Store contract ------------------------------------------------------------

    def put(self, key: str, data: bytes | bytearray | memoryview, *, if_absent: bool = False) -> None:
        path = self._path(key)
        with self._translate_errors("PUT", key, if_absent=if_absent):
            self._deletes_before(key)
            try:
                self.put_file(path, data, if_absent)
            except FileNotFoundError:  # its folder was made or seen by an earlier put, and is gone since
                self._made_dirs.discard(os.path.dirname(path))
                if self._gone():
                    raise vault_gone_error("PUT", key, self.url) from None
                self.put_file(path, data, if_absent)  # only a folder inside the vault was removed: made again

    def _gone(self) -> bool:
        """Whether the vault's folder, seen here before, is missing or empty now (a vault always holds
        its config, written first): moved or deleted, or its disk unmounted, leaving the mount point."""
        if not self._seen:
            return False
        try:
            with os.scandir(self.root) as entries:
                return next(entries, None) is None
        except FileNotFoundError:
            return True

    def put_file(self, path: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        """Create or replace the file at ``path`` atomically and durably (OSErrors as they come). A
        vault that went away (``_gone``) is not made again, half, by a write into one of its folders."""
        directory = os.path.dirname(path)
        if directory not in self._made_dirs:
            missing = []  # folders this put creates: their own names must be made durable too
            parent = directory
            while parent and not os.path.isdir(parent) and parent != os.path.dirname(parent):
                missing.append(parent)
                parent = os.path.dirname(parent)
            if missing and self._gone():
                raise FileNotFoundError(errno.ENOENT, "the vault's folder is gone or empty", self.root)
            try:
                os.makedirs(directory, exist_ok=True)
            # neither is about the object (if_absent's "exists", a reader's "missing"): report the folder
            except FileExistsError:
                raise NotADirectoryError(errno.ENOTDIR, "a file is in the way of a folder", directory) from None
            except FileNotFoundError:  # a filesystem that refuses new folders (/proc, /sys)
                raise PermissionError(errno.EPERM, "this folder cannot be created", directory) from None
            for made in reversed(missing):
                fsync_dir(os.path.dirname(made))
            self._made_dirs.add(directory)
        tmp = os.path.join(directory, TEMP_PREFIX + secrets.token_hex(8))
        try:
            self._writer.create(tmp, data)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        if if_absent:
            try:
                os.link(tmp, path)  # fails with FileExistsError when another writer was first
            finally:
                os.unlink(tmp)
        else:
            os.replace(tmp, path)
        fsync_dir(directory)
        self._seen = True

    def get(self, key: str) -> bytes:
        with self._translate_errors("GET", key), open(self._path(key), "rb") as f:
            self._seen = True
            return f.read()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self._translate_errors("GET", key):
            data = self.pread(self._path(key), start, length)
        if len(data) != length:  # a short file stays short: not retried
            raise ShortReadError("GET", key, self.url, f"short read: wanted {length} bytes at {start}, got {len(data)}")
        return data

    def read_upto(self, key: str, start: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``start``: fewer where the object ends."""
        with self._translate_errors("GET", key):
            return self.pread(self._path(key), start, length)

    def pread(self, path: str, start: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``start``: fewer only where the file ends."""
        return self._reader.read(path, start, length)

    def exists(self, key: str) -> bool:
        with self._translate_errors("STAT", key):
            return os.path.exists(self._path(key))

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object under ``prefix``, sorted. A folder that cannot be read raises instead of
        listing as empty (an unreadable snapshots/ folder must not make prune delete every pack); a
        folder deleted meanwhile, or never made, is empty."""
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        cut = len(self.root) + 1
        out = []
        with self._translate_errors("LIST", prefix):
            for path, size, mtime in _walk(base):
                key = path[cut:]
                if key.rsplit("/", 1)[-1].startswith(TEMP_PREFIX) or (prefix and not key.startswith(prefix)):
                    continue
                out.append(ObjectInfo(key, size, mtime))
        if not out and self._gone():  # not "no snapshots" (or packs) where the whole vault went away
            raise vault_gone_error("LIST", prefix, self.url)
        return sorted(out, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._translate_errors("DELETE", key):
            self._deletes_before(key)
            os.remove(path)
            with self._deletes_mutex:
                self._deleted_in.add(os.path.dirname(path))
                self._deleted_kind = key.split("/", 1)[0]

    def _deletes_before(self, key: str) -> None:
        """Make the deletes made so far durable when ``key`` is of another kind (module docstring). Under the
        mutex: the other threads of a parallel delete wait for the flush instead of running ahead of it; a
        folder whose fsync fails stays pending, so the retried call flushes it first."""
        with self._deletes_mutex:
            if not self._deleted_in or key.split("/", 1)[0] == self._deleted_kind:
                return
            for folder in sorted(self._deleted_in):
                with contextlib.suppress(FileNotFoundError):  # a folder of packs emptied and removed meanwhile
                    fsync_dir(folder)
                self._deleted_in.discard(folder)

    def remove_stale_temp_files(self, older_than_s: float) -> int:
        """Delete the temp files of killed writers older than ``older_than_s``; returns how many."""
        cutoff = time.time() - older_than_s
        removed = 0
        for path, info in self._temp_files():
            if info.st_mtime < cutoff:
                with contextlib.suppress(FileNotFoundError):  # renamed into place by its writer meanwhile
                    os.unlink(path)
                    removed += 1
        return removed

    def temp_files(self) -> TempFiles:
        """(size, mtime) of each temp file here: a write in flight, or one a killed writer left."""
        return [(info.st_size, info.st_mtime) for _, info in self._temp_files()]

    def _temp_files(self) -> Iterator[tuple[str, os.stat_result]]:
        for dirpath, _, filenames in os.walk(self.root):  # nothing when the root is gone
            for name in filenames:
                if name.startswith(TEMP_PREFIX):
                    path = os.path.join(dirpath, name)
                    try:
                        info = os.lstat(path)
                    except FileNotFoundError:  # renamed into place meanwhile
                        continue
                    yield path, info


def _walk(base: str) -> Iterator[tuple[str, int, float]]:
    """(path, size, mtime) of every file under ``base`` (``base`` itself when it is a file). Links to
    files are followed (one whose target is gone, like a file deleted meanwhile, is left out); links to
    folders are not (a loop would fail every listing of the vault)."""
    folders = [base]
    while folders:
        folder = folders.pop()
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            continue
        except NotADirectoryError:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(folder)
                yield folder, st.st_size, st.st_mtime
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(entry.path)
                    continue
                st = entry.stat()
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                yield entry.path, st.st_size, st.st_mtime
