"""Prune deletes only what no kept snapshot needs, and stops before deleting when it cannot be sure.

Each test is a real vault on local disk in a state prune must handle: a delta chain deeper than the
writer makes (built by hand, as the format allows), a chunk whose only readable copy is the second
one, damaged trees, snapshot objects and chunks, a pack cut short, a lock lost between two deleting
steps, another writer let in meanwhile, and garbage collection run without the lock.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from ckptvault import CompressionSettings, Snapshot, Vault
from ckptvault.blob import Kind
from ckptvault.chunking import ChunkerParams
from ckptvault.errors import IntegrityError, LockLostError, UnsupportedFormatError, VaultLockedError
from ckptvault.ops import prune as prune_module
from ckptvault.ops.gc import execute_gc
from ckptvault.repository import locks
from ckptvault.repository.format import pack_key, snapshot_key, tree_key
from ckptvault.repository.locks import LockManager

from .test_corruption import flip
from .test_damaged_metadata import recode_chunk

SMALL = ChunkerParams(min_size=16 * 1024, avg_size=64 * 1024, max_size=256 * 1024)
PIECE = 16 * 1024  # a file this size is one chunk: a backup of it deduplicates against a hand-made chunk
DELTA = CompressionSettings(delta=True)
SUSPENDED_S = 23 * 60  # without a refresh this long, a held lock is lost (others may judge it stale at 30 min)


def packs(url: str) -> set[str]:
    return {p.name for p in (Path(url) / "packs").rglob("*") if p.is_file() and not p.name.startswith(".tmp-")}


def restores_exactly(vault: Vault, snap, source: Path, out: Path) -> None:
    vault.restore(snap, out)
    files = [p for p in source.rglob("*") if p.is_file()]
    assert files and all((out / p.relative_to(source)).read_bytes() == p.read_bytes() for p in files), snap.id


def two_snapshots(vault: Vault, tmp_path: Path, size: int = 600_000):
    """Two backups of unrelated bytes: each has a pack of its own."""
    snaps = []
    for name in ("old", "new"):
        src = tmp_path / name
        src.mkdir()
        (src / "model.bin").write_bytes(os.urandom(size))
        snaps.append((vault.backup(src), src))
    return snaps


def suspended_from_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, the locks this process holds go unrefreshed for 23 minutes, as in a process that
    was suspended (SIGSTOP, a laptop lid): they are lost."""
    real = locks.ticks
    monkeypatch.setattr(locks, "ticks", lambda: real() + SUSPENDED_S)


# ---- what prune keeps -------------------------------------------------------------------------


