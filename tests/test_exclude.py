"""``--exclude``: files and folders left out of a backup, of ``status``'s comparison, of queued
backups (also when a later process ships them) and of each checkpoint ``watch`` ships."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import BackupSupersededError, UsageError
from ckptvault.ops.leftover_pins import JobRecord

from .conftest import write_file

ROOT = Path(__file__).parent.parent


FILES = {
    "model/weights.bin",
    "model/weights.bin.tmp",
    "optimizer.pt",
    "wandb/run-1/events.log",
    "logs/train.txt",
    "logs/keep.json",
    "deep/er/logs/train.txt",
    "tmp",
}


def checkpoint(root: Path) -> Path:
    for rel in FILES:
        write_file(root / rel, f"{rel}\n".encode() * 100)
    return root


def stored_files(vault: Vault, snap: object = "latest") -> set[str]:
    return {e.path for e in vault.files(snap) if e.type == "file"}


def test_names_match_at_any_depth_paths_from_the_root(tmp_path, vault: Vault, cli, repo_url):
    src = checkpoint(tmp_path / "ckpt")
    cli("backup", str(src), "-e", "*.tmp", "--exclude", "wandb", "-e", "logs/*.txt", "-e", "./tmp", "--repo", repo_url)
    assert stored_files(vault) == {"model/weights.bin", "optimizer.pt", "logs/keep.json", "deep/er/logs/train.txt"}
    assert "wandb" not in {e.path for e in vault.files("latest")}, "an excluded folder is not stored either"

    snap = vault.backup(src, exclude=["*/logs", "optimizer.*"])  # '*' matches '/' in a path pattern
    assert stored_files(vault, snap) == FILES - {"optimizer.pt", "deep/er/logs/train.txt"}
    vault.restore(snap, tmp_path / "out")
    assert not (tmp_path / "out" / "optimizer.pt").exists()
    assert (tmp_path / "out" / "model" / "weights.bin").read_bytes() == (src / "model" / "weights.bin").read_bytes()


def test_several_sources_and_a_file_source_are_matched_by_their_names(tmp_path, vault: Vault):
    a, b = checkpoint(tmp_path / "a"), checkpoint(tmp_path / "b")
    snap = vault.backup([a, b, a / "optimizer.pt"], exclude=["b", "model"])
    assert {p.split("/")[0] for p in stored_files(vault, snap)} == {"a", "optimizer.pt"}
    assert not any("/model/" in p for p in stored_files(vault, snap))


def test_bad_patterns_and_excluding_everything_are_one_line_errors_and_write_nothing(tmp_path, repo_url, vault, cli):
    src = checkpoint(tmp_path / "ckpt")
    for pattern, said in [
        ("", "--exclude pattern '' is empty (is a variable unset?)"),
        (".", "--exclude pattern '.' names no file"),
        ("*", "--exclude '*' leaves no file of"),
    ]:
        proc = cli("backup", str(src), "-e", pattern, "--repo", repo_url, check=False)
        assert proc.returncode == 2, proc.stderr
        err = proc.stderr.decode()
        assert said in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert vault.snapshots() == []
    with pytest.raises(UsageError, match="exclude must be a list of strings"):
        vault.backup(src, exclude="*.tmp")  # type: ignore[arg-type]


def test_an_excluded_file_changing_leaves_the_backup_unchanged(tmp_path, vault: Vault):
    src = checkpoint(tmp_path / "ckpt")
    first = vault.backup(src, tags={"run": "x"}, exclude=["*.tmp"])
    (src / "model" / "weights.bin.tmp").write_bytes(b"rewritten")
    again = vault.backup(src, tags={"run": "x"}, exclude=["*.tmp"], skip_if_unchanged=True)
    assert again.id == first.id and len(vault.snapshots()) == 1


def test_a_snapshot_records_its_patterns_and_status_names_what_they_left_out(tmp_path, repo_url, vault: Vault, cli):
    """Files a backup left out are not stored: status still says no (deleting the folder would lose
    them), and names the snapshot that holds the rest; given the same patterns, it says yes."""
    src = checkpoint(tmp_path / "ckpt")
    patterns = ["*.tmp", "wandb", "logs/*.txt"]
    snap = vault.backup(src, exclude=patterns)
    assert snap.excludes == patterns and vault.snapshot("latest").excludes == patterns
    listed = json.loads(cli("snapshots", "--json", "--repo", repo_url).stdout)
    assert listed[0]["excludes"] == patterns

    proc = cli("status", str(src), "--json", "--repo", repo_url, check=False)
    assert proc.returncode == 40
    detail = json.loads(proc.stdout)[0]["detail"]
    assert f"snapshot {snap.short_id} holds all but the 3 file(s) its --exclude patterns" in detail, detail
    assert "give status the same patterns" in detail
    assert not vault.is_backed_up(src)
    # a path pattern is matched from the snapshot's root, also for a folder inside it that is asked about
    assert "holds all but the 1 file(s)" in vault.backup_status(src / "logs").detail
    assert vault.backup_status(src / "deep" / "er" / "logs").backed_up  # not left out: stored
    assert vault.is_backed_up(src, exclude=patterns)
    assert not vault.is_backed_up(src, exclude=["*.tmp"])  # wandb is not in the snapshot
    assert cli("status", str(src), "-e", "*.tmp", "-e", "wandb", "-e", "logs/*.txt", "--repo", repo_url).returncode == 0


def test_status_without_recorded_patterns_compares_every_file(tmp_path, vault: Vault):
    src = checkpoint(tmp_path / "ckpt")
    vault.backup(src)
    assert vault.snapshot("latest").excludes == []
    assert vault.is_backed_up(src)
    vault.backup(src / "model", exclude=["*.tmp"])  # a newer snapshot that holds less
    assert vault.backup_status(src).backed_up and vault.backup_status(src / "model").backed_up


def test_a_backup_under_other_patterns_is_no_twin_of_the_last(tmp_path, vault: Vault):
    src = checkpoint(tmp_path / "ckpt")
    first = vault.backup(src, tags={"run": "x"}, exclude=["*.tmp"])
    again = vault.backup(src, tags={"run": "x"}, exclude=["*.tmp", "no-such-name"], skip_if_unchanged=True)
    assert again.id != first.id and again.excludes == ["*.tmp", "no-such-name"]
    assert stored_files(vault, first) == stored_files(vault, again)


def test_backup_async_leaves_them_out_also_when_a_later_process_ships_its_pins(tmp_path):
    repo = str(tmp_path / "repo")
    Vault.init(repo).close()
    first = checkpoint(tmp_path / "out" / "checkpoint-1")
    with Vault.open(repo) as vault:
        vault.backup_async(first, tags={"step": "0"}, exclude=["wandb", "*.tmp"]).result(timeout=120)
        assert stored_files(vault) == FILES - {"wandb/run-1/events.log", "model/weights.bin.tmp"}

    # a process that pinned checkpoint-1 with these patterns dies before its backup commits
    script = textwrap.dedent(
        """
        import sys, time
        from ckptvault import Vault
        from ckptvault.ops import async_backup

        def hold(*args):
            print("held", flush=True)
            time.sleep(600)

        async_backup.check_sources_unchanged = hold
        Vault.open(sys.argv[1]).backup_async(sys.argv[2], tags={"step": "1"}, exclude=["optimizer.pt", "logs"])
        time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, repo, str(first)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert proc.stdout.readline().strip() == "held"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    (pin,) = (tmp_path / "out" / ".ckptvault-pins").iterdir()
    record = next(JobRecord.from_doc(json.loads(p.read_text())["job"]) for p in pin.rglob("*.json"))
    assert record is not None and record.exclude == ["optimizer.pt", "logs"]

    second = checkpoint(tmp_path / "out" / "checkpoint-2")
    with Vault.open(repo) as vault:
        vault.backup_async(second, tags={"step": "2"}).result(timeout=120)
        vault.flush(timeout=120)
        shipped = vault.latest({"step": "1"})
        # (pins leave out *.tmp files: a trainer's files still being written)
        assert stored_files(vault, shipped) == {
            "model/weights.bin",
            "wandb/run-1/events.log",
            "tmp",
        }
        assert "optimizer.pt" in stored_files(vault, vault.latest({"step": "2"}))


