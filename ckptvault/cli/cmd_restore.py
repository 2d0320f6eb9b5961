from __future__ import annotations

from typing import Annotated

import typer

from ..arguments import refuse_short_id_prefix
from ..ops.restore import OTHERS_LISTED
from .app import NO_VAULT_ARGS, HostOpt, JsonOpt, QuietOpt, TagOpt, VaultArgs, app, command, vault_options
from .output import Output, counted, format_bytes, format_rate, one_line
from .params import parse_hosts, parse_tags


@app.command("restore")
@command
@vault_options
def restore_cmd(
    snapshot: Annotated[
        str,
        typer.Argument(metavar="SNAPSHOT", help="Snapshot ID (a unique prefix of 4 characters or more) or 'latest'."),
    ],
    target: Annotated[str, typer.Argument(metavar="DIR", help="Directory to restore into (created if missing).")],
    tag: TagOpt = None,
    host: HostOpt = None,
    include: Annotated[
        list[str] | None,
        typer.Option(
            "--include",
            "-i",
            metavar="GLOB",
            help="Restore only paths matching this glob (repeatable); an error when none matches anything.",
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace existing files that differ.")] = False,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Restore a snapshot, verifying every chunk and every file."""
    out = Output(json_mode=json_out, quiet=quiet)
    tags, hosts = parse_tags(tag), parse_hosts(host)
    with vault_args.open(out) as vault:
        refuse_short_id_prefix(snapshot, "restore")  # before any lookup, as Vault.restore does
        snap = vault.snapshot(snapshot, tags, hosts=hosts)
        with out.progress("restoring") as progress:
            result = vault.restore(snap, target, include=include, overwrite=overwrite, on_progress=progress)
    if result.setid_cleared:
        out.warn(
            f"{result.setid_cleared} file(s) restored without their setuid/setgid bits: the snapshot does not store "
            "owners, and restored by root they would run as root; set them again (chmod u+s) where you trust them"
        )
    if result.unmatched_globs:
        out.warn(f"--include {', '.join(map(repr, result.unmatched_globs))} matched no path in the snapshot")
    if others := result.not_in_snapshot:
        count = (
            f"{len(others)} or more entries"
            if len(others) >= OTHERS_LISTED
            else f"{len(others)} entr" + ("y" if len(others) == 1 else "ies")
        )
        more = ", ..." if len(others) > 3 else ""
        out.warn(
            f"{target} also holds {count} that snapshot {snap.short_id} does not ({', '.join(others[:3])}{more}), "
            "left as they were: restore into a new or empty folder for the snapshot alone"
        )
    rate = format_rate(result.bytes_written, result.duration_s)
    skipped = f", {result.skipped_files} already present" if result.skipped_files else ""
    if not result.files:  # "0 files, 0 B written" read as if nothing was restored
        made = ((result.dirs, "folder"), (result.symlinks, "link"))
        skipped += "".join(f", {counted(n, what)}" for n, what in made if n)
    out.result(
        {"snapshot": snap.id, "target": target, **{k: v for k, v in result.__dict__.items() if k != "snapshot"}},
        f"restored snapshot {snap.short_id} to {one_line(target)}: {counted(result.files, 'file')}{skipped}, "
        f"{format_bytes(result.bytes_written)} written and verified in {result.duration_s:.1f} s ({rate})",
    )