def test_a_kept_delta_keeps_the_base_of_its_base(tmp_path: Path):
    """A chain two deep (the format allows 16): if only the first base counted as live, the last
    snapshot's save would lose the keyframe its chain ends in, and stop restoring."""
    src = tmp_path / "src"
    rng = np.random.default_rng(7)
    versions = [rng.normal(0, 0.02, PIECE // 4).astype(np.float32)]
    for _ in range(2):
        versions.append(versions[-1] + rng.normal(0, 1e-5, PIECE // 4).astype(np.float32))
    with Vault.init(str(tmp_path / "vault"), chunker=SMALL, pack_size=1 << 20, compression=DELTA) as vault:
        repo = vault._repo
        ids = [repo.chunk_id(v.tobytes()) for v in versions]
        snaps = []
        for k, v in enumerate(versions):  # save k: its one chunk a delta against save k-1's
            data = v.tobytes()
            if k == 0:
                repo.add_chunk(ids[0], repo.codec.encode(Kind.CHUNK, ids[0], data), len(data))
            else:
                blob = repo.codec.encode_delta(ids[k], data, ids[k - 1], versions[k - 1].tobytes(), ())
                repo.add_chunk(ids[k], blob, len(data), ids[k - 1])
            repo.flush()  # a pack of its own
            src.mkdir(exist_ok=True)
            (src / "w.bin").write_bytes(data)
            snaps.append(vault.backup(src, tags={"run": "t", "step": str(k)}))
            assert [e.chunks for e in vault.files(snaps[-1])] == [[ids[k]]]
        assert vault._repo.index.get(ids[2]).base_id == ids[1] and vault._repo.index.get(ids[1]).base_id == ids[0]
        result = vault.prune(keep_latest=1)
        assert [s.id for s in result.forgotten] == [snaps[0].id, snaps[1].id]
        restores_exactly(vault, snaps[2], src, tmp_path / "out")
        assert vault.check(read_data=1.0).ok


def test_a_chunk_is_kept_in_its_whole_copy_not_in_a_delta_against_a_lost_base(tmp_path: Path):
    """A chunk stored twice: as a delta whose base is in no index (its pack was lost; the next backup
    stored the chunk again, whole) and whole. Homing it in the unreadable delta copy would delete
    its only readable copy."""
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(11)
    lost = rng.normal(0, 0.02, PIECE // 4).astype(np.float32)
    x = (lost + rng.normal(0, 1e-5, PIECE // 4).astype(np.float32)).tobytes()
    with Vault.init(str(tmp_path / "vault"), chunker=SMALL, pack_size=1 << 20, compression=DELTA) as vault:
        repo = vault._repo
        x_id, lost_id = repo.chunk_id(x), repo.chunk_id(lost.tobytes())
        for name in ("a.bin", "b.bin"):  # live bytes that make the delta's pack the heavier one
            data = os.urandom(PIECE)
            (src / name).write_bytes(data)
            repo.add_chunk(repo.chunk_id(data), repo.codec.encode(Kind.CHUNK, repo.chunk_id(data), data), PIECE)
        repo.add_chunk(x_id, repo.codec.encode_delta(x_id, x, lost_id, lost.tobytes(), ()), len(x), lost_id)
        repo.flush()
        repo.load_index()
        assert x_id not in repo.index  # the delta copy cannot be read
        repo.add_chunk(x_id, repo.codec.encode(Kind.CHUNK, x_id, x), len(x))  # stored again, whole
        repo.flush()
        (src / "x.bin").write_bytes(x)
        snap = vault.backup(src)
        assert snap.summary.new_bytes == 0  # every chunk deduplicated against the hand-made ones
        vault.prune(keep_latest=1)
        restores_exactly(vault, snap, src, tmp_path / "out")
        assert vault.check(read_data=1.0).ok


def test_a_pack_cut_short_in_a_dead_chunk_is_salvaged_whatever_its_dead_share(tmp_path: Path):
    """A pack whose last chunk (a dead one, under 10 % of its bytes) was cut off: kept whole, its
    index would go on placing a chunk past its end, and check would fail at every run."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(900_000))
    (src / "small.bin").write_bytes(os.urandom(PIECE))
    url = str(tmp_path / "vault")
    with Vault.init(url, chunker=SMALL, pack_size=8 << 20) as vault:  # one pack holds both files
        first = vault.backup(src)
        chunks = {e.path: e.chunks for e in vault.files(first)}
        where = {c: vault._repo.index.get(c) for c in chunks["big.bin"] + chunks["small.bin"]}
        (src / "small.bin").unlink()
        kept = vault.backup(src)
    (pack_id,) = {loc.pack_id for loc in where.values()}
    last = max(where, key=lambda c: where[c].offset)
    assert chunks["small.bin"] == [last]  # the dead chunk is the pack's last: only it is cut
    pack = Path(url) / pack_key(pack_id)
    os.truncate(pack, where[last].offset + where[last].stored_len // 2)
    with Vault.open(url) as vault:
        result = vault.forget([first.id], prune=True)
        assert pack_id in result.gc.repack and not pack.exists()
        restores_exactly(vault, kept, src, tmp_path / "out")
        assert vault.check(read_data=1.0).ok


# ---- what stops prune before it deletes -------------------------------------------------------


@pytest.mark.parametrize("damage", ["flipped", "missing"])
def test_prune_refuses_when_a_kept_snapshots_tree_cannot_be_read(vault: Vault, tmp_path: Path, damage: str):
    """What a kept snapshot needs is unknown without its tree: treating it as needing nothing would
    delete every chunk only that snapshot holds."""
    (_, _), (newest, _) = two_snapshots(vault, tmp_path)
    tree = Path(vault.url) / tree_key(bytes.fromhex(newest.tree_id))
    if damage == "flipped":
        flip(tree, tree.stat().st_size // 2)
    else:
        tree.unlink()
    before = packs(vault.url)
    with Vault.open(vault.url) as fresh, pytest.raises(IntegrityError, match="prune refused: the tree object"):
        fresh.prune(keep_latest=2)
    assert packs(vault.url) == before


def test_forget_with_prune_refuses_while_another_snapshot_object_is_unreadable(vault: Vault, tmp_path: Path):
    """A damaged snapshot object (it may be repaired, or be a newer ckptvault's) names a tree prune
    cannot read. The refusal comes first, naming the cause, with nothing changed; without it the given
    snapshot was forgotten and only the GC's later re-listing stopped the deletes, blaming "another
    writer"."""
    (old, old_src), (new, _) = two_snapshots(vault, tmp_path)
    flip(Path(vault.url) / snapshot_key(bytes.fromhex(new.id)), 40)
    before = packs(vault.url)
    with Vault.open(vault.url) as fresh:
        with pytest.raises(IntegrityError, match="prune refused"):
            fresh.forget([old.id], prune=True)
        assert packs(vault.url) == before
        assert [s.id for s in fresh.snapshots()] == [old.id]  # nothing forgotten either
        restores_exactly(fresh, old, old_src, tmp_path / "out")


def _one_pack_of_two_saves(tmp_path: Path) -> tuple[str, Snapshot, Snapshot, bytes]:
    """A vault whose one pack holds keep.bin and drop.bin of a first save; a second save without drop.bin.
    Returns its URL, both snapshots and keep.bin's first chunk (live, in a pack mostly dead once the first goes)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "keep.bin").write_bytes(os.urandom(600_000))
    (src / "drop.bin").write_bytes(os.urandom(600_000))
    url = str(tmp_path / "vault")
    with Vault.init(url, chunker=SMALL, pack_size=8 << 20) as vault:  # one pack holds both files
        first = vault.backup(src)
        (src / "drop.bin").unlink()
        second = vault.backup(src)
        chunk = next(e for e in vault.files(first) if e.path == "keep.bin").chunks[0]
    return url, first, second, chunk


def test_a_damaged_live_chunk_is_never_repacked_and_its_pack_stays(tmp_path: Path):
    """Repacking copies a live chunk out of a mostly dead pack, then deletes that pack: a damaged chunk
    copied without being verified would lose the copy (still damaged, maybe repairable) it came from,
    and the prune would not say so."""
    url, first, _, chunk = _one_pack_of_two_saves(tmp_path)
    with Vault.open(url) as vault:
        loc = vault._repo.index.get(chunk)
    flip(Path(url) / pack_key(loc.pack_id), loc.offset + loc.stored_len // 2)
    before = packs(url)
    with Vault.open(url) as vault:
        with pytest.raises(IntegrityError, match="prune stopped before deleting any pack or index object"):
            vault.forget([first.id], prune=True)
        assert packs(url) == before


def test_a_live_chunk_of_a_newer_codec_stops_the_repack_as_a_newer_ckptvaults(tmp_path: Path):
    """Not damage: exit 17 naming the chunk, its pack kept; and the message says what did go already (the
    forgotten snapshot), where it said "stopped before deleting anything" (fs57)."""
    url, first, second, chunk = _one_pack_of_two_saves(tmp_path)
    with Vault.open(url) as vault:
        recode_chunk(vault, chunk, 9)
    before = packs(url)
    with Vault.open(url) as vault:
        with pytest.raises(UnsupportedFormatError, match=rf"chunk {chunk.hex()[:12]} in pack .*codec ID 9") as err:
            vault.forget([first.id], prune=True)
        said = str(err.value)
        assert "before deleting any pack or index object (the snapshots it forgets are removed already" in said
        assert packs(url) == before and [s.id for s in vault.snapshots()] == [second.id]


# ---- the lock, checked before each deleting step ----------------------------------------------


def test_a_backup_committed_while_old_index_objects_are_deleted_stops_the_pack_deletes(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A backup whose host judged the prune's lock stale (a skewed clock) deduplicates against the
    forgotten snapshot's pack while the prune deletes the old index objects: deleting that pack next
    would leave the new snapshot unrestorable."""
    (_, old_src), (new, new_src) = two_snapshots(vault, tmp_path)
    other = Vault.open(vault.url)
    repo = vault._repo
    real_delete_index = repo.delete_index
    committed: list = []
    first, done = threading.Lock(), threading.Event()

    def backup_meanwhile(index_id: bytes) -> None:  # the deletes run on several threads at once
        if first.acquire(blocking=False):
            try:
                with monkeypatch.context() as m:
                    m.setattr(LockManager, "is_stale", lambda *a, **k: True)
                    committed.append(other.backup(old_src))
            finally:
                done.set()
        done.wait()
        real_delete_index(index_id)

    monkeypatch.setattr(repo, "delete_index", backup_meanwhile)
    before = packs(vault.url)
    # it said "run prune again", which then refused ("run ckptvault repair-index, then prune again")
    stopped = r"another writer added data.*no pack was deleted since; the packs it meant to delete are in no index "
    with pytest.raises(VaultLockedError, match=stopped + r"now: run vault.repair_index\(\), then prune again$"):
        vault.prune(keep_latest=1)
    monkeypatch.undo()
    (again,) = committed
    assert again.summary.new_bytes == 0  # it stored nothing: it needs the forgotten snapshot's pack
    assert packs(vault.url) == before
    with Vault.open(vault.url) as fresh:
        assert {s.id for s in fresh.snapshots()} == {new.id, again.id}
        restores_exactly(fresh, again, old_src, tmp_path / "again")
        restores_exactly(fresh, new, new_src, tmp_path / "new")
        fresh.repair_index()  # as the message says
        fresh.prune(keep_latest=2)
        assert fresh.check(read_data=1.0).ok
    other.close()


def test_a_lock_lost_while_packs_are_deleted_leaves_the_trees(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Trees nothing refers to go last, after the lock is verified once more. A killed copy's tree has
    an ID derived from what it copies: a rerun of that copy, let in while this prune was suspended,
    commits a snapshot naming that very tree, which the prune must then not delete."""
    (old, old_src), (new, _) = two_snapshots(vault, tmp_path)
    # as if the second backup was killed after its tree, before its snapshot object
    (Path(vault.url) / snapshot_key(bytes.fromhex(new.id))).unlink()
    tree = Path(vault.url) / tree_key(bytes.fromhex(new.tree_id))
    with Vault.open(vault.url) as fresh:
        repo = fresh._repo
        real_delete_pack = repo.delete_pack

        def suspended_after(pack_id: bytes) -> None:
            real_delete_pack(pack_id)
            suspended_from_now(monkeypatch)

        monkeypatch.setattr(repo, "delete_pack", suspended_after)
        with pytest.raises(LockLostError):
            fresh.prune(keep_latest=1)
        monkeypatch.undo()
        assert tree.exists()
    with Vault.open(vault.url) as fresh:  # the next prune finishes the job
        fresh.prune(keep_latest=1)
        assert not tree.exists() and fresh.check(read_data=1.0).ok
        restores_exactly(fresh, old, old_src, tmp_path / "out")


def test_a_lock_lost_after_planning_forgets_no_snapshot(vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A prune suspended between its plan and its first delete may have let a backup in: it must not
    delete even the snapshots it planned to forget."""
    snaps = two_snapshots(vault, tmp_path)
    real_plan_gc = prune_module.plan_gc

    def plan_then_suspended(*args, **kwargs):
        plan = real_plan_gc(*args, **kwargs)
        suspended_from_now(monkeypatch)
        return plan

    monkeypatch.setattr(prune_module, "plan_gc", plan_then_suspended)
    before = packs(vault.url)
    with pytest.raises(LockLostError):
        vault.prune(keep_latest=1)
    monkeypatch.undo()
    assert packs(vault.url) == before
    with Vault.open(vault.url) as fresh:
        assert [s.id for s in fresh.snapshots()] == [s.id for s, _ in snaps]
        for snap, src in snaps:
            restores_exactly(fresh, snap, src, tmp_path / "out" / snap.id)


def test_garbage_collection_without_the_exclusive_lock_is_refused(vault: Vault, tmp_path: Path):
    """A plan made without the exclusive lock (a dry run's) takes a running backup's uploaded pack,
    not yet indexed, for a killed backup's leftover. Executed without the lock, it would delete it
    under the backup: every later lock check would pass, with no lock to verify."""
    kept_src, running_src = tmp_path / "kept", tmp_path / "running"
    for src in (kept_src, running_src):
        src.mkdir()
        (src / "model.bin").write_bytes(os.urandom(600_000))
    kept = vault.backup(kept_src)
    index_dir = Path(vault.url) / "index"
    indexed = set(index_dir.iterdir())
    running = vault.backup(running_src)
    # a backup still uploading: its pack is stored, its index object and snapshot not yet
    for path in set(index_dir.iterdir()) - indexed:
        path.unlink()
    (Path(vault.url) / snapshot_key(bytes.fromhex(running.id))).unlink()
    with Vault.open(vault.url) as fresh:
        plan = fresh.prune(keep_latest=1, dry_run=True).gc
        assert len(plan.delete_packs) == 1 and fresh._repo.locks.held == ()
        before = packs(vault.url)
        with pytest.raises(RuntimeError, match="needs the exclusive lock"):
            execute_gc(fresh._repo, plan)
        assert packs(vault.url) == before
        restores_exactly(fresh, kept, kept_src, tmp_path / "out")
