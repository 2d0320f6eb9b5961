"""What ``Vault.open`` adds to ``Repository.open``: a hint when there is no vault (a file in the way,
a folder that holds something else), and ``create=True`` called by several processes at once (the ranks
of a distributed job): one creates the vault, the others open the one it created."""

from __future__ import annotations

import contextlib
import logging
import os
import time

from ..crypto.keyfile import Keyfile, PassphraseSource, passphrase_secret
from ..errors import UsageError, VaultNotFoundError
from ..location import file_in_the_way, local_folder, metadata_cache_root, refuse_local_non_vault_folder, why_no_vault
from ..repository import Repository
from ..store import Store

log = logging.getLogger("ckptvault")

OPEN_RACE_RETRIES = 5  # Vault.open(create=True) that lost the race to create: looks for the winner's config


def deriving_ahead(key: Keyfile | None, passphrase: PassphraseSource) -> contextlib.AbstractContextManager[None]:
    """The keyfile's scrypt, started before the vault's config is read (on remote storage the first
    request, which sets up the client, takes about as long), when the passphrase is given as text:
    a passphrase function is called only once the keyfile is known to be the vault's."""
    if key is None or not isinstance(passphrase, str):
        return contextlib.nullcontext()
    return key.kdf.deriving_ahead(passphrase_secret(passphrase))


def open_existing(
    store: Store, url: str, key: Keyfile | None, passphrase: PassphraseSource, *, create: bool
) -> Repository | None:
    """The repository at ``url``, or None when there is none and ``create`` is to make it; else
    VaultNotFoundError, with a hint why where there is one."""
    local = local_folder(url)
    if local is not None and file_in_the_way(local) is not None:  # the store would say "Not a directory"
        if create:
            refuse_local_non_vault_folder(url)
        raise VaultNotFoundError(store.url, hint=why_no_vault(url))
    try:
        return _open(store, key, passphrase)
    except VaultNotFoundError as exc:
        odd = getattr(store, "odd_path", None)  # s3://bucket//vault: not s3://bucket/vault (store/keypath.py)
        if odd is not None:
            if create:
                raise UsageError(odd.refusal()) from None
            raise VaultNotFoundError(exc.url, hint=odd.no_vault_hint()) from None
        if create:
            return None
        hint = why_no_vault(url)
        if hint:
            raise VaultNotFoundError(exc.url, hint=hint) from None
        raise


def open_race_winner(store: Store, key: Keyfile | None, passphrase: PassphraseSource) -> Repository:
    """The repository another process created since this one looked for it (this one's init then
    found its config): looked for a few times, a moment apart, on a store that shows a new object late."""
    for attempt in range(OPEN_RACE_RETRIES - 1):
        try:
            return _open(store, key, passphrase)
        except VaultNotFoundError:
            time.sleep(0.05 * 2**attempt)
    return _open(store, key, passphrase)  # the last try: its VaultNotFoundError is raised


def say_created(url: str, *, named: bool, encrypted: bool) -> None:
    """Warn of what may be a mistake in a vault that ``open(create=True)`` has just made."""
    if named:  # not the default location: a typo there is a new, empty vault
        log.warning(
            "ckptvault: created a new vault at %s (none was there, and create=True); if that URL is "
            "mistyped, fix it: the checkpoints are going to this new vault",
            url,
        )
    if not encrypted and os.environ.get("CKPTVAULT_KEYFILE"):  # the CLI and the callbacks would have used it
        log.warning(
            "ckptvault: created %s unencrypted: CKPTVAULT_KEYFILE is set, but Vault.open reads no environment "
            "for its key; pass keyfile= (and passphrase=) to encrypt a new vault",
            url,
        )


def _open(store: Store, key: Keyfile | None, passphrase: PassphraseSource) -> Repository:
    return Repository.open(store, key, passphrase, cache_root=metadata_cache_root())
