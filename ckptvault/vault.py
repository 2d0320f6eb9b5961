"""``Vault``: the public Python API. The CLI uses nothing else.

vault = Vault.open("./vault")              # or Vault.init(url), or Vault.open() for the default
snap = vault.backup("./checkpoints", tags={"run": "x", "step": "1200"})
vault.restore(vault.latest(tags={"run": "x"}), "./resume")
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import logging
import os
import socket
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Concatenate, NoReturn, ParamSpec, TypeVar

from .arguments import (
    KeyfileArg,
    PathLike,
    before_arg,
    callback_arg,
    flag_arg,
    folder_or_default_arg,
    fraction_arg,
    hostname_arg,
    hosts_arg,
    int_arg,
    interval_arg,
    is_snapshot_id,
    keyfile_arg,
    path_arg,
    paths_arg,
    progress_arg,
    refuse_short_id_prefix,
    retry_lock_arg,
    seconds_arg,
    snapshot_arg,
    snapshot_list_arg,
    storage_options_arg,
    str_list_arg,
    tag_keys_arg,
    tags_arg,
    text_arg,
    url_arg,
    wrong_arg,
)
from .chunking import ChunkerParams
from .codec import CompressionSettings
from .crypto.keyfile import DEFAULT_KDF_COST, Keyfile, PassphraseSource, resolve_passphrase
from .errors import (
    CkptVaultError,
    SnapshotNotFoundError,
    UsageError,
    VaultExistsError,
    spelled,
    unused_keyfile_note,
)
from .location import default_repo_url, metadata_cache_root, refuse_local_non_vault_folder
from .ops import keyfiles
from .ops.catalog import (
    SnapshotCatalog,
    handed_out,
    refuse_gc_with_unreadable,
    removed_meanwhile,
    retagged_here,
)
from .ops.gc import DEFAULT_REPACK_THRESHOLD
from .ops.open_or_create import deriving_ahead, open_existing, open_race_winner, say_created
from .ops.progress import Progress
from .ops.reader import DEFAULT_CACHE_CHUNKS, ChunkedFile, SnapshotFile, find_file
from .ops.retag import (
    changed_tags,
    finish_left_behind,
    finished_retag,
    retag,
    retag_gone,
    retagged_before,
    retagged_copy,
)
from .ops.scan import Excludes, check_sources
from .repository import RepoConfig, Repository
from .repository.config import DEFAULT_PACK_SIZE
from .repository.format import LOCKS_PREFIX
from .repository.locks import HeldLock, LockInfo, LocklessRead
from .snapshot import selection
from .snapshot.model import WATCH_SIG_TAG, FileEntry, Snapshot
from .snapshot.retention import RetentionPolicy
from .store import RateArg, RateLimits, Store, open_store

if TYPE_CHECKING:  # the operations a call needs load with it (a CLI command starts ~0.1 s sooner without the rest)
    from .ops.async_backup import AsyncShipper, BackupHandle, BackupJob, OnFull
    from .ops.backup import OnChange
    from .ops.check import CheckReport
    from .ops.copy import CopyResult
    from .ops.drill import DrillReport
    from .ops.file_stream import FileChunks
    from .ops.inspect import FileContents, FileUsage, SnapshotDiff
    from .ops.prune import PruneResult
    from .ops.repair import IndexRepair
    from .ops.restore import RestoreResult
    from .ops.stats import VaultStats
    from .ops.status import BackupStatus
    from .ops.watch_options import LostCheckpoint, ShippedCheckpoint, WatchResult

log = logging.getLogger("ckptvault")


P = ParamSpec("P")
R = TypeVar("R")

# Lock objects are never held back by a bandwidth limit: a refresh queued behind a saturated upload
# could let the lock go stale.
UNTHROTTLED = (LOCKS_PREFIX,)
CLOSED_MESSAGE = "this Vault is closed; open it again with Vault.open(...)"


class _Unchanged(enum.Enum):
    """The default of a setting that keeps its current value when not given (None means something)."""

    UNCHANGED = "unchanged"


UNCHANGED = _Unchanged.UNCHANGED


def _open_only(method: Callable[Concatenate[Vault, P], R]) -> Callable[Concatenate[Vault, P], R]:
    """A public method refuses to run on a closed Vault, takes only True or False for its flags
    (``overwrite="no"`` would otherwise overwrite), and checks an ``on_progress`` and its other
    callbacks before it starts (a bad one failed only once a restore had made its target, or once
    ``watch`` had committed a snapshot)."""
    params = [p for p in inspect.signature(method).parameters.values() if p.kind is p.KEYWORD_ONLY]
    flags = [p.name for p in params if p.annotation == "bool"]
    callbacks = [p.name for p in params if str(p.annotation).startswith("Callable[") and p.name != "on_progress"]

    @functools.wraps(method)
    def checked(self: Vault, /, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._closed:
            raise UsageError(CLOSED_MESSAGE)
        for name in flags:
            flag_arg(name, kwargs.get(name, False))
        progress_arg("on_progress", kwargs.get("on_progress"))
        for name in callbacks:
            callback_arg(name, kwargs.get(name))
        return method(self, *args, **kwargs)

    return checked


def _before_commit(lock: HeldLock, then: Callable[[], None] | None) -> None:
    lock.verify()  # first: a lock that was lost means nothing more may be written
    if then is not None:
        then()


def _owned_here(mutex: threading.RLock) -> bool:
    """Whether this thread holds ``mutex``, from the owner the RLock records in the same C call that takes it
    (and clears in the one that releases it). An owner recorded by a statement of its own, after the take and
    cleared before the release, left a few bytecodes in which a signal handler (run between two bytecodes of
    the frame it interrupted) saw none: its ``backup()`` or ``flush()`` waited for the mutex its own thread
    held, for ever. ``_is_owned`` is what ``threading.Condition`` asks an RLock, in C and in Python."""
    return bool(mutex._is_owned())  # type: ignore[attr-defined]


def _held(mutex: threading.RLock) -> bool:
    """Whether any thread holds ``mutex`` (Python 3.10's RLock has no ``locked()``)."""
    if _owned_here(mutex):
        return True
    if mutex.acquire(blocking=False):
        mutex.release()
        return False
    return True


# Every Vault of this process, for the fork hook below.
_VAULTS: weakref.WeakSet[Vault] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for vault in list(_VAULTS):
        vault._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _signature_entry(entry: FileEntry) -> tuple[str, ...]:
    """One entry of a snapshot's tree as ``ops.pin.signature`` describes what it read from the disk."""
    if entry.type == "symlink":
        return (entry.path, "l", entry.target or "")
    if entry.type == "dir":
        return (entry.path, "d")
    return (entry.path, "f", str(entry.size), str(entry.mtime_ns))


def exclude_arg(value: Sequence[str] | None) -> Excludes:
    """Exclude patterns of ``backup``, ``backup_async``, ``watch`` and ``backup_status``, checked."""
    return Excludes.parse(str_list_arg("exclude", value, "['*.tmp', 'wandb']"))


def _caught_by_ckptvault(exc: BaseException) -> bool:
    """Whether ``exc`` was last caught in ckptvault's own code (its traceback's outermost frame is where it
    was caught): a step of a backup that took it for that step's failure, not the caller that was refused."""
    tb = exc.__traceback__
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).partition(".")[0] == "ckptvault"


