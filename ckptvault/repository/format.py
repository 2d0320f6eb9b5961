"""Format constants and the object layout. Every name here is part of the on-disk promise
written down in docs/format.md: values are never reused for a different meaning."""

from __future__ import annotations

import os
import re
import secrets

FORMAT_NAME = "ckptvault"
FORMAT_VERSION = 1
# Version 2 = version 1 plus delta chunks (codec 3) and the layouts that name their bases (v2 pack
# headers and index objects, below). Only repositories made with delta coding are version 2, so a
# ckptvault that predates it refuses them with a clear message instead of misreading them.
DELTA_FORMAT_VERSION = 2
# Version 3 = version 2 for encrypted repositories whose key verifier authenticates the config's
# settings (chunker, compression, pack size...), not only its ID: storage that rewrites them is caught.
# Every repository made encrypted is version 3; older ckptvault versions refuse it as newer.
SETTINGS_FORMAT_VERSION = 3
SUPPORTED_VERSIONS = (1, 2, 3)

CONFIG_KEY = "config"
# Not ours: the files at the top of another tool's repository, which a vault never holds. kopia's format blob
# (".f" on a filesystem, bare in an object store), where a vault folder would hold "config"
KOPIA_FORMAT_BLOBS = ("kopia.repository", "kopia.repository.f")


def holds_vault_config(folder: str) -> bool:
    """Whether the local ``folder`` is a vault's top folder: it holds a config naming the format."""
    try:
        with open(os.path.join(folder, CONFIG_KEY), "rb") as f:
            return f'"{FORMAT_NAME}"'.encode() in f.read(4096)
    except OSError:
        return False


def vault_at_or_above(folder: str) -> str | None:
    """``folder`` or the nearest folder above it that is a local vault's top folder, if any."""
    while not holds_vault_config(folder):
        if folder == os.path.dirname(folder):
            return None
        folder = os.path.dirname(folder)
    return folder


PACKS_PREFIX = "packs/"
INDEX_PREFIX = "index/"
TREES_PREFIX = "trees/"
SNAPSHOTS_PREFIX = "snapshots/"
LOCKS_PREFIX = "locks/"

PACK_MAGIC = b"CVP1"
PACK_MAGIC_V2 = b"CVP2"  # header entries carry a base chunk ID
INDEX_MAGIC_V2 = b"CVI2"  # a v1 index object starts with its pack count, which can never spell this
OBJECT_ID_SIZE = 32
_OBJECT_NAME = re.compile(f"[0-9a-f]{{{2 * OBJECT_ID_SIZE}}}")


def new_object_id() -> bytes:
    """Packs, index objects, trees and snapshots are named by random 256-bit IDs."""
    return secrets.token_bytes(OBJECT_ID_SIZE)


def pack_key(pack_id: bytes) -> str:
    h = pack_id.hex()
    return f"{PACKS_PREFIX}{h[:2]}/{h}"


def index_key(index_id: bytes) -> str:
    return INDEX_PREFIX + index_id.hex()


def tree_key(tree_id: bytes) -> str:
    return TREES_PREFIX + tree_id.hex()


def snapshot_key(snapshot_id: bytes) -> str:
    return SNAPSHOTS_PREFIX + snapshot_id.hex()


def lock_key(lock_id: bytes) -> str:
    return LOCKS_PREFIX + lock_id.hex()


def id_from_key(key: str) -> bytes | None:
    """The object ID at the end of a key, or None when the name is not one of ours."""
    # Only the keys writers make (``packs/ab/ab...``, ``index/...``): an object named otherwise (in
    # capitals, in a subfolder: a sync tool, a person) would be listed, then looked up where it is not.
    *folders, name = key.split("/")
    if not _OBJECT_NAME.fullmatch(name):
        return None
    where = [PACKS_PREFIX.rstrip("/"), name[:2]] if key.startswith(PACKS_PREFIX) else folders[:1]
    return bytes.fromhex(name) if folders == where else None
