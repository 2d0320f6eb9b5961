"""``--host`` / ``hosts=``: selecting snapshots by the host that took them, as restic's ``--host`` (cli49 #12)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import SnapshotNotFoundError, UsageError
from tests.conftest import write_file


def test_snapshots_and_latest_select_by_host(vault: Vault, two_hosts):
    a1, a2, b1, y = (two_hosts[k] for k in ("a1", "a2", "b1", "y"))
    assert vault.snapshots(hosts=["nodeB"]) == [b1, y]
    assert vault.snapshots({"run": "x"}, hosts=["nodeA"]) == [a1, a2]
    assert vault.snapshots(hosts=["nodeA", "nodeB"]) == vault.snapshots()  # repeated: any of them
    assert vault.snapshots(hosts=None) == vault.snapshots()  # none given: every host
    assert vault.snapshots(tags={}) == vault.snapshots()  # no tag filter: each carries all of no tags
    # latest of run x is step 2 of nodeA; of nodeB's, its step 1
    assert vault.latest({"run": "x"}) == a2
    assert vault.latest({"run": "x"}, hosts=["nodeB"]) == b1
    assert vault.snapshot("latest", {"run": "x"}, hosts=["nodeB"]) == b1
    assert vault.snapshot(a1.id[:8], hosts=["nodeA"]) == a1
    assert vault.snapshot(a1, hosts=["nodeA"]) == a1


def test_restore_and_drill_take_the_newest_of_the_host(vault: Vault, two_hosts, tmp_path: Path):
    vault.restore("latest", tmp_path / "r1", tags={"run": "x"}, hosts=["nodeB"])
    assert (tmp_path / "r1" / "w.bin").read_bytes() == b"b1" * 5000
    vault.restore_latest(tmp_path / "r2", run="x", hosts=["nodeB"])
    assert (tmp_path / "r2" / "w.bin").read_bytes() == b"b1" * 5000
    assert vault.drill(tags={"run": "x"}, hosts=["nodeB"], workdir=tmp_path).snapshot_id == two_hosts["b1"].id


def test_no_match_names_the_hosts_there_are(vault: Vault, two_hosts, tmp_path: Path):
    with pytest.raises(SnapshotNotFoundError, match=r"no snapshot is of host nodeC; the hosts are: nodeA, nodeB"):
        vault.latest(hosts=["nodeC"])
    with pytest.raises(
        SnapshotNotFoundError, match=r"no snapshot of host nodeA has run=y; those that have it are of: nodeB"
    ):
        vault.latest({"run": "y"}, hosts=["nodeA"])
    with pytest.raises(SnapshotNotFoundError, match=r"no snapshot is of host nodeC"):
        vault.restore("latest", tmp_path / "r", hosts=["nodeC"])
    assert not (tmp_path / "r").exists()
    a1 = two_hosts["a1"]
    with pytest.raises(SnapshotNotFoundError, match=r"is of host nodeA, not nodeB; leave out hosts to take it"):
        vault.snapshot(a1.id[:8], hosts=["nodeB"])
    with pytest.raises(SnapshotNotFoundError, match=r"is of host nodeA, not nodeB"):
        vault.snapshot(a1, hosts=["nodeB"])


def test_an_empty_hosts_list_is_refused_in_every_method_that_selects(vault: Vault, two_hosts, tmp_path: Path):
    """h51 #3: hosts=[] selected every host, as None does: a filtered list that ended empty restored, drilled or
    counted another host's snapshots. It is refused, naming the argument and None; tags={} still selects all."""
    said = r"hosts is an empty list, which would select no snapshot .*pass hosts=None \(or leave it out\) for every"
    calls = {
        "snapshots": lambda: vault.snapshots(hosts=[]),
        "snapshot": lambda: vault.snapshot("latest", hosts=[]),
        "snapshot of a Snapshot": lambda: vault.snapshot(two_hosts["a1"], hosts=()),
        "latest": lambda: vault.latest({"run": "x"}, hosts=[]),
        "restore": lambda: vault.restore("latest", tmp_path / "r1", hosts=[]),
        "restore_latest": lambda: vault.restore_latest(tmp_path / "r2", run="x", hosts=[]),
        "drill": lambda: vault.drill(hosts=[], workdir=tmp_path),
        "stats": lambda: vault.stats(hosts=[]),
        "stats of some": lambda: vault.stats(["latest"], tags={}, hosts=[]),
    }
    for name, call in calls.items():
        with pytest.raises(UsageError, match=said):
            call()
            pytest.fail(name)
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()
    assert vault.latest(tags={}, hosts=None) == vault.latest()
    assert vault.stats(tags={}).selected is False  # no filter: the whole vault's figures


