"""Commands SIGKILLed at chosen filesystem changes (tests/support/killcli.py), then run again: the rerun
finishes, `check --read-data` is clean, every snapshot that should be there restores bit-exact, no lock
is left, and a restore's target holds each file whole, old or new.

A sample of the kill points of a sweep that killed each command at every change in turn (cr57: copy into an
empty and a non-empty vault, tag, forget, forget --prune, repair-index, key passwd, init, prune with
repacking, restore --overwrite; plain and encrypted); each case here is one such point, picked by the kind
of change rather than its number, so that it stays put when a command's writes move."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.chunking import ChunkerParams
from ckptvault.store.base import TEMP_PREFIX

from .test_repair_index import damage_header

ROOT = Path(__file__).parent.parent
SMALL = ChunkerParams(min_size=16 * 1024, avg_size=64 * 1024, max_size=256 * 1024)


def checkpoint(step: int) -> dict[str, bytes]:
    return {
        "frozen.bin": random.Random("frozen").randbytes(300_000),
        "opt/optimizer.bin": random.Random(f"opt{step}").randbytes(300_000),
        "state.json": f'{{"step": {step}}}'.encode(),
    }


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    shutil.rmtree(root, ignore_errors=True)
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """``v``: steps 1-3 of run x; ``dst``: an empty vault; ``target``: step 1 restored."""
    work = tmp_path_factory.mktemp("sweep-base")
    with Vault.init(str(work / "v"), chunker=SMALL, pack_size=1 << 20) as vault:
        for step in (1, 2, 3):
            write_tree(work / "src", checkpoint(step))
            vault.backup(work / "src", tags={"run": "x", "step": str(step)})
        vault.restore(vault.latest({"step": "1"}), work / "target")
    Vault.init(str(work / "dst")).close()
    return work


def run(work: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    module = "tests.support.killcli" if env else "ckptvault"
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env={**os.environ, "XDG_DATA_HOME": str(work / "xdg"), **env},
        capture_output=True,
        timeout=120,
    )


def snapshot_ids(v: str) -> dict[str, str]:
    with Vault.open(v) as vault:
        return {s.tags["step"]: s.id for s in vault.snapshots()}


def assert_whole(work: Path, name: str, steps: list[int]) -> None:
    """The vault checks clean, holds exactly ``steps``, each restoring bit-exact, and no lock."""
    with Vault.open(str(work / name)) as vault:
        report = vault.check(read_data=1.0)
        assert report.ok and not report.warnings, (report.problems, report.warnings)
        snaps = vault.snapshots()
        assert sorted(int(s.tags["step"]) for s in snaps) == steps
        for snap in snaps:
            out = work / f"out-{snap.id[:8]}"
            vault.restore(snap, out)
            assert tree(out) == checkpoint(int(snap.tags["step"]))
    assert not [p for p in (work / name / "locks").glob("*") if not p.name.startswith(TEMP_PREFIX)]


CASES = {
    # command (IDs spelled {s1}, {s2}, {s3}), the change it is killed at ({v}: the vault written), how many
    # of those it made first, and the steps in the vault written after the rerun
    "copy-after-its-first-snapshot": ("copy --from-repo {v} --repo {dst}", "replace {dst}/snapshots/", 2, [1, 2, 3]),
    "copy-after-its-pack": ("copy --from-repo {v} --repo {dst}", "replace {dst}/packs/", 1, [1, 2, 3]),
    "forget-between-its-snapshots": ("forget {s1} {s3} --repo {v}", "remove {v}/snapshots/", 2, [2]),
    "forget-prune-at-index-removal": ("forget {s1} {s2} --prune --repo {v}", "remove {v}/index/", 1, [3]),
    "forget-prune-at-pack-removal": ("forget {s1} {s2} --prune --repo {v}", "remove {v}/packs/", 2, [3]),
    "prune-repacking-at-pack-removal": (
        "prune --keep-latest 1 --repack-threshold 0.9 --repo {v}",
        "remove {v}/packs/",
        1,
        [3],
    ),
    "tag-before-the-old-ones-removal": ("tag {s2} --add keep=best --repo {v}", "remove {v}/snapshots/", 1, [1, 2, 3]),
    # killed once the old snapshot was gone (at its tree's removal): the rerun found no snapshot {s2}, exit 18
    "tag-at-the-old-trees-removal": ("tag {s2} --add keep=best --repo {v}", "remove {v}/trees/", 1, [1, 2, 3]),
    "restore-overwrite-mid-file": ("restore {s3} {target} --overwrite --repo {v}", "open {target}/", 2, [1, 2, 3]),
    "restore-into-a-fresh-folder-mid-file": ("restore {s3} {fresh} --repo {v}", "open {fresh}/", 2, [1, 2, 3]),
    "restore-overwrite-between-files": (
        "restore {s3} {target} --overwrite --repo {v}",
        "replace {target}/",
        1,
        [1, 2, 3],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_command_killed_at_a_change_is_finished_by_running_it_again(base: Path, tmp_path: Path, case: str):
    work = tmp_path / "w"
    shutil.copytree(base, work, symlinks=True)
    command, at, nth, steps = CASES[case]
    ids = {f"s{k}": v for k, v in snapshot_ids(str(work / "v")).items()}
    names = {"v": str(work / "v"), "dst": str(work / "dst"), "target": str(work / "target"), **ids}
    names["fresh"] = str(work / "fresh")
    args = [a.format(**names) for a in command.split()]
    killed = run(work, args, KILLCLI_MATCH=at.format(**names), KILLCLI_AT=str(nth))
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    if "{target}" in command:  # each file whole: the old save's or the new one's
        old, new = checkpoint(1), checkpoint(3)
        for name, data in tree(work / "target").items():
            if ".ckptvault-tmp-" not in name:
                assert data in (old[name], new[name]), name
    again = run(work, args)
    assert again.returncode == 0, again.stderr.decode()
    assert_whole(work, "dst" if "{dst}" in command else "v", steps)
    if "{target}" in command:
        assert tree(work / "target") == checkpoint(3)  # no temporary name left either
    if "{fresh}" in command:
        assert tree(work / "fresh") == checkpoint(3)


@pytest.mark.parametrize(
    "at",
    [
        "remove {v}/packs/",  # the damaged pack's removal (it came after the old index objects': cr57)
        "remove {v}/index/",  # the first old index object's: the damaged pack is gone, the index still names it
    ],
)
def test_repair_index_killed_while_it_rewrites_a_pack_whose_header_is_damaged(base: Path, tmp_path: Path, at: str):
    """Killed after the old index objects were removed and before the pack: the pack lay in no index with
    nothing to name its chunks, and the rerun and check both warned that its chunks "cannot be located"
    though every one of them was in the new pack."""
    work = tmp_path / "w"
    shutil.copytree(base, work, symlinks=True)
    v = work / "v"
    damaged = min(p for p in (v / "packs").rglob("*") if p.is_file())
    damage_header(damaged)
    args = ["repair-index", "--read-data", "--repo", str(v)]
    killed = run(work, args, KILLCLI_MATCH=at.format(v=v), KILLCLI_AT="1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    with Vault.open(str(v)) as vault:  # before the rerun: never in no index; gone, a pack whose chunks are elsewhere
        report = vault.check()
    assert not [w for w in report.warnings if "in no index" in w], report.warnings
    assert [p.object for p in report.problems] == ([f"pack {damaged.name[:12]}"] if "packs" in at else [])
    again = run(work, args)
    assert again.returncode == 0 and b"warning" not in again.stderr, again.stderr.decode()
    assert_whole(work, "v", [1, 2, 3])
    assert not damaged.exists()
    assert run(work, ["prune", "--keep-latest", "3", "--repo", str(v)]).returncode == 0
    with Vault.open(str(v)) as vault:
        assert vault.stats().unindexed_packs == 0 and vault.check(read_data=1.0).warnings == []
