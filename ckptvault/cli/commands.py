"""The typer application with every command: importing a cmd_* module registers it."""

from . import (  # noqa: F401
    cmd_backup,
    cmd_check,
    cmd_copy,
    cmd_demo,
    cmd_diff,
    cmd_drill,
    cmd_init,
    cmd_key,
    cmd_prune,
    cmd_restore,
    cmd_ship_pins,
    cmd_show,
    cmd_snapshots,
    cmd_stats,
    cmd_status,
    cmd_tag,
    cmd_watch,
)
from .app import app

__all__ = ["app"]
