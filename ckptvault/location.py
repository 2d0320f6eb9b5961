"""Where a vault is: the default one, a vault in a local folder, and why a local folder is no vault."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import platformdirs

from .errors import UsageError
from .repository.cache import cache_root
from .repository.format import CONFIG_KEY, INDEX_PREFIX, KOPIA_FORMAT_BLOBS, SNAPSHOTS_PREFIX, vault_at_or_above
from .store.base import TEMP_PREFIX


def default_repo_url() -> str:
    """``$CKPTVAULT_REPO``, else a folder in the user's data directory."""
    return os.environ.get("CKPTVAULT_REPO") or os.path.join(platformdirs.user_data_dir("ckptvault"), "repo")


def refuse_local_non_vault_folder(url: str) -> None:
    """A new vault in a local folder that already holds other files (a checkpoint folder named by
    mistake), or inside another vault's folder, would mix with them: refused (like kopia)."""
    path = local_folder(url)
    if path is None:
        return
    in_the_way = file_in_the_way(path)
    if in_the_way is not None:
        raise UsageError(f"{in_the_way} is a file, not a folder; create the vault in a new or empty folder")
    # One listing decides: a racing init (Vault.open(create=True) on every rank) writes its config
    # first, so a listing that shows any other name shows the config too.
    names = os.listdir(path) if os.path.isdir(path) else []
    if CONFIG_KEY in names or set(KOPIA_FORMAT_BLOBS) & set(names):
        return  # a vault already, or another tool's repository: init says which itself
    if any(name + "/" in (SNAPSHOTS_PREFIX, INDEX_PREFIX) and _holds_files(os.path.join(path, name)) for name in names):
        return  # a vault that lost its config, most likely: init says so itself
    if any(not name.startswith(TEMP_PREFIX) for name in names):
        raise UsageError(f"{path} is not empty and holds no vault; create the vault in a new or empty folder")
    parent = _enclosing_vault(path)
    if parent is not None:
        raise UsageError(f"{path} is inside the vault at {parent}; create the vault somewhere else")


def _holds_files(folder: str) -> bool:
    with contextlib.suppress(OSError):
        return any(os.scandir(folder))
    return False


def file_in_the_way(path: str) -> str | None:
    """``path``, or the nearest folder above it that exists, when that is not a folder."""
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return None if os.path.isdir(path) else path


def _enclosing_vault(path: str) -> str | None:
    """The folder above ``path`` that holds a vault, if any."""
    return vault_at_or_above(os.path.dirname(path))


def why_no_vault(url: str) -> str:
    """For a local path that is no vault, why: the hint "create one with init" would only fail
    there (a folder of other files, a folder inside a vault)."""
    path = local_folder(url)
    if path is None:
        return ""
    in_the_way = file_in_the_way(path)
    if in_the_way is not None:
        return f"{in_the_way} is a file, not a folder; give the vault's folder"
    parent = _enclosing_vault(path)
    if parent is not None:
        return f"it is inside the vault at {parent}; name that folder instead"
    with contextlib.suppress(OSError):
        if any(not name.startswith(TEMP_PREFIX) for name in os.listdir(path)):
            return "that folder holds other files, not a vault; check the path"
    return ""


def local_folder(url: str) -> str | None:
    """The absolute path of a vault in a local folder; None for any other store."""
    for local in ("file://", "local://"):
        if url.startswith(local):
            return os.path.abspath(url.removeprefix(local))
    return None if "://" in url else os.path.abspath(os.path.expanduser(url))


def metadata_cache_root() -> Path | None:
    """Where remote repositories' metadata is cached (repository/cache.py): the user's cache folder."""
    return cache_root(platformdirs.user_cache_dir("ckptvault"))
