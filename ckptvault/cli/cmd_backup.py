from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from typing import Annotated

import typer

from ..ops.backup import check_on_change
from ..ops.scan import check_sources
from ..vault import exclude_arg
from .app import (
    NO_VAULT_ARGS,
    ExcludeOpt,
    JsonOpt,
    QuietOpt,
    RecordHostOpt,
    TagOpt,
    VaultArgs,
    app,
    command,
    vault_options,
)
from .output import Output, counted, format_bytes, format_rate
from .params import parse_new_tags


@app.command("backup")
@command
@vault_options
def backup_cmd(
    paths: Annotated[list[str], typer.Argument(metavar="PATH...", help="Files or directories to back up.")],
    tag: TagOpt = None,
    description: Annotated[
        str, typer.Option("--description", "-d", metavar="TEXT", help="Free text stored with the snapshot.")
    ] = "",
    host: RecordHostOpt = None,
    force_read: Annotated[bool, typer.Option("--force-read", help="Read every file, even unchanged ones.")] = False,
    skip_unreadable: Annotated[
        bool, typer.Option("--skip-unreadable", help="Warn about unreadable files instead of failing.")
    ] = False,
    on_change: Annotated[
        str,
        typer.Option(
            metavar="warn|skip|fail",
            help="A file that changed while read, twice: warn (store it), skip (leave it out) or fail; fail also"
            " when a file was deleted or replaced during the backup.",
        ),
    ] = "warn",
    skip_if_unchanged: Annotated[
        bool,
        typer.Option(
            "--skip-if-unchanged",
            help="Write no snapshot when the newest one from this host with these tags, of the same"
            " paths' names, holds the same files (its ID is printed).",
        ),
    ] = False,
    exclude: ExcludeOpt = None,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Back up files and directories as a new snapshot."""
    out = Output(json_mode=json_out, quiet=quiet)
    tags = parse_new_tags(tag)
    check_sources(paths)  # before the default repository is created for a command that cannot work
    when_changed = check_on_change(on_change)
    exclude_arg(exclude)
    started = datetime.now(timezone.utc)
    with (
        vault_args.open(out, writing=True) as vault,
        out.progress("backing up") as progress,
    ):
        snap = vault.backup(
            paths,
            tags=tags,
            description=description,
            hostname=host,
            force_read=force_read,
            skip_unreadable=skip_unreadable,
            on_change=when_changed,
            skip_if_unchanged=skip_if_unchanged,
            exclude=exclude or (),
            on_progress=progress,
            on_warning=out.warn,
        )
    if skip_if_unchanged and snap.time < started:
        out.result(
            {**dataclasses.asdict(snap), "unchanged": True},
            f"unchanged since snapshot {snap.short_id} ({snap.time:%Y-%m-%d %H:%M:%S} UTC): no snapshot written",
        )
        return
    s = snap.summary
    rate = format_rate(s.read_bytes, s.duration_s)
    ratio = s.logical_bytes / max(s.stored_bytes, 1)
    delta = f", delta coding saved ~{format_bytes(s.delta_saved_bytes)}" if s.delta_chunks else ""
    # every file unchanged since the parent snapshot (size, mtime): "0 B/s read" and a ratio of thousands (only
    # the tree stored) read as a measurement; they are none
    unread = not s.read_bytes and s.logical_bytes and not s.new_bytes
    saving = "" if unread else f"dedup+compression {ratio:.2f}x, "
    speed = "no file read: unchanged since the last snapshot" if unread else f"{rate} read"
    out.result(
        snap,
        f"snapshot {snap.short_id} saved: {counted(s.files, 'file')}, {format_bytes(s.logical_bytes)}, "
        f"{format_bytes(s.new_bytes)} new, {format_bytes(s.stored_bytes)} stored{delta}, "
        f"{saving}{s.duration_s:.1f} s ({speed})",
    )
