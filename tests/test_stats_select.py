"""``stats`` of some snapshots: by ID or latest, ``--tag`` and ``--host`` (cli49 #10)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import SnapshotNotFoundError
from tests.conftest import write_file


def test_stats_of_some_snapshots_counts_the_chunks_they_reference(vault: Vault, two_hosts):
    whole = vault.stats()
    assert not whole.selected and whole.snapshots == 4
    b = vault.stats(hosts=["nodeB"])
    assert b.selected and b.snapshots == 2 and [s.id for s in b.per_snapshot] == [two_hosts["b1"].id, two_hosts["y"].id]
    assert b.logical_bytes == 2 * 10000
    assert b.unique_bytes == 2 * 10000  # one chunk each, none shared
    assert 0 < b.stored_bytes < whole.stored_bytes and b.chunks < whole.chunks
    assert b.dedup_ratio == 1.0
    # one snapshot by ID or latest, and the tags and hosts applying to them
    one = vault.stats(["latest"], tags={"run": "x"}, hosts=["nodeA"])
    assert [s.id for s in one.per_snapshot] == [two_hosts["a2"].id] and one.logical_bytes == 10000
    assert vault.stats([two_hosts["a1"].id[:8], two_hosts["a1"]]).snapshots == 1  # named twice: counted once
    with pytest.raises(SnapshotNotFoundError, match="is of host nodeA, not nodeB"):
        vault.stats([two_hosts["a1"].id[:8]], hosts=["nodeB"])
    none = vault.stats(tags={"run": "z"})
    assert none.selected and none.snapshots == 0 and none.stored_bytes == 0 and none.per_snapshot == []


def test_stats_of_a_snapshot_counts_its_shared_chunks_once(vault: Vault, tmp_path: Path):
    write_file(tmp_path / "s" / "a.bin", b"same" * 20000)
    write_file(tmp_path / "s" / "b.bin", b"same" * 20000)  # the same content twice: stored once
    snap = vault.backup(tmp_path / "s")
    stats = vault.stats([snap.id])
    assert stats.logical_bytes == 160000 and stats.unique_bytes == 80000
    assert stats.dedup_ratio == 2.0


def test_cli_stats_takes_snapshots_tags_and_hosts(cli, tmp_path: Path):
    repo = str(tmp_path / "v")
    cli("init", repo)
    for name, host in (("a", "nodeA"), ("b", "nodeB")):
        write_file(tmp_path / name / "w.bin", name.encode() * 1000)
        cli("backup", str(tmp_path / name), "--repo", repo, "--host", host, "--tag", f"run={name}")
    whole = json.loads(cli("stats", "--repo", repo, "--json").stdout)
    assert whole["snapshots"] == 2 and whole["selected"] is False
    by_host = json.loads(cli("stats", "--repo", repo, "--host", "nodeB", "--json").stdout)
    assert by_host["selected"] is True and by_host["snapshots"] == 1 and by_host["logical_bytes"] == 1000
    by_tag = json.loads(cli("stats", "--repo", repo, "--tag", "run=a", "--json").stdout)
    assert [s["tags"] for s in by_tag["per_snapshot"]] == [{"run": "a"}]
    latest = cli("stats", "latest", "--repo", repo).stdout.decode()
    assert "snapshots: 1 (selected)" in latest and "(those their files reference)" in latest
    none = cli("stats", "--repo", repo, "--host", "nodeC")
    assert "selects no snapshot (no snapshot is of host nodeC; the hosts are: nodeA, nodeB)" in none.stderr.decode()


def test_stats_lists_each_snapshot_with_its_host(cli, vault: Vault, two_hosts, tmp_path: Path):
    """h51 #4: the per-snapshot table and --json of stats had no host, where snapshots has one: with several
    nodes writing to a vault, which one's save added the bytes could not be told."""
    assert [s.hostname for s in vault.stats().per_snapshot] == ["nodeA", "nodeA", "nodeB", "nodeB"]
    assert [s.hostname for s in vault.stats(hosts=["nodeB"]).per_snapshot] == ["nodeB", "nodeB"]
    repo = str(tmp_path / "v")
    cli("init", repo)
    for name, host in (("a", "nodeA"), ("b", "nodeB")):
        write_file(tmp_path / name / "w.bin", name.encode() * 1000)
        cli("backup", str(tmp_path / name), "--repo", repo, "--host", host)
    listed = json.loads(cli("stats", "--repo", repo, "--json").stdout)["per_snapshot"]
    assert [s["hostname"] for s in listed] == ["nodeA", "nodeB"]
    lines = cli("stats", "--repo", repo).stdout.decode().splitlines()
    assert lines[0].split()[:4] == ["id", "time", "(UTC)", "host"], lines
    for row, host in zip(lines[1:3], ("nodeA", "nodeB"), strict=True):
        assert row.split()[3] == host, lines


def test_stats_of_a_delta_coded_snapshot_counts_the_bases_it_needs(tmp_path: Path):
    from tests.test_delta import DELTA, SMALL, Training, backup_steps

    with Vault.init(str(tmp_path / "vault"), chunker=SMALL, pack_size=1 << 20, compression=DELTA) as vault:
        _, (second, _) = backup_steps(vault, Training(), tmp_path, range(1, 3))
        assert second.summary.delta_chunks > 0
        stats = vault.stats([second])
        index = vault._repo.index
        referenced = {c for e in vault.files(second) for c in e.chunks}
        bases = {index.get(c).base_id for c in referenced} - {None} - referenced
        assert bases, "the second save is coded against the first's chunks"
        assert stats.chunks == len(referenced) and stats.delta_chunks == second.summary.delta_chunks
        assert stats.unique_bytes == sum(index.get(c).raw_len for c in referenced)  # the bases' raw bytes are not
        assert stats.stored_bytes == sum(index.get(c).stored_len for c in referenced | bases)  # their stored are
        assert stats.delta_saved_bytes == second.summary.delta_saved_bytes and stats.delta_saving_unknown == 0
