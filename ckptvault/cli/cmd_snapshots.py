"""Browsing: snapshots, ls, cat."""

from __future__ import annotations

import base64
import sys
from typing import Annotated

import typer

from ..errors import UsageError
from ..snapshot.selection import selector_options, unmatched
from ..vault import Vault
from .app import NO_VAULT_ARGS, HostOpt, JsonOpt, QuietOpt, TagOpt, VaultArgs, app, command, vault_options
from .output import Output, format_bytes, listed_tags, one_line, writing_stdout
from .params import parse_hosts, parse_tags

SnapshotArg = Annotated[
    str, typer.Argument(metavar="SNAPSHOT", help="Snapshot ID (a unique prefix of 4 characters or more) or 'latest'.")
]


def warn_of_an_empty_selection(out: Output, vault: Vault, tags: dict[str, str], hosts: list[str] | None) -> None:
    """A mistyped --tag or --host must not read as "this run was never backed up": say what there is instead."""
    if tags or hosts:
        every = vault.snapshots()
        why = unmatched(every, tags, hosts, none_readable=bool(vault.unreadable_snapshots))
        out.warn(f"{selector_options(tags, hosts).strip()} selects no snapshot{why}")


@app.command("snapshots")
@command
@vault_options
def snapshots_cmd(
    snapshot: Annotated[
        str | None,
        typer.Argument(
            metavar="SNAPSHOT",
            help="Only this snapshot: an ID prefix (4+ characters) or 'latest' (with --tag/--host: as restore picks).",
        ),
    ] = None,
    tag: TagOpt = None,
    host: HostOpt = None,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """List snapshots, oldest first (--tag, --host: only those with every tag, of any of the hosts)."""
    out = Output(json_mode=json_out, quiet=quiet)
    tags, hosts = parse_tags(tag), parse_hosts(host)
    with vault_args.open(out) as vault:
        # one snapshot: how a resume script learns which step `latest --tag run=x` is, by the same rule
        snaps = (
            [vault.snapshot(snapshot, tags, hosts=hosts)]
            if snapshot is not None
            else vault.snapshots(tags, hosts=hosts)
        )
        if not snaps:
            warn_of_an_empty_selection(out, vault, tags, hosts)
    table = out.table("id", "time (UTC)", "host", "tags", "files", "size", "stored", "description")
    for s in snaps:
        table.add_row(
            s.short_id,
            s.time.strftime("%Y-%m-%d %H:%M:%S"),
            s.hostname,
            listed_tags(s.tags),
            str(s.summary.files),
            format_bytes(s.summary.logical_bytes),
            format_bytes(s.summary.stored_bytes),
            s.description,
        )
    out.result(snaps, table if snaps else "no snapshots", asked=True)


@app.command("ls")
@command
@vault_options
def ls_cmd(
    snapshot: SnapshotArg,
    long: Annotated[bool, typer.Option("--long", "-l", help="Also stored bytes, chunks and file hash.")] = False,
    tag: TagOpt = None,
    host: HostOpt = None,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """List the files of a snapshot with their sizes (--long: stored bytes, chunks, BLAKE3)."""
    out = Output(json_mode=json_out, quiet=quiet)
    tags, hosts = parse_tags(tag), parse_hosts(host)
    with vault_args.open(out) as vault:
        snap = vault.snapshot(snapshot, tags, hosts=hosts)
        entries = vault.files(snap)
        usage = {u.path: u for u in vault.file_usage(snap)} if long else {}
    table = out.table("type", "mode", "size", *(("stored", "chunks", "blake3") if long else ()), "path")
    for e in entries:
        shown = f"{e.path} -> {e.target}" if e.type == "symlink" else e.path + ("/" if e.type == "dir" else "")
        extra = []
        if long:
            u = usage[e.path]
            extra = (
                [format_bytes(u.stored_bytes), str(u.chunks), (e.blake3 or "")[:16]] if e.type == "file" else [""] * 3
            )
        table.add_row(e.type, oct(e.mode), format_bytes(e.size) if e.type == "file" else "", *extra, one_line(shown))
    data = [
        {
            "path": e.path,
            "type": e.type,
            "mode": e.mode,
            "size": e.size,
            "mtime_ns": e.mtime_ns,
            "blake3": e.blake3,
            "target": e.target,
            **({"stored_bytes": usage[e.path].stored_bytes, "chunks": usage[e.path].chunks} if long else {}),
            **_raw_path(e.path),
        }
        for e in entries
    ]
    out.result({"snapshot": snap.id, "entries": data}, table, asked=True)


@app.command("cat")
@command
@vault_options
def cat_cmd(
    snapshot: SnapshotArg,
    path: Annotated[str, typer.Argument(metavar="PATH", help="Path of a file inside the snapshot.")],
    tag: TagOpt = None,
    host: HostOpt = None,
    vault_args: VaultArgs = NO_VAULT_ARGS,
) -> None:
    """Write one file of a snapshot to stdout (verified).

    It streams: a damaged chunk stops it with exit 30 after the bytes before it were written; those bytes are
    correct, but the output is incomplete (check the exit status before using it).
    """
    if sys.stdout is None:
        raise UsageError("standard output is closed: cat writes the file there; send it to a file or a pipe")
    out = Output()
    tags, hosts = parse_tags(tag), parse_hosts(host)
    with vault_args.open(out) as vault:
        snap = vault.snapshot(snapshot, tags, hosts=hosts)
        with writing_stdout():
            sink = sys.stdout.buffer
            for data in vault.read_file(snap, path):
                sink.write(data)
            sink.flush()


def _raw_path(path: str) -> dict[str, str]:
    """``path_base64``: the bytes of a name that is not UTF-8, whose "path" writes its odd bytes as \\xNN
    text, as a name made of those very characters reads (audit fs44 #7): a script reaches the file by them."""
    raw = path.encode("utf-8", "surrogateescape")  # as a snapshot keeps it
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return {"path_base64": base64.b64encode(raw).decode("ascii")}
    return {}
