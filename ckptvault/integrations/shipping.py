"""What the framework callbacks share: the vault, the tags every snapshot carries, handing a
checkpoint to ``Vault.backup_async``, and waiting for the uploads when training ends."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from types import FrameType

from ..arguments import flag_arg, hostname_arg, seconds_arg, tags_arg, text_arg
from ..crypto.keyfile import passphrase_from_env
from ..errors import FlushTimeoutError, UsageError, unused_keyfile_error
from ..interruptions import end_at_once_on_another
from ..ops.async_backup import BackupHandle, OnFull, check_on_full
from ..ops.scan import refuse_sources_in_vault
from ..vault import Vault, exclude_arg

log = logging.getLogger("ckptvault")


class Shipping:
    """A mixin: put it first in a callback's bases, so that its ``__init__`` takes the arguments."""

    ship_on_sigterm = True  # False where the framework handles SIGTERM itself

    def __init__(
        self,
        vault: Vault | str | os.PathLike[str],
        *,
        run: str | None = None,
        tags: dict[str, str] | None = None,
        on_full: OnFull = "coalesce",
        flush_timeout: float | None = None,
        raise_on_error: bool = True,
        exclude: Sequence[str] = (),
        hostname: str | None = None,
    ) -> None:
        """``vault`` is an open Vault or a URL (opened, and created if missing). Snapshots carry
        ``tags``, ``run=<run>`` and ``step=<step>``; ``exclude`` leaves files out of each, as for
        ``Vault.backup``; ``hostname`` is recorded instead of this machine's (a node's name that outlives a
        spot instance, for ``--host``). Arguments are checked here, before training starts, not at the first
        checkpoint."""
        super().__init__()
        check_on_full(on_full)
        self.exclude = exclude_arg(exclude).patterns
        self.hostname = hostname_arg(hostname)
        self.tags = tags_arg(tags, stored=True)
        if run is not None:  # held to the same rules: a run name read from a file may end in a newline
            self.tags = tags_arg({**self.tags, "run": text_arg("run", run)}, stored=True)
        self.on_full = on_full
        self.flush_timeout = seconds_arg("flush_timeout", flush_timeout)
        self.raise_on_error = flag_arg("raise_on_error", raise_on_error)
        self._vault: Vault | str = _shipping_to(vault)
        self.handles: list[BackupHandle] = []  # those not done yet, and the last
        # files already handed over (path, inode, mtime, size), for callbacks that see a file more than once
        self._shipped: set[tuple[str, int, int, int]] = set()
        if self.ship_on_sigterm:
            _ship_before_dying_of_sigterm()

    @property
    def vault(self) -> Vault:
        """The vault it ships to (``configure_async`` sets how long the exit waits for it); a copy sent to
        another process (see ``__getstate__``) opens it by its URL here, at its first read: reading it
        there opens the vault (and creates it if missing, with ``CKPTVAULT_KEYFILE`` and the passphrase,
        as a callback given a URL does), storage I/O that the other attributes do not do."""
        if not isinstance(self._vault, Vault):
            self._vault = _open_by_url(self._vault)
        return self._vault

    @vault.setter
    def vault(self, vault: Vault | str | os.PathLike[str]) -> None:
        """Ship to another vault from now on: an open Vault, or a URL (opened, and created if missing, as
        ``__init__`` does). Refused while a checkpoint handed to the current one is still queued: the end
        of training would not wait for it (``flush()`` that vault first). The Vault it replaces stays open:
        closing it is the caller's. Files already handed to the old vault are not shipped again to the new
        one (they are in the old one), and the checkpoint folder is not checked against the new vault's
        folder here (the start of training does that check)."""
        if any(not h.done() for h in self.handles):
            raise UsageError(
                "the callback's vault cannot change while checkpoints handed to it are still queued: "
                "call flush() on its current vault first"
            )
        self._vault = _shipping_to(vault)

    def ship(self, path: str | os.PathLike[str], step: int | None) -> None:
        # skip_if_unchanged: a resumed run's callback is offered again the files an earlier run
        # shipped (Lightning restores ModelCheckpoint's list of them); they add no snapshot
        tags = dict(self.tags) if step is None else {**self.tags, "step": str(step)}
        handle = self.vault.backup_async(
            path,
            tags=tags,
            on_full=self.on_full,
            skip_if_unchanged=True,
            exclude=self.exclude,
            hostname=self.hostname,
        )
        self.handles = [h for h in self.handles if not h.done()]  # the shipped ones are not kept all run
        self.handles.append(handle)

    def refuse_checkpoints_in_the_vault(self, folder: str | None) -> None:
        """Before training starts: checkpoints saved into the vault's own folder would be refused at
        the first save, mid-training (a vault made where the trainer writes, say)."""
        vault_folder = self._vault.local_folder if isinstance(self._vault, Vault) else None
        if folder and vault_folder:
            try:
                refuse_sources_in_vault([os.path.abspath(folder)], vault_folder)
            except UsageError:
                raise UsageError(
                    f"the trainer saves its checkpoints in {folder}, inside the vault at {vault_folder}; "
                    "give the callback a vault in another folder"
                ) from None

    def finish_shipping(self) -> None:
        """Wait for the queued uploads. When the newest checkpoint handed over is not in the vault,
        its failure is raised, unless ``raise_on_error`` is off; other failures are only logged
        (training's result stands): a resume takes the newest, as when a full queue drops older ones."""
        if not isinstance(self._vault, Vault):
            return  # a copy that shipped nothing in this process
        try:
            self.vault.flush(self.flush_timeout)
        except FlushTimeoutError as exc:
            if self.raise_on_error:
                raise
            log.error("ckptvault: %s at the end of training; they go on in the background until exit", exc)
        except Exception as exc:
            # each failed upload was logged at ERROR when it failed; this says training went on anyway
            newest = self.handles[-1] if self.handles else None
            if newest is None or newest.cancelled() or not newest.done():
                failure: BaseException | None = exc
            else:  # the newest's own failure, if any, is the one to name
                failure = newest.exception(timeout=0)
            if failure is None:
                log.warning(
                    "ckptvault: a checkpoint upload failed (%s); the newest checkpoint (%s) is in the vault, so "
                    "training's result stands",
                    exc,
                    newest.paths if newest is not None else "?",
                )
            elif self.raise_on_error:
                raise failure from failure.__cause__  # its own cause kept, not the flush's
            else:
                log.warning("ckptvault: a checkpoint upload failed (%s); training's result stands", failure)

    def __getstate__(self) -> dict[str, object]:
        """A copy for another process (Lightning's ``ddp_spawn`` pickles its callbacks): the open
        vault and its queue stay here; the copy reopens the vault by its URL when it first ships, as
        a callback given a URL does (``CKPTVAULT_KEYFILE`` and ``CKPTVAULT_PASSPHRASE`` for an
        encrypted one; options in the URL's query)."""
        state = self.__dict__.copy()
        state["_vault"] = self._vault.url if isinstance(self._vault, Vault) else self._vault
        state["handles"] = []
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        """A copy made by ``__getstate__``, or by an older ckptvault, whose state held the vault's URL under
        ``"vault"`` (a plain attribute then, a property now)."""
        state = dict(state)
        if "vault" in state and "_vault" not in state:
            state["_vault"] = state.pop("vault")
        state.setdefault("hostname", None)  # (older: this machine's)
        self.__dict__.update(state)