class Vault:
    def __init__(self, repo: Repository, url: str) -> None:
        self._repo = repo
        self.url = url
        self.created = False  # True when open(create=True) made a new repository
        self._shipper: AsyncShipper | None = None  # backup_async's worker, made on first use
        # The Repository writes one backup at a time. An RLock for its owner (``_owned_here``), never
        # taken twice by one thread: the thread in a backup or copy waits for no backup.
        self._backup_mutex = threading.RLock()
        self._refused: UsageError | None = None  # a call refused on that thread (_refuse_inside_own_backup)
        # Reentrant: close() called again on the thread already closing (a SIGTERM handler that closes, landing in
        # a `with` block's close) deadlocked on it; the inner call returns at once, the outer one goes on.
        self._close_mutex = threading.RLock()
        # Where warnings go besides the "ckptvault" logger (the CLI passes its stderr printer).
        self.on_warning: Callable[[str], None] | None = None
        self._warn = self._warner()  # the Vault's own warnings (a damaged snapshot object, prune's)
        self._catalog = SnapshotCatalog(repo, self._warn)
        self._closing = False  # close() has begun: no new async backups
        # read_file's iterators: each holds a shared lock while a file is read part way (closed by close())
        self._file_readers: weakref.WeakSet[FileChunks] = weakref.WeakSet()
        self._closed = False  # close() has ended: every public method refuses
        self._forked_mid_write: int | None = None  # in a forked child: the parent's PID, when it was writing
        _VAULTS.add(self)
        if repo.unused_keyfile is not None:
            self._warn(unused_keyfile_note(url, repo.unused_keyfile))

    def _forked(self) -> None:
        """In a child forked from the process that opened this Vault (DataLoader workers, a
        ``multiprocessing`` pool): the parent's async queue, its worker thread and the locks its threads
        held at the fork stay the parent's. A child that ran or waited for the queue's copy used to hang
        (its ``flush()``, ``close()`` and ``backup()`` waited forever for threads it does not have) or ship
        the parent's checkpoints a second time; its own queue starts empty. A backup the parent was
        writing leaves the Repository's state part written (chunks of a pack not uploaded yet count as
        stored): writes from here are refused (``_refuse_forked_mid_write``), reads go on."""
        parent = os.getppid()
        if _held(self._backup_mutex):
            self._forked_mid_write = parent
        self._shipper = None  # the parent ships it; its pins are the parent's to release
        self._backup_mutex = threading.RLock()
        self._close_mutex = threading.RLock()
        self._refused = None

    def _refuse_forked_mid_write(self) -> None:
        if self._forked_mid_write is not None:
            raise UsageError(
                f"this Vault is process {self._forked_mid_write}'s, which was writing a backup when it forked this "
                f"process; open a Vault in this process to write: Vault.open({self.url!r})"
            )

    @property
    def unused_keyfile(self) -> str | None:
        """The path of the keyfile given to ``open`` for this vault, which is not encrypted (None when none was):
        it is not used; reads go on, and every write (backup, copy into it, tag, forget, prune...) raises
        UsageError, so that nothing meant to be encrypted is written in the clear."""
        return self._repo.unused_keyfile

    @property
    def unreadable_snapshots(self) -> dict[str, CkptVaultError]:
        """Snapshot objects the latest listing left out because they cannot be decoded (damaged, or
        written by a newer ckptvault): full ID -> the error, which names the object."""
        return self._catalog.unreadable

    @property
    def writing(self) -> bool:
        """Whether a backup or copy into this Vault is being written now, on any thread: a handler that
        ends the process at once (a second SIGTERM) says from it whether an upload was abandoned."""
        return _held(self._backup_mutex)

    @property
    def local_folder(self) -> str | None:
        """The vault's folder on this machine (None for remote storage): nothing is backed up into it."""
        return getattr(self._repo.store, "local_folder", None)

    # ---- keyfiles (ckptvault key ...) -----------------------------------------------------

    @staticmethod
    def generate_keyfile(path: PathLike, *, passphrase: str, kdf_cost: int = DEFAULT_KDF_COST) -> Keyfile:
        """Create a keyfile at ``path`` holding a new random key under ``passphrase`` (at least 8
        characters, not counting spaces at its ends), as ``ckptvault key generate`` does: mode 0600,
        never over an existing file, and bound to the vault settings it will authenticate (a config
        rewritten to weaker ones is refused, docs/security.md). ``kdf_cost``: log2 of scrypt's N
        (14..24; 17 takes ~0.3 s and 128 MiB). Keep a copy of it elsewhere: without it, and its
        passphrase, an encrypted vault cannot be read by anyone."""
        return keyfiles.generate_keyfile(path_arg("path", path), passphrase, kdf_cost)

    @staticmethod
    def change_keyfile_passphrase(
        keyfile: str | os.PathLike[str] | Keyfile,
        *,
        passphrase: PassphraseSource,
        new_passphrase: PassphraseSource,
        kdf_cost: int | None = None,
    ) -> Keyfile:
        """Put the keyfile's key under ``new_passphrase`` (rules as ``generate_keyfile``), written over
        the keyfile in one rename, as ``ckptvault key passwd`` does. The key, and so the vault's data,
        stay the same. Either passphrase may be a function, called when needed: the new one only once
        the current one unlocked the key. ``kdf_cost``: scrypt's new log2(N), else the keyfile's."""
        key = keyfile_arg(keyfile)
        if key is None or not key.path:
            raise wrong_arg("keyfile", keyfile, "a keyfile's path (str or pathlib.Path), or a Keyfile loaded from one")
        return keyfiles.change_passphrase(key, key.path, passphrase, new_passphrase, kdf_cost)

    # ---- opening -----------------------------------------------------------------------

    @classmethod
    def init(
        cls,
        url: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        chunker: ChunkerParams | None = None,
        compression: CompressionSettings | None = None,
        pack_size: int = DEFAULT_PACK_SIZE,
        keyfile: KeyfileArg = None,
        passphrase: PassphraseSource = None,
        limit_upload: RateArg = None,
        limit_download: RateArg = None,
    ) -> Vault:
        """Create a repository at ``url`` (the default location when None).

        With ``keyfile`` (a path or a loaded ``Keyfile``), everything stored is encrypted with
        AES-256-GCM under the keyfile's master key; ``passphrase`` unlocks it (a string, or a
        function called only when needed). ``limit_upload`` and ``limit_download`` cap the bytes
        per second this Vault moves to and from the storage (as in ``Vault.open``)."""
        url = url_arg(url) or default_repo_url()
        limits = RateLimits.resolve(limit_upload, limit_download)
        if not isinstance(chunker, ChunkerParams | None):
            raise wrong_arg("chunker", chunker, "a ChunkerParams (from ckptvault.chunking) or None")
        if not isinstance(compression, CompressionSettings | None):
            raise wrong_arg("compression", compression, "a CompressionSettings (from ckptvault.codec) or None")
        if compression is not None and compression.codec == "zstd":  # not in CompressionSettings: old configs hold any
            int_arg("compression level", compression.level)
        refuse_local_non_vault_folder(url)
        config = RepoConfig(
            chunker=chunker or ChunkerParams(),
            compression=compression or CompressionSettings(),
            pack_size=int_arg("pack_size", pack_size),
        )
        store = open_store(url, storage_options_arg(storage_options), limits=limits, unlimited=UNTHROTTLED)
        odd = getattr(store, "odd_path", None)  # s3://bucket//vault: a second vault beside bucket/vault (keypath.py)
        if odd is not None:
            raise UsageError(odd.refusal())
        key = keyfile_arg(keyfile)
        master = key.unlock(resolve_passphrase(passphrase)) if key else None
        return cls(Repository.init(store, config, key, master, cache_root=metadata_cache_root()), store.url)

    @classmethod
    def open(
        cls,
        url: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        keyfile: KeyfileArg = None,
        passphrase: PassphraseSource = None,
        create: bool = False,
        limit_upload: RateArg = None,
        limit_download: RateArg = None,
        retry_lock: float | timedelta = 0,
    ) -> Vault:
        """Open the repository at ``url`` (a path or URL; None: the default vault); with
        ``create=True`` make it when it does not exist. Several processes may do that at once (the
        ranks of a distributed job): one creates it, the others open it.

        ``limit_upload`` and ``limit_download`` cap the bytes per second this Vault moves to and
        from the storage, all threads together: a number of bytes per second or text such as
        ``"50MB"``, ``"20MiB"``, ``"400Mbit"``; 0 for none; None (the default) takes
        ``CKPTVAULT_LIMIT_UPLOAD`` / ``CKPTVAULT_LIMIT_DOWNLOAD`` from the environment.

        ``retry_lock`` (seconds, or a timedelta): how long each operation keeps trying when another
        process holds a conflicting lock (a prune, or a backup while pruning), retrying after 1, 2,
        4 ... up to 30 s; 0 (the default) fails at once with VaultLockedError. ``backup_async``, the
        callbacks and ``watch`` wait for a prune in their own way (up to an hour, or ``retry_lock`` when
        longer), which ``close`` ends."""
        wait = retry_lock_arg(retry_lock)
        vault = cls._open(
            url, storage_options_arg(storage_options), keyfile, passphrase, create, limit_upload, limit_download
        )
        vault._repo.locks.retry_for = wait  # how long a command waits for a conflicting lock (locks.py, "Waiting")
        return vault

    @classmethod
    def _open(
        cls,
        url: str | os.PathLike[str] | None,
        storage_options: dict[str, Any] | None,
        keyfile: KeyfileArg,
        passphrase: PassphraseSource,
        create: bool,
        limit_upload: RateArg,
        limit_download: RateArg,
    ) -> Vault:
        given_url = url_arg(url)
        url = given_url or default_repo_url()
        create = flag_arg("create", create)
        limits = RateLimits.resolve(limit_upload, limit_download)
        key = keyfile_arg(keyfile)
        with deriving_ahead(key, passphrase):  # scrypt on another core while the config is read
            store = open_store(url, storage_options, limits=limits, unlimited=UNTHROTTLED)
            repo = open_existing(store, url, key, passphrase, create=create)
            if repo is not None:
                return cls(repo, store.url)
            return cls._open_or_create_race(
                url, store, storage_options, key, passphrase, limits, named=given_url is not None
            )

    @classmethod
    def _open_or_create_race(
        cls,
        url: str,
        store: Store,
        storage_options: dict[str, Any] | None,
        key: Keyfile | None,
        passphrase: PassphraseSource,
        limits: RateLimits,
        *,
        named: bool,
    ) -> Vault:
        """``open(create=True)`` where no vault is: create it, or open the one another process created
        since (``named``: the URL was given, not the default location)."""
        try:
            vault = cls.init(
                url,
                storage_options=storage_options,
                keyfile=key,
                passphrase=passphrase,
                limit_upload=limits.upload or 0,
                limit_download=limits.download or 0,
            )
        except VaultExistsError:  # another process created it since we looked: open theirs
            return cls(open_race_winner(store, key, passphrase), store.url)
        vault.created = True
        say_created(vault.url, named=named, encrypted=key is not None)
        return vault

    def close(self) -> None:
        """Wait for every queued async backup, however long they take (as ``flush()`` does;
        ``exit_timeout`` bounds only the interpreter's exit), then release the Vault; every method
        but ``close`` (which may be called again) then raises UsageError. A failed backup was
        logged when it failed and is not raised here. Called again on a thread already in ``close()`` (a
        signal handler), it waits for the queued backups and returns, the outer call doing the rest; on a thread
        inside this Vault's backup or copy, it raises UsageError."""
        if self._shipper is not None and self._shipper.on_worker_thread():  # it would wait for itself
            raise UsageError(
                "close() cannot be called from a backup's done-callback; close the Vault from your own code"
            )
        # a signal handler (SIGTERM) that closes, run on the main thread inside its backup, or a progress
        # callback: it waited for the backup's mutex, held by the very frame it interrupted, for ever
        self._refuse_inside_own_backup(
            "close()",
            "raise SystemExit there (sys.exit(143)) and close the Vault once the backup has unwound "
            "(a `with Vault.open(...)` block does)",
        )
        with self._close_mutex:  # a second caller waits until the first has closed
            if self._closing:
                if not self._closed and self._shipper is not None:
                    # this thread's own close() is under way (reentered from a signal handler): wait for the
                    # queue as every close() does; returning at once, a handler that went on to os._exit() lost it
                    self._shipper.close()
                return
            self._closing = True
            try:
                if self._shipper is not None:
                    # Not bounded: a vault closed in a long-lived process must not drop backups that
                    # would still ship, and the caller can flush(timeout) first to bound the wait.
                    waiting = self._shipper.pending()
                    if waiting:
                        log.info("ckptvault: waiting for %d queued backup(s) before the vault closes", waiting)
                    self._shipper.close()
            except KeyboardInterrupt:
                # Ctrl-C ends the wait: nothing queued runs any more (each is named, its pins kept),
                # and the running backup keeps the repository until it ends or the process does.
                if self._shipper is not None:
                    self._shipper.abandon("on Ctrl-C while the vault closed")
                self._closed = True
                raise
            with self._backup_mutex:  # a synchronous backup on another thread finishes first
                self._closed = True
                for reader in list(self._file_readers):  # a file read part way holds its shared lock
                    reader.cut_by_close()
                self._repo.close()

    def __enter__(self) -> Vault:
        if self._closed:
            raise UsageError(CLOSED_MESSAGE)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> NoReturn:
        # a Vault holds locks, connections and threads of this process: pickled into a DataLoader's spawned
        # worker it failed with "cannot pickle '_thread.lock' object", naming nothing of what to do
        raise TypeError(
            "a Vault cannot be pickled or copied (it holds this process's locks, connections and threads); "
            f"in another process (a DataLoader worker) open one there: Vault.open({self.url!r})"
        )

    @property
    def config(self) -> RepoConfig:
        return self._repo.config

    # ---- snapshots ---------------------------------------------------------------------

    @_open_only
    def snapshots(self, tags: dict[str, str] | None = None, *, hosts: Sequence[str] | None = None) -> list[Snapshot]:
        """All snapshots (matching every given tag, and of any of ``hosts`` when given), oldest first.
        ``tags``: None or ``{}`` for no tag filter (every snapshot carries all of no tags); ``hosts``: a list of
        hostnames, or None for every host (an empty list is refused, UsageError: any of no host is no
        snapshot, and a filtered list that ended empty must not widen to every host). Every method that
        selects (``snapshot``, ``latest``, ``restore``, ``restore_latest``, ``drill``, ``stats``) takes them so.

        A snapshot object that cannot be decoded (damaged, or written by a newer ckptvault) is left
        out with a warning naming it (once per Vault: the "ckptvault" logger and ``on_warning``);
        ``unreadable_snapshots`` then holds its ID and error. ``forget`` removes such an object by its
        ID, and ``prune`` and ``"latest"`` refuse while one exists (it may hold the newest save)."""
        tags = tags_arg(tags)
        wanted_hosts = hosts_arg(hosts)
        snaps, _ = self._catalog.listing()
        return sorted(selection.matching(snaps, tags, wanted_hosts), key=lambda s: s.time)

    def _warner(self, on_warning: Callable[[str], None] | None = None, *, logged: bool = True) -> Callable[[str], None]:
        """Where warnings go: the "ckptvault" logger (unless not ``logged``), and a call's ``on_warning``,
        or else the Vault's (looked up at each warning: the CLI sets it once the Vault is open). The one
        place that decides it: the Vault's own warnings (``_warn``) and each call's."""

        def warn(message: str) -> None:
            if logged:
                log.warning(message)
            to = on_warning if on_warning is not None else self.on_warning
            if to is not None:
                to(message)

        return warn

    @_open_only
    def snapshot(
        self, spec: str | Snapshot, tags: dict[str, str] | None = None, *, hosts: Sequence[str] | None = None
    ) -> Snapshot:
        """A snapshot by unique ID prefix (4 characters or more, as everywhere: ``arguments.ID_PREFIX_MIN``), or
        ``"latest"`` (newest step, else time) among those with ``tags`` and of any of ``hosts`` (restic's
        ``--host``; None: any host; ``[]`` is refused, as for ``snapshots``). An ID, or a Snapshot, must match
        them too. An ID naming a snapshot object that cannot be decoded raises that object's error."""
        spec = snapshot_arg(spec)
        refuse_short_id_prefix(spec, "name")  # `restore 1` is refused: so is Vault.snapshot("1"), ls 1, diff 1 9
        tags = tags_arg(tags)
        wanted_hosts = hosts_arg(hosts)
        if isinstance(spec, Snapshot):  # the tags are checked all the same, as for its ID
            return selection.select([spec], spec.short_id, tags, wanted_hosts) if tags or wanted_hosts else spec
        try:
            return self._catalog.find(spec, tags, wanted_hosts)
        except SnapshotNotFoundError:
            # a whole ID that a tag replaced: its new ID can be told (retagged_id), and is named
            if is_snapshot_id(spec) and (copy := retagged_copy(self._catalog.listing()[0], spec.lower())):
                raise retagged_before(spec.lower(), copy) from None
            raise

    @_open_only
    def latest(self, tags: dict[str, str] | None = None, *, hosts: Sequence[str] | None = None) -> Snapshot:
        """The newest snapshot (highest step, else time) with ``tags`` and of any of ``hosts``."""
        return self.snapshot("latest", tags, hosts=hosts)

    @_open_only
    def files(self, snapshot: str | Snapshot) -> list[FileEntry]:
        """The snapshot's tree: every file, directory and symlink, sorted by path."""
        return self._catalog.tree(self.snapshot(snapshot), self.url)

    # ---- backup and restore ------------------------------------------------------------

    @_open_only
    def backup(
        self,
        paths: PathLike | Sequence[PathLike],
        *,
        tags: dict[str, str] | None = None,
        description: str | None = "",
        hostname: str | None = None,
        force_read: bool = False,
        skip_unreadable: bool = False,
        on_change: OnChange = "warn",
        skip_if_unchanged: bool = False,
        exclude: Sequence[str] = (),
        on_progress: Progress | None = None,
        on_warning: Callable[[str], None] | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> Snapshot:
        """Back up files and directories as one snapshot.

        ``before_commit`` is called just before the snapshot is written: what it raises is raised
        instead, and no snapshot is written (the chunks stored stay for the next backup to reuse).

        Files unchanged since the previous snapshot of the same paths from the same host
        (size, mtime, inode, ctime) are not read again unless ``force_read``. A file that
        changes while it is read is read once more; if it changes again, ``on_change`` decides:
        "warn" stores the bytes read and warns, "skip" leaves the file out and warns, "fail"
        raises SourceError and writes no snapshot.

        ``skip_if_unchanged``: when the newest snapshot from this host that carries all of
        ``tags``, of sources with the same names, holds exactly these files (paths, modes, mtimes,
        sizes, content hashes), no snapshot is written and that one is returned (its ``time``
        then predates the call).

        ``exclude``: files and folders to leave out, e.g. ``["*.tmp", "wandb", "logs/*.txt"]``: a
        name at any depth, or a path from the snapshot's root (docs/usage.md, "Excluding files").
        """
        return self._backup(
            paths,
            exclude_arg(exclude),
            tags=tags,
            description=description,
            hostname=hostname,
            force_read=force_read,
            skip_unreadable=skip_unreadable,
            on_change=on_change,
            skip_if_unchanged=skip_if_unchanged,
            on_progress=on_progress,
            on_warning=on_warning,
            before_commit=before_commit,
        )

    @_open_only  # the worker's jobs too: a job that starts once the Vault closed takes no lock
    def _backup(
        self,
        paths: PathLike | Sequence[PathLike],
        excludes: Excludes,
        *,
        tags: dict[str, str] | None = None,
        description: str | None = "",
        hostname: str | None = None,
        force_read: bool = False,
        skip_unreadable: bool = False,
        on_change: OnChange = "warn",
        skip_if_unchanged: bool = False,
        on_progress: Progress | None = None,
        on_warning: Callable[[str], None] | None = None,
        before_commit: Callable[[], None] | None = None,
        wait_for_lock: bool = True,
        taken_at: datetime | None = None,
        log_warnings: bool = True,
    ) -> Snapshot:
        """``backup`` with its exclude rules parsed: the watch's in-place jobs add a rule no pattern spells.
        ``wait_for_lock=False``: no ``retry_lock`` wait (the async shipper waits for the vault itself, in a
        way its close and SIGTERM can end). ``log_warnings=False``: only to ``on_warning`` (watch says them
        itself, naming the checkpoint)."""
        from .ops.backup_session import vault_backup

        sources = paths_arg(paths)
        tags = tags_arg(tags, stored=True)
        description = text_arg("description", description, optional=True) or ""
        hostname = hostname_arg(hostname) or socket.gethostname()
        abs_paths = sorted(check_sources(sources))
        with self._writing(), self._repo.locks.acquire(exclusive=False, retry=wait_for_lock) as lock:
            self._repo.load_index_as_stored()  # under the lock: what a prune removed before is not reused
            self._repo.reconcile_when_due()  # reuse what a killed backup uploaded; not what is gone
            result = vault_backup(
                self._repo,
                sorted(self._catalog.listing(copies=False)[0], key=lambda s: s.time),  # read only
                self.files,
                sources,
                abs_paths,
                tags=tags,
                description=description,
                hostname=hostname,
                excludes=excludes,
                skip_if_unchanged=skip_if_unchanged,
                force_read=force_read,
                skip_unreadable=skip_unreadable,
                on_change=on_change,
                progress=on_progress,
                before_commit=functools.partial(_before_commit, lock, before_commit),
                vault_folder=self.local_folder,
                taken_at=taken_at,
            )
        warn = self._warner(on_warning, logged=log_warnings or on_warning is None)  # said somewhere all the same
        for warning in result.warnings:
            warn(warning)
        return handed_out(result.snapshot)  # an unchanged backup's twin is a kept object: the caller gets a copy

    @_open_only
    def restore(
        self,
        snapshot: str | Snapshot,
        target: PathLike,
        *,
        tags: dict[str, str] | None = None,
        hosts: Sequence[str] | None = None,
        include: Sequence[str] | None = None,
        overwrite: bool = False,
        on_progress: Progress | None = None,
    ) -> RestoreResult:
        """Restore into ``target``, verifying every chunk and every file hash; ``include`` (a list of
        globs) restores only the paths matching one. A target that cannot be written (disk full,
        read-only, no permission) raises a StorageError naming the path (StorageFullError when full).
        What the target held that the snapshot does not is left as it was, and named in the result's
        ``not_in_snapshot``. ``tags`` and ``hosts`` select as for ``snapshot``: ``"latest"`` is the newest
        of those, and an ID must match them."""
        return self._checked_restore(snapshot, target, include, overwrite, on_progress, tags=tags, hosts=hosts)

    def _checked_restore(
        self,
        snapshot: str | Snapshot,
        target: PathLike,
        include: Sequence[str] | None,
        overwrite: bool,
        on_progress: Progress | None,
        *,
        alone: bool = False,
        tags: dict[str, str] | None = None,
        hosts: Sequence[str] | None = None,
    ) -> RestoreResult:
        from .ops.restore import restore_full_hint, target_error

        snapshot = snapshot_arg(snapshot)
        refuse_short_id_prefix(snapshot, "restore")  # `restore 1 ./resume` meant step 1, and wrote another save
        where = path_arg("target", target)
        globs = None if include is None else str_list_arg("include", include, "['model/*']")
        wanted, wanted_hosts = tags_arg(tags), hosts_arg(hosts)  # before the target is made
        try:
            return self._restore(
                snapshot,
                where,
                include=globs,
                overwrite=overwrite,
                on_progress=on_progress,
                alone=alone,
                tags=wanted,
                hosts=wanted_hosts,
            )
        except OSError as exc:  # the store's failures are StorageErrors already: this is the target
            hint = restore_full_hint() if os.path.isdir(where) else ""  # not even the folder could be made
            raise target_error(exc, where, full_hint=hint) from exc

    def _restore(
        self,
        snapshot: str | Snapshot,
        target: str,
        *,
        include: list[str] | None = None,
        overwrite: bool = False,
        on_progress: Progress | None = None,
        alone: bool = False,
        tags: dict[str, str] | None = None,
        hosts: Sequence[str] | None = None,
        kept: bool = True,
    ) -> RestoreResult:
        """``restore`` with a target that cannot be written raised as the OSError (see ops/restore.py).
        ``kept``: False for a target removed after (see ``run_restore``)."""
        from .ops.restore import run_restore

        with self._repo.locks.acquire_to_read():
            self._repo.load_index_as_stored()
            snap = self.snapshot(snapshot, tags, hosts=hosts)
            return run_restore(
                self._repo,
                snap,
                self._files_still_stored(snap),
                target,
                include=include,
                overwrite=overwrite,
                progress=on_progress,
                workers=self._repo.download_concurrency,
                vault_folder=self.local_folder,
                alone=alone,
                kept=kept,
            )

    def _files_still_stored(self, snapshot: str | Snapshot) -> list[FileEntry]:
        """``files``, under a lock taken after ``snapshot`` was chosen: a prune may have removed it in
        between, and a tree kept in this host's metadata cache would still be read (its chunks then
        missing, as if the vault were damaged)."""
        snap = self.snapshot(snapshot)
        if not self._repo.has_snapshot(bytes.fromhex(snap.id)):
            raise removed_meanwhile(snap, self.url, self._catalog.retagged.get(snap.id))
        return self.files(snap)

    @_open_only
    def read_file(self, snapshot: str | Snapshot, path: PathLike) -> Iterator[bytes]:
        """Yield one file's bytes chunk by chunk; each chunk is verified, and the whole-file
        hash is checked at the end (raising IntegrityError after the last chunk if it differs)."""
        from .ops.file_stream import FileChunks, read_whole

        snap = self.snapshot(snapshot_arg(snapshot))
        entry = find_file(self.files(snap), path_arg("path", path), snap.id)  # raised here, not at the first next()
        reader = FileChunks(read_whole(self._repo, entry), entry.path)
        self._file_readers.add(reader)
        return reader

    @_open_only
    def copy_from(
        self,
        source: Vault,
        snapshots: Sequence[str | Snapshot] | None = None,
        *,
        tags: dict[str, str] | None = None,
        dry_run: bool = False,
        decrypt: bool = False,
        on_progress: Progress | None = None,
        on_warning: Callable[[str], None] | None = None,
    ) -> CopyResult:
        """Copy snapshots of ``source`` into this vault (restic's ``copy``): all of them, those
        carrying ``tags``, or the given ones (IDs or prefixes, ``"latest"``, Snapshots). A snapshot
        keeps its ID, time, host, paths and tags, so one this vault holds already is not copied
        again (``already_there``); a retagged one has a new ID and is copied again. Every chunk read
        is verified; the chunks are coded by this vault's settings and encrypted under its key.
        Out of an encrypted vault into an unencrypted one only with ``decrypt`` (UsageError otherwise:
        the copies would be stored in the clear). ``on_warning`` gets each warning (also logged): copies
        stored unencrypted out of an encrypted vault, and snapshots the source forgot or retagged while
        they waited to be copied (``gone``).
        A snapshot that cannot be read in the source (a damaged chunk, tree or snapshot object; the
        latter only counts when copying all of them) does not stop the others: once they are copied,
        CopyIncompleteError names each, with what was copied as its ``result``."""
        from .ops.copy_session import copy_listed, finish_copy, refuse_decrypting

        warn = self._warner(on_warning)
        if not isinstance(source, Vault):
            raise UsageError(f"source must be an open Vault (Vault.open(url)), not {type(source).__name__}")
        specs = None if snapshots is None else snapshot_list_arg(snapshots)
        listing = spelled(f"ckptvault snapshots --repo {source.url}", "source.snapshots()")
        for spec in specs or ():
            refuse_short_id_prefix(spec, "copy", listing)  # `copy 9` copied whichever began with 9 (cp47 #3)
        tags = tags_arg(tags)
        decrypt = flag_arg("decrypt", decrypt)
        if source.config.repo_id == self.config.repo_id:
            raise UsageError(
                f"{source.url} and {self.url} are the same vault; copy into another one "
                f"(create it with: {spelled('ckptvault init URL', 'Vault.init(url)')})"
            )
        if source._closed:
            raise UsageError(f"the source vault: {CLOSED_MESSAGE}")
        if not (dry_run or decrypt):
            refuse_decrypting(source._repo, self._repo, (source.url, self.url))
        with contextlib.ExitStack() as locks:
            locks.enter_context(source._repo.locks.acquire_to_read())
            lock = None
            if not dry_run:  # a dry run writes nothing: it only reads which snapshots are in both vaults
                locks.enter_context(self._writing("copy_from()", "call it once this backup has returned"))
                lock = locks.enter_context(self._repo.locks.acquire(exclusive=False))
                self._repo.load_index_as_stored()  # under the lock: what a prune removed before is not reused
                self._repo.reconcile_with_stored_packs()
            source._repo.load_index_as_stored()
            listed, unreadable = source._catalog.listing()  # the pair of one listing: another thread's may follow
            result = copy_listed(
                source._repo,
                self._repo,
                listed,
                unreadable,
                specs,
                tags,
                urls=(source.url, self.url),
                progress=on_progress,
                before_commit=None if lock is None else functools.partial(_before_commit, lock, None),
                dry_run=dry_run,
                warn=warn,
                decrypt=decrypt,
            )
        mirror = specs is None and not tags and not dry_run  # all of them
        return finish_copy(result, unreadable, self._repo, urls=(source.url, self.url), mirror=mirror, warn=warn)

    @_open_only
    def stats(
        self,
        snapshots: Sequence[str | Snapshot] | None = None,
        *,
        tags: dict[str, str] | None = None,
        hosts: Sequence[str] | None = None,
    ) -> VaultStats:
        """What the snapshots hold versus what the vault stores. Without arguments, of the whole vault.
        ``snapshots`` (IDs, ``"latest"``, Snapshots), ``tags`` and ``hosts`` (as for ``snapshots()``; given
        with ``snapshots``, each must match them, and ``"latest"`` is the newest that does) count only those
        snapshots (``selected``): their logical bytes, the distinct chunks their files reference (their
        trees are read), and the stored bytes and packs of those chunks with the delta bases they need (what
        keeping only them takes; metadata not counted). A selection of no snapshot gives zeros."""
        from .ops.stats import compute_selected_stats, compute_stats

        specs = None if snapshots is None else snapshot_list_arg(snapshots)
        tags = tags_arg(tags)
        wanted_hosts = hosts_arg(hosts)
        self._repo.refresh_index()  # as stored now, not as when this Vault first read it
        if specs is None and not tags and not wanted_hosts:
            every, unreadable = self._catalog.listing()
            return compute_stats(self._repo, sorted(every, key=lambda s: s.time), len(unreadable))
        with self._repo.locks.acquire_to_read():  # a prune waits (or is refused) while the trees are read
            if specs is None:
                chosen = self.snapshots(tags, hosts=wanted_hosts)
            else:
                picked = {s.id: s for s in (self.snapshot(spec, tags, hosts=wanted_hosts) for spec in specs)}
                chosen = sorted(picked.values(), key=lambda s: s.time)
            trees = [self._files_still_stored(s) for s in chosen]
        return compute_selected_stats(self._repo, chosen, trees, len(self._catalog.unreadable))

    # ---- retention and maintenance -----------------------------------------------------

    @_open_only
    def prune(
        self,
        *,
        keep_latest: int | None = None,
        before: datetime | timedelta | None = None,
        tags: dict[str, str] | None = None,
        keep_tags: Sequence[str] = (),
        group_by: str | None = None,
        dry_run: bool = False,
        repack_threshold: float = DEFAULT_REPACK_THRESHOLD,
        now: datetime | None = None,
    ) -> PruneResult:
        """Forget the snapshots the policy does not keep, then reclaim their space.

        A snapshot goes only when it is outside the newest ``keep_latest`` of its group AND
        older than ``before`` (a time, or an age like ``timedelta(days=14)``); either rule alone
        applies alone; with neither, no snapshot goes and only the space of forgotten ones is reclaimed.
        ``keep_tags`` is a list: ``["milestone"]``. ``dry_run`` changes nothing and returns exactly
        what a real run would do. A real run first waits for this Vault's queued ``backup_async`` backups
        to end (so do ``forget(prune=True)`` and ``repair_index``), without a limit: as long as they take,
        their retries through a storage outage and their wait for another process's prune (up to an hour)
        included. ``retry_lock`` does not bound it: it is for other processes' locks, and its default (0,
        refuse at once) would make a prune right after ``backup_async`` fail or not by timing. To bound the
        wait, call ``flush(timeout=...)`` first: FlushTimeoutError when they have not ended by then (and a
        failed backup's error, as every flush)."""
        from .ops.prune import run_prune

        policy = RetentionPolicy(
            keep_latest=int_arg("keep_latest", keep_latest, optional=True),
            before=before_arg(before, now),
            tags=tags_arg(tags),
            keep_tags=tuple(str_list_arg("keep_tags", keep_tags, "['milestone']")),
            group_by=text_arg("group_by", group_by, optional=True),
        )
        repack_threshold = fraction_arg(spelled("--repack-threshold", "repack_threshold"), repack_threshold)
        # a dry run deletes nothing: a shared lock lets backups go on meanwhile (its plan may then
        # count a running backup's packs, not yet indexed, as leftovers; the real run cannot)
        with self._repo.locks.acquire_to_read() if dry_run else self._exclusive_lock("prune()"):
            self._repo.load_index()
            every, unreadable = self._catalog.listing()
            every.sort(key=lambda s: s.time)
            refuse_gc_with_unreadable(unreadable)
            with self._repo.aborting_writes_on_error():  # a failed repack leaves nothing behind the lock
                result = run_prune(self._repo, every, policy, dry_run=dry_run, repack_threshold=repack_threshold)
        for warning in result.warnings:
            self._warn(warning)
        return result

    @_open_only
    def forget(self, snapshots: Sequence[str | Snapshot], *, prune: bool = False, dry_run: bool = False) -> PruneResult:
        """Remove the given snapshots (a list of IDs or unique prefixes, ``"latest"``, or Snapshots);
        with ``prune``, reclaim their space too. Those no longer in the vault (a rerun of a forget that
        was stopped half way) are named in a warning and skipped, unless none of them is there and no
        ``prune`` was asked for: SnapshotNotFoundError then.

        A snapshot object that cannot be decoded is removed by its ID without reading it (its tree
        is left for the next prune). ``prune`` refuses while another such object exists. An ID prefix
        must have at least 4 characters (``arguments.ID_PREFIX_MIN``). With ``prune`` (not ``dry_run``), it
        first waits, without a limit, for this Vault's queued ``backup_async`` backups, as ``prune`` does
        (``flush(timeout=...)`` first bounds that)."""
        from .ops.prune import run_forget

        snapshots = snapshot_list_arg(snapshots)
        for spec in snapshots:
            refuse_short_id_prefix(spec, "forget")
        with (
            self._repo.locks.acquire_to_read()
            if dry_run
            else self._exclusive_lock("forget(prune=True)")
            if prune
            else self._repo.locks.acquire(exclusive=False)
        ):
            self._repo.load_index()
            every, unreadable_now = self._catalog.listing()
            every.sort(key=lambda s: s.time)
            return run_forget(
                self._repo, every, unreadable_now, snapshots, prune=prune, dry_run=dry_run, warn=self._warn
            )

    @_open_only
    def tag(
        self,
        snapshot: str | Snapshot,
        *,
        add: dict[str, str] | None = None,
        remove: Sequence[str] | None = None,
        tags: dict[str, str] | None = None,
    ) -> Snapshot:
        """Give a snapshot new tags: ``add`` sets keys (replacing a value a key has), ``remove``
        takes keys away (a key it does not carry is no change). Returns the snapshot as it is now:
        under a new ID when its tags changed (ops/retag.py says why), the same one when not.
        ``snapshot`` is an ID prefix (4 characters or more), ``"latest"`` (among those with ``tags``) or a Snapshot."""
        snapshot = snapshot_arg(snapshot)
        refuse_short_id_prefix(snapshot, "retag")  # a retag replaces the snapshot: as forget does
        add = tags_arg(add, "add", stored=True)
        remove = tag_keys_arg("remove", remove)
        tags = tags_arg(tags)
        both = sorted(set(add) & set(remove))
        if both:
            raise UsageError(
                f"tag key {both[0]!r} is both added and removed; "
                f"give it to one of {spelled('--add', 'add')} and {spelled('--remove', 'remove')}"
            )
        if not add and not remove:
            raise UsageError(
                f"nothing to change: give tags to {spelled('--add', 'add')} or keys to {spelled('--remove', 'remove')}"
            )
        with self._repo.locks.acquire(exclusive=False) as lock:
            # a Snapshot given is looked up again: another process may have retagged or forgotten it
            try:
                chosen = self.snapshot(snapshot.id if isinstance(snapshot, Snapshot) else snapshot, tags)
            except SnapshotNotFoundError:
                if isinstance(snapshot, Snapshot) and snapshot.id not in {s.id for s in self.snapshots()}:
                    if (new_id := self._catalog.retagged.get(snapshot.id)) is not None:
                        raise retagged_here(snapshot, new_id) from None
                    raise retag_gone(snapshot) from None  # not "no snapshot <its 64 hex digits>"
                done = self._finished_retag(snapshot, tags, add, remove)
                if done is None:
                    raise
                return done
            renewed_tags = changed_tags(chosen.tags, add, remove)
            if renewed_tags == chosen.tags and (
                old := finish_left_behind(self._repo, chosen, self.snapshots(), lock.verify)
            ):
                self._warn(f"removed snapshot {old.short_id}, which a killed tag left beside {chosen.short_id}")
            retagged = retag(self._repo, chosen, renewed_tags, lock.verify)
            if retagged.id != chosen.id:
                self._catalog.retagged[chosen.id] = retagged.id
            return retagged

    def _finished_retag(
        self, spec: str | Snapshot, tags: dict[str, str] | None, add: dict[str, str], remove: list[str]
    ) -> Snapshot | None:
        """The copy an earlier ``tag`` of the whole ID ``spec`` finished before it was killed (``finished_retag``),
        said in a warning; None when ``spec`` names no such pair."""
        if not isinstance(spec, str) or not is_snapshot_id(spec):
            return None
        old_id = spec.lower()
        done = finished_retag(self.snapshots(tags), old_id, add, remove)
        if done is not None:
            self._warn(
                f"snapshot {old_id[:8]} was retagged already, as {done.short_id} (by an interrupted run of this tag, "
                "or another process); nothing changed"
            )
        return done

    @_open_only
    def check(self, *, read_data: float | bool = 0.0, seed: int | None = None) -> CheckReport:
        """Verify structure; with ``read_data`` (a fraction of packs, 1.0 or True = all, as ``check
        --read-data`` and ``repair_index(read_data=True)``) decode and verify chunks.
        Never raises on damage: inspect ``report.ok`` and ``report.problems``. (On a vault it may only
        read, where it takes no lock: VaultLockedError when a prune began meanwhile and problems were found;
        LockLostError when a prune removed its lock, taking it for a dead process's, and problems were found.)"""
        from .ops.check import run_check

        read_data = float(read_data) if isinstance(read_data, bool) else fraction_arg("read_data", read_data)
        seed = int_arg("seed", seed, optional=True)
        with self._repo.locks.acquire_to_read() as lock, self._repo.cache_bypassed():
            report = run_check(self._repo, read_data=read_data, seed=seed)
            if not report.ok and isinstance(lock, LocklessRead) and (instead := lock.prune_started()) is not None:
                raise instead  # what looked missing is what a prune removed meanwhile, not damage
            if not report.ok and isinstance(lock, HeldLock) and (lost := lock.lost_meanwhile()) is not None:
                raise lost  # ... or what one removed after taking this check's lock for a dead process's
            return report

    @_open_only
    def locks(self) -> list[LockInfo]:
        return self._repo.locks.list()

    @_open_only
    def unlock(self, *, remove_all: bool = False) -> list[LockInfo]:
        """Remove stale locks (or, with ``remove_all``, every lock); returns those removed. Ages are judged
        by this host's clock set back by how far it runs ahead of the storage's (a probe lock object)."""
        manager = self._repo.locks
        now = None if remove_all else manager.judging_now()
        removed = [lock for lock in manager.list() if remove_all or manager.is_stale(lock, now=now)]
        for lock in removed:
            manager.remove(lock)
        return removed

    @_open_only
    def repair_index(
        self, *, dry_run: bool = False, read_data: bool = False, drop_failing: bool = False
    ) -> IndexRepair:
        """Index again, from the packs' own sealed headers, every pack that no readable index object
        describes, drop the packs that are gone, then remove the index objects this replaces
        (``ckptvault.ops.repair``); with ``read_data``, also read every pack and drop the chunks that
        do not verify, so the next backup of their files stores them again; ``drop_failing`` (which reads
        every pack too) also drops the packs the storage fails to serve on every attempt (a server error
        that outlasts the retries; a later ``read_data`` repair indexes their chunks again if they read).
        Takes the exclusive lock, after waiting, without a limit, for this Vault's queued ``backup_async``
        backups, as ``prune`` does (``flush(timeout=...)`` first bounds that); ``dry_run`` (a shared lock)
        changes nothing and returns what a real run would do."""
        from .ops.repair import repair_index

        read_data = flag_arg("read_data", read_data)
        drop_failing = flag_arg("drop_failing", drop_failing)
        with self._repo.locks.acquire_to_read() if dry_run else self._exclusive_lock("repair_index()"):
            result = repair_index(self._repo, dry_run=dry_run, read_data=read_data, drop_failing=drop_failing)
            if not dry_run:
                self._repo.load_index()
            return result

    # ---- training loop: async shipping, watching, status, drill ------------------------

    @_open_only
    def backup_async(
        self,
        paths: PathLike | Sequence[PathLike],
        *,
        tags: dict[str, str] | None = None,
        description: str | None = "",
        hostname: str | None = None,
        on_full: OnFull = "coalesce",
        pin: bool = True,
        skip_if_unchanged: bool = False,
        exclude: Sequence[str] = (),
    ) -> BackupHandle:
        """Queue a backup and return at once; a worker thread runs it (docs/training.md).

        The sources are pinned first (hard links beside them, microseconds per file), so the
        trainer may delete them as soon as this returns. When ``max_pending`` backups are
        already waiting, ``on_full="coalesce"`` drops the oldest waiting one (its handle raises
        BackupSupersededError) and ``"block"`` waits for a slot. ``skip_if_unchanged`` and
        ``exclude``: as for ``backup`` (excluded files are not pinned).
        Pins that a process which died before they shipped left beside the sources (for this
        vault) are queued first, oldest first, under the tags and exclude patterns they were
        given; they are not counted in ``max_pending`` and never dropped (docs/training.md)."""
        from .ops.async_backup import queueing

        if self._closing:
            raise UsageError(CLOSED_MESSAGE)
        with queueing("backup_async()"):  # not inside another on this thread (a signal handler's): it would hang
            return self._backup_async(paths, tags, description, hostname, on_full, pin, skip_if_unchanged, exclude)

    def _backup_async(
        self,
        paths: PathLike | Sequence[PathLike],
        tags: dict[str, str] | None,
        description: str | None,
        hostname: str | None,
        on_full: OnFull,
        pin: bool,
        skip_if_unchanged: bool,
        exclude: Sequence[str],
    ) -> BackupHandle:
        from .ops.async_backup import check_on_full, leftover_jobs, make_job, staging_folder

        # every check before pinning: a refused call leaves no pin behind (submit releases them too)
        sources = paths_arg(paths)
        tags = tags_arg(tags, stored=True)
        description = text_arg("description", description, optional=True) or ""
        hostname = hostname_arg(hostname)
        excludes = exclude_arg(exclude)
        check_on_full(on_full)
        self._refuse_forked_mid_write()  # before pinning, as the next one
        self._repo.refuse_unused_keyfile()  # before pinning, not in the worker's first lock
        shipper = self._async_shipper()
        vault_id = self.config.repo_id
        # what a dead process pinned here goes first
        for leftover in leftover_jobs([staging_folder(p) for p in sources], vault_id):
            shipper.submit(leftover)
        job = make_job(
            sources,
            vault_id=vault_id,
            tags=tags,
            description=description,
            hostname=hostname,
            pin=pin,
            skip_if_unchanged=skip_if_unchanged,
            exclude=excludes,
            vault_folder=self.local_folder,
        )
        return shipper.submit(job, on_full=on_full)

    @_open_only
    def ship_leftover_pins(
        self, folder: PathLike, *, timeout: float | None = None, state_dir: PathLike | None = None
    ) -> list[Snapshot]:
        """Ship what a process that died left pinned in ``folder`` (the folder its checkpoints were saved
        in, which holds ``.ckptvault-pins``, or that pins folder itself), and wait for it: on a restart on
        the same disk, call it before ``restore_latest``, so that the newest save of the run that died is
        in the vault when the resume picks one (else the first ``backup_async`` ships it later, and it
        becomes ``latest`` over the resumed run's newer saves). Returns the snapshots, oldest first;
        raises the first failure, or FlushTimeoutError after ``timeout`` seconds. A wait cut short (the
        timeout, Ctrl-C) ships no more of them: the one under way goes on, the others stay pinned for the
        next call. The pins a dead ``watch`` sidecar left are not shipped here (a watch ships them, with its
        record of what shipped) but named in a warning with the call that ships them: those in ``folder``'s
        ``.ckptvault-watch``, and, given ``state_dir`` (the watch's own ``state_dir``), those there."""
        from .ops.async_backup import leftover_jobs, queueing, ship_leftovers
        from .ops.leftover_pins import pins_folder, say_other_vaults, say_watch_pins, watch_state_folder

        folder = path_arg("folder", folder)
        timeout = seconds_arg(spelled("--timeout", "timeout"), timeout)
        state = watch_state_folder(None if state_dir is None else path_arg("state_dir", state_dir))
        pins = pins_folder(folder, self._warn)
        self._refuse_forked_mid_write()  # before taking the pins over
        self._refuse_inside_own_backup("ship_leftover_pins()", "call it once this backup has returned")
        shipper = self._async_shipper()
        with queueing("ship_leftover_pins()"):  # its flock on the pins folder, as backup_async's
            jobs = leftover_jobs([pins], self.config.repo_id)
        shipped = ship_leftovers(shipper, jobs, folder, pins, timeout)
        say_other_vaults(pins, folder, self.config.repo_id, self._warn)
        say_watch_pins(folder, state, self._warn)
        return shipped

    @_open_only
    def flush(self, timeout: float | None = None) -> None:
        """Wait for every queued backup. Raises FlushTimeoutError after ``timeout`` seconds, else
        the first error of the queued backups that failed since the previous flush."""
        timeout = seconds_arg("timeout", timeout)
        if self._shipper is not None:
            self._shipper.flush(timeout)  # refused inside this Vault's backup, which the queued ones wait for

    @_open_only
    def configure_async(
        self, *, max_pending: int | _Unchanged = UNCHANGED, exit_timeout: float | _Unchanged | None = UNCHANGED
    ) -> None:
        """How many backups may wait behind the running one (default 2), and how long the
        interpreter's exit waits for queued backups (default 600 s; None: as long as they take;
        ``close()`` always waits for them). A setting not given keeps its value."""
        if not isinstance(max_pending, _Unchanged) and int_arg("max_pending", max_pending) < 1:
            raise UsageError(f"max_pending {max_pending} must be at least 1")
        if not isinstance(exit_timeout, _Unchanged):
            exit_timeout = seconds_arg("exit_timeout", exit_timeout)
        shipper = self._async_shipper()  # both checked before either changes
        if not isinstance(max_pending, _Unchanged):
            shipper.max_pending = max_pending
        if not isinstance(exit_timeout, _Unchanged):
            shipper.exit_timeout = exit_timeout

    def _refuse_inside_own_backup(self, call: str, advice: str) -> None:
        """Refuse ``call``, which would wait for this Vault's backup, on the thread inside that backup: a
        signal handler (SIGTERM) runs on the main thread between two bytecodes of the backup it interrupted,
        and a progress callback inside it, so the backup (or the queue's next one, which waits for it) can
        only end once the call has returned: the process hung until SIGKILL."""
        if _owned_here(self._backup_mutex):
            refused = UsageError(
                f"{call} was called on a thread inside this Vault's backup or copy (from a signal handler or a "
                f"callback), which it would wait for forever; {advice}"
            )
            # raised inside the backup, where a step that outlives a storage error may catch it (a tree or a
            # delta base that cannot be read): the backup then went on, and training with it; ``_writing``
            # raises it again once the backup has returned, unless the caller (the handler) caught it
            self._refused = refused
            raise refused

    @contextlib.contextmanager
    def _writing(
        self,
        call: str = "backup()",
        advice: str = "queue it with backup_async() instead, which ships it once this backup has ended",
    ) -> Iterator[None]:
        self._refuse_forked_mid_write()
        # a SIGTERM handler that backs up a save of its own, landing inside a backup: the mutex is that frame's
        self._refuse_inside_own_backup(call, advice)
        with self._backup_mutex:  # a handler landing in the check's gap before this runs a backup of its own first
            try:
                yield
            finally:
                refused, self._refused = self._refused, None
            if refused is not None and _caught_by_ckptvault(refused):  # by a step of the backup, which went on
                raise refused

    def _exclusive_lock(self, caller: str) -> HeldLock:
        """The exclusive lock, once this Vault's own queued backups have ended: their shared locks, this
        process's own, are never waited for (one could be this thread's), so a prune right after a
        ``backup_async`` failed or not as its worker had started or not (api49 #1). Not from a thread the
        worker would wait for in turn (a backup's done-callback, or a callback of a backup or copy running
        on it): the lock is then refused at once, as before."""
        self._refuse_forked_mid_write()
        shipper = self._shipper
        waited_on = shipper is None or shipper.on_worker_thread() or _owned_here(self._backup_mutex)
        if shipper is not None and not waited_on and (queued := shipper.pending()):
            log.info("%s waits for this Vault's %d queued backup(s) to end first", caller, queued)
            shipper.wait_for_queued()
        return self._repo.locks.acquire(exclusive=True)

    def _async_shipper(self) -> AsyncShipper:
        from .ops.async_backup import AsyncShipper

        if self._shipper is None:
            self._shipper = AsyncShipper(
                self._run_job, refuse_wait=self._refuse_inside_own_backup, retry_lock=self._repo.locks.retry_for
            )
        return self._shipper

    def _run_job(self, job: BackupJob) -> Snapshot:
        from .ops.async_backup import check_sources_unchanged

        excludes = exclude_arg(job.exclude)
        if job.leave_unfinished:
            excludes = replace(excludes, unfinished=True)
        return self._backup(
            job.sources,
            excludes,
            tags=job.tags,
            description=job.description,
            hostname=job.hostname,
            skip_if_unchanged=job.skip_if_unchanged,
            on_warning=job.warnings.append,
            before_commit=functools.partial(check_sources_unchanged, job),
            wait_for_lock=False,
            taken_at=job.taken_at,
            log_warnings=job.log_warnings,
        )

    @_open_only
    def watch(
        self,
        directory: PathLike,
        *,
        tags: dict[str, str] | None = None,
        hostname: str | None = None,
        interval: float = 0.1,
        settle: float = 2.0,
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
        state_dir: PathLike | None = None,
        once: bool = False,
        grace: float = 0.0,
        stop: threading.Event | None = None,
        on_shipped: Callable[[ShippedCheckpoint], None] | None = None,
        on_warning: Callable[[str], None] | None = None,
        on_start: Callable[[int], None] | None = None,
        on_lost: Callable[[LostCheckpoint], None] | None = None,
    ) -> WatchResult:
        """Ship every complete checkpoint that appears in ``directory`` until ``stop`` is set
        (or, with ``once``, what is there now), pinning each first (docs/training.md).
        ``include``: globs on the names of the checkpoints to ship; ``exclude``: what to leave out of
        each, as for ``backup`` (a pattern without ``/`` also skips checkpoints of that name).
        ``on_start(n)`` runs after the first look, ``n`` being the pins resumed from a previous run;
        ``on_lost`` for each checkpoint that will never ship (dropped for room, or deleted while it
        shipped in place), besides its warning.
        ``grace``: once ``stop`` is set, go on shipping what is pinned, and what appears meanwhile (a
        trainer's save on preemption), for this many seconds; 0 stops after the upload in flight.
        ``hostname``: recorded in each snapshot instead of this machine's (as ``backup``'s: a spot instance
        comes back under a new machine name, ``--host nodeB`` selects the node's saves whatever it is)."""
        from .ops.watch import Watcher
        from .ops.watch_options import WatchOptions

        directory = path_arg("directory", directory)
        hostname = hostname_arg(hostname)
        options = WatchOptions(
            interval=interval_arg("interval", interval),
            settle=interval_arg("settle", settle),
            include=tuple(str_list_arg("include", include, "['step_*']")),
            exclude=exclude_arg(exclude),
            state_dir=folder_or_default_arg("state_dir", state_dir, "watch's state (pins, shipped list)"),
            once=once,
            grace=interval_arg("grace", grace),
            retry_lock=self._repo.locks.retry_for,
        )
        user_tags = tags_arg(tags, stored=True)
        if stop is not None and not (callable(getattr(stop, "is_set", None)) and callable(getattr(stop, "wait", None))):
            raise wrong_arg("stop", stop, "a threading.Event (set it to stop watching), or None")
        self._refuse_forked_mid_write()
        self._repo.refuse_unused_keyfile()  # before the first pin

        def shipped_digests() -> list[tuple[str, str, str]]:
            snaps = self.snapshots(user_tags)
            return [
                (s.tags.get("checkpoint", ""), s.tags[WATCH_SIG_TAG], s.id) for s in snaps if WATCH_SIG_TAG in s.tags
            ]

        def shipped_files(snapshot_id: str) -> tuple[tuple[str, ...], ...]:
            """A shipped folder's signature (ops/pin.py ``signature``) as its snapshot's tree records it."""
            return tuple(sorted(_signature_entry(e) for e in self.files(snapshot_id)))

        def ship(job: BackupJob) -> Snapshot:
            return self._run_job(replace(job, hostname=hostname) if hostname else job)

        watcher = Watcher(
            directory,
            tags=user_tags,
            ship=ship,
            shipped_digests=shipped_digests,
            shipped_files=shipped_files,
            options=options,
            stop=stop,
            on_shipped=on_shipped,
            on_warning=self._warner(on_warning),
            on_start=on_start,
            on_lost=on_lost,
            vault_folder=self.local_folder,
        )
        return watcher.run()

    @_open_only
    def backup_status(self, path: PathLike, *, exclude: Sequence[str] = ()) -> BackupStatus:
        """Whether the local file or folder ``path`` is durably stored, and in which snapshot.
        ``exclude``: files to leave out of the comparison (as for ``backup``; path patterns are
        matched from ``path``); without it every file counts (a snapshot missing only what its own
        exclude patterns left out is named in ``detail``)."""
        from .ops.status import backup_status

        where = path_arg("path", path)
        excludes = exclude_arg(exclude)
        with self._repo.locks.acquire_to_read():
            return backup_status(self._repo, where, self.snapshots(), self.files, self.local_folder, excludes)

    @_open_only
    def is_backed_up(self, path: PathLike, *, exclude: Sequence[str] = ()) -> bool:
        """True when one snapshot holds every file of ``path`` (but those ``exclude`` leaves out)
        with the same content, durably: then deleting the local copy loses nothing else."""
        return self.backup_status(path, exclude=exclude).backed_up

    @_open_only
    def drill(
        self,
        snapshot: str | Snapshot = "latest",
        *,
        tags: dict[str, str] | None = None,
        hosts: Sequence[str] | None = None,
        load: bool = False,
        workdir: PathLike | None = None,
        on_progress: Progress | None = None,
    ) -> DrillReport:
        """Restore into a temporary folder, verify every file, optionally load each tensor file;
        times each phase and deletes the folder. Raises IntegrityError when bytes are wrong;
        a file that does not load is reported (``report.ok``), not raised. ``tags`` and ``hosts`` select
        as for ``snapshot``."""
        from .ops.drill import run_drill

        snap = self.snapshot(snapshot, tags, hosts=hosts)
        return run_drill(
            snap,
            self.files(snap),
            lambda target: self._restore(snap, target, on_progress=on_progress, kept=False),  # removed after
            load=load,
            workdir=folder_or_default_arg("workdir", workdir, "the drill's temporary copy"),
        )

    @_open_only
    def restore_latest(
        self,
        target: PathLike,
        *,
        run: str | None = None,
        tags: dict[str, str] | None = None,
        hosts: Sequence[str] | None = None,
        include: Sequence[str] | None = None,
        overwrite: bool = False,
        on_progress: Progress | None = None,
    ) -> RestoreResult:
        """The resume path: restore the newest snapshot (highest step) of ``run`` into ``target``, which
        must hold nothing the snapshot does not (RestoreConflictError before anything is written: a
        folder mixing two saves, e.g. two ``*.ckpt`` files, could resume from the wrong one). ``hosts``: only
        the snapshots of these hosts (as for ``snapshot``)."""
        path_arg("target", target)  # before looking for the snapshot
        wanted = tags_arg(tags)
        wanted_hosts = hosts_arg(hosts)
        if run is not None:
            run = text_arg("run", run)
            if wanted.get("run", run) != run:
                raise UsageError(f"run={run!r} and tags={{'run': {wanted['run']!r}}} name two runs; give one")
            wanted["run"] = run
        return self._checked_restore(
            self.latest(wanted, hosts=wanted_hosts), target, include, overwrite, on_progress, alone=True
        )

    # ---- browsing and comparing without restoring (docs/checkpoints.md) -----------------

    @_open_only
    def open_file(
        self, snapshot: str | Snapshot, path: PathLike, *, cache_chunks: int = DEFAULT_CACHE_CHUNKS
    ) -> SnapshotFile:
        """A seekable, read-only binary file of one snapshot file that fetches only the chunks a
        read touches (each verified against its ID), keeping the last ``cache_chunks`` decoded."""
        wanted = path_arg("path", path)
        cache_chunks = int_arg("cache_chunks", cache_chunks)
        if cache_chunks < 0:
            raise UsageError(f"cache_chunks {cache_chunks} is negative; give the number of decoded chunks to keep")
        snap = self.snapshot(snapshot)
        return SnapshotFile(
            ChunkedFile(
                self._repo, find_file(self.files(snap), wanted, snap.id), cache_chunks=cache_chunks, snapshot=snap
            )
        )

    @_open_only
    def file_usage(self, snapshot: str | Snapshot) -> list[FileUsage]:
        """Every entry of the snapshot with its stored bytes and chunk count (``ls --long``)."""
        from .ops.inspect import file_usage

        return file_usage(self._repo, self.files(snapshot))

    @_open_only
    def show(self, snapshot: str | Snapshot, path: PathLike, *, stats: bool = False) -> FileContents:
        """The tensors of a safetensors, .npy/.npz or torch zip file in the snapshot, from its header
        alone; with ``stats``, min/max/mean/std/NaN count per tensor (reads each tensor once)."""
        from .ops.inspect import show_file

        wanted = path_arg("path", path)
        with self._repo.locks.acquire_to_read():  # a prune waits (or is refused) while the chunks are read
            snap = self.snapshot(snapshot)
            return show_file(self._repo, find_file(self._files_still_stored(snap), wanted, snap.id), stats=stats)

    @_open_only
    def diff(self, a: str | Snapshot, b: str | Snapshot, *, tensors: bool = False) -> SnapshotDiff:
        """Files added, removed and changed from ``a`` to ``b`` and the bytes new in ``b``; with
        ``tensors``, which tensors of each changed tensor file were added, removed or changed."""
        from .ops.inspect import diff_trees

        with self._repo.locks.acquire_to_read():  # a prune waits (or is refused) while the chunks are read
            snap_a, snap_b = self.snapshot(a), self.snapshot(b)
            files_a, files_b = self._files_still_stored(snap_a), self._files_still_stored(snap_b)
            return diff_trees(self._repo, snap_a.id, files_a, snap_b.id, files_b, tensors=tensors)
