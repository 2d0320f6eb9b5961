"""A damaged index object: reads go around it through the packs' own headers, prune refuses, and
``repair-index`` rewrites it durably (real bytes flipped in a real repository)."""

import json
import logging
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from ckptvault import Snapshot, Vault
from ckptvault.errors import IntegrityError
from ckptvault.repository.format import pack_key
from ckptvault.repository.pack import TRAILER, header_range

from .test_corruption import flip


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def two_saves(repo_url: str, tmp_path: Path):
    """Two backups into a fresh vault; the first one's index object damaged. Returns the sources."""
    index_dir = Path(repo_url) / "index"
    saves = []
    with Vault.init(repo_url) as vault:
        for step in (1, 2):
            src = tmp_path / f"step-{step}"
            src.mkdir()
            (src / "weights.bin").write_bytes(os.urandom(300_000 * step))
            (src / "config.json").write_text(f'{{"step": {step}}}')
            vault.backup(src, tags={"step": str(step)})
            if step == 1:
                (first_index,) = os.listdir(index_dir)
            saves.append(src)
    flip(index_dir / first_index, os.path.getsize(index_dir / first_index) // 2)
    return saves, first_index


def one_pack(repo_url: str, tmp_path: Path, size: int) -> tuple[Path, Snapshot, Path]:
    """A fresh vault holding one backup of one random file of ``size`` bytes, in one pack: (the
    source folder, its snapshot, the pack file)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(size))
    with Vault.init(repo_url) as vault:
        snap = vault.backup(src)
    (pack,) = [p for p in (Path(repo_url) / "packs").rglob("*") if p.is_file()]
    return src, snap, pack


def damage_header(pack: Path) -> None:
    """Flip a byte in the middle of the pack's sealed header (a fixed distance from the end landed in
    the chunk's bytes when the header, compressed, came out short: the test failed ~1 run in 10)."""
    data = bytearray(pack.read_bytes())
    start, length = header_range(bytes(data[-TRAILER.size :]), len(data))
    data[start + length // 2] ^= 0xFF
    pack.write_bytes(bytes(data))


def test_reads_go_around_a_damaged_index_object_and_prune_refuses(
    two_saves, repo_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    saves, damaged = two_saves
    with caplog.at_level(logging.WARNING, logger="ckptvault.damage"), Vault.open(repo_url) as vault:
        for step, src in enumerate(saves, 1):
            vault.restore(vault.latest({"step": str(step)}), tmp_path / f"out-{step}")
            assert tree(tmp_path / f"out-{step}") == tree(src)
        assert f"index object(s) {damaged[:12]} damaged" in caplog.text and "vault.repair_index()" in caplog.text

        report = vault.check(read_data=1.0)
        assert [p.object for p in report.problems] == [f"index {damaged[:12]}"], report.problems
        assert "run: vault.repair_index()" in report.problems[0].detail and report.affected == {}

        (saves[1] / "new.bin").write_bytes(os.urandom(100_000))  # backups go on meanwhile
        newer = vault.backup(saves[1], tags={"step": "3"})
        vault.restore(newer, tmp_path / "out-3")
        assert tree(tmp_path / "out-3") == tree(saves[1])

        packs_before = sorted(os.listdir(Path(repo_url) / "packs"))
        with pytest.raises(IntegrityError, match=r"index object .* is damaged.*vault\.repair_index\(\)"):
            vault.prune(keep_latest=1)
        assert sorted(os.listdir(Path(repo_url) / "packs")) == packs_before  # nothing deleted

        planned = vault.repair_index(dry_run=True)
        assert planned.damaged == [damaged] and planned.packs_reindexed >= 1 and planned.unreadable_packs == []
        assert damaged in os.listdir(Path(repo_url) / "index")

        done = vault.repair_index()
        assert done.damaged == [damaged] and done.packs_reindexed == planned.packs_reindexed
        assert damaged not in os.listdir(Path(repo_url) / "index")
        assert vault.check(read_data=1.0).ok
    with Vault.open(repo_url) as vault:  # a fresh process sees a whole index: prune runs
        vault.prune(keep_latest=1)
        vault.restore("latest", tmp_path / "after")
        assert tree(tmp_path / "after") == tree(saves[1]) and vault.check(read_data=1.0).ok


def test_a_pack_whose_index_and_header_are_both_damaged_is_indexed_from_what_the_object_still_says(
    two_saves, repo_url: str, tmp_path: Path
):
    saves, damaged = two_saves
    with Vault.open(repo_url) as vault:
        first = vault.latest({"step": "1"})
        (pack_id,) = {vault._repo.index.get(c).pack_id for e in vault.files(first) for c in e.chunks}
    pack = Path(repo_url) / pack_key(pack_id)
    flip(pack, os.path.getsize(pack) - 12)  # inside the sealed header, just before its length
    with Vault.open(repo_url) as vault:
        report = vault.check()
        named = [p.detail for p in report.problems if p.object == f"pack {pack_id.hex()[:12]}"]
        assert named and "header is damaged" in named[0], report.problems
        assert set(report.affected) == {first.id}, report.affected  # the second save has its own index
        result = vault.repair_index()
        assert result.damaged == [damaged] and result.unreadable_packs == []
        assert result.salvaged_packs == [pack_id.hex()]  # the entries of it that verify (one byte flipped in one)
        vault.restore(vault.latest({"step": "2"}), tmp_path / "out")
        assert tree(tmp_path / "out") == tree(saves[1])


def test_repair_index_cli(two_saves, repo_url: str, cli):
    _, damaged = two_saves
    proc = cli("repair-index", "--repo", repo_url, "--dry-run")
    assert f"damaged index objects: {damaged[:12]}; would index" in proc.stdout.decode()
    proc = cli("repair-index", "--repo", repo_url)
    assert f"damaged index objects: {damaged[:12]}; indexed" in proc.stdout.decode(), proc.stdout
    assert "removed the damaged object(s)" in proc.stdout.decode()
    proc = cli("check", "--repo", repo_url, "--read-data")
    assert proc.stdout.decode().startswith("no problems found"), proc.stdout


def test_a_backup_does_not_deduplicate_against_packs_that_are_gone(
    repo_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    # what a backup that lost its lock to a prune leaves: index objects naming packs the prune deleted,
    # and no snapshot; the next backup of the same bytes must store them again, not point at nothing
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(400_000))
    with Vault.init(repo_url) as vault:
        orphaned = vault.backup(src)
    (Path(repo_url) / "snapshots" / orphaned.id).unlink()
    for pack in (Path(repo_url) / "packs").rglob("*"):
        if pack.is_file():
            pack.unlink()
    with caplog.at_level(logging.WARNING, logger="ckptvault.damage"), Vault.open(repo_url) as vault:
        snap = vault.backup(src)
        assert snap.summary.new_bytes > 0 and "missing from the store" in caplog.text
    for attempt in range(4):  # fresh readers, whichever copy the index objects' order puts first
        with Vault.open(repo_url) as vault:
            vault.restore(snap, tmp_path / f"out-{attempt}")
        assert tree(tmp_path / f"out-{attempt}") == tree(src)
    with Vault.open(repo_url) as vault:
        report = vault.check(read_data=1.0)
        assert report.affected == {} and all("is missing" in p.detail for p in report.problems), report.problems
        repaired = vault.repair_index()
        assert repaired.missing_packs and repaired.damaged == [] and vault.check(read_data=1.0).ok
        vault.prune(keep_latest=1)
        vault.restore(snap, tmp_path / "after-prune")
    assert tree(tmp_path / "after-prune") == tree(src)


def test_a_deleted_index_object_is_recoverable_and_check_says_so(two_saves, repo_url: str, cli, tmp_path: Path):
    saves, first_index = two_saves
    (Path(repo_url) / "index" / first_index).unlink()  # gone, not damaged: its packs are simply in no index
    # reads go around it too: the packs no index names are read by their own headers (restore said
    # "chunk is missing from the repository")
    restored = cli("restore", "--repo", repo_url, "--tag", "step=1", "latest", str(tmp_path / "first"))
    assert "no index object names" in restored.stderr.decode() and tree(tmp_path / "first") == tree(saves[0])
    assert cli("cat", "--repo", repo_url, "--tag", "step=1", "latest", "config.json").stdout == b'{"step": 1}'
    with Vault.open(repo_url) as vault:
        report = vault.check()
        assert report.affected == {} and report.problems, report.problems
        said = "holds it (the snapshot still restores); run: vault.repair_index()"
        assert all(said in p.detail for p in report.problems), report.problems
    proc = cli("check", "--repo", repo_url, check=False)
    assert proc.returncode == 30 and "forget" not in proc.stderr.decode()
    # the way on is each line's repair-index, not check once more (docs audit 39 L6: "run: ckptvault check
    # --read-data (it says what to do)" closed check's own error)
    assert proc.stderr.decode().rstrip().endswith("follow the hint on each line"), proc.stderr
    assert cli("repair-index", "--repo", repo_url).returncode == 0
    assert cli("check", "--repo", repo_url, "--read-data").stdout.decode().startswith("no problems found")


def test_a_pack_cut_short_is_stored_again_by_the_next_backup_and_salvaged_by_prune(
    repo_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, cli
):
    # a truncated upload or a damaged disk: the index places chunks past the pack's end; the next
    # backup of those bytes said "saved" while deduplicating against them, and its snapshot did not restore
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(3_000_000))
    (src / "small.bin").write_bytes(os.urandom(200_000))  # at the pack's start: survives the cut
    with Vault.init(repo_url) as vault:
        first = vault.backup(src)
    (pack,) = [p for p in (Path(repo_url) / "packs").rglob("*") if p.is_file()]
    os.truncate(pack, pack.stat().st_size // 2)
    only_weights = tmp_path / "only-weights"
    only_weights.mkdir()
    (only_weights / "weights.bin").write_bytes((src / "weights.bin").read_bytes())
    with caplog.at_level(logging.WARNING, logger="ckptvault.damage"), Vault.open(repo_url) as vault:
        second = vault.backup(only_weights)
        assert second.summary.new_bytes == 3_000_000 and "shorter than the index says" in caplog.text
    for snap in (first, second):  # the old snapshot too: its chunks now have whole copies
        with Vault.open(repo_url) as vault:
            vault.restore(snap, tmp_path / f"out-{snap.id}")
        assert (tmp_path / f"out-{snap.id}" / "weights.bin").read_bytes() == (src / "weights.bin").read_bytes()
    proc = cli("check", "--repo", repo_url, check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 30 and "forget" not in err and "no snapshot is affected" in err, err
    assert (
        f"other packs hold them: ckptvault prune --repo {repo_url} copies out its whole chunks and removes it"
        in proc.stdout.decode()
    )
    with Vault.open(repo_url) as vault:
        vault.prune(keep_latest=2)  # small.bin's chunk is salvaged from the cut pack, which goes
        assert not pack.exists() and vault.check(read_data=1.0).ok
        vault.restore(first, tmp_path / "after-prune")
    assert tree(tmp_path / "after-prune") == tree(src)


def test_a_pack_cut_short_that_holds_the_only_copy_is_named_and_never_pruned(repo_url: str, tmp_path: Path):
    _, snap, pack = one_pack(repo_url, tmp_path, 3_000_000)
    os.truncate(pack, pack.stat().st_size // 2)
    with Vault.open(repo_url) as vault:
        report = vault.check()
        assert report.affected == {snap.id: ["weights.bin"]}
        assert "a backup of the files holding them stores them again" in str(report.problems)
        with pytest.raises(IntegrityError) as refused:
            vault.prune(keep_latest=1)
    assert pack.exists()
    # it said "in no indexed pack" and, with a stray pack beside it, "run ckptvault repair-index"
    assert re.search(
        rf"1 indexed pack\(s\) holding them are cut short \(truncated; e.g. {pack.name[:12]}, [\d,]+ bytes stored\); "
        r"nothing was deleted; run: vault\.check\(\), which names the files and snapshots that need them; back those "
        r"files up again, or forget those snapshots, then prune again$",
        str(refused.value),
    ), refused.value


def test_plain_repair_index_names_a_pack_cut_short(repo_url: str, tmp_path: Path, cli):
    """It said only "damaged index objects: none; indexed 0 pack(s) again", exit 0 (audit 35a F9)."""
    _, _, pack = one_pack(repo_url, tmp_path, 300_000)
    os.truncate(pack, pack.stat().st_size // 2)
    proc = cli("repair-index", "--repo", repo_url)
    err = proc.stderr.decode()
    assert f"1 indexed pack(s) end before chunks the index places in them (cut short; e.g. {pack.name[:12]})" in err
    assert f"check --repo {repo_url} names the snapshots and files that need them" in err, err
    assert json.loads(cli("repair-index", "--json", "--repo", repo_url).stdout)["cut_short_packs"] == [pack.name]
    proc = cli("repair-index", "--read-data", "--json", "--repo", repo_url)  # it drops the cut chunks instead
    assert "cut short" not in proc.stderr.decode()
    repaired = json.loads(proc.stdout)
    assert repaired["damaged_chunks"] and repaired["cut_short_packs"] == []
    assert json.loads(cli("repair-index", "--json", "--repo", repo_url).stdout)["cut_short_packs"] == []


def test_prune_names_a_pack_gone_from_the_storage_and_sends_no_one_to_repair_index(repo_url: str, tmp_path: Path):
    _, _, pack = one_pack(repo_url, tmp_path, 300_000)
    index_before = set((Path(repo_url) / "index").iterdir())
    with Vault.open(repo_url) as vault:  # a killed backup's leftover: a pack of other data whose header reads
        other = tmp_path / "other"
        other.mkdir()
        (other / "x.bin").write_bytes(os.urandom(200_000))
        leftover = vault.backup(other)
    for index in set((Path(repo_url) / "index").iterdir()) - index_before:
        index.unlink()
    (Path(repo_url) / "snapshots" / leftover.id).unlink()
    (stray,) = [p for p in (Path(repo_url) / "packs").rglob("*") if p.is_file() and p != pack]
    pack.unlink()
    with Vault.open(repo_url) as vault, pytest.raises(IntegrityError) as refused:
        vault.prune(keep_latest=2)
    said = str(refused.value)
    assert f"1 indexed pack(s) holding them are missing from the storage (e.g. {pack.name[:12]})" in said, said
    assert "repair_index" not in said and "damaged header" not in said and "run: vault.check()" in said
    assert stray.exists()


def test_a_damaged_chunk_found_by_reading_is_dropped_so_the_next_backup_stores_it_again(
    repo_url: str, tmp_path: Path, cli
):
    # after check --read-data named a damaged chunk, a backup of the same file deduplicated against it
    # ("0 B new"), status called the file backed up, and the new snapshot did not restore
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(400_000))
    (src / "other.bin").write_bytes(os.urandom(400_000))
    with Vault.init(repo_url, pack_size=1 << 20) as vault:
        first = vault.backup(src)
        damaged_file = "weights.bin"
        chunk = vault.files(first)[[e.path for e in vault.files(first)].index(damaged_file)].chunks[0]
        loc = vault._repo.index.get(chunk)
    flip(Path(repo_url) / pack_key(loc.pack_id), loc.offset + loc.stored_len // 2)
    proc = cli("check", "--repo", repo_url, "--read-data", check=False)
    said = proc.stdout.decode()
    assert proc.returncode == 30 and f"repair-index --repo {repo_url} --read-data drops it" in said, said
    last = proc.stderr.decode().strip()  # healing comes before forgetting
    assert f"still on disk, ckptvault repair-index --repo {repo_url} --read-data and a new backup" in last
    assert last.index("repair-index") < last.index("ckptvault forget")
    dry = cli("repair-index", "--repo", repo_url, "--read-data", "--dry-run").stdout.decode()
    assert "would drop 1 damaged chunk(s)" in dry
    assert "dropped 1 damaged chunk(s)" in cli("repair-index", "--repo", repo_url, "--read-data").stdout.decode()
    # what is left is the backup: the check no longer sends the user back to repair-index (ux43)
    last = cli("check", "--repo", repo_url, check=False).stderr.decode().strip()
    assert "still on disk, a new backup of them stores those chunks again" in last and "repair-index" not in last, last
    said = cli("status", str(src), "--repo", repo_url, check=False)
    assert said.returncode == 40  # not called backed up, and what heals it is named
    assert f"store those bytes anew: ckptvault backup --repo {repo_url} {src}" in said.stdout.decode()
    with Vault.open(repo_url) as vault:
        assert f"store those bytes anew: Vault.backup({str(src)!r})" in vault.backup_status(src).detail
        second = vault.backup(src)  # as status advised: the file whose chunk is gone is read again
        assert second.summary.new_chunks == 1
        assert vault.check(read_data=1.0).affected == {}  # the old snapshot restores through the new copy
        for snap in (first, second):
            vault.restore(snap, tmp_path / f"out-{snap.id}")
            assert tree(tmp_path / f"out-{snap.id}") == tree(src)
        vault.prune(keep_latest=2, repack_threshold=0.0)
        assert vault.check(read_data=1.0).ok


def test_read_data_repair_drops_a_damaged_base_not_the_intact_deltas_against_it(tmp_path: Path):
    # a delta fails to decode with its base: dropping it too meant a backup storing the base again
    # could not bring back the snapshots that need the delta
    def safetensors(values: np.ndarray) -> bytes:
        header = json.dumps({"w": {"dtype": "F32", "shape": [values.size], "data_offsets": [0, values.nbytes]}})
        header += " " * (-len(header) % 8)
        return struct.pack("<Q", len(header)) + header.encode() + values.tobytes()

    src, url = tmp_path / "src", str(tmp_path / "vault")
    src.mkdir()
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(1_500_000).astype(np.float32)
    (src / "model.safetensors").write_bytes(safetensors(weights))
    with Vault.init(url) as vault:
        vault.backup(src, tags={"run": "x", "step": "1"})
        first_save = (src / "model.safetensors").read_bytes()
        weights = weights + rng.standard_normal(weights.size).astype(np.float32) * 1e-4
        (src / "model.safetensors").write_bytes(safetensors(weights))
        second = vault.backup(src, tags={"run": "x", "step": "2"})
        index = vault._repo.index
        delta = next(c for c in vault.files(second)[0].chunks if index.get(c).base_id is not None)
        base = index.get(delta).base_id
        loc = index.get(base)
    flip(Path(url) / pack_key(loc.pack_id), loc.offset + loc.stored_len // 2)
    with Vault.open(url) as vault:
        dropped = vault.repair_index(read_data=True).damaged_chunks
        assert base.hex() in dropped and delta.hex() not in dropped
    (src / "model.safetensors").write_bytes(first_save)  # the base's bytes, stored again by the next backup
    with Vault.open(url) as vault:
        vault.backup(src, tags={"run": "x", "step": "1-again"}, force_read=True)
        vault.restore(second, tmp_path / "out")
        assert vault.check(read_data=1.0).affected == {}
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == safetensors(weights)


def test_a_pack_in_no_index_with_a_damaged_header_is_said_to_be_prunable(repo_url: str, tmp_path: Path, cli):
    # check said repair-index would index it again, and repair-index that check would name what it affects
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(300_000))
    with Vault.init(repo_url) as vault:
        vault.backup(src)
    (pack,) = [p for p in (Path(repo_url) / "packs").rglob("*") if p.is_file()]
    stray = Path(repo_url) / "packs" / "ab" / ("ab" * 32)
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(pack.read_bytes()[:-100])  # a killed write's leftover: its trailer is gone
    proc = cli("check", "--repo", repo_url)
    assert "1 of them with a damaged header: nothing can name their chunks, and prune removes them" in (
        proc.stderr.decode()
    )
    with Vault.open(repo_url) as vault:
        vault.prune(keep_latest=1)
        assert not stray.exists() and vault.check(read_data=1.0).ok


def test_prune_with_the_index_gone_points_at_repair_index(repo_url: str, tmp_path: Path):
    """Every chunk is in a pack no index object names: the way out is repair-index, not check."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(300_000))  # one chunk or two: the advice is the same
    with Vault.init(repo_url) as vault:
        vault.backup(src)
    for index in (Path(repo_url) / "index").iterdir():
        index.unlink()
    with Vault.open(repo_url) as vault:
        assert vault.stats().unindexed_packs == 1  # stats said "0 B in 0 chunks" and nothing else
        with pytest.raises(
            IntegrityError,
            match=r"1 pack\(s\) in no index hold (it|them): run vault\.repair_index\(\), then prune again$",
        ):
            vault.prune(keep_latest=1)
        vault.repair_index()
        assert vault.stats().unindexed_packs == 0
        assert vault.prune(keep_latest=1).gc.delete_packs == {}


def test_prune_does_not_send_back_to_repair_index_when_the_stray_pack_cannot_be_read(repo_url: str, tmp_path: Path):
    """Index object and pack header both damaged: repair-index said the pack's chunks cannot be located,
    and prune then said to run repair-index (audit 35a F7: advice that loops)."""
    _, _, pack = one_pack(repo_url, tmp_path, 300_000)
    for index in (Path(repo_url) / "index").iterdir():
        index.unlink()
    damage_header(pack)
    with Vault.open(repo_url) as vault:
        assert vault.repair_index().unreadable_packs == [pack.name]
        with pytest.raises(IntegrityError) as refused:
            vault.prune(keep_latest=1)
    assert f"1 pack(s) in no index have a damaged header, which nothing can read (e.g. {pack.name[:12]})" in str(
        refused.value
    )
    assert "repair_index" not in str(refused.value) and "forget those snapshots" in str(refused.value)
    assert pack.exists()


def test_a_pack_whose_header_is_damaged_is_rewritten_by_repair_index_read_data(repo_url: str, tmp_path: Path, cli):
    """The pack reads through the index, but nothing repaired its header: check failed at every run, and
    the pack was one damaged index object away from being lost."""
    src, snap, pack = one_pack(repo_url, tmp_path, 2_000_000)
    damage_header(pack)
    proc = cli("check", "--repo", repo_url, check=False)
    said = proc.stdout.decode()
    assert proc.returncode == 30 and f"repair-index --repo {repo_url} --read-data copies them" in said, said
    dry = cli("repair-index", "--read-data", "--dry-run", "--repo", repo_url).stdout.decode()
    assert "would copy the chunks of 1 pack(s) whose header is damaged" in dry and pack.exists()
    done = cli("repair-index", "--read-data", "--repo", repo_url).stdout.decode()
    assert "copied the chunks of 1 pack(s) whose header is damaged into new packs" in done, done
    assert not pack.exists()
    cli("check", "--read-data", "--repo", repo_url)
    cli("restore", snap.id, str(tmp_path / "out"), "--repo", repo_url)
    assert (tmp_path / "out" / "weights.bin").read_bytes() == (src / "weights.bin").read_bytes()


def test_a_damaged_header_pack_holding_bytes_no_index_entry_covers_is_kept_by_repair_index_read_data(
    repo_url: str, tmp_path: Path, cli
):
    """A damaged index object can lose an entry (its bytes garbled) while the pack's header is damaged
    too: rewriting the pack from the entries left deleted the one intact copy of that chunk."""
    # more than the largest chunk (4 MiB): two chunks at least, whatever the random bytes (3 MB was one in CI)
    _, _, pack = one_pack(repo_url, tmp_path, 6_000_000)
    with Vault.open(repo_url) as vault:
        repo = vault._repo
        ((index_id, packs),) = repo.read_index_objects().items()
        ((pack_id, entries),) = packs.items()
        assert len(entries) >= 2
        with repo.locks.acquire(exclusive=True):
            repo.write_index({pack_id: entries[:-1]})  # what is left of the damaged object: the last chunk lost
            repo.delete_index(index_id)
    damage_header(pack)
    kept = pack.read_bytes()
    done = cli("repair-index", "--read-data", "--repo", repo_url)
    assert "hold bytes no index entry accounts for" in done.stderr.decode(), done.stderr
    assert pack.read_bytes() == kept, "the pack holding the lost entry's chunk was rewritten"
    with Vault.open(repo_url) as vault:
        assert vault.repair_index(read_data=True, dry_run=True).kept_packs == [pack_id.hex()]


def test_a_pack_whose_trailer_is_damaged_is_still_rewritten(repo_url: str, tmp_path: Path):
    """Its header still decodes right after the last entry: nothing in it is unaccounted for."""
    src, snap, pack = one_pack(repo_url, tmp_path, 2_000_000)
    flip(pack, pack.stat().st_size - 1)  # the trailer's magic
    with Vault.open(repo_url) as vault:
        result = vault.repair_index(read_data=True)
        assert result.kept_packs == [] and len(result.rewritten_packs) == 1 and not pack.exists()
        vault.restore(snap, tmp_path / "out")
    assert (tmp_path / "out" / "weights.bin").read_bytes() == (src / "weights.bin").read_bytes()


def test_a_pack_whose_only_chunk_was_dropped_is_not_called_unindexed_by_stats(repo_url: str, tmp_path: Path):
    """Its index object still names it, with no entries: repair-index cannot index it "again"."""
    src = tmp_path / "src"
    src.mkdir()
    # under the default chunker's smallest chunk (256 KiB): one chunk always (300 KB of random bytes made two in
    # ~1 run of 50, leaving the pack another indexed chunk, and the test checked nothing)
    (src / "w.bin").write_bytes(os.urandom(200_000))
    with Vault.init(repo_url) as vault:
        snap = vault.backup(src)
        (chunk,) = vault.files(snap)[0].chunks
        loc = vault._repo.index.get(chunk)
    flip(Path(repo_url) / pack_key(loc.pack_id), loc.offset + loc.stored_len // 2)
    with Vault.open(repo_url) as vault:
        assert len(vault.repair_index(read_data=True).damaged_chunks) == 1
        assert vault.stats().unindexed_packs == 0


def test_a_damaged_index_object_still_maps_a_pack_whose_header_is_damaged_too(repo_url: str, tmp_path: Path, cli):
    """Two flipped bytes: one in a pack's header, one in the index object naming it. repair-index deleted
    the object, the pack's chunks could no longer be located, check advised forget, and forget --prune
    deleted a pack whose every chunk was intact. Now the object's entries are taken where each verifies."""
    src, snap, pack = one_pack(repo_url, tmp_path, 2_000_000)
    (index,) = [p for p in (Path(repo_url) / "index").iterdir()]
    damage_header(pack)
    flip(index, index.stat().st_size - 1)  # its checksum fails; the entries it holds are still whole
    proc = cli("check", "--repo", repo_url, check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 30 and f"run ckptvault repair-index --repo {repo_url} first" in err, err
    assert "ckptvault forget" not in err, err
    done = cli("repair-index", "--repo", repo_url).stdout.decode()
    assert "indexed 1 pack(s) whose header is damaged from what the damaged index object(s) said" in done, done
    cli("restore", snap.id, str(tmp_path / "out"), "--repo", repo_url)
    assert (tmp_path / "out" / "weights.bin").read_bytes() == (src / "weights.bin").read_bytes()
    cli("repair-index", "--read-data", "--repo", repo_url)  # and the header is made sound again
    cli("check", "--read-data", "--repo", repo_url)


def dropped_pack(repo_url: str, tmp_path: Path, cli) -> tuple[Path, Path, int]:
    """A vault holding one file of one chunk in one pack, read damaged (a byte flipped in the chunk) when
    repair-index --read-data dropped it: (the source, the pack, the byte's offset: flip it to heal)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(200_000))
    with Vault.init(repo_url) as vault:
        snap = vault.backup(src)
        (chunk,) = vault.files(snap)[0].chunks
        loc = vault._repo.index.get(chunk)
    pack, at = Path(repo_url) / pack_key(loc.pack_id), loc.offset + loc.stored_len // 2
    flip(pack, at)  # what reading it gives while the fault lasts
    assert "dropped 1 damaged chunk(s)" in cli("repair-index", "--repo", repo_url, "--read-data").stdout.decode()
    return src, pack, at


def test_a_dropped_pack_that_reads_whole_again_is_indexed_again(repo_url: str, tmp_path: Path, cli):
    """--drop-failing-packs takes a storage fault that passes for a damaged pack (a link cutting every
    download, a 500 window): once it passed, nothing brought the snapshot back, and check advised forget
    (audit 32a F2). A repair-index --read-data before the prune indexes again the chunks that verify."""
    src, pack, at = dropped_pack(repo_url, tmp_path, cli)
    assert cli("restore", "latest", str(tmp_path / "lost"), "--repo", repo_url, check=False).returncode == 30
    flip(pack, at)  # the fault passed: the pack reads whole again
    assert "dropped pack" not in cli("repair-index", "--repo", repo_url).stdout.decode()  # reads no pack
    out = cli("repair-index", "--repo", repo_url, "--read-data").stdout.decode()
    assert "indexed the chunks of 1 dropped pack(s) that read and verify now again" in out, out
    cli("restore", "latest", str(tmp_path / "back"), "--repo", repo_url)
    assert tree(tmp_path / "back") == tree(src)
    with Vault.open(repo_url) as vault:
        assert vault.check(read_data=1.0).ok
        vault.prune(keep_latest=1)
        assert pack.exists() and vault.check(read_data=1.0).ok  # not taken for a pack no chunk needs


def test_a_dropped_chunk_stored_again_since_is_not_indexed_twice(repo_url: str, tmp_path: Path, cli):
    """Reviving a dropped pack whose chunks a later backup stored again (as --drop-failing-packs advises)
    indexed them twice, and prune then kept the once failing copy about half the time."""
    src, old_pack, at = dropped_pack(repo_url, tmp_path, cli)
    with Vault.open(repo_url) as vault:
        assert vault.backup(src, force_read=True).summary.new_chunks == 1  # stored again, in a new pack
    flip(old_pack, at)
    out = cli("repair-index", "--repo", repo_url, "--read-data").stdout.decode()
    assert "dropped pack" not in out, out
    with Vault.open(repo_url) as vault:
        vault.prune(keep_latest=2)
        assert not old_pack.exists(), "the pack no index names a chunk of is removed, the new copy kept"
        assert vault.check(read_data=1.0).ok


def test_check_of_a_lost_index_object_says_the_snapshots_it_names_still_restore(cli, tmp_path):
    """Each line named a snapshot while the summary said "affecting 0 snapshot(s)" (cr48 F5)."""
    from tests.conftest import one_file_vault

    repo = one_file_vault(cli, tmp_path)
    for index_object in (Path(repo) / "index").iterdir():
        index_object.unlink()
    proc = cli("check", "--repo", repo, check=False)
    said = proc.stdout.decode() + proc.stderr.decode()
    assert proc.returncode == 30 and "holds it (the snapshot still restores); run: ckptvault repair-index" in said
    assert "no snapshot is affected: each still restores" in said, said
