"""``ckptvault drill``: restore a snapshot into a temporary folder, verify it, time the recovery."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import DrillFailedError, IntegrityError
from .app import (
    NO_VAULT_ARGS,
    HostOpt,
    JsonOpt,
    QuietOpt,
    TagOpt,
    VaultArgs,
    app,
    command,
    require_nonempty,
    vault_options,
)
from .output import Output, counted, format_bytes, format_rate, one_line, with_vault_named
from .params import parse_hosts, parse_tags


@app.command("drill")
@command
@vault_options
def drill_cmd(
    snapshot: Annotated[
        str,
        typer.Argument(metavar="SNAPSHOT", help="Snapshot ID (a unique prefix of 4 characters or more) or 'latest'."),
    ] = "latest",
    tag: TagOpt = None,
    host: HostOpt = None,
    load: Annotated[
        bool,
        typer.Option(
            "--load",
            help="Also load each .safetensors/.pt/.pth/.ckpt file and zip .bin (safetensors, torch), parse each"
            " .json, and check shard indexes and torch.distributed.checkpoint folders.",
        ),
    ] = False,
    tmp_dir: Annotated[
        str | None,
        typer.Option("--tmp-dir", metavar="DIR", help="Where to make the temporary folder (default: the system's)."),
    ] = None,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Restore drill: fetch into a temporary folder, verify every file, optionally load, print each phase's time."""
    out = Output(json_mode=json_out, quiet=quiet)
    tags, hosts = parse_tags(tag), parse_hosts(host)
    if tmp_dir is not None:
        require_nonempty("--tmp-dir", tmp_dir, "a folder", default="the system's temporary folder")
    with (
        vault_args.open(out) as vault,
        out.progress("drill: fetching") as progress,
    ):
        try:
            report = vault.drill(snapshot, tags=tags, hosts=hosts, load=load, workdir=tmp_dir, on_progress=progress)
        except IntegrityError as exc:  # damaged bytes: CI reading --json gets a verdict too (exit 30)
            out.result({"ok": False, "error": with_vault_named(str(exc))})  # as the error line says it
            raise
    step = f" (step {report.step})" if report.step is not None else ""
    rate = format_rate(report.bytes, report.fetch_s)
    size = f"{counted(report.files, 'file')}, {format_bytes(report.bytes)}"
    lines = [f"drill of snapshot {report.snapshot_id[:8]}{step}: {size}"]
    if report.swept:
        lines.append(
            f"  removed {len(report.swept)} folder(s) left by killed drills ({format_bytes(report.swept_bytes)}): "
            + ", ".join(one_line(path) for path in report.swept)
        )
    lines += [
        f"  fetch   {report.fetch_s:8.2f} s  restored, every chunk and file hash verified ({rate})",
        f"  verify  {report.verify_s:8.2f} s  every file re-read and checked against the snapshot",
    ]
    if report.load_s is not None:
        loaded = sum(c.ok for c in report.loads)
        if report.loads:
            lines.append(f"  load    {report.load_s:8.2f} s  {loaded} of {len(report.loads)} file(s) passed")
        else:
            lines.append(f"  load    {report.load_s:8.2f} s  no file of a kind it loads: only the bytes were verified")
    for check in report.loads:
        lines.append(f"    {'ok  ' if check.ok else 'FAIL'} {check.path}: {check.loader}, {check.detail}")
    for skipped in report.skipped:
        lines.append(f"    skip {skipped}")
    verdict = "recovery OK" if report.ok else "recovery FAILED"
    not_loaded = len(report.skipped) + sum(check.partial for check in report.loads)
    if report.ok and not_loaded:  # "OK" must not read as "every file loaded"
        lacking = report.lacking_a_library
        why = f", {'' if lacking == not_loaded else f'{lacking} '}for want of a library" if lacking else ""
        verdict += f" ({not_loaded} file(s) not loaded{why}: see above)"
    lines.append(f"  total   {report.total_s:8.2f} s  {verdict}")
    out.result({"ok": report.ok, "lacking_a_library": report.lacking_a_library, **report.__dict__}, "\n".join(lines))
    if not report.ok:
        failed = [c for c in report.loads if not c.ok]
        raise DrillFailedError(f"drill: {failed[0].path} restored intact but does not load: {failed[0].detail}")
