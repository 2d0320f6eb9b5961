"""Changing a snapshot's tags: a new snapshot object and tree, then the old pair goes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.crypto.keyfile import Keyfile
from ckptvault.errors import IntegrityError, LockLostError, SnapshotNotFoundError, UsageError
from ckptvault.repository import Repository, locks

from .conftest import tree_digest


def two_saves(vault: Vault, tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(os.urandom(300_000))
    vault.backup(src, tags={"run": "x", "step": "1"})
    (src / "model.bin").write_bytes(os.urandom(300_000))
    vault.backup(src, tags={"run": "x", "step": "2"})
    return src


def test_tags_are_added_and_removed_and_the_snapshot_keeps_everything_else(vault: Vault, tmp_path: Path):
    src = two_saves(vault, tmp_path)
    first, second = vault.snapshots()
    tagged = vault.tag(first, add={"keep": "best", "step": "1"}, remove=["run", "absent"])
    assert tagged.id != first.id and tagged.tree_id != first.tree_id
    assert tagged.tags == {"step": "1", "keep": "best"}
    assert (tagged.time, tagged.paths, tagged.summary, tagged.hostname) == (
        first.time,
        first.paths,
        first.summary,
        first.hostname,
    )
    assert {s.id for s in vault.snapshots()} == {tagged.id, second.id}  # the old object is gone
    assert vault.tag(tagged, add={"keep": "best"}) == tagged  # nothing to change: the same snapshot
    with pytest.raises(SnapshotNotFoundError):
        vault.tag(first, add={"a": "b"})  # as it was: retagged since
    # the tag protects it from a prune that would otherwise take it, and it restores
    result = vault.prune(keep_latest=1, keep_tags=["keep"])
    assert {s.id for s in vault.snapshots()} == {tagged.id, second.id}
    assert not result.retention.forget
    assert vault.check(read_data=1.0).ok
    (src / "model.bin").write_bytes(b"")
    vault.restore(tagged, tmp_path / "out")
    assert (tmp_path / "out" / "model.bin").stat().st_size == 300_000
    assert vault.latest({"run": "x"}).id == second.id


def test_latest_among_tags_and_bad_input(vault: Vault, tmp_path: Path):
    two_saves(vault, tmp_path)
    tagged = vault.tag("latest", tags={"run": "x"}, add={"keep": "yes"})
    assert tagged.tags == {"run": "x", "step": "2", "keep": "yes"}
    with pytest.raises(UsageError, match="'keep' is both added and removed"):
        vault.tag("latest", add={"keep": "no"}, remove=["keep"])
    with pytest.raises(UsageError, match="nothing to change"):
        vault.tag("latest")
    with pytest.raises(UsageError, match="remove must be a list of strings"):
        vault.tag("latest", remove="keep")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="tag key '' is invalid"):
        vault.tag("latest", add={"": "x"})
    with pytest.raises(UsageError, match=r"remove takes tag keys; 'keep=yes' is not one .*: to take the tag away give"):
        vault.tag("latest", remove=["keep=yes"])
    with pytest.raises(SnapshotNotFoundError, match="no snapshot matches latest"):
        vault.tag("latest", tags={"run": "nope"}, add={"a": "b"})
    assert len(vault.snapshots()) == 2


def test_interrupted_between_the_new_and_the_old_snapshot_leaves_both_whole(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    src = two_saves(vault, tmp_path)
    first = vault.snapshots()[0]

    def killed(self: Repository, snapshot_id: bytes, tree_id: bytes | None) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Repository, "delete_snapshot", killed)
    with pytest.raises(KeyboardInterrupt):
        vault.tag(first, add={"keep": "best"})
    monkeypatch.undo()
    twins = [s for s in vault.snapshots() if s.time == first.time]
    assert len(twins) == 2 and first in twins
    assert len({s.tree_id for s in twins}) == 2  # each has a tree of its own
    vault.forget([first.id])  # forgetting one (and its tree) leaves the other whole
    assert vault.check(read_data=1.0).ok
    vault.restore(next(s for s in twins if s.id != first.id), tmp_path / "out")
    assert (tmp_path / "out" / "model.bin").stat().st_size == (src / "model.bin").stat().st_size


def test_a_lost_lock_writes_no_snapshot_and_keeps_the_old_one(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    two_saves(vault, tmp_path)
    before = vault.snapshots()

    def lost(self: locks.HeldLock) -> None:
        raise LockLostError("the lock was lost")

    monkeypatch.setattr(locks.HeldLock, "verify", lost)
    with pytest.raises(LockLostError):
        vault.tag(before[0], add={"keep": "best"})
    monkeypatch.undo()
    assert vault.snapshots() == before
    assert vault.check().ok


def test_an_encrypted_vault_retags_and_restores(tmp_path: Path):
    keyfile, _ = Keyfile.create("pass phrase", scrypt_n=2**10)
    keyfile.save(tmp_path / "team.key")
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(os.urandom(200_000))
    with Vault.init(str(tmp_path / "vault"), keyfile=tmp_path / "team.key", passphrase="pass phrase") as vault:
        snap = vault.backup(src, tags={"run": "x"})
        tagged = vault.tag(snap, add={"keep": "best"})
        vault.restore(tagged, tmp_path / "out")
        assert vault.check(read_data=1.0).ok
    assert tree_digest(tmp_path / "out") == tree_digest(src)


def test_cli_tag(cli, tmp_path: Path):
    repo = str(tmp_path / "repo")
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(os.urandom(100_000))
    cli("init", repo)
    cli("backup", str(src), "-r", repo, "-t", "run=x", "-t", "step=1", "-q")
    done = cli("tag", "latest", "-r", repo, "-t", "run=x", "--add", "keep=best", "--add", "note=a,b")
    assert (
        done.stdout.decode().startswith("snapshot ")
        and 'tags: run=x,step=1,keep=best,note="a,b"' in done.stdout.decode()
    )
    again = cli("tag", "latest", "-r", repo, "--add", "keep=best")
    assert "already has these tags" in again.stdout.decode()
    absent = cli("tag", "latest", "-r", repo, "--remove", "nokey")  # cli49 #13: not "already has these tags"
    assert absent.stdout.decode().startswith("snapshot ") and absent.stdout.decode().endswith(
        ' has no tag nokey (its tags: run=x,step=1,keep=best,note="a,b"); nothing changed\n'
    )
    two = cli("tag", "latest", "-r", repo, "--remove", "nokey", "--remove", "other").stdout.decode()
    assert " has no tags nokey, other (its tags: " in two, two
    for args, message in [
        (["--add", "k=v", "--remove", "k"], "error: tag key 'k' is both added and removed; give it to one of --add"),
        ([], "error: nothing to change: give tags to --add or keys to --remove"),
        (["--add", "=v"], "error: --add: '=v' is not key=value"),
        (["--add", "keep="], "error: --add keep= has an empty value (is a variable unset?)"),
        # a key holds no "=" and is never empty: these removed nothing and said "already has these tags" (ux43)
        (
            ["--remove", "keep=best"],
            "error: --remove takes tag keys; 'keep=best' is not one (a key holds no '='): "
            "to take the tag away give --remove keep",
        ),
        (["--remove", ""], "error: --remove takes tag keys; '' is empty (is a variable unset?)"),
    ]:
        bad = cli("tag", "latest", "-r", repo, *args, check=False)
        assert bad.returncode == 2 and bad.stderr.decode().startswith(message), bad.stderr
        assert "Traceback" not in bad.stderr.decode()
    listed = json.loads(cli("snapshots", "-r", repo, "--json").stdout)
    assert [s["tags"]["keep"] for s in listed] == ["best"]
    removed = json.loads(cli("tag", listed[0]["id"][:8], "-r", repo, "--remove", "keep", "--json").stdout)
    assert removed["previous_id"] == listed[0]["id"] and "keep" not in removed["snapshot"]["tags"]
    assert removed["snapshot"]["id"] != listed[0]["id"]


def test_a_snapshot_forgotten_while_it_is_tagged_does_not_come_back(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # forget (a shared lock, like tag) removes it between tag's listing and its new snapshot object
    two_saves(vault, tmp_path)
    first, second = vault.snapshots()
    save = Repository.save_snapshot

    def forgotten_meanwhile(self: Repository, snapshot_id: bytes, raw: bytes, **kwargs: bool) -> None:
        save(self, snapshot_id, raw, **kwargs)
        self.delete_snapshot(bytes.fromhex(first.id), bytes.fromhex(first.tree_id))

    monkeypatch.setattr(Repository, "save_snapshot", forgotten_meanwhile)
    with pytest.raises(SnapshotNotFoundError, match="forgotten or retagged by another process meanwhile"):
        vault.tag(first, add={"keep": "best"})
    monkeypatch.undo()
    assert vault.snapshots() == [second]
    assert vault.check().ok and len(list((tmp_path / "repo" / "trees").iterdir())) == 1


def test_a_snapshot_forgotten_while_its_tree_is_read_is_gone_not_damage(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """forget deleting the snapshot and its tree just before tag read the tree: exit 20, "object
    trees/... is missing; run check", for what is only forgotten (a multi-writer audit)."""
    two_saves(vault, tmp_path)
    first, second = vault.snapshots()
    load = Repository.load_tree

    def forgotten_first(self: Repository, tree_id: bytes) -> bytes:
        self.delete_snapshot(bytes.fromhex(first.id), bytes.fromhex(first.tree_id))
        return load(self, tree_id)

    monkeypatch.setattr(Repository, "load_tree", forgotten_first)
    with pytest.raises(SnapshotNotFoundError, match="forgotten or retagged by another process meanwhile"):
        vault.tag(first, add={"keep": "best"})
    monkeypatch.undo()
    assert vault.snapshots() == [second]