def test_a_pin_record_of_a_version_before_exclude_still_ships():
    doc = {
        "job_id": "j",
        "vault_id": "v",
        "tags": {"step": "1"},
        "description": "",
        "hostname": None,
        "folders": ["/x/.ckptvault-pins"],
        "pinned": "d",
    }
    assert JobRecord.from_doc(doc).exclude == []
    assert JobRecord.from_doc({**doc, "exclude": [1]}) is None


def test_watch_leaves_them_out_of_each_checkpoint_and_skips_checkpoints_of_such_names(tmp_path, repo_url, vault, cli):
    ckpts = tmp_path / "ckpts"
    checkpoint(ckpts / "step_100")
    checkpoint(ckpts / "scratch_1")
    args = ("watch", str(ckpts), "--once", "--settle", "0.2", "--repo", repo_url)
    lines = cli(*args, "-e", "scratch_*", "-e", "*.tmp", "-e", "model/*.bin").stdout.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shipped step_100"), lines
    assert stored_files(vault) == FILES - {"model/weights.bin", "model/weights.bin.tmp"}
    assert {s.tags["checkpoint"] for s in vault.snapshots()} == {"step_100"}
    assert os.path.isdir(ckpts / "scratch_1")


def test_a_trailing_slash_matches_folders_and_a_leading_double_star_any_depth(tmp_path, vault: Vault):
    src = checkpoint(tmp_path / "ckpt")
    write_file(src / "model" / "logs", b"a file named logs")
    snap = vault.backup(src, exclude=["logs/"])
    assert stored_files(vault, snap) == FILES - {"logs/train.txt", "logs/keep.json", "deep/er/logs/train.txt"} | {
        "model/logs"
    }
    snap = vault.backup(src, exclude=["**/logs/*.txt", "**/wandb"])
    assert {"logs/train.txt", "deep/er/logs/train.txt"}.isdisjoint(stored_files(vault, snap))
    assert "wandb/run-1/events.log" not in stored_files(vault, snap)
    assert "logs/keep.json" in stored_files(vault, snap)


