"""An object store's path as written: ``s3://bucket//vault`` is not ``s3://bucket/vault``.

A folder's path is resolved by the filesystem that holds it (``/data//vault`` and ``/data/./vault``
are ``/data/vault`` on a local disk and over SFTP), but S3, GCS and Azure keep an object's name as
written: a doubled '/' (a typo, or ``s3://bucket/$PREFIX/vault`` with an empty ``PREFIX``), a '.' or
a '..' in the path names other objects, an empty place where ``init`` made a second vault and every
other command said "no vault". Where no vault can be, the path is refused at once: on S3 (s3fs lists
``bucket//vault`` as ``bucket/vault``, SeaweedFS resolves '//' and refuses '.') and a '.' or '..' on
Azure (its requests resolve them). On GCS and Azure, which keep and list such names as written, no
vault is made there, "no vault" there names the URL meant, and a vault an earlier version made at one
still opens.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from .backends import AZURE, S3

# what each odd part of a path is called in a message
_ODD_PARTS = {"": "an empty folder name ('//')", ".": "a '.' folder name", "..": "a '..' folder name"}


@dataclass(frozen=True)
class OddPath:
    """An object store path with parts kept as written that a file system would resolve."""

    url: str  # as given (shown: no query string, no password)
    part: str  # the first odd part: "", "." or ".."
    what: str  # the first odd part, in words
    meant: str  # the URL it most likely means: the parts resolved as a file system would

    def unusable(self, protocol: str) -> str | None:
        """Why no vault can be at this path on ``protocol``'s storage (refused before any request), or None."""
        if protocol in S3:
            # s3fs reads and writes such a key as written, but lists bucket//vault as bucket/vault (a vault there
            # listed "no snapshots"); SeaweedFS's filer resolves '//' (the vault at bucket/vault, listing nothing
            # as its) and refuses a '.' ("Invalid Request")
            return (
                f"{self.url} has {self.what} in its path, which S3 clients and servers read in different ways: "
                f"write {self.meant}"
            )
        if self.part and protocol in AZURE:
            # Azure's requests resolve '.' and '..' while their signature is made over the path as written: every
            # request failed "access denied"
            return f"{self.url} has {self.what} in its path, which Azure Storage cannot address: write {self.meant}"
        return None

    def no_vault_hint(self) -> str:
        """Why no vault is found there (VaultNotFoundError's hint)."""
        kept = "kept as written in the objects' names"
        return f"its path has {self.what}, {kept}, so it is not {self.meant}: write {self.meant}"

    def refusal(self) -> str:
        """Why no vault is made there."""
        return (
            f"{self.url} has {self.what} in its path, kept as written in the objects' names, so a vault there "
            f"would not be {self.meant}: write {self.meant}"
        )


def odd_path(url: str, root: str) -> OddPath | None:
    """What is odd in the path of an object store's ``root`` (``bucket/key/path``, without leading or
    trailing '/'), or None; ``url``: the store's URL as messages show it."""
    key = root.partition("/")[2]
    odd = next((part for part in key.split("/") if part in _ODD_PARTS), None) if key else None
    if odd is None:
        return None
    return OddPath(url, odd, _ODD_PARTS[odd], _resolved(url))


def _resolved(url: str) -> str:
    """``url`` with its path's doubled '/', '.' and '..' resolved as a file system resolves them."""
    parts = urlsplit(url)
    path = posixpath.normpath(re.sub("/+", "/", parts.path)) if parts.path.strip("/") else ""
    return f"{parts.scheme}://{parts.netloc}{'' if path == '/' else path}"
