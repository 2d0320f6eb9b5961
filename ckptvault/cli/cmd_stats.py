from __future__ import annotations

import math
from typing import Annotated

import typer

from .app import NO_VAULT_ARGS, HostOpt, JsonOpt, QuietOpt, TagOpt, VaultArgs, app, command, vault_options
from .cmd_snapshots import warn_of_an_empty_selection
from .output import Output, counted, format_bytes, listed_tags
from .params import parse_hosts, parse_tags


@app.command("stats")
@command
@vault_options
def stats_cmd(
    snapshot: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="SNAPSHOT...",
            help="Only these snapshots: ID prefixes (4+ characters) or 'latest' (with --tag/--host: among those).",
        ),
    ] = None,
    tag: TagOpt = None,
    host: HostOpt = None,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """What each snapshot added, then logical versus stored bytes and the dedup ratio (--quiet: those alone).
    With SNAPSHOT, --tag or --host: of those snapshots only (the chunks they reference; docs/usage.md)."""
    out = Output(json_mode=json_out, quiet=quiet)
    tags, hosts = parse_tags(tag), parse_hosts(host)
    with vault_args.open(out) as vault:
        stats = vault.stats(snapshot or None, tags=tags, hosts=hosts)
        if not snapshot and not stats.snapshots:
            warn_of_an_empty_selection(out, vault, tags, hosts)
    if stats.unindexed_packs:
        out.warn(
            f"{stats.unindexed_packs} pack(s) are in no index (uploaded by a backup running now, left by an "
            "interrupted backup or prune, or an index object is gone): their chunks are not counted in unique bytes; "
            "once no backup runs, ckptvault repair-index indexes them again"
        )
    table = out.table("id", "time (UTC)", "host", "tags", "logical", "new", "stored")
    for s in stats.per_snapshot:
        table.add_row(
            s.id[:8],
            s.time.strftime("%Y-%m-%d %H:%M:%S"),
            s.hostname,
            listed_tags(s.tags),
            format_bytes(s.logical_bytes),
            format_bytes(s.new_bytes),
            format_bytes(s.stored_bytes),
        )
    whose = (
        "the selected snapshots"
        if stats.selected
        else "the readable snapshots"
        if stats.unreadable_snapshots
        else "all snapshots"
    )
    head = (
        f"snapshots: {stats.snapshots}{' (selected)' if stats.selected else ''}\n"
        f"logical bytes: {format_bytes(stats.logical_bytes)} ({whose})\n"
        f"unique bytes: {format_bytes(stats.unique_bytes)} in {counted(stats.chunks, 'chunk')}"
        f"{' (those their files reference)' if stats.selected else ''}\n"
        + (
            f"stored bytes: {format_bytes(stats.stored_bytes)} in {counted(stats.packs, 'pack')}: those chunks and "
            "the delta bases they need, without metadata\n"
            if stats.selected
            else f"stored bytes: {format_bytes(stats.stored_bytes)} in {counted(stats.packs, 'pack')} and metadata\n"
        )
        + (
            f"dedup ratio: not told while {stats.unreadable_snapshots} snapshot object(s) cannot be read (their "
            "files are left out of the logical bytes, their chunks are not)"
            if stats.dedup_ratio is None or stats.total_ratio is None
            else f"dedup ratio: {_ratio(stats.dedup_ratio)}, with compression: {_ratio(stats.total_ratio)}"
            if stats.logical_bytes
            else "dedup ratio: none yet (no file data stored)"
        )
    )
    if stats.delta_chunks:
        head += (
            f"\ndelta coding: {counted(stats.delta_chunks, 'chunk')} ({format_bytes(stats.delta_bytes)}) stored in "
            f"{format_bytes(stats.delta_stored_bytes)}, about {format_bytes(stats.delta_saved_bytes)} saved "
            "over coding them whole"
        )
        if stats.delta_saving_unknown:
            how = (
                "added by the backups of other snapshots, or copied in"
                if stats.selected
                else "copied in, or added by a backup whose snapshot is forgotten"
            )
            head += f" (not counting about {stats.delta_saving_unknown} whose saving is not known: {how})"
    data = {**stats.__dict__, "dedup_ratio": stats.dedup_ratio, "total_ratio": stats.total_ratio}
    if out.json_mode:
        out.result(data)
        return
    if stats.per_snapshot and not out.quiet:  # a row per snapshot: thousands in a vault never pruned
        out.result(data, table, asked=True)
    out.result(data, head, asked=True)  # last, where a long table leaves it in sight


def _ratio(value: float) -> str:
    """Two significant digits under 0.1, in plain decimals: a tiny vault's metadata outweighs its data, and
    "0.00x" told nothing; ``.2g`` said "4.8e-05x" for one byte among 3,000 empty files."""
    if value >= 0.1 or value <= 0:
        return f"{value:.2f}x"
    return f"{value:.{1 - math.floor(math.log10(value))}f}x"
