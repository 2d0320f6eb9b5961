"""``ckptvault status PATH`` / ``Vault.is_backed_up``: safe to delete only when every file is
durably stored with the same content."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from ckptvault.ops.status import _missing_chunks
from ckptvault.repository.index import ChunkLocation
from tests.conftest import write_file
from tests.test_corruption import flip


def checkpoint(path: Path) -> Path:
    write_file(path / "model.safetensors", os.urandom(300_000))
    write_file(path / "optimizer.pt", os.urandom(100_000))
    write_file(path / "trainer_state.json", b'{"global_step": 1200}')
    return path


def test_a_backed_up_checkpoint_is_reported_with_its_snapshot(tmp_path, vault):
    ckpt = checkpoint(tmp_path / "checkpoints" / "checkpoint-1200")
    assert not vault.is_backed_up(ckpt)
    snap = vault.backup(ckpt, tags={"step": "1200"})
    status = vault.backup_status(ckpt)
    assert status.backed_up and status.snapshot is not None and status.snapshot.id == snap.id
    assert status.files == 3 and status.prefix == ""
    assert vault.is_backed_up(ckpt / "optimizer.pt"), "one file of it is held too"
    newer = vault.backup(ckpt.parent)  # a later snapshot holds it too: status names the newest
    assert newer.time > snap.time
    status = vault.backup_status(ckpt)
    assert status.snapshot is not None and status.snapshot.id == newer.id and status.prefix == "checkpoint-1200/"


def test_a_checkpoint_inside_a_backup_of_its_parent_counts(tmp_path, vault):
    parent = tmp_path / "checkpoints"
    checkpoint(parent / "checkpoint-1200")
    checkpoint(parent / "checkpoint-1300")
    vault.backup(parent)
    status = vault.backup_status(parent / "checkpoint-1300")
    assert status.backed_up and status.prefix == "checkpoint-1300/"


def test_any_difference_means_not_backed_up(tmp_path, vault):
    ckpt = checkpoint(tmp_path / "checkpoint-5")
    vault.backup(ckpt)
    data = bytearray((ckpt / "optimizer.pt").read_bytes())
    data[500] ^= 1  # same size, same name, one bit of content
    (ckpt / "optimizer.pt").write_bytes(bytes(data))
    assert not vault.is_backed_up(ckpt)
    vault.backup(ckpt)
    assert vault.is_backed_up(ckpt)
    write_file(ckpt / "extra.bin", b"new")
    assert not vault.is_backed_up(ckpt)


def test_one_file_whose_bytes_a_snapshot_holds_under_another_name_is_backed_up(tmp_path, vault, repo_url, cli):
    """Lightning's last.ckpt is a copy of the newest epoch=N-step=M.ckpt, which its callback ships once, under
    that name: `status ckpts/last.ckpt`, the check before deleting or shutting down, said NOT backed up (exit
    40) with "no snapshot holds its 1 file(s) with the same content" (tr43). A folder still needs its names."""
    ckpts = tmp_path / "ckpts"
    write_file(ckpts / "epoch=11-step=96.ckpt", os.urandom(200_000))
    snap = vault.backup(ckpts / "epoch=11-step=96.ckpt", tags={"step": "96"})
    write_file(ckpts / "last.ckpt", (ckpts / "epoch=11-step=96.ckpt").read_bytes())
    status = vault.backup_status(ckpts / "last.ckpt")
    assert status.backed_up and status.snapshot is not None and status.snapshot.id == snap.id, status
    assert status.detail == f"in snapshot {snap.short_id} as epoch=11-step=96.ckpt"
    said = cli("status", str(ckpts / "last.ckpt"), "--repo", repo_url)
    assert f"backed up: 1 file, 200.00 KB; in snapshot {snap.short_id} as epoch=11-step=96.ckpt" in said.stdout.decode()
    data = bytearray((ckpts / "last.ckpt").read_bytes())
    data[7] ^= 1
    (ckpts / "last.ckpt").write_bytes(bytes(data))
    assert not vault.is_backed_up(ckpts / "last.ckpt")  # the same size is not the same bytes
    write_file(tmp_path / "renamed" / "other.ckpt", (ckpts / "epoch=11-step=96.ckpt").read_bytes())
    assert not vault.is_backed_up(tmp_path / "renamed")  # a folder is restored by its names
    write_file(tmp_path / "empty", b"")
    vault.backup(tmp_path / "empty")
    write_file(tmp_path / "nothing", b"")
    assert not vault.is_backed_up(tmp_path / "nothing")  # any empty file is not this one


def test_a_snapshot_whose_pack_is_gone_is_not_durable(tmp_path, repo_url, vault):
    ckpt = checkpoint(tmp_path / "checkpoint-9")
    vault.backup(ckpt)
    for pack in (Path(repo_url) / "packs").rglob("*"):
        if pack.is_file():
            pack.unlink()
    status = vault.backup_status(ckpt)
    assert not status.backed_up and "missing" in status.detail


def test_a_snapshot_whose_pack_is_cut_short_is_not_durable(tmp_path, repo_url, vault):
    """It said "backed up" while restore failed on the truncated pack (audit 36a F2)."""
    ckpt = checkpoint(tmp_path / "checkpoint-9")
    vault.backup(ckpt)
    (pack,) = [p for p in (Path(repo_url) / "packs").rglob("*") if p.is_file()]
    os.truncate(pack, pack.stat().st_size // 2)
    status = vault.backup_status(ckpt)
    assert not status.backed_up
    assert "which is cut short (truncated); run: vault.check()" in status.detail, status.detail
    assert pack.name[:12] in status.detail


def test_status_of_several_paths_warns_once_of_a_damaged_index_object(tmp_path, repo_url, vault, cli):
    """Each path reloaded the index and said the same warning again (audit 36a F8)."""
    ckpts = [checkpoint(tmp_path / f"checkpoint-{i}") for i in range(3)]
    for ckpt in ckpts:
        vault.backup(ckpt)
    vault.close()
    index = next(p for p in (Path(repo_url) / "index").iterdir())
    flip(index, index.stat().st_size // 2)
    proc = cli("status", *map(str, ckpts), "--repo", repo_url)
    assert proc.stderr.decode().count("index object(s)") == 1, proc.stderr.decode()
    assert proc.stdout.decode().count(": backed up") == 3


def test_status_cli_exit_codes_for_scripts(tmp_path, repo_url, vault, cli):
    done = checkpoint(tmp_path / "ck" / "checkpoint-1")
    todo = checkpoint(tmp_path / "ck" / "checkpoint-2")
    vault.backup_async(done, tags={"step": "1"}).result(timeout=60)  # pinned: the snapshot holds a pin's path
    ok = cli("status", str(done), "--repo", repo_url)
    assert "backed up" in ok.stdout.decode() and "NOT" not in ok.stdout.decode()
    both = cli("status", str(done), str(todo), "--repo", repo_url, "--json", check=False)
    assert both.returncode == 40
    assert [r["backed_up"] for r in json.loads(both.stdout)] == [True, False]
    err = both.stderr.decode().strip().splitlines()
    assert len(err) == 1 and "not backed up" in err[0]
    missing = cli("status", str(tmp_path / "nope"), "--repo", repo_url, check=False)
    assert missing.returncode == 3 and "Traceback" not in missing.stderr.decode()


def test_quiet_status_names_every_path_to_keep(tmp_path, repo_url, cli):
    """With -q only the error line is left, and a cleanup script's user reads it: it named the first
    path that is not backed up only (audit 31b L2)."""
    first = checkpoint(tmp_path / "ck" / "checkpoint-1")
    second = checkpoint(tmp_path / "ck" / "checkpoint-2")
    cli("init", repo_url, check=False)
    proc = cli("status", str(first), str(second), "--repo", repo_url, "-q", check=False)
    assert proc.returncode == 40
    assert f"keep them: {first}, {second}" in proc.stderr.decode()


def test_a_file_still_being_written_is_named_when_a_pinned_backup_left_it_out(tmp_path, vault):
    """backup_async (and watch) pin no name still being written (``*.tmp``): the checkpoint is not
    backed up as a whole, and the detail said only "no snapshot holds its files"; it names the
    snapshot that holds the rest now, and what it left out, as for --exclude patterns (audit 31b L3)."""
    ckpt = checkpoint(tmp_path / "ck" / "checkpoint-3")
    write_file(ckpt / "state.tmp", b"half written")
    snap = vault.backup_async(ckpt, tags={"step": "3"}).result(timeout=60)
    status = vault.backup_status(ckpt)
    assert not status.backed_up
    assert f"snapshot {snap.short_id} holds all but the 1 file(s) named as still being written" in status.detail
    assert "state.tmp" in status.detail, status.detail
    assert vault.backup_status(ckpt, exclude=["*.tmp"]).backed_up


def test_a_chunk_read_through_a_later_copy_is_stored_whichever_chunk_is_looked_at_first():
    """Two backups that raced coded A and B against each other's copies; A also has a whole copy. A
    failure found for B while A was still being resolved (a loop) was kept, so a file holding A then B
    was "not backed up" while B alone was, and a restore reads both (a review of status's rule)."""
    a, b = b"A" * 32, b"B" * 32
    gone, a_delta, a_whole, b_delta = (bytes([i]) * 32 for i in range(1, 5))
    copies = {
        a: [ChunkLocation(gone, 0, 10, 10), ChunkLocation(a_delta, 0, 10, 10, b), ChunkLocation(a_whole, 0, 10, 10)],
        b: [ChunkLocation(b_delta, 0, 10, 10, a)],
    }
    repo = SimpleNamespace(index=SimpleNamespace(locations=lambda c: copies.get(c, [])))
    listed = {a_delta: 1000, a_whole: 1000, b_delta: 1000}
    for order in ([a, b], [b, a], [b]):
        assert _missing_chunks([SimpleNamespace(path="f", chunks=order)], repo, listed) == "", order
    del listed[a_whole]  # now A's only copies are gone or a delta against B, itself a delta against A
    for order in ([a], [b]):
        assert _missing_chunks([SimpleNamespace(path="f", chunks=order)], repo, listed), order


def test_status_reads_the_packs_of_a_deleted_index_object_by_their_headers(tmp_path, repo_url, vault, cli):
    """Every reader reads a pack whose index object is gone by its sealed header; status called such a
    checkpoint NOT backed up ('chunk ... is in no index'), while docs/usage.md counts a chunk stored when a
    copy lies whole in a listed pack (an audit's encrypted damage matrix, index0-delete). The warning is
    said once, not once per path (status reloads the index for each)."""
    first = checkpoint(tmp_path / "checkpoint-1")
    vault.backup(first)
    before = set((Path(repo_url) / "index").iterdir())
    packs_before = {p for p in (Path(repo_url) / "packs").rglob("*") if p.is_file()}
    later = [checkpoint(tmp_path / f"checkpoint-{i}") for i in (2, 3)]
    for ckpt in later:
        vault.backup(ckpt)
    vault.close()
    for index in set((Path(repo_url) / "index").iterdir()) - before:
        index.unlink()
    proc = cli("status", str(first), *map(str, later), "--repo", repo_url)
    assert proc.stdout.decode().count(": backed up") == 3, proc.stdout.decode()
    err = proc.stderr.decode()
    assert err.count("no index object names") == 1 and "repair-index" in err and "Traceback" not in err, err
    for pack in {p for p in (Path(repo_url) / "packs").rglob("*") if p.is_file()} - packs_before:
        pack.unlink()  # the packs themselves gone too: nothing holds the later checkpoints' chunks
    gone = cli("status", str(later[0]), "--repo", repo_url, check=False)
    assert gone.returncode == 40 and "NOT backed up" in gone.stdout.decode(), gone.stdout.decode()


def test_a_watched_folder_is_in_no_one_snapshot_and_status_says_to_ask_about_its_checkpoints(
    tmp_path, repo_url, vault, cli
):
    """A watch ships each checkpoint folder as its own snapshot: ``status out`` said only that no snapshot
    held its files, which read as if the watch had shipped nothing."""
    out = tmp_path / "out"
    checkpoint(out / "checkpoint-1")
    cli("watch", str(out), "--repo", repo_url, "--once")
    said = cli("status", str(out), "--repo", repo_url, check=False)
    assert said.returncode == 40, said.stderr
    hint = f"a watch ships each checkpoint folder in it as a snapshot of its own: ask about those (status {out}/"
    assert hint + "checkpoint-1)" in said.stdout.decode(), said.stdout
    assert cli("status", str(out / "checkpoint-1"), "--repo", repo_url).returncode == 0
    checkpoint(tmp_path / "plain" / "checkpoint-1")
    plain = cli("status", str(tmp_path / "plain"), "--repo", repo_url, check=False)
    assert plain.returncode == 40 and "a watch ships" not in plain.stdout.decode(), plain.stdout
