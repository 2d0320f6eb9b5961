"""Maintenance: check, repair-index and unlock."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from ..errors import StorageError, UsageError
from ..repository.locks import STALE_AFTER, running_here
from .app import NO_VAULT_ARGS, JsonOpt, QuietOpt, VaultArgs, app, command, vault_options
from .output import Output, with_vault_named
from .params import parse_fraction


@app.command("check")
@command
@vault_options
def check_cmd(
    read_data: Annotated[bool, typer.Option("--read-data", help="Read and verify every chunk.")] = False,
    read_data_subset: Annotated[
        str | None, typer.Option(metavar="SHARE", help="Read and verify this share of the packs, e.g. 10%.")
    ] = None,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Verify the repository: index, packs and snapshots (and with --read-data, every byte)."""
    out = Output(json_mode=json_out, quiet=quiet)
    if read_data and read_data_subset:
        raise UsageError("give --read-data (every chunk) or --read-data-subset (a share of them), not both")
    fraction = 1.0 if read_data else parse_fraction(read_data_subset, "--read-data-subset") if read_data_subset else 0.0
    with vault_args.open(out) as vault:
        report = vault.check(read_data=fraction)
    for warning in report.warnings:
        out.warn(warning)
    counts = report.counts()
    # the advice in each problem names this vault in JSON too: a script pasting it must not act on the default vault
    problems = [dataclasses.replace(p, detail=with_vault_named(p.detail)) for p in report.problems]
    data = {"ok": report.ok, **report.__dict__, "problems": problems}
    if report.ok:
        out.result(data, f"no problems found: {counts}")
        return
    lines = [f"{p.object}: {p.detail}" for p in problems]
    for snapshot_id, files in report.affected.items():
        lines.append(f"affects snapshot {snapshot_id[:8]}: {_files(files)}")
    for snapshot_id, files in report.unavailable.items():
        lines.append(f"cannot check or restore snapshot {snapshot_id[:8]} until it can be read: {_files(files)}")
    out.result(data, "\n".join(lines), asked=True)
    error = report.error(vault.url)
    if error is not None:
        raise error


def _files(files: list[str]) -> str:
    return "the whole snapshot" if files == ["*"] else ", ".join(files[:5]) + (" ..." if len(files) > 5 else "")


