"""``backup --skip-if-unchanged`` (and ``skip_if_unchanged=True`` in the API): no new snapshot when
the newest one from this host with the same tags, of sources with the same names, holds the same
files. Everything else writes a snapshot as before: a change of content, mode or mtime, other
tags, other source names, and a tree that went back to an older state (the newest differs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ckptvault import Vault

from .conftest import write_file


def snapshot_count(vault: Vault) -> int:
    return len(vault.snapshots())


def test_the_cli_writes_no_snapshot_for_an_unchanged_tree_and_says_which_holds_it(cli, tmp_path: Path):
    repo, src = str(tmp_path / "repo"), tmp_path / "ckpts"
    write_file(src / "model.safetensors", os.urandom(300_000))
    cli("init", repo)
    first = json.loads(cli("backup", str(src), "--repo", repo, "--tag", "run=a", "--json").stdout)

    again = cli("backup", str(src), "--repo", repo, "--tag", "run=a", "--skip-if-unchanged")
    assert again.stdout.decode().startswith(f"unchanged since snapshot {first['id'][:8]}")
    as_json = json.loads(
        cli("backup", str(src), "--repo", repo, "--tag", "run=a", "--skip-if-unchanged", "--json").stdout
    )
    assert as_json["id"] == first["id"] and as_json["unchanged"] is True
    with Vault.open(repo) as vault:
        assert snapshot_count(vault) == 1

    # without the flag a snapshot is written, as always
    cli("backup", str(src), "--repo", repo, "--tag", "run=a")
    with Vault.open(repo) as vault:
        assert snapshot_count(vault) == 2


def test_any_difference_writes_a_snapshot(vault: Vault, tmp_path: Path):
    src = tmp_path / "ckpts"
    weights = write_file(src / "w.bin", b"a" * 100_000, mtime_ns=1_000_000_000)
    base = vault.backup(src, tags={"run": "a"})

    def backup(**tags: str):
        return vault.backup(src, tags=tags or {"run": "a"}, skip_if_unchanged=True)

    assert backup().id == base.id
    assert backup(run="a", extra="x").id != base.id  # the twin must carry every tag asked for
    write_file(weights, b"b" * 100_000, mtime_ns=1_000_000_000)  # same size and mtime, other bytes
    changed = backup()
    assert changed.id != base.id
    assert backup().id == changed.id
    os.chmod(weights, 0o600)
    assert backup().id != changed.id
    count = snapshot_count(vault)
    os.utime(weights, ns=(2_000_000_000, 2_000_000_000))
    backup()
    write_file(src / "new.bin", b"c")
    backup()
    assert snapshot_count(vault) == count + 2


def test_a_tree_back_to_an_older_state_is_compared_with_the_newest_snapshot_only(vault: Vault, tmp_path: Path):
    # `latest` must give what is on disk now: an older snapshot holding it does not count
    src = tmp_path / "ckpts"
    write_file(src / "w.bin", b"a" * 1000, mtime_ns=1_000_000_000)
    old = vault.backup(src, tags={"run": "a"})
    write_file(src / "w.bin", b"b" * 1000, mtime_ns=2_000_000_000)
    vault.backup(src, tags={"run": "a"})
    write_file(src / "w.bin", b"a" * 1000, mtime_ns=1_000_000_000)
    now = vault.backup(src, tags={"run": "a"}, skip_if_unchanged=True)
    assert now.id != old.id and vault.latest({"run": "a"}).id == now.id


def test_a_superset_of_the_tags_counts_and_a_twin_of_another_name_does_not(vault: Vault, tmp_path: Path):
    write_file(tmp_path / "one" / "last.ckpt", b"x" * 5000, mtime_ns=1_000_000_000)
    write_file(tmp_path / "two" / "last.ckpt", b"x" * 5000, mtime_ns=1_000_000_000)
    write_file(tmp_path / "two" / "best.ckpt", b"x" * 5000, mtime_ns=1_000_000_000)
    shipped = vault.backup(tmp_path / "one" / "last.ckpt", tags={"run": "a", "step": "10"})
    # the same name and contents in another folder (a pin's): the snapshot that carries run=a holds it
    assert vault.backup(tmp_path / "two" / "last.ckpt", tags={"run": "a"}, skip_if_unchanged=True).id == shipped.id
    # the same contents under another name: not that snapshot
    other = vault.backup(tmp_path / "two" / "best.ckpt", tags={"run": "a", "step": "10"}, skip_if_unchanged=True)
    assert other.id != shipped.id and snapshot_count(vault) == 2


def test_backup_async_skips_a_pinned_file_already_shipped(vault: Vault, tmp_path: Path):
    ckpt = write_file(tmp_path / "ckpts" / "epoch=0-step=5.ckpt", os.urandom(200_000))
    first = vault.backup_async(ckpt, tags={"run": "a", "step": "5"}, skip_if_unchanged=True).result(60)
    again = vault.backup_async(ckpt, tags={"run": "a", "step": "5"}, skip_if_unchanged=True).result(60)
    assert again.id == first.id and snapshot_count(vault) == 1
    assert os.listdir(tmp_path / "ckpts") == ["epoch=0-step=5.ckpt"], "the pins were released"


def test_a_twin_whose_tree_is_damaged_gets_a_new_snapshot_not_an_error(vault: Vault, repo_url: str, tmp_path: Path):
    src = write_file(tmp_path / "ckpts" / "w.bin", b"a" * 5000).parent
    twin = vault.backup(src, tags={"run": "a"})
    tree = Path(repo_url) / "trees" / twin.tree_id
    damaged = bytearray(tree.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    tree.write_bytes(bytes(damaged))
    written = vault.backup(src, tags={"run": "a"}, skip_if_unchanged=True)
    assert written.id != twin.id and vault.files(written)[-1].path == "w.bin"


def test_a_damaged_parent_tree_does_not_stop_later_backups(vault: Vault, repo_url: str, tmp_path: Path):
    src = write_file(tmp_path / "ckpts" / "w.bin", os.urandom(50_000)).parent
    parent = vault.backup(src)
    tree = Path(repo_url) / "trees" / parent.tree_id
    tree.write_bytes(tree.read_bytes()[:-1] + bytes([tree.read_bytes()[-1] ^ 1]))
    warnings: list[str] = []
    child = vault.backup(src, on_warning=warnings.append)
    assert child.summary.read_bytes == 50_000, "every file was read: the parent's tree could not say what changed"
    assert len(warnings) == 1 and f"cannot read the tree of snapshot {parent.short_id}" in warnings[0]
    restored = tmp_path / "restored"
    vault.restore(child, restored)
    assert (restored / "w.bin").read_bytes() == (src / "w.bin").read_bytes()
