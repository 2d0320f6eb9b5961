"""``ckptvault status PATH...``: is this local checkpoint durably stored, so that deleting it is safe?"""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import NotBackedUpError
from ..ops.scan import check_sources
from ..vault import exclude_arg
from .app import NO_VAULT_ARGS, ExcludeOpt, JsonOpt, QuietOpt, VaultArgs, app, command, vault_options
from .output import Output, counted, format_bytes


@app.command("status")
@command
@vault_options
def status_cmd(
    paths: Annotated[list[str], typer.Argument(metavar="PATH...", help="Local checkpoint files or folders.")],
    exclude: ExcludeOpt = None,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Say whether each path is durably backed up (same files, same content). Exit 0 when all are, 40 when not.

    Every file counts: give the --exclude patterns the backups were made with to leave those files out."""
    out = Output(json_mode=json_out, quiet=quiet)
    check_sources(paths)
    exclude_arg(exclude)
    with vault_args.open(out) as vault:
        results = [vault.backup_status(p, exclude=exclude or ()) for p in paths]
    lines = []
    for given, r in zip(paths, results, strict=True):
        state = "backed up" if r.backed_up else "NOT backed up"
        lines.append(f"{given}: {state}: {counted(r.files, 'file')}, {format_bytes(r.bytes)}; {r.detail}")
    out.result(
        [
            {
                "path": r.path,
                "backed_up": r.backed_up,
                "snapshot": r.snapshot.id if r.snapshot else None,
                "prefix": r.prefix,
                "files": r.files,
                "bytes": r.bytes,
                "detail": r.detail,
            }
            for r in results
        ],
        "\n".join(lines),
    )
    missing = [given for given, r in zip(paths, results, strict=True) if not r.backed_up]
    if missing:
        named = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise NotBackedUpError(f"{len(missing)} of {len(paths)} path(s) are not backed up; keep them: {named}")
