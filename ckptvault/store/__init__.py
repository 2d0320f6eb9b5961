"""Storage: a small interface over fsspec (every repository byte goes through it)."""

from .base import ObjectInfo, Store
from .fsspec_store import FsspecStore, open_store

__all__ = ["FsspecStore", "ObjectInfo", "Store", "open_store"]
