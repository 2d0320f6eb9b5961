"""What the vault already holds of the watched folder (watch.py): the ``checkpoint`` tag and ``watch-sig``
digest of every snapshot the watcher shipped, so that a checkpoint shipped before a restart is not
shipped twice."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from ..errors import CkptVaultError, StorageError
from .pin import Signature, files_of, is_subset
from .watch_candidate import WarnOnce, tag_text

# (checkpoint tag, watch-sig[, snapshot ID]) of every shipped snapshot, oldest first
Digests = Callable[[], Iterable[tuple[str, ...]]]
Shipped = Callable[[str], Signature]  # a shipped snapshot's files, by its ID, as a signature of its folder


class ShippedIndex:
    """Loaded beside the polling, which must start at once: the list may take a while to load (a LIST
    and a GET per snapshot). ``loaded`` is set once it is, or failed to."""

    def __init__(
        self, load: Digests, *, once: bool, retry_s: float, warn_once: WarnOnce, files: Shipped | None = None
    ) -> None:
        self._load = load
        self._files = files
        self._newest: dict[str, tuple[str, str]] = {}  # checkpoint tag -> (watch-sig, snapshot ID) of its newest
        self._signatures: dict[str, Signature | None] = {}  # by snapshot ID: read once, None where unreadable
        self._once = once
        self._retry_s = retry_s
        self._warn_once = warn_once
        self._digests: set[tuple[str, str]] = set()
        self.loaded = threading.Event()
        self._error: BaseException | None = None
        self._retry_at: float | None = None  # when to load them again after an outage

    def start_loading(self) -> None:
        self._error = None
        self.loaded.clear()
        threading.Thread(target=self._load_all, name="ckptvault-watch-index", daemon=True).start()

    def _load_all(self) -> None:
        try:
            rows = list(self._load())
            self._digests = {(row[0], row[1]) for row in rows}
            self._newest = {row[0]: (row[1], row[2]) for row in rows if len(row) > 2}  # oldest first: newest wins
        except BaseException as exc:  # raised again on the polling thread
            self._error = exc
        finally:
            self.loaded.set()

    def known(self) -> bool:
        """Whether the vault's shipped digests are loaded (raising what loading them raised). A
        storage outage at start is waited out, outside --once: pinning goes on meanwhile, so
        rotation cannot win, and the list is loaded again ``retry_s`` seconds later."""
        if not self.loaded.is_set():
            return False
        error = self._error
        if error is None:
            return True
        if self._once or not (isinstance(error, StorageError) and error.retryable):
            raise error
        now = time.monotonic()
        if self._retry_at is None:
            self._warn_once(
                ("digests", ""),
                f"cannot list what was shipped yet: {error}; nothing ships until it can (tried again every "
                f"{self._retry_s:g} s); checkpoints are pinned meanwhile where there is room",
            )
            self._retry_at = now + self._retry_s
        elif now >= self._retry_at:
            self._retry_at = None
            self.start_loading()
        return False

    def readable(self) -> bool:
        """Loaded without an error: what is not in it was not shipped."""
        return self.loaded.is_set() and self._error is None

    def holds(self, name: str, digest: str) -> bool:
        """Whether the checkpoint ``name`` whose files have ``digest`` was shipped."""
        return (tag_text(name), digest) in self._digests

    def add(self, name: str, digest: str) -> None:
        self._digests.add((tag_text(name), digest))

    def holds_what_is_left(self, name: str, sig: Signature, digest_of: Callable[[Signature], str]) -> bool:
        """Whether the folder ``name`` holds only files of the newest snapshot shipped under that name, as they
        were (same paths, sizes, mtimes), some of them gone: its rotation deleting it, or the trainer trimming it,
        while no watcher ran. A running watcher takes that for no new save (``Done``); a restart knows only the
        digests, and shipped what was left as a newer snapshot of the same step. Read from its tree once, where
        the name shipped before with another digest; the tree must give the digest its tag records."""
        newest = self._newest.get(tag_text(name))
        if newest is None or self._files is None or not any(files_of(sig)):  # no file yet: a save to come
            return False
        digest, snapshot_id = newest
        if snapshot_id not in self._signatures:
            try:
                self._signatures[snapshot_id] = self._files(snapshot_id)
            except CkptVaultError:  # unreadable now: shipped again, as before, rather than lost
                self._signatures[snapshot_id] = None
        shipped = self._signatures[snapshot_id]
        return shipped is not None and digest_of(shipped) == digest and is_subset(sig, shipped)
