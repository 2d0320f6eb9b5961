"""``FsspecStore``: the Store contract on any fsspec filesystem.

fsspec gives neither atomic writes nor durable ones on local disks (its LocalFileSystem
writes in place), so local puts write a temp file in the target directory, fsync it,
rename it over the final name and fsync the directory. Object stores get one PUT.
Instance caching is off: fsspec caches instances and listings per argument set, which
would leak state between repositories (and tests) in one process.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import ObjectNotFoundError, StorageError, StorageFullError
from .base import ObjectInfo
from .retrying import RetryingStore, RetryPolicy

TEMP_PREFIX = ".tmp-"


class FsspecStore:
    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        try:
            self.fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **(storage_options or {}))
        except (ValueError, ImportError) as exc:
            raise StorageError("open", "", url, str(exc)) from exc
        self.root = root.rstrip("/")
        self._local = isinstance(self.fs, LocalFileSystem)
        self._made_dirs: set[str] = set()

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    @contextmanager
    def _translate(self, op: str, key: str) -> Iterator[None]:
        """The one place where backend exceptions become ckptvault errors."""
        try:
            yield
        except FileNotFoundError as exc:
            raise ObjectNotFoundError(op, key, self.url) from exc
        except PermissionError as exc:
            raise StorageError(op, key, self.url, "permission denied") from exc
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFullError(op, key, self.url, exc.strerror or "disk full") from exc
            raise StorageError(op, key, self.url, str(exc) or type(exc).__name__, retryable=True) from exc
        except StorageError:
            raise
        except Exception as exc:  # backend-specific errors (botocore, azure, ...)
            raise StorageError(op, key, self.url, f"{type(exc).__name__}: {exc}") from exc

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        with self._translate("PUT", key):
            if self._local:
                self._put_local(self._path(key), data)
            else:
                self.fs.pipe_file(self._path(key), bytes(data))

    def _put_local(self, path: str, data: bytes | bytearray | memoryview) -> None:
        directory = os.path.dirname(path)
        if directory not in self._made_dirs:
            os.makedirs(directory, exist_ok=True)
            self._made_dirs.add(directory)
        tmp = os.path.join(directory, TEMP_PREFIX + secrets.token_hex(8))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def get(self, key: str) -> bytes:
        with self._translate("GET", key):
            return self.fs.cat_file(self._path(key))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self._translate("GET", key):
            data = self.fs.cat_file(self._path(key), start=start, end=start + length)
        if len(data) != length:
            # on a local disk a short object stays short; over a network the next try may get it all
            raise StorageError(
                "GET",
                key,
                self.url,
                f"short read: wanted {length} bytes at {start}, got {len(data)}",
                retryable=not self._local,
            )
        return data

    def exists(self, key: str) -> bool:
        with self._translate("STAT", key):
            return bool(self.fs.exists(self._path(key)))

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = self._path(prefix)
        with self._translate("LIST", prefix):
            try:
                found = self.fs.find(base, detail=True)
            except FileNotFoundError:
                return []
        cut = len(self.root) + 1
        out = []
        for path, info in found.items():
            key = path[cut:] if path.startswith(self.root + "/") else path.lstrip("/")
            if key.rsplit("/", 1)[-1].startswith(TEMP_PREFIX) or info.get("type") == "directory":
                continue
            out.append(ObjectInfo(key, int(info.get("size") or 0)))
        return sorted(out, key=lambda o: o.key)

    def remove_stale_temp_files(self, older_than_s: float) -> int:
        """Delete temp files that a killed writer left behind (local stores only: object stores
        have no partial objects). Returns how many were removed."""
        if not self._local or not os.path.isdir(self.root):
            return 0
        cutoff = time.time() - older_than_s
        removed = 0
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                path = os.path.join(dirpath, name)
                if name.startswith(TEMP_PREFIX) and os.lstat(path).st_mtime < cutoff:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                        removed += 1
        return removed

    def delete(self, key: str) -> None:
        with self._translate("DELETE", key):
            self.fs.rm_file(self._path(key))


def open_store(
    url: str, storage_options: dict[str, Any] | None = None, retry: RetryPolicy | None = None
) -> RetryingStore:
    """The store for a repository URL (a plain path means a local folder), with retries."""
    if "://" not in url:
        url = os.path.abspath(os.path.expanduser(url))
    return RetryingStore(FsspecStore(url, storage_options), retry)