@app.command("repair-index")
@command
@vault_options
def repair_index_cmd(
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Change nothing; print what would be done.")] = False,
    read_data: Annotated[
        bool,
        typer.Option(
            "--read-data",
            help="Also read every pack: drop damaged chunks, so the next backup stores them again, and copy the"
            " chunks of a pack whose header is damaged into a new pack.",
        ),
    ] = False,
    drop_failing: Annotated[
        bool,
        typer.Option(
            "--drop-failing-packs",
            help="Also drop from the index the packs the storage fails to serve on every attempt (a server error"
            " that outlasts CKPTVAULT_RETRY_FOR), so the next backup stores their chunks again. Implies --read-data.",
        ),
    ] = False,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Rebuild the index where it is damaged (from the packs' own headers) or names packs that are gone."""
    out = Output(json_mode=json_out, quiet=quiet)
    with vault_args.open(out, writes=not dry_run) as vault:
        result = vault.repair_index(dry_run=dry_run, read_data=read_data, drop_failing=drop_failing)
    if result.kept_packs:
        out.warn(
            f"{len(result.kept_packs)} pack(s) whose header is damaged hold bytes no index entry accounts for "
            f"(e.g. {result.kept_packs[0][:12]}): a chunk a snapshot needs may be there, so they are kept, not "
            "rewritten; ckptvault check names the snapshots and files whose chunks are in no index"
        )
    if result.cut_short_packs and not read_data:  # --read-data drops their cut chunks, and says so
        out.warn(
            f"{len(result.cut_short_packs)} indexed pack(s) end before chunks the index places in them (cut short; "
            f"e.g. {result.cut_short_packs[0][:12]}): this repair reads no pack data and keeps their entries; the "
            "next backup of the files holding those chunks stores them again, prune salvages the pack's whole "
            "chunks and removes it, and ckptvault check names the snapshots and files that need them"
        )
    if result.unreadable_packs:
        out.warn(
            f"{len(result.unreadable_packs)} pack(s) in no readable index have a damaged header too "
            f"(e.g. {result.unreadable_packs[0][:12]}): their chunks cannot be located; "
            "ckptvault check names the snapshots and files that needed them, if any"
        )
    index, remove, drop = (
        ("would index", "would remove", "would drop") if dry_run else ("indexed", "removed", "dropped")
    )
    damaged = ", ".join(i[:12] for i in result.damaged) or "none"
    out.result(
        result.__dict__,
        f"damaged index objects: {damaged}; {index} {result.packs_reindexed} pack(s) again from their headers"
        + (f", {remove} the damaged object(s)" if result.damaged else "")
        + (f"; {drop} {len(result.missing_packs)} missing pack(s) from the index" if result.missing_packs else "")
        + (
            f"; {drop} the chunks of {len(result.failing_packs)} pack(s) the storage fails to serve from the index "
            "(prune removes the packs; a repair-index --read-data before then indexes them again if they read by "
            "then): the next backup of the files holding them stores them again"
            if drop_failing and result.failing_packs
            else ""
        )
        + (
            f"; {drop} {len(result.damaged_chunks)} damaged chunk(s) from the index: the next backup of the files "
            "holding them stores them again, and the snapshots that need them then restore"
            if result.damaged_chunks
            else ""
        )
        + (
            f"; {index} {len(result.salvaged_packs)} pack(s) whose header is damaged from what the damaged "
            "index object(s) said of them (each chunk verified against its ID)"
            if result.salvaged_packs
            else ""
        )
        + (
            f"; {'would copy' if dry_run else 'copied'} the chunks of {len(result.rewritten_packs)} pack(s) whose "
            f"header is damaged into new packs, and {'remove' if dry_run else 'removed'} them"
            if result.rewritten_packs
            else ""
        )
        + (
            f"; {index} the chunks of {len(result.revived_packs)} dropped pack(s) that read and verify now again"
            if result.revived_packs
            else ""
        ),
        asked=dry_run,  # a dry run's plan is what was asked for: --quiet keeps it
    )
    if result.unread_packs:
        failing = [p for p in result.unread_packs if p in result.failing_packs]
        raise StorageError(
            "GET",
            "",
            vault.url,
            "unreadable packs",
            message=f"{len(result.unread_packs)} pack(s) could not be read (e.g. {result.unread_packs[0][:12]}), so "
            "their chunks were not verified and none was dropped: ckptvault check says why; fix the access and run "
            "repair-index --read-data again"
            + (
                f"; the storage fails {len(failing)} of them on every attempt (e.g. {failing[0][:12]}; a server "
                "error): if that persists, add --drop-failing-packs"
                if failing
                else ""
            ),
        )


@app.command("unlock")
@command
@vault_options
def unlock_cmd(
    remove_all: Annotated[
        bool, typer.Option("--remove-all", help="Remove every lock, also live ones. Only when no ckptvault runs.")
    ] = False,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Remove stale locks (not refreshed for 30 minutes, or held by a dead process on this host)."""
    out = Output(json_mode=json_out, quiet=quiet)
    with vault_args.open(out) as vault:
        removed = vault.unlock(remove_all=remove_all)
        left = vault.locks()
    for lock in removed:
        out.info(f"removed {lock.describe()}")
        if running_here(lock):  # with --remove-all; or a process that has not refreshed its lock for 30 min
            out.warn(
                f"pid {lock.pid} on this host is running and held that lock: a backup or prune there now stops "
                "before committing or deleting anything more (it lost its lock) and must be run again"
            )
    text = f"removed {len(removed)} lock(s)"
    if left:
        text += (
            f"; {len(left)} lock(s) not stale yet remain ({left[0].describe()}); one whose holder is gone goes "
            f"stale {round(STALE_AFTER.total_seconds() / 60)} minutes after its last refresh. If their machines "
            "are gone for good (reclaimed instances), --remove-all removes them now; use it only when no "
            "ckptvault process on any host uses this vault"
        )
    out.result({"removed": [lk.describe() for lk in removed], "remaining": [lk.describe() for lk in left]}, text)
