"""What the framework callbacks share: the vault, the tags every snapshot carries, handing a
checkpoint to ``Vault.backup_async``, and waiting for the uploads when training ends."""

from __future__ import annotations

import logging

from ..ops.async_backup import BackupHandle, OnFull
from ..vault import Vault

log = logging.getLogger("ckptvault")


class Shipping:
    """A mixin: put it first in a callback's bases, so that its ``__init__`` takes the arguments."""

    def __init__(
        self,
        vault: Vault | str,
        *,
        run: str | None = None,
        tags: dict[str, str] | None = None,
        on_full: OnFull = "coalesce",
        flush_timeout: float | None = None,
        raise_on_error: bool = True,
    ) -> None:
        """``vault`` is an open Vault or a URL (opened, and created if missing). Snapshots carry
        ``tags``, ``run=<run>`` and ``step=<step>``."""
        super().__init__()
        self.vault = vault if isinstance(vault, Vault) else Vault.open(vault, create=True)
        self.tags = dict(tags or {})
        if run is not None:
            self.tags["run"] = run
        self.on_full = on_full
        self.flush_timeout = flush_timeout
        self.raise_on_error = raise_on_error
        self.handles: list[BackupHandle] = []
        # files already handed over (path, inode, mtime, size), for callbacks that see a file more than once
        self._shipped: set[tuple[str, int, int, int]] = set()

    def ship(self, path: str, step: int | None) -> None:
        tags = dict(self.tags) if step is None else {**self.tags, "step": str(step)}
        self.handles.append(self.vault.backup_async(path, tags=tags, on_full=self.on_full))

    def finish_shipping(self) -> None:
        """Wait for the queued uploads; the first failure is raised unless ``raise_on_error`` is off
        (the worker logged it already, and training's result stands)."""
        try:
            self.vault.flush(self.flush_timeout)
        except Exception:
            if self.raise_on_error:
                raise