@pytest.mark.parametrize("damage", ["flipped", "removed"])
def test_tagging_a_snapshot_whose_tree_is_damaged_names_the_snapshot_and_what_to_do(
    vault: Vault, tmp_path: Path, damage: str
):
    """It said only "tree object X is damaged: checksum mismatch", or "object trees/... is missing"
    with a storage error's exit code, where ls names the snapshot and says what to do (audit 36a F5)."""
    two_saves(vault, tmp_path)
    first, second = vault.snapshots()
    (tree,) = [p for p in (Path(vault.url) / "trees").rglob("*") if p.name == first.tree_id]
    if damage == "flipped":
        raw = bytearray(tree.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        tree.write_bytes(bytes(raw))
    else:
        tree.unlink()
    with Vault.open(vault.url) as fresh, pytest.raises(IntegrityError) as refused:
        fresh.tag(first.id, add={"keep": "best"})
    said = str(refused.value)
    if damage == "flipped":
        assert f"tree object {first.tree_id[:12]} is damaged" in said, said
        assert f"(the tree of snapshot {first.short_id})" in said
    else:
        assert f"tree object {first.tree_id[:12]} of snapshot {first.short_id} is missing from {vault.url}" in said
    assert str(refused.value).endswith(
        f"run: vault.check(), then remove the snapshot with: vault.forget([{first.short_id!r}])"
    )
    assert [s.id for s in vault.snapshots()] == [first.id, second.id]


_TAG_SLOWLY = """
import sys, time
from ckptvault import cli
from ckptvault.repository import Repository

delete = Repository.delete_snapshot

def slow_delete(self, *args):  # the new snapshot is written; the old one not yet removed
    print("deleting", flush=True)
    time.sleep(1.0)
    return delete(self, *args)

Repository.delete_snapshot = slow_delete
sys.argv = ["ckptvault", *sys.argv[1:]]
cli.main()
"""


def test_sigterm_while_tag_replaces_the_snapshot_waits_for_the_old_one_to_go(vault: Vault, tmp_path: Path):
    """Stopped between writing the snapshot with its new tags and deleting the old one, ``tag`` left
    both: a rerun tagged whichever "latest" picked, and ``prune --keep-latest`` counted the save twice."""
    two_saves(vault, tmp_path)
    before = {s.id for s in vault.snapshots()}
    proc = subprocess.Popen(
        [sys.executable, "-c", _TAG_SLOWLY, "tag", "latest", "--repo", vault.url, "--add", "keep=best"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "deleting\n"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "has its old tags or its new ones, not both" in err
    with Vault.open(vault.url) as fresh:
        after = fresh.snapshots()
    assert len(after) == len(before) and sum(s.tags.get("keep") == "best" for s in after) == 1


def test_an_interruption_is_held_back_once_and_raised_when_the_step_ends():
    from ckptvault.interruptions import hold_back, uninterrupted

    assert not hold_back(KeyboardInterrupt)  # no step running: raised at once by the handler
    steps = []
    with pytest.raises(KeyboardInterrupt), uninterrupted():
        assert hold_back(KeyboardInterrupt)
        assert not hold_back(KeyboardInterrupt)  # a second one is not held: a stuck step can be left
        steps.append("finished")
    assert steps == ["finished"]
    with pytest.raises(KeyboardInterrupt) as caught, uninterrupted():  # a step that fails on its own: the
        hold_back(KeyboardInterrupt)  # signal still ends the command, its exit code, chained to the failure
        raise ValueError
    assert isinstance(caught.value.__cause__, ValueError)
    with uninterrupted():
        pass  # nothing held any more


def test_tagging_a_snapshot_retagged_meanwhile_says_so_by_its_short_id(vault: Vault, tmp_path: Path):
    """The CLI picks the snapshot, then tags it: a `tag` of another process in between made the loser say
    "no snapshot <all 64 hex digits>", which named neither the ID typed nor what happened."""
    two_saves(vault, tmp_path)
    chosen = vault.latest()
    with Vault.open(vault.url) as other:  # the other process (a retag through this Vault is said as its own)
        other.tag(chosen, add={"keep": "best"})
    with pytest.raises(SnapshotNotFoundError) as caught:
        vault.tag(chosen, add={"note": "x"})
    assert str(caught.value).startswith(f"snapshot {chosen.short_id} was forgotten or retagged by another process")


def test_a_snapshot_object_given_to_tag_is_taken_as_stored(vault: Vault, tmp_path: Path):
    """Its tree, time and paths come from the vault, not from the object in hand (an edited or stale one
    named another snapshot's tree, which the tag then deleted with the old pair)."""
    two_saves(vault, tmp_path)
    first, second = vault.snapshots()
    first_files, second_files = vault.files(first), vault.files(second)
    renewed = vault.tag(replace(first, tree_id=second.tree_id), add={"keep": "best"})
    assert vault.files(renewed) == first_files
    assert vault.files(second) == second_files  # its tree was not deleted with the old pair
    with Vault.open(vault.url) as fresh:
        assert fresh.check(read_data=1.0).ok


def test_a_tag_killed_between_its_copy_and_the_old_ones_removal_is_finished_by_a_rerun_or_a_prune(tmp_path: Path):
    """audit cr45: SIGKILL between the new snapshot and the old one's removal left both; the same tag run again
    wrote a third copy, and `prune --keep-latest 2` counted the two copies of one save and forgot the other save."""
    import signal

    from .test_lock_loss import finish, lockcli, wait_stopped

    repo = tmp_path / "repo"
    with Vault.init(str(repo)) as vault:
        two_saves(vault, tmp_path)
        first, second = vault.snapshots()

    def killed_tag(marker: Path) -> None:
        proc = lockcli(
            "tag", second.id, "--add", "keep=best", "--repo", str(repo), "-q",
            tmp_path=tmp_path, LOCKCLI_STOP="after-snapshot", LOCKCLI_MARKER=str(marker),
        )  # fmt: skip
        wait_stopped(proc, marker)
        proc.send_signal(signal.SIGKILL)
        finish(proc)

    killed_tag(tmp_path / "stopped-1")
    with Vault.open(str(repo)) as vault:
        assert len(vault.snapshots()) == 3  # both copies of the second save
        vault.unlock(remove_all=True)  # the killed process's lock
        result = vault.prune(keep_latest=2)
        assert [s.id for s in result.forgotten] == [second.id]
        kept = vault.snapshots()
        assert kept[0].id == first.id and kept[1].tags == {**second.tags, "keep": "best"}
        assert vault.check(read_data=1.0).ok

    repo = tmp_path / "again"
    with Vault.init(str(repo)) as vault:
        (tmp_path / "again-src").mkdir()
        two_saves(vault, tmp_path / "again-src")
        first, second = vault.snapshots()
    killed_tag(tmp_path / "stopped-2")
    with Vault.open(str(repo)) as vault:
        vault.unlock(remove_all=True)
        renewed = vault.tag(second, add={"keep": "best"})  # the same tag again finishes the first
        assert [s.id for s in vault.snapshots()] == [first.id, renewed.id]
        assert vault.check(read_data=1.0).ok


def test_a_snapshot_this_vault_retagged_is_named_as_retagged_not_removed_by_another_process(
    vault: Vault, tmp_path: Path
):
    """api49 #5: after `vault.tag()` in this process, the old Snapshot's errors said "another process removed
    it meanwhile" (or "forgotten or retagged by another process"), sending the user after a process that
    never was."""
    two_saves(vault, tmp_path)
    first = vault.snapshots()[0]
    tagged = vault.tag(first, add={"keep": "best"})
    said = rf"snapshot {first.short_id} was retagged by this Vault's tag\(\) as {tagged.id[:8]}: use the Snapshot"
    for call in (
        lambda: vault.restore(first, tmp_path / "out"),
        lambda: vault.files(first),
        lambda: vault.tag(first, add={"x": "y"}),
    ):
        with pytest.raises(SnapshotNotFoundError, match=said):
            call()


def test_a_tag_of_latest_killed_before_the_old_ones_removal_is_finished_by_the_same_tag_again(cli, tmp_path: Path):
    """cr57: `tag latest --tag run=x --add keep=best` SIGKILLed between writing the new snapshot and removing the
    old one left both, of one step and one time; run again, `latest` took the copy whenever its ID sorted higher
    (half the time), which "already has these tags; nothing changed": the old one stayed until a prune."""
    from ckptvault.ops.retag import retagged_id

    repo = tmp_path / "repo"
    with Vault.init(str(repo)) as vault:
        two_saves(vault, tmp_path)
        first, second = vault.snapshots()
    # a tag whose copy's ID sorts above the old one's: the copy is then `latest` of the pair
    value = next(
        f"best{n}" for n in range(100) if retagged_id(second.id, {**second.tags, "keep": f"best{n}"}) > second.id
    )
    command = ["tag", "latest", "--tag", "run=x", "--add", f"keep={value}", "--repo", str(repo)]
    killed = subprocess.run(
        [sys.executable, "-m", "tests.support.killcli", *command],
        env={**os.environ, "KILLCLI_MATCH": f"remove {repo}/snapshots/", "KILLCLI_AT": "1"},
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with Vault.open(str(repo)) as vault:
        assert len(vault.snapshots()) == 3  # both copies of the second save
    again = cli(*command)
    with Vault.open(str(repo)) as vault:
        now = vault.snapshots()
        assert [s.id for s in now] == [first.id, retagged_id(second.id, {**second.tags, "keep": value})]
        assert vault.check(read_data=1.0).ok
    assert f"removed snapshot {second.short_id}, which a killed tag left beside" in again.stderr.decode()


def test_a_whole_id_that_a_tag_replaced_is_named_with_what_it_became(cli, tmp_path: Path):
    """`tag <64 hex> --add note=x` rerun on a snapshot an earlier `tag <64 hex> --add keep=best` had retagged
    said "no snapshot <64 hex>", as did a restore by that ID: the copy's ID is known (retagged_id), and named."""
    repo = tmp_path / "repo"
    with Vault.init(str(repo)) as vault:
        two_saves(vault, tmp_path)
        _, second = vault.snapshots()
    cli("tag", second.id, "--add", "keep=best", "--repo", str(repo))
    with Vault.open(str(repo)) as vault:
        copy = vault.snapshots()[-1]
    said = (
        f"error: snapshot {second.id[:8]} was retagged: it is {copy.short_id} now (tags: run=x, step=2, keep=best), "
        f"as a change of tags gives a snapshot a new ID; give {copy.short_id}"
    )
    for command in (["tag", second.id, "--add", "note=x"], ["restore", second.id, str(tmp_path / "out")]):
        proc = cli(*command, "--repo", str(repo), check=False)
        assert proc.returncode == 18 and proc.stderr.decode().splitlines() == [said], proc.stderr
    assert not (tmp_path / "out").exists()
    with Vault.open(str(repo)) as vault:
        assert vault.snapshots()[-1] == copy
        with pytest.raises(SnapshotNotFoundError, match=f"it is {copy.short_id} now"):
            vault.files(second.id.upper())
    again = cli("tag", second.id, "--add", "keep=best", "--repo", str(repo))  # the same change: done already
    assert f"snapshot {second.id[:8]} is now {copy.short_id}" in again.stdout.decode()