@pytest.mark.parametrize(
    ("pattern", "said"),
    [("/data/ckpt/wandb", "is absolute"), ("../x", "holds '..'"), ("a/../b", "holds '..'"), ("./", "names no file")],
)
def test_absolute_and_parent_patterns_are_refused(tmp_path, vault: Vault, pattern, said):
    with pytest.raises(UsageError, match=said):
        vault.backup(checkpoint(tmp_path / "ckpt"), exclude=[pattern])
    assert vault.snapshots() == []


def test_an_excluded_file_changing_before_an_async_backup_commits_does_not_supersede_it(tmp_path, monkeypatch):
    from ckptvault.ops import async_backup

    ckpt = checkpoint(tmp_path / "out" / "checkpoint-1")
    real_check = async_backup.check_sources_unchanged

    def log_grows_then_check(job):  # the trainer appends to its log while the save ships
        with open(ckpt / "logs" / "train.txt", "ab") as f:
            f.write(b"step 2 loss 0.1\n")
        real_check(job)

    monkeypatch.setattr(async_backup, "check_sources_unchanged", log_grows_then_check)
    with Vault.init(str(tmp_path / "repo")) as vault:
        snap = vault.backup_async(ckpt, tags={"step": "1"}, exclude=["*.txt"]).result(timeout=120)
        assert "optimizer.pt" in stored_files(vault, snap) and "logs/train.txt" not in stored_files(vault, snap)
        assert not (tmp_path / "out" / ".ckptvault-pins").exists()
        # without the pattern, the same change is a checkpoint rewritten in place: not stored
        handle = vault.backup_async(ckpt, tags={"step": "1b"})
        with pytest.raises(BackupSupersededError):
            handle.result(timeout=120)


@pytest.mark.parametrize(
    ("growing", "exclude"),
    [("logs/train.txt", "logs/*.txt"), ("wandb/out.tmp", "wandb")],  # a log; a file being written in a folder
)
def test_an_excluded_file_that_keeps_changing_does_not_keep_a_checkpoint_from_settling(
    tmp_path, vault: Vault, growing, exclude
):
    ckpts = tmp_path / "ckpts"
    ckpt = checkpoint(ckpts / "step_100")
    stop = threading.Event()

    def keep_writing() -> None:
        while not stop.wait(0.05):
            with open(ckpt / growing, "ab") as f:
                f.write(b"loss 0.1\n")

    writer = threading.Thread(target=keep_writing)
    writer.start()
    try:
        result = vault.watch(ckpts, once=True, settle=0.5, interval=0.05, exclude=[exclude])
    finally:
        stop.set()
        writer.join()
    assert [s.name for s in result.shipped] == ["step_100"]
    assert growing not in stored_files(vault)


