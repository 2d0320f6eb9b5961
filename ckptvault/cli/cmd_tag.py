"""tag: change the tags of a stored snapshot."""

from __future__ import annotations

from typing import Annotated

import typer

from ..arguments import is_snapshot_id, refuse_short_id_prefix
from ..errors import SnapshotNotFoundError
from ..snapshot.model import Snapshot
from .app import NO_VAULT_ARGS, JsonOpt, QuietOpt, VaultArgs, app, command, vault_options
from .output import Output, listed_tags
from .params import parse_new_tags, parse_tags


@app.command("tag")
@command
@vault_options
def tag_cmd(
    snapshot: Annotated[
        str,
        typer.Argument(metavar="SNAPSHOT", help="Snapshot ID (a unique prefix of 4 or more characters) or 'latest'."),
    ],
    add: Annotated[
        list[str] | None,
        typer.Option(
            "--add", "-a", metavar="KEY=VALUE", help="Tag key=value to set (repeatable; replaces the key's value)."
        ),
    ] = None,
    remove: Annotated[
        list[str] | None, typer.Option("--remove", metavar="KEY", help="Tag key to take away (repeatable).")
    ] = None,
    tag: Annotated[
        list[str] | None,
        typer.Option(
            "--tag",
            "-t",
            metavar="KEY=VALUE",
            help="Choose among snapshots with this tag key=value (repeatable); not a change.",
        ),
    ] = None,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Add or remove tags of a snapshot (e.g. --add keep=best, kept by prune --keep-tag keep).
    The snapshot gets a new ID when its tags change."""
    out = Output(json_mode=json_out, quiet=quiet)
    changes = parse_new_tags(add, "--add")
    refuse_short_id_prefix(snapshot, "retag")  # before any lookup, as Vault.tag does
    with vault_args.open(out, writes=True) as vault:
        try:
            before: Snapshot | None = vault.snapshot(snapshot, parse_tags(tag))
        except SnapshotNotFoundError:
            if not is_snapshot_id(snapshot):
                raise
            # the rerun of a tag killed after it removed the old snapshot: Vault.tag finds its copy (or raises
            # this same error), and says so in a warning; the result is the one the killed run would have shown
            before = None
        if before is not None:
            after = vault.tag(before, add=changes, remove=remove or [])
        else:
            after = vault.tag(snapshot, add=changes, remove=remove or [], tags=parse_tags(tag))
    shown = listed_tags(after.tags) or "none"
    previous_id = before.id if before is not None else snapshot.lower()
    data = {"previous_id": previous_id, "snapshot": after}
    if before is None:
        out.result(data, f"snapshot {previous_id[:8]} is now {after.short_id}, tags: {shown}")
    elif after.id == before.id:
        missing = [k for k in dict.fromkeys(remove or []) if k not in before.tags]
        absent = f"{'tags' if len(missing) > 1 else 'tag'} {', '.join(missing)}"
        has = f"already has these tags ({shown})" if changes or not missing else f"has no {absent} (its tags: {shown})"
        also = f" and no {absent}" if missing and changes else ""
        out.result(data, f"snapshot {after.short_id} {has}{also}; nothing changed")
    else:
        out.result(data, f"snapshot {before.short_id} is now {after.short_id}, tags: {shown}")
