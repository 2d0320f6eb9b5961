"""Storage: a small interface over fsspec (every repository byte goes through it)."""

from .base import ObjectInfo, Store
from .fsspec_store import FsspecStore, open_store
from .readahead import ReadAheadStore
from .retrying import RetryingStore, RetryPolicy

__all__ = ["FsspecStore", "ObjectInfo", "ReadAheadStore", "RetryPolicy", "RetryingStore", "Store", "open_store"]
