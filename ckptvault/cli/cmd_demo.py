from __future__ import annotations

import filecmp
import os
import tempfile

from ..errors import IntegrityError
from ..ops.sample import write_sample_checkpoint
from .app import NO_VAULT_ARGS, JsonOpt, QuietOpt, VaultArgs, app, command, vault_options
from .output import Output, counted, format_bytes


@app.command("demo")
@command
@vault_options
def demo_cmd(
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Back up two saves of a generated sample checkpoint, restore the latest, and verify it."""
    out = Output(json_mode=json_out, quiet=quiet)
    snapshots = []
    with (
        tempfile.TemporaryDirectory(prefix="ckptvault-demo-") as work,
        vault_args.open(out, writing=True) as vault,
    ):
        yours = [s for s in vault.snapshots() if s.tags.get("run") != "demo"]  # a vault in use: say so, even with -q
        for step in (100, 200):
            src = os.path.join(work, f"checkpoint-{step}")
            write_sample_checkpoint(src, step)
            snap = vault.backup(src, tags={"run": "demo", "step": str(step)}, description="ckptvault demo")
            snapshots.append(snap)
            s = snap.summary
            out.info(
                f"backup of {os.path.basename(src)}: snapshot {snap.short_id}, {counted(s.files, 'file')}, "
                f"{format_bytes(s.logical_bytes)}, {format_bytes(s.new_bytes)} new, "
                f"{format_bytes(s.stored_bytes)} stored"
            )
        latest = vault.latest(tags={"run": "demo"})
        target = os.path.join(work, "restored")
        result = vault.restore(latest, target)
        names = sorted(os.listdir(src))
        _match, mismatch, errors = filecmp.cmpfiles(src, target, names, shallow=False)
        if mismatch or errors:
            raise IntegrityError(f"demo restore differs from the source: {mismatch + errors}")
        out.info(
            f"restored latest --tag run=demo (snapshot {latest.short_id}, step {latest.step}): "
            f"{counted(result.files, 'file')}, {format_bytes(result.bytes_written)}, byte-identical to the source"
        )
        demos = vault.snapshots(tags={"run": "demo"})  # an earlier demo's too
        forget = f"ckptvault forget {' '.join(s.short_id for s in demos)} --prune"
        if yours:
            saves = "two saves" if len(demos) == 2 else f"{len(demos)} saves"
            out.warn(
                f"the demo's {saves} (run=demo) are now newer than the {counted(len(yours), 'other snapshot')} in "
                f"{vault.url}: a `restore latest` without --tag would take the demo's; remove them with: {forget}"
            )
        else:
            out.info(
                f"demo done; the vault is at {vault.url} (see: ckptvault snapshots --tag run=demo; a `restore latest` "
                f"without --tag would take the demo's save: remove it with: {forget})"
            )
        out.result({"vault": vault.url, "snapshots": snapshots, "restored": result, "verified": True})
