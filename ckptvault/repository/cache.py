"""A local cache of a remote repository's metadata objects: index, snapshot and tree objects.

Listing snapshots or browsing a remote repository would otherwise download every snapshot
object (and the whole index) each time. These objects are immutable and named by random IDs, so
a cached copy under the same key is the same object, and nothing ever has to be invalidated
because it changed, only because it was deleted.

Layout: ``<cache root>/<repository ID>/`` holding ``CACHEDIR.TAG`` (backup tools skip the
folder), ``repository.json`` (the ID it belongs to) and one file per object under its repository
key (``index/<id>``, ``snapshots/<id>``, ``trees/<id>``). The bytes are the stored blobs as they are,
still sealed: an encrypted repository's cache is as encrypted as the repository.

Validation, every time:
- cached bytes are decoded and verified like fresh ones (checksum or AES-GCM tag bound to the
  object's kind and ID); a cached object that fails is deleted and fetched again;
- the repository is listed as before (the listing is the truth; the cache only saves the GETs);
  cached objects the listing no longer has (a prune removed them) are deleted, and a cached object
  whose size differs from the listed one is fetched again;
- a ``repository.json`` naming another repository, or one that cannot be read, empties the folder.
Any failure of the cache itself (full disk, permissions) turns it off for the process with a
warning in the log: the cache can make a command faster, never make it fail.

The root is ``CKPTVAULT_CACHE_DIR``, else the user's cache folder (``~/.cache/ckptvault`` on
Linux); ``CKPTVAULT_NO_CACHE=1`` turns it off. Only remote stores are cached.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from ..durable import replace_with
from ..errors import IntegrityError

log = logging.getLogger("ckptvault")
notice = logging.getLogger("ckptvault.store.cache")  # the CLI shows its warnings (cli/process.py)

T = TypeVar("T")
ENV_CACHE_DIR = "CKPTVAULT_CACHE_DIR"
ENV_NO_CACHE = "CKPTVAULT_NO_CACHE"
MARKER = "repository.json"
CACHEDIR_TAG = "Signature: 8a477f597d28d172789f06886806bc55\n# ckptvault metadata cache; safe to delete\n"
_ID = re.compile(r"[0-9a-f]{16,64}")
_KEY = re.compile(r"(index|snapshots|trees)/[0-9a-f]{64}")


def cache_root(default: str | os.PathLike[str]) -> Path | None:
    """Where caches live: CKPTVAULT_CACHE_DIR, else ``default``; None when CKPTVAULT_NO_CACHE is set."""
    if os.environ.get(ENV_NO_CACHE, "").strip().lower() not in ("", "0", "false", "no"):
        return None
    return Path(os.environ.get(ENV_CACHE_DIR) or default)


def _make_private(directory: Path) -> None:
    """0700 for a cache folder of ours that others may list or read (made before caches were private);
    one of another user's, or on a disk that refuses the change, is left as it is."""
    try:
        st = directory.stat()
        if st.st_uid == os.geteuid() and st.st_mode & 0o077:
            directory.chmod(0o700)
    except OSError:
        pass


class MetadataCache:
    """The cache of one repository; a disabled one (``directory=None``) just fetches."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    @classmethod
    def disabled(cls) -> MetadataCache:
        return cls(None)

    @classmethod
    def open(cls, root: Path | None, repo_id: str) -> MetadataCache:
        if root is None or not _ID.fullmatch(repo_id):
            return cls.disabled()
        cache = cls(root / repo_id)
        cache._guard(lambda: cache._prepare(repo_id))
        return cache

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def _prepare(self, repo_id: str) -> None:
        assert self.directory is not None
        marker = self.directory / MARKER
        try:
            belongs = json.loads(marker.read_text()).get("repository") == repo_id
        except (OSError, ValueError, AttributeError):
            belongs = False
        if belongs:
            _make_private(self.directory)  # one made before caches were (its files are then out of others' reach)
        else:
            if self.directory.exists():
                log.info("metadata cache %s does not belong to repository %s; rebuilding it", self.directory, repo_id)
                shutil.rmtree(self.directory)
            # 0700: the cache of an unencrypted vault holds its file names, as readable as the vault itself
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            (self.directory / "CACHEDIR.TAG").write_text(CACHEDIR_TAG)
            self._write_atomic(marker, json.dumps({"repository": repo_id, "version": 1}).encode())

    def _guard(self, action: Callable[[], T]) -> T | None:
        """Run a cache action; a failing cache is switched off, never fatal."""
        if self.directory is None:
            return None
        try:
            return action()
        except OSError as exc:
            # on the store's logger, which the CLI shows: every command then reads every object from the vault
            notice.warning(
                "metadata cache %s disabled: %s (commands read metadata from the vault instead; %sset %s to a "
                "writable folder)",
                self.directory,
                exc,
                "free space there, or " if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "",
                ENV_CACHE_DIR,
            )
            self.directory = None
            return None

    def _path(self, key: str) -> Path | None:
        if self.directory is None or not _KEY.fullmatch(key):
            return None
        return self.directory / key

    def _write_atomic(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_with(str(path), lambda tmp: Path(tmp).write_bytes(data), ".tmp-")

    def read(
        self,
        key: str,
        fetch: Callable[[], tuple[bytes, T]],
        decode: Callable[[bytes], T],
        size: int | None = None,
    ) -> T:
        """The decoded object: from the cache when a verified copy is there, else ``fetch()`` (which
        returns the stored bytes and their decoded, verified value), keeping the bytes for next time."""
        path = self._path(key)
        if path is not None:
            cached = self._guard(lambda: _read_if_present(path))
            if cached is not None and (size is None or len(cached) == size):
                try:
                    value = decode(cached)
                except IntegrityError:
                    log.warning("cached %s failed verification; fetching it again", key)
                else:
                    with self._lock:
                        self.hits += 1
                    return value
        raw, value = fetch()
        with self._lock:
            self.misses += 1
        if path is not None:
            self._guard(lambda: self._write_atomic(path, raw))
        return value

    def discard(self, key: str) -> None:
        path = self._path(key)
        if path is not None:
            self._guard(lambda: path.unlink(missing_ok=True))

    def retain(self, prefix: str, keys: Iterable[str]) -> None:
        """Drop cached objects under ``prefix`` that the repository listing no longer has."""
        if self.directory is None:
            return
        folder = self.directory / prefix.rstrip("/")
        keep = {k.rsplit("/", 1)[-1] for k in keys}

        def sweep() -> None:
            if not folder.is_dir():
                return
            for entry in folder.iterdir():
                if entry.name not in keep:
                    entry.unlink(missing_ok=True)

        self._guard(sweep)


def _read_if_present(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
