"""show: the tensors of a checkpoint file inside a snapshot, read from its header alone."""

from __future__ import annotations

from typing import Annotated

import typer

from .app import NO_VAULT_ARGS, HostOpt, JsonOpt, QuietOpt, TagOpt, VaultArgs, app, command, vault_options
from .cmd_snapshots import SnapshotArg
from .output import Output, counted, format_bytes
from .params import parse_hosts, parse_tags


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


@app.command("show")
@command
@vault_options
def show_cmd(
    snapshot: SnapshotArg,
    path: Annotated[
        str, typer.Argument(metavar="PATH", help="A safetensors, .npy/.npz or torch zip file in the snapshot.")
    ],
    stats: Annotated[
        bool, typer.Option("--stats", help="Also min/max/mean/std/NaN count per tensor (reads them).")
    ] = False,
    tag: TagOpt = None,
    host: HostOpt = None,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """List the tensors of a checkpoint file (name, dtype, shape, bytes, offset) without restoring it."""
    out = Output(json_mode=json_out, quiet=quiet)
    tags, hosts = parse_tags(tag), parse_hosts(host)
    with vault_args.open(out) as vault:
        contents = vault.show(vault.snapshot(snapshot, tags, hosts=hosts), path, stats=stats)
    columns = ["name", "dtype", "shape", "bytes", "offset"]
    if stats:
        columns += ["min", "max", "mean", "std", "nan", "inf"]
    table = out.table(*columns)
    for t in contents.tensors:
        row = [t.name, t.dtype, "?" if t.shape is None else "x".join(map(str, t.shape)) or "scalar"]
        row += [format_bytes(t.nbytes), str(t.offset)]
        if stats:
            s = t.stats
            row += [_num(s.min), _num(s.max), _num(s.mean), _num(s.std), str(s.nan), str(s.inf)] if s else ["-"] * 6
        table.add_row(*row)
    out.info(
        f"{contents.path}: {contents.format}, {counted(len(contents.tensors), 'tensor')}, "
        f"{format_bytes(contents.size)}; "
        f"read {counted(contents.fetched_chunks, 'chunk')} ({format_bytes(contents.fetched_bytes)})"
    )
    out.result(contents, table, asked=True)
