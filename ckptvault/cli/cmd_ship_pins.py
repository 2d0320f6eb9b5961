"""ship-pins: ship what a process that died left pinned beside its checkpoints (a restart on the same disk)."""

from __future__ import annotations

import os
import shlex
from typing import Annotated

import typer

from ..ops.names import WATCH_STATE_FOLDER
from ..ops.watch_lock import pins_of_a_stopped_watcher
from ..snapshot.model import format_tags
from ..units import counted
from .app import NO_VAULT_ARGS, JsonOpt, QuietOpt, VaultArgs, app, command, vault_options
from .output import Output


@app.command("ship-pins")
@command
@vault_options
def ship_pins_cmd(
    folder: Annotated[
        str,
        typer.Argument(
            metavar="FOLDER", help="The folder the dead run saved its checkpoints in (it holds .ckptvault-pins)."
        ),
    ],
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            metavar="S",
            help="Ship no more after this many seconds: the checkpoint under way is finished, the others stay "
            "pinned for the next run (default: none).",
        ),
    ] = None,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Ship the checkpoints a trainer that died left pinned (backup_async's pins), and wait for them.
    On a restart on the same disk, run it before `restore latest`: the dead run's newest save is then
    in the vault when the resume picks one."""
    out = Output(json_mode=json_out, quiet=quiet)
    with vault_args.open(out, writes=True) as vault:
        shipped = vault.ship_leftover_pins(folder, timeout=timeout)
    for snap in shipped:
        out.info(f"shipped snapshot {snap.short_id} ({format_tags(snap.tags) or 'no tags'}): {snap.description}")
    _say_watch_pins(out, folder)
    out.result(
        {"folder": folder, "snapshots": shipped},
        f"{counted(len(shipped), 'checkpoint')} left pinned in {folder} shipped"
        if shipped
        else f"nothing left pinned in {folder}",
    )


def _say_watch_pins(out: Output, folder: str) -> None:
    """The watch sidecar's pins are not backup_async's: a restart's `ship-pins` then `restore latest` took
    "nothing left pinned" for all shipped while a dead watcher's pin held the newest save (wt47 F6)."""
    if held := pins_of_a_stopped_watcher(folder):
        out.warn(
            f"{os.path.join(folder, WATCH_STATE_FOLDER)} holds {counted(held, 'checkpoint')} a watch sidecar "
            f"pinned; ship them with: ckptvault watch {shlex.quote(folder)} --once"
        )
