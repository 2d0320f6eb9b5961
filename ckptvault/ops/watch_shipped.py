"""What the vault already holds of the watched folder (watch.py): the ``checkpoint`` tag and ``watch-sig``
digest of every snapshot the watcher shipped, so that a checkpoint shipped before a restart is not
shipped twice."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from ..errors import StorageError
from .watch_candidate import WarnOnce, tag_text

Digests = Callable[[], Iterable[tuple[str, str]]]  # (checkpoint tag, watch-sig) of every shipped snapshot


class ShippedIndex:
    """Loaded beside the polling, which must start at once: the list may take a while to load (a LIST
    and a GET per snapshot). ``loaded`` is set once it is, or failed to."""

    def __init__(self, load: Digests, *, once: bool, retry_s: float, warn_once: WarnOnce) -> None:
        self._load = load
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
            self._digests = set(self._load())
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
