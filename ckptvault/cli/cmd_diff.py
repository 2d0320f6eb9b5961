"""diff: what changed between two snapshots, per file and (with --tensors) per tensor."""

from __future__ import annotations

from typing import Annotated

import typer

from .app import NO_VAULT_ARGS, HostOpt, JsonOpt, QuietOpt, TagOpt, VaultArgs, app, command, vault_options
from .output import Output, counted, format_bytes, one_line
from .params import parse_hosts, parse_tags


@app.command("diff")
@command
@vault_options
def diff_cmd(
    a: Annotated[
        str,
        typer.Argument(
            metavar="SNAPSHOT_A", help="The older snapshot (ID, unique prefix of 4 or more characters, or 'latest')."
        ),
    ],
    b: Annotated[str, typer.Argument(metavar="SNAPSHOT_B", help="The newer snapshot.")],
    tensors: Annotated[
        bool, typer.Option("--tensors", help="Per changed tensor file: tensors added, removed and changed.")
    ] = False,
    tag: TagOpt = None,
    host: HostOpt = None,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Files, folders and links added, removed and changed from A to B, and the bytes B added; no file is restored.
    With --tag or --host, both must carry those tags and be of one of those hosts ('latest': the latest that is)."""
    out = Output(json_mode=json_out, quiet=quiet)
    tags, hosts = parse_tags(tag), parse_hosts(host)
    with vault_args.open(out) as vault:
        result = vault.diff(vault.snapshot(a, tags, hosts=hosts), vault.snapshot(b, tags, hosts=hosts), tensors=tensors)
    # "status  size  path  (new) (details)": the size before the path, right-aligned, so that both line up
    # B's size where the entry is in B (none for a file that became a folder or a link: A's size belonged to
    # what is gone), A's for one removed
    sizes = {f.path: _shown_size(f.size_b if f.type_b is not None else f.size_a) for f in result.files}
    width = max(map(len, sizes.values()), default=0)
    column = (lambda size: f"{size:>{width}}  ") if width else (lambda size: "")
    indent = " " * (9 + len(column(""))) + "  "
    lines = []
    for f in result.files:
        kind = f.type_b or f.type_a
        target = f.target_b if f.target_b is not None else f.target_a
        said = any(d.startswith("target ") for d in f.details)  # "(target a -> b)" names both already
        shown = f"{f.path} -> {target}" if kind == "symlink" and target is not None and not said else f.path
        shown += "/" if kind == "dir" else ""
        new = f"  ({format_bytes(f.new_bytes)} new)" if f.new_bytes else ""
        what = [d for d in f.details if d != "content"]
        details = f"  ({'; '.join(what)})" if what else ""
        lines.append(one_line(f"{f.status:8} {column(sizes[f.path])}{shown}{new}{details}"))
        if f.tensors is not None:
            t = f.tensors
            lines += [f"{indent}+ {name}" for name in t.added]
            lines += [f"{indent}- {name}" for name in t.removed]
            lines += [f"{indent}~ {name}" for name in t.changed]
            lines.append(
                f"{indent}tensors: {len(t.changed)} changed, {len(t.added)} added, {len(t.removed)} removed, "
                f"{t.unchanged} unchanged"
            )
    count = {s: sum(f.status == s for f in result.files) for s in ("changed", "added", "removed", "metadata")}
    metadata = f", {count['metadata']} with new mode or mtime" if count["metadata"] else ""
    lines.append(
        f"{count['changed']} changed, {count['added']} added, {count['removed']} removed{metadata}, "
        f"{counted(result.unchanged_files, 'file')} unchanged; {format_bytes(result.new_bytes)} new in {result.b[:8]}"
    )
    out.result(result, "\n".join(lines), asked=True)


def _shown_size(size: int | None) -> str:
    return format_bytes(size) if size is not None else ""
