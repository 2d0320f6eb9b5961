"""Retention: prune and forget."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated

import typer

from ..ops.prune import DEFAULT_REPACK_THRESHOLD, PruneResult
from ..snapshot.model import format_tags
from ..snapshot.retention import Decision, missing_group_label, unused_keep_tags
from ..snapshot.selection import tag_options, unmatched_tags
from .app import NO_VAULT_ARGS, JsonOpt, QuietOpt, TagOpt, VaultArgs, app, command, vault_options
from .output import Output, format_bytes
from .params import parse_before, parse_keep_tags, parse_tags

DryRunOpt = Annotated[bool, typer.Option("--dry-run", "-n", help="Change nothing; print what would be removed.")]


def _decision(d: Decision) -> dict[str, str]:
    return {"id": d.snapshot.id, "reason": d.reason, **({"group": d.group} if d.group is not None else {})}


def note_ungrouped(out: Output, result: PruneResult, group_by: str | None) -> None:
    """Say so when some snapshots lack the --group-by tag: they are pruned as a group of their own."""
    if group_by is None or group_by == "host":
        return
    label = missing_group_label(group_by)
    lacking = [d for d in result.retention.decisions if d.group == label]
    if lacking:
        grouped = sum(d.group is not None for d in result.retention.decisions)
        out.info(
            f"note: {len(lacking)} of {grouped} snapshot(s) have no tag {group_by!r}; "
            f"they are pruned as one group, {label!r}, whose newest is kept"
        )


def note_runs_emptied(out: Output, result: PruneResult, group_by: str | None, keep_latest: int | None) -> None:
    """Without --group-by the newest N (or with --before alone, the newest one) are counted over every
    run together, so a run that saved earlier can lose all its snapshots to another's newer ones: name
    each run left with none."""
    if group_by is not None:
        return
    decisions = result.retention.decisions
    runs = {d.snapshot.tags["run"] for d in decisions if "run" in d.snapshot.tags}
    kept = {d.snapshot.tags["run"] for d in decisions if d.keep and "run" in d.snapshot.tags}
    emptied = sorted(runs - kept)
    if emptied:
        has = "would have" if result.dry_run else "has"
        rule = "--keep-latest counts the snapshots" if keep_latest else "only the newest snapshot is kept"
        out.warn(
            f"{', '.join(f'run={r}' for r in emptied)} {has} no snapshot left: {rule} of all {len(runs)} runs "
            f"together; --group-by run keeps the newest {'N' if keep_latest else 'one'} of each"
        )


def note_unselected(out: Output, result: PruneResult, tags: dict[str, str] | None) -> None:
    """A mistyped --tag selects nothing and so removes nothing: say so, with the values in use."""
    snapshots = [d.snapshot for d in result.retention.decisions]
    if tags and snapshots and not any(s.matches(tags) for s in snapshots):
        out.warn(f"{tag_options(tags).strip()} selects no snapshot{unmatched_tags(snapshots, tags)}; none removed")


def note_unprotecting(out: Output, result: PruneResult, keep_tags: tuple[str, ...]) -> None:
    """A --keep-tag that no snapshot carries protects nothing (one a typo away from a tag in use
    was refused before anything was removed): say so."""
    snapshots = [d.snapshot for d in result.retention.decisions]
    for spec in unused_keep_tags(snapshots, keep_tags):
        keys = ", ".join(sorted({k for s in snapshots for k in s.tags})) or "none"
        out.warn(f"--keep-tag {spec} is on no snapshot (tag keys in use: {keys}); it protected nothing")


def report(out: Output, result: PruneResult, summary: str | None = None) -> None:
    """The removed snapshots and ``summary`` (default: what prune removed and reclaimed)."""
    gone = result.forgotten
    grouped = any(d.group is not None for d in result.retention.decisions)
    table = out.table("id", "time (UTC)", "tags", "size", *(["group"] if grouped else []), "why")
    for d in result.retention.decisions:
        if not d.keep:
            s = d.snapshot
            tags = format_tags(s.tags)
            size = format_bytes(s.summary.logical_bytes)
            group = [d.group or ""] if grouped else []
            table.add_row(s.short_id, f"{s.time:%Y-%m-%d %H:%M:%S}", tags, size, *group, d.reason)
    gc = result.gc
    data = {
        "dry_run": result.dry_run,
        "forget": [_decision(d) for d in result.retention.decisions if not d.keep],
        "keep": [_decision(d) for d in result.retention.decisions if d.keep],
        "packs_deleted": len(gc.delete_packs),
        "packs_repacked": len(gc.repack),
        "reclaim_bytes": gc.reclaim_bytes,
        "stored_before": result.stored_before,
        "stored_after": result.stored_after,
    }
    if out.json_mode:
        out.result(data)
        return
    if gone:
        out.result(data, table)
    out.result(data, summary or _pruned(result))


def _pruned(result: PruneResult) -> str:
    gone, kept, gc = len(result.forgotten), len(result.retention.keep), result.gc
    if result.dry_run:  # the plan counts pack bytes; a real run measures the whole repository after
        return (
            f"would remove {gone} snapshot(s), keep {kept}; "
            f"would remove {len(gc.delete_packs)} pack(s), repack {len(gc.repack)} "
            f"({format_bytes(gc.repack_bytes)} to copy); would reclaim about {format_bytes(gc.reclaim_bytes)}"
        )
    return (
        f"removed {gone} snapshot(s), kept {kept}; "
        f"removed {len(gc.delete_packs)} pack(s), repacked {len(gc.repack)} "
        f"({format_bytes(gc.repack_bytes)} copied); "
        f"reclaimed {format_bytes(result.stored_before - result.stored_after)}"
    )


@app.command("prune")
@command
@vault_options
def prune_cmd(
    keep_latest: Annotated[int | None, typer.Option(help="Keep the newest N snapshots (of each group).")] = None,
    before: Annotated[
        str | None, typer.Option(help="Only remove snapshots older than this: ISO date/time, or an age like 14d, 36h.")
    ] = None,
    tag: TagOpt = None,
    group_by: Annotated[str | None, typer.Option(help="Apply the policy per value of this tag key, or 'host'.")] = None,
    keep_tag: Annotated[
        list[str] | None, typer.Option(help="Never remove snapshots with this tag (key or key=value; repeatable).")
    ] = None,
    repack_threshold: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Repack a pack once this fraction of its bytes is dead (0..1).")
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
    tags = parse_tags(tag)
    keep_tags = parse_keep_tags(keep_tag)
    with vault_args.open(out) as vault:
        result = vault.prune(
            keep_latest=keep_latest,
            before=parse_before(before, now),
            tags=tags,
            keep_tags=keep_tags,
            group_by=group_by,
            dry_run=dry_run,
            repack_threshold=repack_threshold,
        )
    note_unselected(out, result, tags)
    note_unprotecting(out, result, keep_tags)
    note_ungrouped(out, result, group_by)
    note_runs_emptied(out, result, group_by, keep_latest)
    report(out, result)


@app.command("forget")
@command
@vault_options
def forget_cmd(
    snapshots: Annotated[
        list[str], typer.Argument(help="Snapshot IDs (unique prefixes of 4 or more characters), or latest.")
    ],
    prune: Annotated[bool, typer.Option("--prune", help="Also reclaim the space they held.")] = False,
    dry_run: DryRunOpt = False,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Remove the given snapshots (their data stays until a prune, or use --prune)."""
    out = Output(json_mode=json_out, quiet=quiet)
    with vault_args.open(out) as vault:
        result = vault.forget(snapshots, prune=prune, dry_run=dry_run)
    if prune:
        report(out, result)
        return
    gone, kept = len(result.forgotten), len(result.retention.keep)
    done = f"would forget {gone} snapshot(s), keep {kept}" if dry_run else f"forgot {gone} snapshot(s), kept {kept}"
    report(out, result, f"{done}; their data stays until: ckptvault prune")
