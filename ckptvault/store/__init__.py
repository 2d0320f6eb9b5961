"""Storage: a small interface over local folders and fsspec (every repository byte goes through it).

fsspec is loaded only for a URL with a protocol: ``FsspecStore`` is imported on first use."""

from typing import TYPE_CHECKING, Any

from .base import ObjectInfo, Store
from .local import LocalStore
from .opening import open_store
from .readahead import ReadAheadStore
from .retrying import RetryingStore, RetryPolicy
from .throttle import RateArg, RateLimits, ThrottledStore

if TYPE_CHECKING:
    from .fsspec_store import FsspecStore


def __getattr__(name: str) -> Any:
    if name == "FsspecStore":
        from .fsspec_store import FsspecStore

        return FsspecStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FsspecStore",
    "LocalStore",
    "ObjectInfo",
    "RateArg",
    "RateLimits",
    "ReadAheadStore",
    "RetryPolicy",
    "RetryingStore",
    "Store",
    "ThrottledStore",
    "open_store",
]
