"""Retention: prune and forget."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated

import typer

from ..ops.catalog import is_stand_in
from ..ops.gc import DEFAULT_REPACK_THRESHOLD
from ..ops.prune import PruneResult
from ..snapshot.retention import Decision
from .app import NO_VAULT_ARGS, JsonOpt, QuietOpt, TagOpt, VaultArgs, app, command, vault_options
from .output import Output, format_bytes, listed_tags, with_vault_named
from .params import parse_before, parse_keep_tags, parse_tags

DryRunOpt = Annotated[bool, typer.Option("--dry-run", "-n", help="Change nothing; print what would be removed.")]


def _decision(d: Decision) -> dict[str, str]:
    return {"id": d.snapshot.id, "reason": d.reason, **({"group": d.group} if d.group is not None else {})}


def report(out: Output, result: PruneResult, summary: str | None = None) -> None:
    """The removed snapshots and ``summary`` (default: what prune removed and reclaimed)."""
    gone = result.forgotten
    grouped = any(d.group is not None for d in result.retention.decisions)
    table = out.table("id", "time (UTC)", "tags", "size", *(["group"] if grouped else []), "why")
    for d in result.retention.decisions:
        if not d.keep:
            s = d.snapshot
            group = [d.group or ""] if grouped else []
            if is_stand_in(s):  # an object forgotten unread: its time, tags and size are unknown, not 1970's
                table.add_row(s.short_id, "?", "?", "?", *group, d.reason)
                continue
            tags = listed_tags(s.tags)
            size = format_bytes(s.summary.logical_bytes)
            table.add_row(s.short_id, f"{s.time:%Y-%m-%d %H:%M:%S}", tags, size, *group, d.reason)
    gc = result.gc
    data = {
        "dry_run": result.dry_run,
        "forget": [_decision(d) for d in result.retention.decisions if not d.keep],
        "keep": [_decision(d) for d in result.retention.decisions if d.keep],
        "packs_deleted": len(gc.delete_packs),
        "packs_repacked": len(gc.repack),
        "reclaim_bytes": result.reclaim_bytes,
        "stored_before": result.stored_before,
        "stored_after": result.stored_after,
    }
    if out.json_mode:
        out.result(data)
        return
    if gone:  # a dry run's plan is what was asked for: --quiet keeps it
        out.result(data, table, asked=result.dry_run)
    said = summary or _pruned(result)  # asked-for text is shown as it is: the command it suggests named here
    out.result(data, with_vault_named(said) if result.dry_run else said, asked=result.dry_run)


def _pruned(result: PruneResult) -> str:
    gone, kept, gc = len(result.forgotten), len(result.retention.keep), result.gc
    if result.dry_run:  # the plan counts pack bytes; a real run measures the whole repository after
        return (
            f"would remove {gone} snapshot(s), keep {kept}; "
            f"would remove {len(gc.delete_packs)} pack(s), repack {len(gc.repack)} "
            f"({format_bytes(gc.repack_bytes)} to copy); would reclaim about {format_bytes(result.reclaim_bytes)}"
        )
    return (
        f"removed {gone} snapshot(s), kept {kept}; "
        f"removed {len(gc.delete_packs)} pack(s), repacked {len(gc.repack)} "
        f"({format_bytes(gc.repack_bytes)} copied); "
        f"reclaimed {format_bytes(result.reclaim_bytes)}"
    )


@app.command("prune")
@command
@vault_options
def prune_cmd(
    keep_latest: Annotated[
        int | None, typer.Option(metavar="N", help="Keep the newest N snapshots (of each group).")
    ] = None,
    before: Annotated[
        str | None,
        typer.Option(
            metavar="DATE|AGE", help="Only remove snapshots older than this: ISO date/time, or an age like 14d, 36h."
        ),
    ] = None,
    tag: TagOpt = None,
    group_by: Annotated[
        str | None, typer.Option(metavar="KEY", help="Apply the policy per value of this tag key, or 'host'.")
    ] = None,
    keep_tag: Annotated[
        list[str] | None,
        typer.Option(metavar="TAG", help="Never remove snapshots with this tag (key or key=value; repeatable)."),
    ] = None,
    repack_threshold: Annotated[
        float,
        typer.Option(
            min=0.0, max=1.0, metavar="F", help="Repack a pack once this fraction of its bytes is dead (0..1)."
        ),
    ] = DEFAULT_REPACK_THRESHOLD,
    dry_run: DryRunOpt = False,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Remove snapshots outside the newest N AND older than --before, then reclaim their space (with no rule:
    only the space of snapshots already forgotten)."""
    out = Output(json_mode=json_out, quiet=quiet)
    now = datetime.now(timezone.utc)
    with vault_args.open(out, writes=not dry_run) as vault:
        result = vault.prune(
            keep_latest=keep_latest,
            before=parse_before(before, now),
            tags=parse_tags(tag),
            keep_tags=parse_keep_tags(keep_tag),
            group_by=group_by,
            dry_run=dry_run,
            repack_threshold=repack_threshold,
        )
    report(out, result)  # its warnings were said by the vault (on_warning)


@app.command("forget")
@command
@vault_options
def forget_cmd(
    snapshots: Annotated[
        list[str],
        typer.Argument(metavar="SNAPSHOT...", help="Snapshot IDs (unique prefixes of 4+ characters), or latest."),
    ],
    prune: Annotated[bool, typer.Option("--prune", help="Also reclaim the space they held.")] = False,
    dry_run: DryRunOpt = False,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Remove the given snapshots (their data stays until a prune, or use --prune)."""
    out = Output(json_mode=json_out, quiet=quiet)
    with vault_args.open(out, writes=not dry_run) as vault:
        result = vault.forget(snapshots, prune=prune, dry_run=dry_run)
    if prune:
        report(out, result)
        return
    gone, kept = len(result.forgotten), len(result.retention.keep)
    done = f"would forget {gone} snapshot(s), keep {kept}" if dry_run else f"forgot {gone} snapshot(s), kept {kept}"
    report(out, result, f"{done}; their data stays until: ckptvault prune")
