"""ship-pins: ship what a process that died left pinned beside its checkpoints (a restart on the same disk)."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import NotBackedUpError
from ..ops.leftover_pins import watch_pins_left
from ..ops.names import PIN_FOLDER, WATCH_STATE_FOLDER
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
    state_dir: Annotated[
        str | None,
        typer.Option(
            "--state-dir",
            metavar="DIR",
            help="The --state-dir a watch sidecar of FOLDER was started with: its pins there are named too "
            "(default: FOLDER's .ckptvault-watch only).",
        ),
    ] = None,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Ship the checkpoints a trainer that died left pinned (backup_async's pins), and wait for them.
    On a restart on the same disk, run it before `restore latest`: the dead run's newest save is then
    in the vault when the resume picks one. A dead watch sidecar's pins are named, with the command
    that ships them, and the command exits 40 while they are left."""
    out = Output(json_mode=json_out, quiet=quiet)
    with vault_args.open(out, writes=True) as vault:
        shipped = vault.ship_leftover_pins(folder, timeout=timeout, state_dir=state_dir)
    for snap in shipped:
        out.info(f"shipped snapshot {snap.short_id} ({format_tags(snap.tags) or 'no tags'}): {snap.description}")
    if left := watch_pins_left(folder, state_dir):
        # named in a warning above; exit 0 and "nothing left pinned" let a restart script (ship-pins, then
        # restore latest) resume from an older save than the one the dead watcher held (rv61)
        total = sum(held for _, held, _ in left)
        commands = " and ".join(command for _, _, command in left)
        raise NotBackedUpError(
            f"{counted(total, 'checkpoint')} a watch sidecar that stopped pinned {'is' if total == 1 else 'are'} "
            f"not shipped (ship-pins ships backup_async's pins): run {commands} before resuming from the vault"
        )
    out.result(
        {"folder": folder, "state_dir": state_dir, "snapshots": shipped},
        f"{counted(len(shipped), 'checkpoint')} left pinned in {folder} shipped"
        if shipped
        else f"nothing left pinned in {folder} ({_looked_in(folder, state_dir)})",
    )


def _looked_in(folder: str, state_dir: str | None) -> str:
    """Where ship-pins looked: a watch given --state-dir keeps its pins outside FOLDER, and a restart that
    heard "nothing left pinned" resumed without the dead watcher's newest save (sp60)."""
    if state_dir is not None:
        return f"looked in its {PIN_FOLDER} and {WATCH_STATE_FOLDER}, and in {state_dir}"
    return (
        f"looked in its {PIN_FOLDER} and {WATCH_STATE_FOLDER}; a watch started with --state-dir keeps its pins "
        "there: give ship-pins the same --state-dir"
    )
