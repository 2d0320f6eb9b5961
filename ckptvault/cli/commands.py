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
from .cmd_key import key_app

# `ckptvault --help` lists each command by the first paragraph of its docstring, where typer keeps the source's
# line breaks ("those with" / "--tag, or ..."); a command's own --help joins them. Join them for the list too.
for _typer in (app, key_app):
    for _info in _typer.registered_commands:
        if _info.short_help is None and _info.callback is not None:
            _info.short_help = " ".join((_info.help or _info.callback.__doc__ or "").split("\n\n")[0].split())

__all__ = ["app"]
