"""``open_store``: the store stack for a repository URL."""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import UsageError
from .base import Store
from .local import LocalStore
from .options import read_ahead_bytes
from .readahead import ReadAheadStore
from .retrying import RetryingStore, RetryPolicy
from .throttle import RateLimits, ThrottledStore


def open_store(
    url: str,
    storage_options: dict[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    limits: RateLimits | None = None,
    unlimited: tuple[str, ...] = (),
) -> Store:
    """The store for a repository URL (a plain path means a local folder), with retries, the
    bandwidth limits (else those of the environment; keys under ``unlimited`` prefixes are never held
    back) and, for remote stores, read-ahead. A plain path without storage options needs no fsspec
    (LocalStore); options given for one are checked by fsspec's local filesystem, as for file://."""
    policy = retry or RetryPolicy.from_env()
    inner: Store
    plain_path = "://" not in url  # "::" inside a path is part of a folder's name
    url = _checked_url(url)
    if plain_path and not storage_options:
        inner = LocalStore(url)
    else:
        from .fsspec_store import FsspecStore

        inner = FsspecStore(url, storage_options, op_timeout=policy.op_timeout)
    limits = RateLimits.resolve() if limits is None else limits
    retrying = RetryingStore(inner, policy)
    store: Store = ThrottledStore(retrying, limits, unlimited) if limits else retrying
    window = read_ahead_bytes()
    return ReadAheadStore(store, window) if retrying.remote and window else store


def check_storage_options(url: str, storage_options: dict[str, Any]) -> None:
    """What ``open_store`` refuses of a URL and its options (UsageError), found before anything connects:
    ``copy`` checks its destination's before it opens its source (a source's option given to the
    destination by mistake was found only after the source had been tried for minutes without it)."""
    if storage_options:
        from .fsspec_store import FsspecStore

        FsspecStore(_checked_url(url), storage_options)


def _checked_url(url: str) -> str:
    _refuse_chained_url(url)
    if "://" not in url:
        _refuse_mistyped_url(url)
        url = os.path.abspath(os.path.expanduser(url))
    _refuse_relative_file_url(url)
    return url


# Protocols of the storage ckptvault is used with: "s3:/bucket/vault" or "gs:bucket/vault" is a URL with a
# typo, and taken as a local path it would keep every checkpoint on the machine it is meant to leave.
_REMOTE_PROTOCOLS = frozenset({
    "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "sftp", "ssh", "ftp", "http", "https", "webdav",
    "hf", "oci", "oss", "r2", "file", "local", "memory",
})  # fmt: skip
_LOCAL_PROTOCOLS = frozenset({"file", "local"})
_PROTOCOL_TYPO = re.compile(r"([A-Za-z][\w+.-]*):/?(?!/)(.*)", re.S)
_CHAINED = re.compile(r"([A-Za-z][\w+.-]*)::")  # a protocol, then "::" (not /data/run::1/vault)


def _refuse_mistyped_url(path: str) -> None:
    match = _PROTOCOL_TYPO.fullmatch(path)
    if match and match[1].lower() in _REMOTE_PROTOCOLS:
        proto, rest = match[1], match[2]
        # a local folder's URL holds its absolute path after the '//': file:///tmp/x (file://tmp/x is ./tmp/x)
        url = f"{proto}:///{rest}" if proto.lower() in _LOCAL_PROTOCOLS else f"{proto}://{rest}"
        raise UsageError(
            f"{path!r} is not a URL (it lacks the '//' of {proto}://) and would be a local folder: write "
            f"{url}, or ./{path} for a local folder of that name"
        )


def _refuse_chained_url(url: str) -> None:
    """fsspec chains filesystems with "::" (``simplecache::s3://bucket/vault``). ckptvault sets its
    retries, time limits and folder rules by the storage a URL names, which a chain hides behind its
    first layer; and a caching layer has nothing to add (ckptvault keeps the vault's metadata on this
    machine itself)."""
    match = _CHAINED.match(url)
    if not match:
        return
    import fsspec  # only here: a plain path loads no fsspec

    if match[1].lower() in fsspec.available_protocols():  # not a folder named run::1
        raise UsageError(
            f"{url!r} chains fsspec filesystems ({match[1]}::...), which ckptvault does not open; give the "
            f"storage's own URL: {url.split('::', 1)[1]}"
        )


def _refuse_relative_file_url(url: str) -> None:
    """``file://tmp/x`` is the folder ./tmp/x to fsspec, not /tmp/x, which is what its writer meant (a URL's
    path starts after a third '/'): refused rather than made where nobody will look for it."""
    proto, sep, rest = url.partition("://")
    if sep and proto.lower() in _LOCAL_PROTOCOLS and not rest.startswith("/"):
        raise UsageError(
            f"{url!r} names no absolute folder (the path of a {proto}:// URL starts after a third '/'): write "
            f"{proto}:///{rest.removeprefix('localhost/')} for /{rest.removeprefix('localhost/')}, or the "
            "folder's plain path"
        )
