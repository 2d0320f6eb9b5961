"""Keyfiles made and changed without a vault (``ckptvault key generate`` and ``key passwd``, through
``Vault.generate_keyfile`` and ``Vault.change_keyfile_passphrase``): the vault layer checks the
arguments, this makes the key and binds it to the vault settings it will authenticate."""

from __future__ import annotations

from ..crypto.keyfile import (
    MIN_NEW_PASSPHRASE,
    Keyfile,
    PassphraseSource,
    check_kdf_cost,
    resolve_passphrase,
    too_short,
)
from ..errors import UsageError
from ..repository.format import SETTINGS_FORMAT_VERSION


def generate_keyfile(where: str, passphrase: PassphraseSource, kdf_cost: int) -> Keyfile:
    """A new random key under ``passphrase``, saved at ``where`` (mode 0600, never over a file)."""
    checked = new_passphrase(passphrase, "passphrase")
    key, _ = Keyfile.create(checked, scrypt_n=2 ** check_kdf_cost(kdf_cost), min_vault_format=SETTINGS_FORMAT_VERSION)
    return key.save(where)


def change_passphrase(
    key: Keyfile, path: str, passphrase: PassphraseSource, new: PassphraseSource, kdf_cost: int | None
) -> Keyfile:
    """``key`` under the ``new`` passphrase, written over ``path`` in one rename. ``new`` is asked for
    only once ``passphrase`` unlocked the key."""
    scrypt_n = None if kdf_cost is None else 2 ** check_kdf_cost(kdf_cost)
    master = key.unlock(resolve_passphrase(passphrase))
    return key.with_passphrase(master, new_passphrase(new, "new_passphrase"), scrypt_n).save(path, overwrite=True)


def new_passphrase(source: PassphraseSource, name: str) -> str:
    """A new passphrase from ``source`` (the argument ``name``), refused when missing or too short."""
    if source is None:
        raise UsageError(f"no {name} given: give the new passphrase (or a function that returns it)")
    passphrase = resolve_passphrase(source)
    if too_short(passphrase):
        raise UsageError(
            f"the new passphrase is shorter than {MIN_NEW_PASSPHRASE} characters, not counting spaces at its ends; "
            "choose a longer one"
        )
    return passphrase