def _ship_before_dying_of_sigterm() -> None:
    """SIGTERM is how a spot instance, Kubernetes or SLURM says "you are being preempted", with a
    grace period; left to its default it ends the process at once and every queued checkpoint is
    lost. Unless the program handles SIGTERM itself (Lightning does), it becomes an exit: training
    unwinds and the exit hook ships what is queued (``configure_async(exit_timeout=...)`` bounds the
    wait: make it fit the grace period). A second SIGTERM ends the process at once (not the first one
    delivered twice, as ``timeout`` does: interruptions.SAME_SIGNAL_S)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum: int, _frame: FrameType | None) -> None:
    end_at_once_on_another(signum)
    log.warning("ckptvault: SIGTERM: shipping the queued checkpoints before exiting (SIGTERM again to stop at once)")
    raise SystemExit(128 + signum)


def _shipping_to(vault: Vault | str | os.PathLike[str]) -> Vault:
    """An open Vault, or the one at a URL, refused when a keyfile was given for it and it is not encrypted:
    every checkpoint would be refused, mid-training; this says so before training starts."""
    if not isinstance(vault, Vault):
        return _open_by_url(vault)
    if vault.unused_keyfile is not None:
        raise unused_keyfile_error(vault.url, vault.unused_keyfile)
    return vault


def _open_by_url(url: str | os.PathLike[str]) -> Vault:
    """Open (or create) the vault as the CLI would in the same job: with ``CKPTVAULT_KEYFILE`` and
    ``CKPTVAULT_PASSPHRASE`` when set. A job set up for ``ckptvault`` commands must not have its
    callback create an unencrypted vault at the same URL."""
    vault = Vault.open(
        url,
        create=True,
        keyfile=os.environ.get("CKPTVAULT_KEYFILE") or None,
        passphrase=passphrase_from_env,  # asked for only if the vault is encrypted
    )
    if vault.unused_keyfile is not None:  # as _shipping_to
        vault.close()
        raise unused_keyfile_error(vault.url, vault.unused_keyfile)
    return vault
