"""Storage: a small interface over fsspec (every repository byte goes through it)."""

from .base import ObjectInfo, Store
from .fsspec_store import FsspecStore, open_store
from .readahead import ReadAheadStore
from .retrying import RetryingStore, RetryPolicy
from .throttle import RateArg, RateLimits, ThrottledStore

__all__ = [
    "FsspecStore",
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
