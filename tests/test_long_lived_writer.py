"""A Vault kept open across many backups (a training job's shipper, the watch sidecar) reads the
index objects and snapshot objects it has not read yet, not all of them at every backup, and still
never deduplicates against what another process's prune deleted meanwhile."""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path

import pytest

from ckptvault import Vault
from tests.conftest import write_file


def _count_reads(vault: Vault, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Whole-object reads of the vault's storage, by top-level folder (``index``, ``snapshots``...)."""
    reads: Counter[str] = Counter()
    store = vault._repo.store
    get = store.get

    def counting_get(key: str):
        reads[key.split("/", 1)[0]] += 1
        return get(key)

    monkeypatch.setattr(store, "get", counting_get)
    return reads


@pytest.mark.parametrize("first", ["restore", "backup"])
def test_a_vault_lists_its_index_objects_once_for_its_first_restore_or_backup(
    tmp_path: Path, vault: Vault, monkeypatch: pytest.MonkeyPatch, first: str
):
    """Each listing is a round trip on remote storage, before the first byte of data moves. A vault whose
    config says it is not encrypted lists them once more, before its first lock: one object is read to see
    that its objects are plain, so that a config rewritten to "none" gets no lock naming this host in the
    clear (ek44 #1); an encrypted vault lists them once."""
    write_file(tmp_path / "ckpt" / "state.bin", os.urandom(20_000))
    vault.backup(tmp_path / "ckpt")
    with Vault.open(vault.url) as fresh:
        listings: Counter[str] = Counter()
        store, real_list = fresh._repo.store, fresh._repo.store.list
        monkeypatch.setattr(store, "list", lambda prefix: listings.update([prefix]) or real_list(prefix))
        if first == "restore":
            fresh.restore("latest", tmp_path / "out")
        else:
            fresh.backup(tmp_path / "ckpt")
    assert listings["index/"] == 2, listings  # one of them the look before the first lock


def test_the_nth_backup_of_a_long_lived_vault_reads_only_the_new_metadata(
    tmp_path: Path, vault: Vault, monkeypatch: pytest.MonkeyPatch
):
    source = tmp_path / "ckpt"
    for step in range(12):
        write_file(source / "state.bin", os.urandom(20_000))
        vault.backup(source, tags={"run": "a", "step": str(step)})
    with Vault.open(vault.url) as other:  # another process backs up meanwhile: its objects are new here
        write_file(tmp_path / "other" / "x.bin", os.urandom(20_000))
        other.backup(tmp_path / "other")

    reads = _count_reads(vault, monkeypatch)
    write_file(source / "state.bin", os.urandom(20_000))
    snap = vault.backup(source, tags={"run": "a", "step": "12"})
    # the other process's index object; its snapshot and this vault's previous one (written, not yet
    # listed); 13 index objects and 13 snapshots before
    assert reads["index"] == 1 and reads["snapshots"] == 2, reads
    assert len(vault.snapshots()) == 14 and reads["snapshots"] == 3
    # every chunk of the fresh random file is new (its 20 kB may be cut in one chunk or two: content-defined)
    assert snap.summary.new_chunks == snap.summary.chunks >= 1


def test_a_long_lived_vault_stores_again_what_another_process_pruned_since(
    tmp_path: Path, vault: Vault, caplog: pytest.LogCaptureFixture
):
    dropped, kept = os.urandom(1_000_000), os.urandom(300_000)
    first, second = tmp_path / "first", tmp_path / "second"
    write_file(first / "optimizer.bin", dropped)
    write_file(second / "model.bin", kept)
    vault.backup(first, tags={"step": "1"})

    with Vault.open(vault.url) as other:
        other.backup(second, tags={"step": "2"})
        pruned = other.prune(keep_latest=1)
        assert pruned.forgotten and pruned.gc.delete_packs, pruned

    # the long-lived vault loaded the index that named the pruned packs: it must not reuse them
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        again = vault.backup(first, tags={"step": "3"})
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # no "missing from the store"
    assert again.summary.new_bytes == len(dropped), again.summary

    with Vault.open(vault.url) as fresh:
        assert fresh.check(read_data=1.0).ok
        fresh.restore(again, tmp_path / "out")
    assert (tmp_path / "out" / "optimizer.bin").read_bytes() == dropped


def test_a_long_lived_vault_stores_again_a_chunk_repair_index_dropped(tmp_path: Path, vault: Vault):
    """repair-index --read-data keeps the pack and drops the damaged chunk's entry: a Vault that merged
    only whole packs kept the entry and deduplicated against the damaged chunk (review25 F1)."""
    source = tmp_path / "src"
    write_file(source / "a.bin", os.urandom(200_000))
    write_file(source / "b.bin", os.urandom(200_000))
    first = vault.backup(source, tags={"step": "1"})
    chunk = next(e for e in vault.files(first) if e.path == "a.bin").chunks[0]
    loc = vault._repo.index.get(chunk)
    pack = next(Path(vault.url).rglob(loc.pack_id.hex()))
    data = bytearray(pack.read_bytes())
    data[loc.offset + loc.stored_len // 2] ^= 0xFF
    pack.chmod(0o644)
    pack.write_bytes(bytes(data))
    with Vault.open(vault.url) as admin:  # another process
        assert [c[:12] for c in admin.repair_index(read_data=True).damaged_chunks] == [chunk.hex()[:12]]

    second = vault.backup(source, tags={"step": "2"})
    assert second.summary.new_chunks == 1 and second.summary.new_bytes > 0, second.summary
    with Vault.open(vault.url) as fresh:
        fresh.restore(second, tmp_path / "out")
    assert (tmp_path / "out" / "a.bin").read_bytes() == (source / "a.bin").read_bytes()


def test_a_long_lived_vault_stores_again_deltas_a_prune_dropped(tmp_path: Path):
    """Prune drops the entries of dead deltas from a pack it keeps; once their base is stored again
    (another process), a Vault that merged only whole packs deduplicated against them: the backup
    said it succeeded, its snapshot did not restore, and every later prune refused (review25 F1)."""
    from tests.test_delta import DELTA, SMALL, Training, contents

    url = str(tmp_path / "vault")
    run, source, other = Training(), tmp_path / "src", tmp_path / "other"
    with Vault.init(url, chunker=SMALL, compression=DELTA) as vault:  # the long-lived writer
        run.save(source)
        first = vault.backup(source, tags={"run": "t", "step": "1"})
        run.step()
        run.save(source)
        write_file(source / "big.bin", os.urandom(12_000_000))  # shares the pack of the second save's deltas
        second = vault.backup(source, tags={"run": "t", "step": "2"})
        assert second.summary.delta_chunks > 0
        write_file(other / "big.bin", (source / "big.bin").read_bytes())
        vault.backup(other)  # keeps that pack mostly alive
        with Vault.open(url) as admin:  # another process: forget --prune
            admin.forget([first.id, second.id], prune=True)
        with Vault.open(url) as again:  # another process stores the first save's tensors, the bases, again
            Training().save(tmp_path / "bases")
            again.backup(tmp_path / "bases", tags={"run": "q"})

        run.save(tmp_path / "third")  # the second save's tensors once more
        third = vault.backup(tmp_path / "third", tags={"run": "t", "step": "3"})
        assert third.summary.new_chunks >= second.summary.delta_chunks, third.summary

    with Vault.open(url) as fresh:
        assert fresh.check(read_data=1.0).ok
        fresh.restore(third, tmp_path / "out")
        assert contents(tmp_path / "out") == contents(tmp_path / "third")
        fresh.prune(keep_latest=5)


def _count_pack_listings(vault: Vault, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    listings: list[int] = []
    list_packs = vault._repo.list_packs

    def counting() -> dict[bytes, int]:
        listings.append(1)
        return list_packs()

    monkeypatch.setattr(vault._repo, "list_packs", counting)
    return listings


def test_a_long_lived_vault_lists_every_pack_only_when_it_may_find_something(
    tmp_path: Path, vault: Vault, monkeypatch: pytest.MonkeyPatch
):
    """Each backup listed every pack of the vault (to adopt what a killed writer left, and to drop what is
    gone): on S3 a long-lived Vault's backups grew slower with the vault, 67 ms each at first, 162 ms after
    600 (63 ms of it that listing). Now: the first backup, after a failed one, once another process wrote an
    index object, and every RECONCILE_EVERY_S."""
    from ckptvault.repository import repository

    source = tmp_path / "ckpt"
    listings = _count_pack_listings(vault, monkeypatch)
    for step in range(5):
        write_file(source / "state.bin", os.urandom(20_000))
        vault.backup(source, tags={"step": str(step)})
    assert len(listings) == 1
    with Vault.open(vault.url) as other:  # another process's index object: maybe one that lost its lock
        write_file(tmp_path / "other" / "x.bin", os.urandom(20_000))
        other.backup(tmp_path / "other")
    vault.backup(source, tags={"step": "5"})
    assert len(listings) == 2
    vault.backup(source, tags={"step": "6"})
    assert len(listings) == 2
    monkeypatch.setattr(repository, "RECONCILE_EVERY_S", 0.0)
    vault.backup(source, tags={"step": "7"})
    assert len(listings) == 3


def test_a_long_lived_vault_adopts_what_its_failed_backup_uploaded(
    tmp_path: Path, vault: Vault, monkeypatch: pytest.MonkeyPatch
):
    source = tmp_path / "ckpt"
    write_file(source / "state.bin", os.urandom(3_000_000))
    vault.backup(source, tags={"step": "0"})
    write_file(source / "state.bin", os.urandom(3_000_000))

    def fail():
        raise RuntimeError("killed before the commit")

    with pytest.raises(RuntimeError):
        vault.backup(source, tags={"step": "1"}, before_commit=fail)
    listings = _count_pack_listings(vault, monkeypatch)
    snap = vault.backup(source, tags={"step": "1"})
    assert len(listings) == 1 and snap.summary.new_bytes < 100_000, snap.summary  # adopted, not sent again


def test_an_index_object_absorbed_by_this_vaults_compaction_still_makes_it_list_the_packs(
    tmp_path: Path, vault: Vault, monkeypatch: pytest.MonkeyPatch
):
    """A writer that lost its lock to a prune indexes a pack the prune deleted. Its index object appeared
    during this Vault's backup and went into the object this Vault's compaction wrote, so no foreign object
    was left to make the next backup list the packs: it deduplicated against the deleted pack and committed
    a snapshot that could not be restored (review of this change)."""
    from ckptvault.ops import compact
    from ckptvault.repository.format import pack_key

    shared = os.urandom(300_000)  # what the lost writer stored, and this vault saves later
    for step in range(3):
        write_file(tmp_path / "a" / "f.bin", os.urandom(20_000))
        vault.backup(tmp_path / "a", tags={"step": str(step)})

    def lost_lock_writer() -> None:
        monkeypatch.setattr(compact, "COMPACT_AT", 1000)  # the other process does not compact
        with Vault.open(vault.url) as other:
            write_file(tmp_path / "w" / "f.bin", shared)
            other.backup(tmp_path / "w")
            for pack_id in other._repo.uploaded_packs:  # what the prune deleted
                os.unlink(os.path.join(vault.url, pack_key(pack_id)))
        monkeypatch.setattr(compact, "COMPACT_AT", 1)

    monkeypatch.setattr(compact, "COMPACT_AT", 1)  # compacts at the end of the next backup
    write_file(tmp_path / "a" / "f.bin", os.urandom(20_000))
    vault.backup(tmp_path / "a", tags={"step": "3"}, before_commit=lost_lock_writer)
    write_file(tmp_path / "b" / "f.bin", shared)
    snap = vault.backup(tmp_path / "b", tags={"step": "4"})
    assert snap.summary.new_bytes >= 300_000  # stored again, not deduplicated against the deleted pack
    vault.restore(snap, tmp_path / "out")