@pytest.mark.parametrize(("hosts", "expected"), [("nodeB", "must be a list of strings"), ([""], "is blank")])
def test_hosts_must_be_a_list_of_names(vault: Vault, two_hosts, hosts, expected):
    with pytest.raises(UsageError, match=expected):
        vault.snapshots(hosts=hosts)


def test_cli_host_selects_in_every_command(cli, tmp_path: Path):
    repo = str(tmp_path / "v")
    cli("init", repo)
    for name, host, run in (("a", "nodeA", "x"), ("b", "nodeB", "x"), ("c", "nodeA", "y")):
        write_file(tmp_path / name / "w.bin", name.encode() * 100)
        cli("backup", str(tmp_path / name), "--repo", repo, "--host", host, "--tag", f"run={run}")
    listed = json.loads(cli("snapshots", "--repo", repo, "--host", "nodeB", "--json").stdout)
    assert [s["hostname"] for s in listed] == ["nodeB"]
    both = json.loads(cli("snapshots", "--repo", repo, "-H", "nodeA", "--host", "nodeB", "--json").stdout)
    assert len(both) == 3
    latest = json.loads(
        cli("snapshots", "latest", "--repo", repo, "--host", "nodeA", "--tag", "run=x", "--json").stdout
    )
    assert [s["hostname"] for s in latest] == ["nodeA"] and latest[0]["tags"] == {"run": "x"}
    cli("restore", "latest", str(tmp_path / "r"), "--repo", repo, "--host", "nodeB", "--tag", "run=x")
    assert (tmp_path / "r" / "w.bin").read_bytes() == b"b" * 100
    assert cli("cat", "latest", "w.bin", "--repo", repo, "--host", "nodeA").stdout == b"c" * 100
    ls = json.loads(cli("ls", "latest", "--repo", repo, "--host", "nodeB", "--json").stdout)
    assert ls["snapshot"] == listed[0]["id"]
    diff = json.loads(cli("diff", "latest", "latest", "--repo", repo, "--host", "nodeB", "--json").stdout)
    assert diff["a"] == diff["b"] == listed[0]["id"]
    drill = json.loads(cli("drill", "--repo", repo, "--host", "nodeB", "--json").stdout)
    assert drill["snapshot_id"] == listed[0]["id"]

    missing = cli("restore", "latest", str(tmp_path / "r2"), "--repo", repo, "--host", "nodeC", check=False)
    assert missing.returncode == 18
    assert "the hosts are: nodeA, nodeB" in missing.stderr.decode() and "--host nodeC" in missing.stderr.decode()
    empty = cli("snapshots", "--repo", repo, "--host", "nodeC")
    assert "warning: --host nodeC selects no snapshot (no snapshot is of host nodeC" in empty.stderr.decode()
    blank = cli("snapshots", "--repo", repo, "--host", "", check=False)
    assert blank.returncode == 2 and "--host: '' is blank" in blank.stderr.decode()


