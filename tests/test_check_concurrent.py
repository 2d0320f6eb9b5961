"""check runs beside backup and forget (all take shared locks): a backup that commits while check
runs, or a snapshot forgotten while check runs, is not reported as damage. The concurrent
operation runs through a second Vault at a chosen point of check (a hook on check's store
listings and reads), so there is no timing race; a really missing tree is still damage."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.repository.format import INDEX_PREFIX, SNAPSHOTS_PREFIX, snapshot_key

from .conftest import write_file


def make_source(root: Path, seed: int) -> Path:
    write_file(root / "model.bin", os.urandom(600_000) + bytes([seed]))
    write_file(root / "state.json", f'{{"step": {seed}}}'.encode())
    return root


@pytest.fixture
def repo(tmp_path: Path) -> str:
    url = str(tmp_path / "repo")
    Vault.init(url, pack_size=1 << 20).close()
    return url


def hook_after(checker: Vault, method: str, wanted: Callable[[str], bool], action: Callable[[], None]) -> list[str]:
    """Run ``action`` once, right after the checker's store returns the first call of ``method`` whose
    key or prefix ``wanted`` accepts. Returns a list that names the call once the hook has fired."""
    checker._repo.refuse_if_downgraded_before_writing()  # the look before its first lock: not one of check's
    store = checker._repo.store
    original = getattr(store, method)
    fired: list[str] = []

    def hooked(key: str, *args, **kwargs):
        result = original(key, *args, **kwargs)
        if not fired and wanted(key):
            fired.append(key)
            action()
        return result

    setattr(store, method, hooked)
    return fired


@pytest.mark.parametrize("read_data", [0.0, 1.0])
def test_a_backup_that_commits_after_check_listed_the_index_is_not_damage(tmp_path: Path, repo: str, read_data: float):
    with Vault.open(repo) as writer:
        writer.backup(make_source(tmp_path / "a", 1))
    checker = Vault.open(repo)

    def concurrent_backup() -> None:
        with Vault.open(repo) as other:  # new chunks, a new index object, then its snapshot
            other.backup(make_source(tmp_path / "b", 2), tags={"late": "1"})

    fired = hook_after(checker, "list", lambda prefix: prefix.startswith(INDEX_PREFIX), concurrent_backup)
    report = checker.check(read_data=read_data)
    assert fired, "the backup ran between check's listings"
    assert report.ok, report.problems
    assert report.snapshots == 1  # the late snapshot was committed after check listed the snapshots

    again = Vault.open(repo).check(read_data=1.0)
    assert again.ok, again.problems
    assert again.snapshots == 2


@pytest.mark.parametrize("read_data", [0.0, 1.0])
def test_a_backup_that_compacts_the_index_objects_check_listed_is_not_damage(
    tmp_path: Path, repo: str, read_data: float, monkeypatch: pytest.MonkeyPatch
):
    """The compaction deletes the objects check listed, after writing what replaces them: check lists
    again (review25 F2: three "index ... is missing" problems and exit 30 on a sound vault)."""
    from ckptvault.ops import compact

    monkeypatch.setattr(compact, "COMPACT_AT", 3)
    with Vault.open(repo) as writer:
        for seed in range(3):
            writer.backup(make_source(tmp_path / "a", seed))
        listed = writer._repo.list_index_ids()
    checker = Vault.open(repo)

    def compacting_backup() -> None:
        with Vault.open(repo) as other:
            other.backup(make_source(tmp_path / "b", 9), tags={"late": "1"})
            assert not set(listed) & set(other._repo.list_index_ids())  # every listed object replaced

    fired = hook_after(checker, "list", lambda prefix: prefix.startswith(INDEX_PREFIX), compacting_backup)
    report = checker.check(read_data=read_data)
    assert fired and report.ok, report.problems
    assert report.snapshots == 3


def two_snapshots_one_to_forget(tmp_path: Path, repo: str) -> tuple[str, Callable[[], None]]:
    """Two snapshots; the second's ID, and an action that forgets it through another Vault."""
    with Vault.open(repo) as writer:
        writer.backup(make_source(tmp_path / "a", 1), tags={"n": "1"})
        gone = writer.backup(make_source(tmp_path / "b", 2), tags={"n": "2"})

    def concurrent_forget() -> None:
        with Vault.open(repo) as other:
            other.forget([gone.id])  # the snapshot object, then its tree

    return gone.id, concurrent_forget


def test_a_snapshot_forgotten_after_check_listed_it_is_not_damage(tmp_path: Path, repo: str):
    _, concurrent_forget = two_snapshots_one_to_forget(tmp_path, repo)
    checker = Vault.open(repo)
    fired = hook_after(checker, "list", lambda prefix: prefix.startswith(SNAPSHOTS_PREFIX), concurrent_forget)
    report = checker.check(read_data=1.0)
    assert fired
    assert report.ok, report.problems
    assert report.snapshots == 1
    assert not report.affected


def test_a_snapshot_forgotten_between_reading_it_and_its_tree_is_not_damage(tmp_path: Path, repo: str):
    gone_id, concurrent_forget = two_snapshots_one_to_forget(tmp_path, repo)
    checker = Vault.open(repo)
    key = snapshot_key(bytes.fromhex(gone_id))
    fired = hook_after(checker, "get", lambda k: k == key, concurrent_forget)
    report = checker.check()
    assert fired
    assert report.ok, report.problems
    assert report.snapshots == 1


def test_a_missing_tree_of_a_snapshot_that_is_still_there_is_damage(tmp_path: Path, repo: str):
    with Vault.open(repo) as writer:
        kept = writer.backup(make_source(tmp_path / "a", 1), tags={"n": "1"})
        broken = writer.backup(make_source(tmp_path / "b", 2), tags={"n": "2"})
        writer._repo.delete_tree(bytes.fromhex(broken.tree_id))
    report = Vault.open(repo).check()
    assert not report.ok
    assert [p.object for p in report.problems] == [f"snapshot {broken.id[:12]}"]
    assert report.affected == {broken.id: ["*"]}
    assert kept.id not in report.affected
