"""The repository engine: config, packs, index, and the object layout on a Store."""

from .config import RepoConfig
from .repository import Repository

__all__ = ["RepoConfig", "Repository"]