def test_a_selection_from_an_empty_vault_says_it_has_no_snapshots(cli, tmp_path: Path):
    """h51 #2: `snapshots --host X` on a vault with no snapshot said "the hosts are: none"."""
    repo = str(tmp_path / "v")
    cli("init", repo)
    for args in (["snapshots"], ["stats"], ["snapshots", "--tag", "run=x"]):
        proc = cli(*args, "--repo", repo, "--host", "nodeA", "--json")
        said = proc.stderr.decode()
        assert "selects no snapshot (the vault has no snapshots yet)" in said and "none" not in said, (args, said)
    missing = cli("restore", "latest", str(tmp_path / "r"), "--repo", repo, "-H", "nodeA", check=False)
    assert missing.returncode == 18, missing.stderr
    assert "no snapshot matches latest --host nodeA (the vault has no snapshots yet)" in missing.stderr.decode()
    plain = cli("restore", "latest", str(tmp_path / "r"), "--repo", repo, check=False)  # doc55: said no more
    assert plain.returncode == 18 and "no snapshot matches latest (the vault has no snapshots yet); list" in str(plain)
    tagged = cli("snapshots", "--repo", repo, "--tag", "run=x").stderr.decode()
    assert "--tag run=x selects no snapshot (the vault has no snapshots yet)" in tagged, tagged


def test_backup_and_watch_take_h_for_the_host_and_the_writers_say_what_they_take_instead(cli, tmp_path: Path):
    """h51 #5: `backup --host NAME` had no -H, which the reading commands take for --host (restic's backup has
    both); `prune --host X` and `forget --host X` got click's bare "No such option": they name --group-by host
    and the snapshot IDs instead, exit 2 as other usage errors, and change nothing."""
    from tests.test_cli import one_line_error

    repo = str(tmp_path / "v")
    cli("init", repo)
    write_file(tmp_path / "src" / "w.bin", b"w" * 100)
    cli("backup", str(tmp_path / "src"), "--repo", repo, "-H", "nodeB")
    write_file(tmp_path / "out" / "checkpoint-1" / "w.bin", b"x" * 100)
    cli("watch", str(tmp_path / "out"), "--once", "--repo", repo, "-H", "nodeC")
    listed = json.loads(cli("snapshots", "--repo", repo, "--json").stdout)
    assert [s["hostname"] for s in listed] == ["nodeB", "nodeC"]
    for command, args, said in (
        ("prune", ["--keep-latest", "1", "--host", "nodeB"], "prune takes no --host: use --group-by host to apply"),
        ("prune", ["--keep-latest", "1", "-H", "nodeB"], "prune takes no --host: use --group-by host"),
        ("forget", ["latest", "--host", "nodeB"], "forget takes no --host: give the snapshot IDs (ckptvault snapshots"),
        ("forget", ["latest", "--host=nodeB"], "or use ckptvault prune --group-by host"),
        ("tag", ["latest", "-H", "nodeB", "--add", "k=v"], "tag takes no --host: give the snapshot's ID"),
        ("copy", ["--from-repo", repo, "--host", "nodeB"], "copy takes no --host: give snapshot IDs"),
    ):
        proc = cli(command, *args, "--repo", repo, check=False)
        assert proc.returncode == 2, proc.stderr
        line = one_line_error(proc)
        assert said in line and "No such option" not in line, line
    assert json.loads(cli("snapshots", "--repo", repo, "--json").stdout) == listed
    backup_help = cli("backup", "--help").stdout.decode()
    assert re.search(r"--host\s+-H\s+NAME", backup_help), backup_help


def test_a_hostname_with_spaces_at_its_ends_or_too_long_is_refused(vault: Vault, tmp_path: Path):
    """h5 #3: `backup --host " nodeA"` was stored as another host than nodeA, looking the same in the tables, and
    a 300-character name stretched every table (tags stop at 256 characters and refuse spaces at their ends)."""
    write_file(tmp_path / "s" / "w.bin", b"w")
    for bad, said in (
        (" nodeA", "has spaces at its ends"),
        ("nodeA ", "has spaces at its ends"),
        ("n" * 257, r"is longer than 256 characters \(257\)"),
    ):
        with pytest.raises(UsageError, match=said):
            vault.backup(tmp_path / "s", hostname=bad)
    assert vault.snapshots() == []
    assert vault.backup(tmp_path / "s", hostname="n" * 256).hostname == "n" * 256
