from __future__ import annotations

import filecmp
import os
import tempfile

from ..errors import IntegrityError, StorageFullError
from ..ops.sample import ROOM_HINT, write_sample_checkpoint
from ..snapshot.model import Snapshot
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
        yours = [s for s in vault.snapshots() if not _of_a_demo(s)]  # a vault in use: say so, even with -q
        for step in (100, 200):
            src = os.path.join(work, f"checkpoint-{step}")
            write_sample_checkpoint(src, step)
            snap = vault.backup(src, tags={"run": "demo", "step": str(step)}, description=DEMO_DESCRIPTION)
            snapshots.append(snap)
            s = snap.summary
            out.info(
                f"backup of {os.path.basename(src)}: snapshot {snap.short_id}, {counted(s.files, 'file')}, "
                f"{format_bytes(s.logical_bytes)}, {format_bytes(s.new_bytes)} new, "
                f"{format_bytes(s.stored_bytes)} stored"
            )
        latest = vault.latest(tags={"run": "demo"})
        shown = "latest --tag run=demo"
        if latest.id != snapshots[-1].id:  # a run of the user's own named demo, at a higher step
            latest, shown = snapshots[-1], "the demo's second save"
        target = os.path.join(work, "restored")
        try:
            result = vault.restore(latest, target)
        except StorageFullError as exc:  # "a rerun finishes it" would be wrong: the folder goes with the demo
            raise StorageFullError(exc.op, exc.key, exc.url, exc.reason, hint=ROOM_HINT) from None
        names = sorted(os.listdir(src))
        _match, mismatch, errors = filecmp.cmpfiles(src, target, names, shallow=False)
        if mismatch or errors:
            raise IntegrityError(f"demo restore differs from the source: {mismatch + errors}")
        out.info(
            f"restored {shown} (snapshot {latest.short_id}, step {latest.step}): "
            f"{counted(result.files, 'file')}, {format_bytes(result.bytes_written)}, byte-identical to the source"
        )
        demos = [s for s in vault.snapshots() if _of_a_demo(s)]  # an earlier demo's too
        forget = f"ckptvault forget {' '.join(s.short_id for s in demos)} --prune"
        them = "them" if len(demos) == 2 else f"all {len(demos)} demo saves"
        if yours:
            out.warn(
                f"the demo's two saves (run=demo) are now newer than the {counted(len(yours), 'other snapshot')} in "
                f"{vault.url}: a `restore latest` without --tag would take the demo's; remove {them} with: {forget}"
            )
        else:
            out.info(
                f"demo done; the vault is at {vault.url} (see: ckptvault snapshots --tag run=demo; a `restore latest` "
                f"without --tag would take the demo's save: remove {them} with: {forget})"
            )
        out.result({"vault": vault.url, "snapshots": snapshots, "restored": result, "verified": True})


DEMO_DESCRIPTION = "ckptvault demo"


def _of_a_demo(snapshot: Snapshot) -> bool:
    """Made by a demo: its tag and description (a run the user named demo is theirs, not the demo's)."""
    return snapshot.tags.get("run") == "demo" and snapshot.description == DEMO_DESCRIPTION
