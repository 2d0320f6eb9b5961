"""``FsspecStore``: the Store contract on any fsspec filesystem.

fsspec gives neither atomic writes nor durable ones on local disks (its LocalFileSystem
writes in place), so local puts write a temp file in the target directory, fsync it (packs
bypass the page cache: localwrite.py), rename it over the final name and fsync the directory.
SFTP gets the same temp-name-and-rename.
Object stores get one PUT (s3fs turns a big one into a multipart upload, completed atomically).
Instance caching is off: fsspec caches instances and listings per argument set, which
would leak state between repositories (and tests) in one process.

Remote filesystems are made on first use, so an unreachable server fails inside the retried call
with a one-line error, not at construction. SFTP gets a pool of sessions, one per concurrent call
(paramiko's client is not safe to share between threads), and a session that failed is closed
and replaced.
Every call on an async filesystem (s3fs, gcsfs, adlfs) carries the per-call deadline into
fsspec, which cancels the request on the event loop and closes its connection.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import logging
import os
import secrets
import stat
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.spec import AbstractFileSystem

from ..errors import CkptVaultError, ObjectNotFoundError, ShortReadError, StorageError, UsageError
from ..units import format_seconds
from .backends import (
    AZURE,
    S3,
    WEBDAV,
    Profile,
    bucket_of,
    default_options,
    filesystem_class,
    install_hint,
    nested_option_error,
    option_error,
    option_value_error,
    profile_for,
    tune,
)
from .base import TEMP_PREFIX, ObjectInfo, TempFiles
from .failures import (
    BackendAdvice,
    Failure,
    Kind,
    classify,
    exception_chain,
    hide_credentials,
    one_line,
    range_past_the_end,
    status_in_chain,
    storage_error,
)
from .keypath import odd_path
from .local import LocalStore, vault_gone_error
from .options import TransferLimits, credential_values, display_url, resolve_options
from .retrying import BASE_DEADLINE_S, call_deadline, no_answer

_TIME_FIELDS = ("mtime", "LastModified", "updated", "last_modified", "created")  # what listings call it
POOL_SIZE = 8  # SFTP sessions at most, per store
MAX_CUT_TEMPS = 1000  # temp files of cut writes remembered for removal (a few bytes each)
_IN_PROCESS_CREATE = threading.Lock()  # memory filesystems check-then-create; make that atomic
# Every store of this process, for the fork hook below.
_STORES: weakref.WeakSet[FsspecStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class FsspecStore:
    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, *, op_timeout: float | None = None
    ) -> None:
        try:
            self.url = display_url(url)
            target, options, explicit = resolve_options(url, storage_options)
        except ValueError as exc:  # not echoed: it may hold a password that display_url would have hidden
            raise _invalid_url(f"{url.split('://', 1)[0]}://..." if "://" in url else "URL", exc) from None
        self.op_timeout = op_timeout
        self._fs: Any = None
        self._fs_lock = threading.Lock()
        # Pooled sessions not in use, by the nice value of the thread that opened them: a session's
        # transport thread keeps it, and a backup_async worker's (lowered) must not serve others.
        self._idle: dict[int, list[Any]] = {}
        self._sessions: weakref.WeakSet[Any] = weakref.WeakSet()  # every SFTP session opened, idle or not
        self._slots = threading.BoundedSemaphore(POOL_SIZE)
        self._made_dirs: set[str] = set()
        self._cut_temps: list[str] = []  # temp files of puts cut mid-write (_remove_cut_temps)
        self._seen = False  # whether an object was read or written here: the vault's folder existed
        self._options = options
        self._secrets = credential_values(options)  # never shown in a message
        protocol = fsspec.core.split_protocol(target)[0] or "file"
        try:
            cls: Any = filesystem_class(fsspec.get_filesystem_class(protocol), protocol, options)
        except ImportError as exc:
            hint = install_hint(protocol)
            raise UsageError(f"repository {self.url}: {protocol}:// needs {one_line(str(exc))}; {hint}") from None
        except ValueError:
            raise UsageError(f"repository {self.url}: no fsspec filesystem handles {protocol}://") from None
        problem = (  # a value first: -o port=true to s3:// says what it must be before that S3 takes no port
            option_value_error(options)
            or option_error(cls, protocol, explicit)
            or nested_option_error(protocol, options, explicit)
        )
        if problem:
            raise UsageError(f"repository {self.url}: {problem}")
        try:
            root = cls._strip_protocol(target)
            self._kwargs = {**cls._get_kwargs_from_urls(target), **default_options(protocol, options)}
        except ValueError as exc:  # a port that is no number, an unclosed [IPv6 address
            raise _invalid_url(self.url, exc) from None
        protocols = cls.protocol if isinstance(cls.protocol, tuple) else (cls.protocol,)
        self.profile: Profile = profile_for(
            protocols, local_disk=issubclass(cls, LocalFileSystem), in_memory=issubclass(cls, MemoryFileSystem)
        )
        self._cls = cls
        self.root = self._root(root)
        self.odd_path = odd_path(self.url, self.root) if self._keeps_path_as_written() else None
        unusable = self.odd_path.unusable(self.profile.protocol) if self.odd_path is not None else None
        if unusable:
            raise UsageError(unusable)
        self._bucket = bucket_of(self.profile.protocol, self.root)
        self._bucket_seen = False
        # any local-disk filesystem, whatever protocol name it registers, gets LocalStore's atomic
        # temp+rename puts, positioned reads and no watchdog thread per call
        self._disk = LocalStore(self.root, url=self.url) if issubclass(cls, LocalFileSystem) else None
        self.local_folder = self.root if self._disk is not None else None  # the vault's folder on this machine
        self.needs_deadline = self._disk is None
        self.remote = self.profile.remote
        self.transfers = TransferLimits.from_env(self.remote)
        # an async filesystem enforces the deadline itself, cancelling the request on its loop
        self.enforces_deadline = bool(getattr(cls, "async_impl", False))
        self.supports_if_absent = self.profile.conditional_put
        if not self.remote:
            self._filesystem()
        _STORES.add(self)

    def _forked(self) -> None:
        """In a child forked from this process (a DataLoader worker, a ``multiprocessing`` pool's process, which
        may use the Vault it inherited): the connections are the parent's. An async filesystem (s3fs, gcsfs,
        adlfs) refused every call there ("RuntimeError: This class is not fork-safe", said as a storage
        failure), and an SFTP session, whose reading thread stays in the parent, hung the child's calls for the
        whole deadline while what it wrote over the parent's connection made the server drop the parent's. The
        child opens its own; those it inherited are closed on its side only (its copy of each socket: nothing
        is sent, so the parent's sessions go on), without taking any of paramiko's locks (``_drop_inherited``)."""
        inherited = list(self._sessions)
        self._fs = None
        self._idle = {}
        self._sessions = weakref.WeakSet()
        self._fs_lock = threading.Lock()  # a parent thread may have held them at the fork
        self._slots = threading.BoundedSemaphore(POOL_SIZE)
        for fs in inherited:
            _drop_inherited(fs)

    # ---- plumbing ----------------------------------------------------------------------

    @property
    def fs(self) -> Any:
        """The filesystem (tests and tools; store operations use ``_session``)."""
        return self._filesystem()

    def _new_filesystem(self) -> Any:
        if self.profile.pooled:
            _quiet_paramiko()  # before its first connection: a reset greeting is logged by the connect
        try:
            fs = self._cls(skip_instance_cache=True, **self._kwargs)
        except Exception as exc:
            local = _local_setting_error(exc)
            if local is None:
                if self.profile.pooled and (advice := _not_ssh(exc, self._kwargs)) is not None:
                    raise advice from exc  # not retried: a port where something else answers
                raise
            raise UsageError(f"repository {self.url}: {hide_credentials(local, self._secrets)}") from None
        tune(fs, self.profile.protocol, self._options)
        if self.profile.pooled:
            _bound_silence(fs, self._silence_bound)
            self._sessions.add(fs)
        return fs

    def _filesystem(self) -> Any:
        with self._fs_lock:
            if self._fs is None:
                self._fs = self._new_filesystem()
            return self._fs

    @contextmanager
    def _session(self, op: str, key: str, nbytes: int | None = None, *, if_absent: bool = False) -> Iterator[Any]:
        """One call: a filesystem to use (a pooled session for SFTP) and error translation around it.
        ``nbytes``: what the call moves, where known (its deadline)."""
        with self._translate_errors(op, key, if_absent=if_absent, nbytes=nbytes):
            if not self.profile.pooled:
                yield self._filesystem()
                return
            wait = call_deadline(self.op_timeout, nbytes) or None
            if not self._slots.acquire(timeout=wait):
                # said as what it means: "no free session" alone read as a fault of this machine's, where the
                # server had stopped answering the calls holding every session (a frozen sshd)
                raise TimeoutError(
                    f"no free session after {wait:g} s: all {POOL_SIZE} are in calls the server has not answered"
                )
            niceness = _thread_niceness()
            try:
                fs = self._idle_session(niceness)
                if fs is None:
                    fs = self._new_filesystem()
                try:
                    yield fs
                except Exception as exc:
                    silent = getattr(fs, SILENT_MARK, False)
                    if classify(exc).retryable or silent:
                        _close_session(fs)  # the session may be dead; the retry opens a new one
                        fs = None
                    if silent and not isinstance(exc, SessionSilent):
                        # what paramiko raised after the silence (its own error over a stream the timeout cut) is
                        # the silence, retried as one: not a permanent failure of its own
                        raise SessionSilent(silent_said(self._silence_bound)) from exc
                    raise
                else:
                    if getattr(fs, SILENT_MARK, False):  # fell silent in a step paramiko let pass (a file's CLOSE)
                        _close_session(fs)
                        fs = None
                finally:
                    if fs is not None:
                        with self._fs_lock:
                            self._idle.setdefault(niceness, []).append(fs)
            finally:
                self._slots.release()

    @property
    def _silence_bound(self) -> float:
        """How long an SFTP session may move no byte (``_bound_silence``)."""
        return BASE_DEADLINE_S if self.op_timeout is None else self.op_timeout

    def _idle_session(self, niceness: int) -> Any:
        """A pooled session whose connection is still up, or None: those that died idle (a dropped link
        kills them all at once) are closed, not handed to the retries one after another."""
        while True:
            with self._fs_lock:
                idle = self._idle.get(niceness)
                fs = idle.pop() if idle else None
            if fs is None or (not getattr(fs, SILENT_MARK, False) and _session_alive(fs)):
                return fs
            _close_session(fs)

    def _deadline(self, nbytes: int | None = None) -> dict[str, Any]:
        """The deadline argument for an async filesystem's call (see retrying.call_deadline)."""
        seconds = call_deadline(self.op_timeout, nbytes) if self.enforces_deadline else 0
        return {"timeout": seconds} if seconds else {}

    def _root(self, root: str) -> str:
        """The vault's path as keys are made under it: no '/' at its end, nor at its start on an object store (s3fs
        and gcsfs read ``s3:///bucket/vault`` as ``/bucket/vault``, the same objects as ``bucket/vault``, but the
        listings name them without the '/', and the vault's were taken for no vault's: "no snapshots")."""
        return root.strip("/") if self._keeps_path_as_written() else root.rstrip("/")

    def _keeps_path_as_written(self) -> bool:
        """Whether the storage keeps a path's '//', '.' and '..' in the objects' names (keypath.py)."""
        return self.profile.object_store and not issubclass(self._cls, MemoryFileSystem)  # memory paths are resolved

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    @contextmanager
    def _translate_errors(
        self, op: str, key: str, *, if_absent: bool = False, nbytes: int | None = None
    ) -> Iterator[None]:
        """The one place where backend exceptions become ckptvault errors."""
        started = time.monotonic()
        try:
            yield
        except CkptVaultError:  # already one (a StorageError, a bad local setting found opening a session)
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            failure = classify(exc, self._bucket)
            if failure.kind is Kind.NOT_FOUND:
                failure = self._bucket_missing() or failure
            elif (
                op == "PUT"
                and self.profile.protocol in WEBDAV
                and not isinstance(exc, BackendAdvice)  # which says what the 409 under it meant
                and status_in_chain(exc)[0] == 409
            ):
                # WebDAV answers a PUT whose folder is missing 409 Conflict (RFC 4918 9.7.1): said as on SFTP
                failure = Failure(Kind.NOT_FOUND, failure.reason)
            if failure.kind is Kind.NO_BUCKET and self.profile.protocol in AZURE:  # Azure's word for it
                failure = Failure(failure.kind, failure.reason.replace("bucket", "container", 1))
            deadline = self._deadline(nbytes).get("timeout")
            if type(exc).__name__ == "FSTimeoutError" and deadline:
                # the call's deadline, or the client's own read timeout (60 s without a byte), which ends
                # a stalled download first: the time waited then, not the deadline that did not pass
                waited = time.monotonic() - started
                said = deadline if waited >= deadline - 1 else waited
                failure = Failure(failure.kind, no_answer(said))
            silent = next((node for node in exception_chain(exc) if isinstance(node, SessionSilent)), None)
            if silent is not None:  # said as the silence it was, whatever paramiko raised after it
                failure = Failure(Kind.TRANSIENT, str(silent))
            failure = Failure(failure.kind, hide_credentials(failure.reason, self._secrets))
            in_folders = not self.profile.object_store
            raise storage_error(
                op, key, self.url, exc, if_absent=if_absent, failure=failure, in_folders=in_folders
            ) from exc

    def _bucket_missing(self) -> Failure | None:
        """After a "not found" on an object store: is it the bucket that is missing? gcsfs and adlfs
        report both alike. Asked until the bucket is seen once; any doubt counts as "it exists".
        Returns the failure to report instead of "object not found", or None."""
        if not self._bucket or not self.profile.object_store or self._bucket_seen:
            return None
        fs = self._filesystem()
        try:
            self._bucket_seen = bool(fs.exists(self._bucket, **self._deadline(0)))
        except Exception:
            return None
        if self._bucket_seen:
            return None
        if self.profile.protocol in S3:
            # an S3 service names a missing bucket (NoSuchBucket); another HTTP server answers a bare 404
            try:
                fs.call_s3("list_objects_v2", Bucket=self._bucket, MaxKeys=1, **self._deadline(0))
            except Exception as exc:
                status, code = status_in_chain(exc)
                if code != "NoSuchBucket":
                    if status != 404:
                        return None
                    where = self._options.get("endpoint_url") or "the endpoint"
                    reason = f"{where} answered 404 without an S3 error code: is endpoint_url an S3 service?"
                    return Failure(Kind.PERMANENT, reason)
            else:
                self._bucket_seen = True
                return None
        return classify(FileNotFoundError(errno.ENOENT, "NoSuchBucket"), self._bucket)

    # ---- the Store contract ------------------------------------------------------------

    def put(self, key: str, data: bytes | bytearray | memoryview, *, if_absent: bool = False) -> None:
        if self._disk is not None:
            self._disk.put(key, data, if_absent=if_absent)
            return
        path = self._path(key)
        with self._session("PUT", key, len(data), if_absent=if_absent) as fs:
            if if_absent and not self.supports_if_absent and self._exists(fs, path):
                raise FileExistsError(errno.EEXIST, "exists", path)  # best effort: this backend cannot enforce it
            if not self.profile.object_store:
                try:
                    self._put_in_folder(fs, path, data, if_absent)
                except FileNotFoundError:  # its folder, made here before, was removed since
                    directory = path.rsplit("/", 1)[0]
                    if not self._seen:  # a vault being made: its path may be what is wrong
                        self._say_blocked_folder(fs, directory)
                    if directory not in self._made_dirs:
                        raise
                    self._made_dirs.discard(directory)
                    self._put_in_folder(fs, path, data, if_absent)  # made again, unless the whole vault went
            elif if_absent and self.profile.conditional_put:
                if self.profile.remote:
                    fs.pipe_file(path, bytes(data), mode="create", **self._deadline(len(data)))
                else:
                    with _IN_PROCESS_CREATE:
                        fs.pipe_file(path, bytes(data), mode="create")
            else:
                fs.pipe_file(path, bytes(data), **self._deadline(len(data)))

    def _put_in_folder(self, fs: Any, path: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        directory = path.rsplit("/", 1)[0]
        if directory and directory not in self._made_dirs:
            self._make_folder(fs, directory)
            self._made_dirs.add(directory)
        if self.profile.rename_put:
            self._put_renamed(fs, path, data, if_absent)
        else:
            fs.pipe_file(path, bytes(data), **self._deadline(len(data)))
        self._seen = True

    def _make_folder(self, fs: Any, directory: str) -> None:
        """Make ``directory`` and the folders above it that are missing, but never the vault's own folder
        once the vault was seen here: one that is gone or empty (moved, deleted, the server's disk
        unmounted) is not made again, half, by a write into one of its folders; that write fails as
        FileNotFoundError ("the folder it goes into is missing", retried as an outage)."""
        if not self._seen:  # a vault being made
            try:
                fs.makedirs(directory, exist_ok=True)
            except (FileNotFoundError, FileExistsError, NotADirectoryError):  # what SFTP, webdav4 say of a file there
                self._say_blocked_folder(fs, directory)
                raise
            return
        pending = [directory]
        tried_again: set[str] = set()
        while pending:
            folder = pending[-1]
            parent = folder.rsplit("/", 1)[0]
            in_vault = len(parent) > len(self.root)
            # only where a folder right inside the vault (locks/, packs/) is missing
            if not in_vault and not self._holds_anything(fs):
                raise FileNotFoundError(errno.ENOENT, "the vault's folder is gone or empty", self.root)
            try:
                fs.mkdir(folder, create_parents=False)
            except Exception as exc:  # made meanwhile by another writer, or its parent is missing (SFTP may say
                # "Failure"; webdav4 raises its own ResourceConflict when the parent exists by the time it looks)
                if classify(exc).retryable and not isinstance(exc, OSError):
                    raise  # the storage is not answering: the retries decide
                if not fs.isdir(folder):
                    if not in_vault:
                        raise
                    if not fs.isdir(parent):
                        pending.append(parent)
                        continue
                    if folder in tried_again:
                        raise
                    # the parent was missing when this mkdir ran and another writer (a thread of this
                    # process, another host) made it since: make the folder again, once
                    tried_again.add(folder)
                    continue
            pending.pop()

    def _say_blocked_folder(self, fs: Any, directory: str) -> None:
        """Raise what ``_blocked_folder`` finds, if anything."""
        advice = self._blocked_folder(fs, directory)
        if advice is not None:
            raise advice from None

    def _blocked_folder(self, fs: Any, directory: str) -> BackendAdvice | None:
        """Why a folder of a vault being made is missing after it was made, or cannot be made: a file where a
        folder of its path should be, or a folder in which the server makes none. OpenSSH answers both "No such
        file", which read as a folder gone away ("the vault moved, deleted, or its disk unmounted?"), retried
        ~13 s; webdav4 "File exists" (init said "a vault already exists") or "Not a directory" (409). None
        where neither is so (another writer removed the folder meanwhile: that stays a retry)."""
        path, missing = directory, ""
        while path.strip("/"):
            try:
                kind = fs.info(path).get("type")
            except FileNotFoundError:
                path, missing = path.rsplit("/", 1)[0], path
                continue
            if kind != "directory":
                return BackendAdvice(f"{path} is a file, not a folder; create the vault in a new or empty folder")
            if missing:
                return BackendAdvice(
                    f"the server makes no folder {missing} in {path} (a special or read-only file system?); "
                    "create the vault in a folder of this user's on the server"
                )
            return None
        return None

    def _holds_anything(self, fs: Any) -> bool:
        try:  # a vault always holds its config; one at the server's root is "" here, which SFTP cannot list
            return bool(self._ls(fs, self.root or "/"))
        except FileNotFoundError:
            return False

    def _put_renamed(self, fs: Any, path: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        """Temp name, then rename. SFTP's plain rename never replaces an existing file, which makes it
        a create-if-absent; posix-rename replaces atomically for the normal case."""
        directory = path.rsplit("/", 1)[0]
        tmp = f"{directory}/{TEMP_PREFIX}{secrets.token_hex(8)}"
        try:
            with fs.open(tmp, "wb") as f:
                if hasattr(f, "set_pipelined"):
                    f.set_pipelined(True)  # paramiko: stream the writes instead of one round trip per 32 KiB
                f.write(bytes(data))
        except BaseException:
            self._remember_cut_temp(tmp)
            raise
        self._remove_cut_temps(fs)
        try:
            ftp = getattr(fs, "ftp", None)
            if if_absent and ftp is not None:
                ftp.rename(tmp, path)
            else:
                fs.mv(tmp, path)
        except Exception as failure:
            self._remove_temp(fs, tmp)  # a connection cut at the rename left the whole temp file there
            if isinstance(failure, OSError) and if_absent and fs.exists(path):
                raise FileExistsError(errno.EEXIST, "exists", path) from None
            raise
        except BaseException:  # interrupted (Ctrl-C): no further call on a session that may hang
            self._remember_cut_temp(tmp)
            raise

    def _remember_cut_temp(self, tmp: str) -> None:
        if len(self._cut_temps) < MAX_CUT_TEMPS:
            self._cut_temps.append(tmp)

    def _remove_temp(self, fs: Any, tmp: str) -> bool:
        """Remove a temp file; False where this session was cut too: it is then remembered for the next write
        that gets through. One never made (cut before its OPEN), renamed into place after all, or that this
        session may not remove (left to prune) counts as done."""
        try:
            fs.rm_file(tmp)
        except (FileNotFoundError, PermissionError):
            pass
        except Exception:
            self._remember_cut_temp(tmp)
            return False
        return True

    def _remove_cut_temps(self, fs: Any) -> None:
        """The temp files of writes cut mid-transfer, removed once a write gets through again: a flapping
        SFTP link left 25 of them (253 MB) after one backup, for a prune an hour later (audit rb44 #7).
        One this session may not remove is left to that prune; one whose removal was cut too waits for the
        next write that gets through."""
        while self._cut_temps:
            try:
                tmp = self._cut_temps.pop()
            except IndexError:  # another thread took the last one
                return
            if not self._remove_temp(fs, tmp):
                return

    def get(self, key: str) -> bytes:
        with self._session("GET", key) as fs:
            return self._read(fs, self._path(key), None, None)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if self._disk is not None:
            return self._disk.get_range(key, start, length)
        with self._session("GET", key, length) as fs:
            data = self._read(fs, self._path(key), start, length)
        if len(data) != length:  # over a network the next try may get it all, unless the object is that short
            raise ShortReadError(
                "GET",
                key,
                self.url,
                f"short read: wanted {length} bytes at {start}, got {len(data)}",
                retryable=self.remote and not self._ends_before(key, start + length),
            )
        return bytes(data)

    def _ends_before(self, key: str, end: int) -> bool:
        """Whether the object is shorter than ``end`` bytes, as its size says (False where that cannot be had):
        a truncated pack's chunks past its end were each read six times over, minutes a pack on SFTP."""
        try:
            with self._session("STAT", key, 0) as fs:
                size = fs.info(self._path(key), **self._deadline(0)).get("size")
        except CkptVaultError:
            return False
        return isinstance(size, int) and size < end

    def read_upto(self, key: str, start: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``start``: fewer where the object ends (read-ahead windows)."""
        with self._session("GET", key, length) as fs:
            return self._read(fs, self._path(key), start, length)

    def _read(self, fs: Any, path: str, start: int | None, length: int | None) -> bytes:
        ftp = getattr(fs, "ftp", None) if self.profile.pooled else None
        if ftp is None:
            end = None if start is None or length is None else start + length
            # s3fs asks for the size (a HEAD) before a whole read, to split a big one into parts: metadata
            # objects are small, so that doubled the requests of a fresh machine's listing of every snapshot
            sized = start is None and self.profile.protocol in S3 and _sizes_whole_reads(fs)
            whole_in_one = {"max_concurrency": 1} if sized else {}
            try:
                data = bytes(fs.cat_file(path, start=start, end=end, **whole_in_one, **self._deadline(length)))
            except Exception as exc:
                if start is None or not range_past_the_end(exc):
                    raise
                data = b""  # a truncated pack: its damage is told as a short read, not as a storage failure
            self._seen = True
            return data
        # paramiko reads 32 KiB per round trip unless asked to pipeline: 30x faster on 20 MiB
        with ftp.open(path, "rb") as f:
            self._seen = True
            if start is None or length is None:
                f.prefetch()
                return bytes(f.read())
            return b"".join(f.readv([(start, length)]))

    def exists(self, key: str) -> bool:
        with self._session("STAT", key, 0) as fs:
            found = self._exists(fs, self._path(key))
            # a missing bucket is said before anything is written: some S3 servers (SeaweedFS) make a
            # bucket on the first PUT into it, and `init` into a mistyped bucket must not make one. Only
            # S3 confirms it (NoSuchBucket): gcsfs calls a bucket it may not inspect and that is empty missing
            if not found and self.profile.protocol in S3 and (failure := self._bucket_missing()):
                raise StorageError("STAT", key, self.url, failure.reason)
            return found

    def _exists(self, fs: Any, path: str) -> bool:
        """``fs.exists``, but where that is fsspec's generic one (WebDAV, SFTP), which answers False for any
        failure: a server that did not answer read as "no config here", and counted as an answer."""
        if self.profile.object_store or type(fs).exists is not AbstractFileSystem.exists:
            return bool(fs.exists(path, **self._deadline(0)))
        try:
            fs.info(path, **self._deadline(0))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        try:
            with self._session("LIST", prefix) as fs:
                if self.profile.object_store:
                    found = fs.find(base, detail=True, **self._deadline())
                    if isinstance(found, list):  # adlfs answers find(<one object>, detail=True) with names
                        found = {name: fs.info(name) for name in found}
                else:
                    found, base_missing = self._find_in_folders(fs, base)
                    # not "no snapshots" (or packs) where the whole vault went away
                    if base_missing and self._seen and not self._holds_anything(fs):
                        raise vault_gone_error("LIST", prefix, self.url)
        except ObjectNotFoundError:
            return []  # nothing under the prefix (a missing bucket is an error, not this)
        cut = len(self.root) + 1
        out = []
        for path, info in found.items():
            key = path[cut:] if path.startswith(self.root + "/") else path.lstrip("/")
            if key.rsplit("/", 1)[-1].startswith(TEMP_PREFIX) or info.get("type") == "directory":
                continue
            if prefix and not key.startswith(prefix):
                continue
            # local and SFTP say mtime, S3 LastModified, GCS updated, Azure last_modified, memory created
            when = next((info[n] for n in _TIME_FIELDS if info.get(n) is not None), None)
            out.append(ObjectInfo(key, int(info.get("size") or 0), when))
        return sorted(out, key=lambda o: o.key)

    def _find_in_folders(self, fs: Any, base: str) -> tuple[dict[str, dict[str, Any]], bool]:
        """``fs.find`` for filesystems of folders (local, SFTP), except that a folder that cannot be
        read raises instead of listing as empty: fsspec's walk omits it (its ``on_error`` does not
        reach subfolders), and an unreadable snapshots/ folder then made prune delete every pack.
        A folder deleted meanwhile, or never made, is empty. Also whether ``base`` itself is missing."""
        found: dict[str, dict[str, Any]] = {}
        folders = [base]
        base_missing = False
        while folders:
            folder = folders.pop()
            try:
                entries = self._ls(fs, folder)
            except FileNotFoundError:
                base_missing = base_missing or folder == base
                continue
            for info in entries:
                name = info["name"].rstrip("/")
                if info.get("type") != "directory":
                    found[name] = info
                elif name != folder:
                    folders.append(name)
        return found, base_missing

    def _ls(self, fs: Any, folder: str) -> Sequence[dict[str, Any]]:
        """``fs.ls(folder, detail=True)``; on SFTP through paramiko's ``listdir_attr``. fsspec lists with
        ``listdir_iter``, which reads its replies off the session without matching them to its requests: a
        reply it did not ask for (the CLOSE paramiko sends unanswered for a file object garbage-collected)
        was read as entries without a mode, and fsspec failed on them (TypeError "an integer is required",
        ~1 backup in 4 right after an outage)."""
        ftp = getattr(fs, "ftp", None) if self.profile.pooled else None  # fsspec's FTP has an ftplib one so named
        if ftp is None:
            return fs.ls(folder, detail=True, **self._deadline())
        folder = folder or "/"  # a vault at the server's root is "" here, which SFTP cannot list by that name
        entries = []
        for attr in ftp.listdir_attr(folder):
            path = f"{folder.rstrip('/')}/{attr.filename}"
            if attr.st_mode is None:  # listed without its attributes: whether it is a folder decides the walk
                try:
                    attr = ftp.lstat(path)
                except FileNotFoundError:
                    continue  # removed since
            when = datetime.fromtimestamp(attr.st_mtime or 0, tz=timezone.utc)
            kind = "directory" if stat.S_ISDIR(attr.st_mode or 0) else "file"
            entries.append({"name": path, "size": attr.st_size or 0, "type": kind, "mtime": when})
        return entries

    def delete(self, key: str) -> None:
        with self._session("DELETE", key, 0) as fs:
            fs.rm_file(self._path(key), **self._deadline(0))

    def remove_stale_temp_files(self, older_than_s: float) -> int:
        """Delete what killed writers left behind, when older than ``older_than_s``: temp files
        (local disks, SFTP) and unfinished multipart uploads (S3). Returns how many were removed.
        GCS resumable uploads and Azure uncommitted blocks expire on the server by themselves."""
        cutoff = time.time() - older_than_s
        if self._disk is not None:
            return self._disk.remove_stale_temp_files(older_than_s)
        with self._session("CLEANUP", "(leftovers)") as fs:
            if self.profile.rename_put:
                return self._remove_remote_temp_files(fs, cutoff)
            if self.profile.protocol in ("s3", "s3a"):
                return self._abort_stale_multipart_uploads(fs, older_than_s)
        return 0

    def temp_files(self) -> TempFiles:
        """(size, mtime) of each temp file of a write here (local disks, SFTP; none on object stores)."""
        if self._disk is not None:
            return self._disk.temp_files()
        if not self.profile.rename_put:
            return []
        with self._session("LIST", "(temp files)") as fs:
            return [(size, when) for _, size, when in self._remote_temp_files(fs)]

    def _remote_temp_files(self, fs: Any) -> Iterator[tuple[str, int, float]]:
        found, _ = self._find_in_folders(fs, self.root)
        for path, info in found.items():
            if path.rsplit("/", 1)[-1].startswith(TEMP_PREFIX):
                mtime = info.get("mtime")
                when = mtime.timestamp() if isinstance(mtime, datetime) else float(mtime or 0)
                yield path, int(info.get("size") or 0), when

    def _remove_remote_temp_files(self, fs: Any, cutoff: float) -> int:
        removed = 0
        for path, _, when in self._remote_temp_files(fs):
            if when < cutoff:
                with contextlib.suppress(FileNotFoundError):
                    fs.rm_file(path)
                    removed += 1
        return removed

    def _abort_stale_multipart_uploads(self, fs: Any, older_than_s: float) -> int:
        """Abort this repository's multipart uploads started more than ``older_than_s`` ago by the
        server's clock (the Date of the listing), so a client with a wrong clock cannot abort a live one."""
        bucket, _, key_root = self.root.partition("/")
        prefix = f"{key_root}/" if key_root else ""
        removed = 0
        markers: dict[str, str] = {}
        while True:
            page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers, **self._deadline())
            now = _server_time(page) or time.time()
            for upload in page.get("Uploads", []) or []:
                started = upload.get("Initiated")
                if not isinstance(started, datetime):
                    continue
                when = (started if started.tzinfo else started.replace(tzinfo=timezone.utc)).timestamp()
                if when < now - older_than_s:
                    fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                    removed += 1
            if not page.get("IsTruncated"):
                return removed
            markers = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}


def _server_time(response: dict[str, Any]) -> float | None:
    date = (response.get("ResponseMetadata") or {}).get("HTTPHeaders", {}).get("date")
    try:
        return parsedate_to_datetime(date).timestamp() if date else None
    except (TypeError, ValueError):
        return None


SILENT_MARK = "_ckptvault_silent"  # set on an SFTP session that fell silent: closed, not pooled again


class SessionSilent(TimeoutError):
    """An SFTP session moved no byte for its bound (``_bound_silence``): it was closed, never to be read again."""


def silent_said(seconds: float) -> str:
    return f"no answer after {format_seconds(seconds)} s: the SFTP session was closed, a new one serves the retry"


def _bound_silence(fs: Any, seconds: float) -> None:
    """A read or write of the SFTP session that moves no byte for ``seconds`` fails. paramiko's channel
    waits forever by default: a connection dropped without a word (a NAT entry, a VPN) left the call's
    thread blocked after its deadline gave up on it, holding its session's slot of the pool for good;
    eight such calls and every later one failed, the server healthy again (audit 32a F1).

    The session is never read or written again then, and closed, not pooled: the silence may have cut an
    SFTP packet in two, and paramiko reads on (closing the file sends a CLOSE and reads its answer, a
    timeout there swallowed): a server thawed after a SIGSTOP sent the rest of the packet, read as the next
    one's length, "Garbage packet received" after 60-76 s of silence in place of the silence it was (nf54
    #2). Closing the client right at the timeout raced paramiko's other steps on it (a TypeError)."""
    channel = getattr(getattr(fs, "ftp", None), "get_channel", lambda: None)()
    if channel is None or seconds <= 0:
        return
    channel.settimeout(seconds)
    said = silent_said(seconds)

    def bounded(method: Any) -> Any:
        def call(*args: Any) -> Any:
            if getattr(fs, SILENT_MARK, False):  # never read or written again (closing it here raced paramiko)
                raise SessionSilent(said)
            try:
                return method(*args)
            except TimeoutError as exc:
                setattr(fs, SILENT_MARK, True)
                raise SessionSilent(said) from exc

        return call

    channel.recv = bounded(channel.recv)
    channel.send = bounded(channel.send)


@functools.cache
def _quiet_paramiko() -> None:
    """paramiko's records of what ckptvault retries or reports itself stay out of a process that configured no
    logging: a training process shipping with ``backup_async`` printed, through Python's last-resort handler,
    "Socket exception: Connection reset by peer", "Exception (client): Error reading SSH protocol banner" and
    its traceback, and a dying prefetch thread's traceback, for a dropped session that was retried and
    shipped (the CLI configures logging and drops them itself). A NullHandler on paramiko's logger changes
    only that: a process that configured logging still gets its records. A paramiko prefetch thread's death
    (the socket closed under it) is the read's failure, raised and retried on the reading thread: the thread
    hook leaves it out and hands every other thread's to the hook there was."""
    logging.getLogger("paramiko").addHandler(logging.NullHandler())
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if not _paramiko_prefetch(args):
            previous(args)

    threading.excepthook = hook


def _paramiko_prefetch(args: threading.ExceptHookArgs) -> bool:
    """Whether a thread died with an error inside paramiko's SFTP prefetch (``SFTPFile._prefetch_thread``)."""
    if not isinstance(args.exc_value, Exception):
        return False
    tb = args.exc_traceback
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "_prefetch_thread" and "paramiko" in code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _not_ssh(exc: Exception, kwargs: dict[str, Any]) -> Exception | None:
    """The advice that what answers at the SFTP vault's host and port is no SSH server, or None."""
    host = kwargs.get("host")
    if not isinstance(host, str) or not host:
        return None
    from .ssh_hosts import not_ssh_advice  # paramiko, only for an SFTP vault

    port = kwargs.get("port")
    return not_ssh_advice(exc, host, port if isinstance(port, int) else 22)


def _session_alive(fs: Any) -> bool:
    """Whether the SFTP session's SSH transport is still up (paramiko notices a connection closed on it)."""
    client = getattr(fs, "client", None)
    transport = client.get_transport() if client is not None else None
    return transport is not None and transport.is_active()


def _close_session(fs: Any) -> None:
    client = getattr(fs, "client", None)  # paramiko's SSHClient under fsspec's SFTPFileSystem
    with contextlib.suppress(Exception):
        if client is not None:
            client.close()


# The SFTP sessions a forked child inherited from its parent: kept referenced there for the child's life.
_INHERITED_SESSIONS: list[Any] = []


def _drop_inherited(fs: Any) -> None:
    """A session a forked child inherited, put out of use there without one of paramiko's locks: the parent's
    threads take them for each packet (a channel's, its buffers', the channel map's), and a copy held at the fork
    is never released in the child, where closing through paramiko (``client.close()``) waited on it for ever:
    the child hung in the fork hook, before its first line. Only the child's copy of the socket is closed
    (nothing is sent: the parent's session goes on); the session stays referenced, so that no ``__del__`` of
    paramiko's closes it later, which takes those locks too and would write into the parent's stream."""
    _INHERITED_SESSIONS.append(fs)
    client = getattr(fs, "client", None)
    transport = client.get_transport() if client is not None else None
    if transport is None:
        return
    transport.active = False  # a message sent on it later is dropped, never written
    with contextlib.suppress(Exception):
        transport.sock.close()


def _thread_niceness() -> int:
    """The calling thread's nice value (Linux keeps one per thread); 0 where it cannot be read."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (OSError, AttributeError):
        return 0


def _invalid_url(shown: str, exc: ValueError) -> UsageError:
    return UsageError(f"repository {shown} is not a valid URL: {one_line(hide_credentials(str(exc)))}")


def _local_setting_error(exc: Exception) -> str | None:
    """What is wrong on this machine when making a filesystem (an SFTP session connects and reads
    its key file then): a local file an option names that cannot be read, a key file that is no
    key, an option value of the wrong type. None for anything else (the network, the server), which
    stays a storage error and is retried. Retrying cannot fix these, and "object not found" (a
    missing key file) would read as "no vault here"."""
    if isinstance(exc, OSError) and isinstance(exc.filename, str):
        return (
            f"cannot read {exc.filename}: {exc.strerror or exc}; check the storage options that name files "
            "on this machine (e.g. -o key_filename=...; ~ is expanded)"
        )
    names = {klass.__name__ for klass in type(exc).__mro__}
    if "PasswordRequiredException" in names:
        return "the key file (-o key_filename) is encrypted; give its passphrase with -o passphrase=..."
    if "SSHException" in names and "AuthenticationException" not in names and "key" in str(exc).lower():
        return f"{one_line(str(exc))}; check -o key_filename=..."  # not a key, or a key of a kind it cannot read
    if isinstance(exc, ValueError) and "connection_string or account_name" in str(exc):  # adlfs: none given
        return (
            "no Azure credentials found; set AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME with "
            "AZURE_STORAGE_ACCOUNT_KEY), or give -o account_name=... with -o account_key=... or -o sas_token=..."
        )
    if isinstance(exc, (TypeError, ValueError)):
        return f"a storage option has a value of the wrong kind ({one_line(str(exc))}); check the -o options"
    return None


@functools.cache
def _whole_reads_sized(cat_file: Any) -> bool:
    return "max_concurrency" in inspect.signature(cat_file).parameters


def _sizes_whole_reads(fs: Any) -> bool:
    """Whether the filesystem asks for an object's size before reading it whole, and can be told not to
    (s3fs from 2026.3, whose ``_cat_file`` takes ``max_concurrency``; earlier ones make no HEAD)."""
    cat_file = getattr(type(fs), "_cat_file", None)
    return cat_file is not None and _whole_reads_sized(cat_file)
