"""Command-line interface: a thin layer over ``ckptvault.Vault``. Importing a cmd_* module registers it."""

import logging

from . import (  # noqa: F401
    cmd_backup,
    cmd_check,
    cmd_demo,
    cmd_diff,
    cmd_drill,
    cmd_init,
    cmd_key,
    cmd_prune,
    cmd_restore,
    cmd_show,
    cmd_snapshots,
    cmd_stats,
    cmd_status,
    cmd_watch,
)
from .app import app


def main() -> None:
    # The library logs notices such as "a read failed verification; reading it again"; the CLI
    # reports outcomes itself, one line each, so only the library's errors pass through.
    logging.getLogger("ckptvault").setLevel(logging.ERROR)
    app()
