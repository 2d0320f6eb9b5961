"""Command-line interface: a thin layer over ``ckptvault.Vault``."""

from . import cmd_backup, cmd_demo, cmd_init, cmd_key, cmd_restore, cmd_snapshots, cmd_stats  # noqa: F401 - registers commands
from .app import app


def main() -> None:
    app()