def test_watch_ships_again_under_other_patterns(tmp_path, repo_url, vault: Vault, cli):
    ckpts = tmp_path / "ckpts"
    checkpoint(ckpts / "step_100")
    args = ("watch", str(ckpts), "--once", "--settle", "0.2", "--repo", repo_url)
    assert len(cli(*args, "-e", "optimizer.pt").stdout.decode().splitlines()) == 1
    assert len(cli(*args, "-e", "optimizer.pt").stdout.decode().splitlines()) == 0, "shipped already"
    assert len(cli(*args).stdout.decode().splitlines()) == 1, "without the pattern it is another checkpoint"
    assert "optimizer.pt" in stored_files(vault)
    # (watch never ships *.tmp files: names of files still being written)
    assert cli("status", str(ckpts / "step_100"), "-e", "*.tmp", "--repo", repo_url).returncode == 0


def test_an_excluded_file_among_several_sources_changing_does_not_supersede_the_save(tmp_path, monkeypatch):
    from ckptvault.ops import async_backup

    run = tmp_path / "run"
    files = [write_file(run / name, name.encode() * 1000) for name in ("model.pt", "optim.pt", "train.log")]
    real_check = async_backup.check_sources_unchanged

    def log_grows_then_check(job):
        with open(run / "train.log", "ab") as f:
            f.write(b"step 2\n")
        real_check(job)

    monkeypatch.setattr(async_backup, "check_sources_unchanged", log_grows_then_check)
    with Vault.init(str(tmp_path / "repo")) as vault:
        snap = vault.backup_async(files, tags={"step": "1"}, exclude=["*.log"]).result(timeout=120)
        assert stored_files(vault, snap) == {"model.pt", "optim.pt"}
        with pytest.raises(UsageError, match=r"exclude '\*.pt', '\*.log' leaves no file of"):
            vault.backup_async(run, exclude=["*.pt", "*.log"])
    assert not (tmp_path / ".ckptvault-pins").exists()


def test_watch_adopting_a_pin_made_under_other_patterns_ships_it_once(tmp_path, vault: Vault):
    from ckptvault.ops import pin as pins

    ckpts = tmp_path / "ckpts"
    checkpoint(ckpts / "step_1")
    pins.create(str(ckpts / "step_1"), str(ckpts / ".ckptvault-watch" / "pins"))  # a run without patterns, killed
    first = vault.watch(ckpts, once=True, settle=0.2, exclude=["logs"])
    again = vault.watch(ckpts, once=True, settle=0.2, exclude=["logs"])
    assert [s.name for s in first.shipped] == ["step_1"] and again.shipped == []
    assert not any(p.startswith("logs/") for p in stored_files(vault))


def test_a_backup_in_place_of_files_all_still_being_written_says_so_not_blaming_the_patterns(tmp_path: Path):
    """The watch's in-place backups leave out names still being written (Excludes.unfinished), which no
    --exclude spelled: "--exclude  leaves no file" named an empty list of patterns the user never gave."""
    from ckptvault.errors import SourceError
    from ckptvault.ops.scan import Excludes, scan_sources

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "SHARD.TMP").write_bytes(b"half")
    with pytest.raises(SourceError, match="its files are all still being written") as info:
        scan_sources([str(tmp_path / "ckpt")], skip_unreadable=False, exclude=Excludes(unfinished=True))
    assert "--exclude" not in str(info.value)


@pytest.mark.parametrize(
    "pattern, said",
    [
        # only blamed a trainer that died while saving ("if the trainer died while saving it, it never will")
        (
            "*.bin",
            "step_1 holds only files the exclude patterns leave out: it never ships under them; "
            "change exclude to ship it",
        ),
        # left out every checkpoint by its name without a word (once for all of them)
        (
            "*",
            "step_1 is never shipped: an exclude pattern matches its name, and a pattern without '/' leaves out "
            "whole checkpoints too; change exclude if it should ship (said once)",
        ),
    ],
)
def test_watch_says_why_its_exclude_patterns_ship_no_checkpoint(tmp_path, vault: Vault, pattern: str, said: str):
    """wt47 F8: the patterns, not the trainer, are named."""
    ckpts = tmp_path / "ckpts"
    for step in (1, 2):
        (ckpts / f"step_{step}").mkdir(parents=True)
        (ckpts / f"step_{step}" / "w.bin").write_bytes(b"weights")
    warnings: list[str] = []
    vault.on_warning = warnings.append
    result = vault.watch(ckpts, once=True, settle=0.2, interval=0.05, exclude=[pattern])
    assert not result.shipped
    assert said in warnings and len(warnings) == (1 if pattern == "*" else 2), warnings  # (a warning a checkpoint)
