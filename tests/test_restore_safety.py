"""Restore never writes outside its target, refuses crafted trees, and is rerunnable."""

import errno
import fcntl
import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from ckptvault import Snapshot, Vault
from ckptvault.blob import Kind
from ckptvault.chunking import ChunkerParams
from ckptvault.crypto.keyfile import Keyfile
from ckptvault.errors import (
    IntegrityError,
    MalformedObjectError,
    RestoreConflictError,
    StorageError,
    StorageFullError,
    UnsafePathError,
    UsageError,
)
from ckptvault.ops import restore as restore_module
from ckptvault.ops.restore import temp_stem
from ckptvault.repository.format import INDEX_PREFIX, id_from_key
from ckptvault.repository.index import decode_index, encode_index
from ckptvault.snapshot.manifest import encode_snapshot, encode_tree
from ckptvault.snapshot.model import FileEntry

from .conftest import tree_digest


@pytest.fixture
def backed_up(vault: Vault, tmp_path: Path):
    src = tmp_path / "src"
    (src / "model").mkdir(parents=True)
    (src / "model" / "weights.bin").write_bytes(os.urandom(300_000))
    (src / "model" / "config.json").write_text('{"a": 1}')
    (src / "optimizer.pt").write_bytes(os.urandom(100_000))
    snap = vault.backup(src)
    return vault, src, snap


def plant_tree(vault: Vault, snap, entries) -> str:
    """Write a crafted tree and a snapshot pointing at it, as a hostile repository would."""
    repo = vault._repo
    tree_id = repo.save_tree(encode_tree(entries))
    new_id = secrets.token_bytes(32)
    repo.save_snapshot(new_id, encode_snapshot(replace(snap, id=new_id.hex(), tree_id=tree_id.hex())))
    return new_id.hex()


@pytest.mark.parametrize("bad_path", ["../escaped", "/tmp/abs-escape", "model/../../escaped"])
def test_crafted_paths_are_refused(backed_up, tmp_path: Path, bad_path: str):
    vault, _, snap = backed_up
    entries = vault.files(snap)
    victim = next(e for e in entries if e.path == "optimizer.pt")
    crafted = plant_tree(vault, snap, [*entries, replace(victim, path=bad_path)])
    target = tmp_path / "deep" / "target"
    with pytest.raises(UnsafePathError, match="restore refused"):
        vault.restore(crafted, target)
    assert not (tmp_path / "deep" / "escaped").exists() and not (tmp_path / "escaped").exists()
    assert not os.path.exists("/tmp/abs-escape")
    assert not target.exists() or not any(target.iterdir())


def test_file_below_a_symlink_entry_is_refused(backed_up, tmp_path: Path):
    vault, _, snap = backed_up
    entries = vault.files(snap)
    victim = next(e for e in entries if e.path == "optimizer.pt")
    link = replace(victim, path="link", type="symlink", target=str(tmp_path / "outside"), chunks=[], size=0)
    crafted = plant_tree(vault, snap, [*entries, link, replace(victim, path="link/payload")])
    (tmp_path / "outside").mkdir()
    with pytest.raises(UnsafePathError, match="below a symlink"):
        vault.restore(crafted, tmp_path / "target")
    assert list((tmp_path / "outside").iterdir()) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"path": "model/config.json/child"}, "lies below the file 'model/config.json'"),
        ({"path": "optimizer.pt/d", "type": "dir", "chunks": [], "size": 0}, "lies below the file 'optimizer.pt'"),
        ({"mode": 2**40}, "not permission bits"),
        ({"mode": -1}, "not permission bits"),
        ({"mtime_ns": 10**30}, "impossible mtime_ns"),
    ],
)
def test_a_crafted_entry_fails_the_plan_and_check(backed_up, tmp_path: Path, change: dict, message: str):
    vault, _, snap = backed_up
    entries = vault.files(snap)
    victim = next(e for e in entries if e.path == "optimizer.pt")
    changed = replace(victim, **change)  # a new entry where the path changes, else the victim altered
    crafted = plant_tree(
        vault, snap, [*entries, changed] if "path" in change else [changed if e is victim else e for e in entries]
    )
    with pytest.raises(MalformedObjectError, match=re.escape(message)):
        vault.restore(crafted, tmp_path / "target")
    assert not (tmp_path / "target").exists()
    report = vault.check()
    assert not report.ok and any(message in p.detail for p in report.problems), report.problems


def test_symlink_in_the_target_is_not_written_through(backed_up, tmp_path: Path):
    vault, _, snap = backed_up
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", target / "model")
    with pytest.raises(UnsafePathError, match=r"through the symlink .* remove the link, or restore elsewhere"):
        vault.restore(snap, target)
    assert list((tmp_path / "outside").iterdir()) == []


def test_size_that_disagrees_with_chunks_is_refused(backed_up, tmp_path: Path):
    vault, _, snap = backed_up
    entries = [replace(e, size=e.size + 1) if e.path == "optimizer.pt" else e for e in vault.files(snap)]
    crafted = plant_tree(vault, snap, entries)
    with pytest.raises(MalformedObjectError, match=r"optimizer\.pt"):
        vault.restore(crafted, tmp_path / "target")
    assert not (tmp_path / "target" / "optimizer.pt").exists()
    with (
        pytest.raises(IntegrityError, match=r"optimizer\.pt: its chunks hold"),
        vault.open_file(crafted, "optimizer.pt") as f,
    ):
        f.read()  # the random-access reader, which hashes no whole file, checks the sizes as the restore does


def test_a_tree_whose_sizes_disagree_with_the_chunks_is_damage_exit_30_and_check_names_it(
    backed_up, tmp_path: Path, cli: Callable
):
    """docs/usage.md said such a restore plan is refused with exit 2 (a usage error); it is damage, exit 30, before
    anything is written. The restore sends the user to check, which found nothing: it names the file now."""
    vault, _, snap = backed_up
    entries = [replace(e, size=e.size + 1) if e.path == "optimizer.pt" else e for e in vault.files(snap)]
    crafted = plant_tree(vault, snap, entries)
    proc = cli("restore", "--repo", vault.url, crafted[:8], str(tmp_path / "target"), check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 30 and "optimizer.pt" in err and "ckptvault check" in err, err
    assert not (tmp_path / "target").exists()
    # check blamed the tree, unread, and had the whole snapshot forgotten, which restores without the file
    check = cli("check", "--repo", vault.url, check=False)
    out, err = check.stdout.decode(), check.stderr.decode()
    assert check.returncode == 30, (out, err)
    assert f"snapshot {crafted[:12]}: file optimizer.pt: the tree says" in out, out
    assert "which of the two is wrong is not known until its chunks are read" in out, out
    assert f"affects snapshot {crafted[:8]}: optimizer.pt" in out and "ckptvault forget" not in err, err
    assert f"run ckptvault check --repo {vault.url} --read-data first" in err, err
    read = cli("check", "--repo", vault.url, "--read-data", check=False)
    out, err = read.stdout.decode(), read.stderr.decode()
    assert "read back whole at those lengths, so the tree was written wrong, which no backup mends" in out, out
    assert "a restore of the snapshot is refused whole" in out and "restore --include leaving this one out" in out
    assert "a new backup" not in err and "restore the files not named (restore --include), then remove" in err, err
    assert f"forget --repo {vault.url} {crafted[:8]}" in err and snap.id[:8] not in err, err
    cli("restore", "--repo", vault.url, crafted[:8], str(tmp_path / "target"), "--include", "model/*")
    assert sorted(p.name for p in (tmp_path / "target").rglob("*")) == ["config.json", "model", "weights.bin"]


def test_an_index_entry_whose_length_disagrees_with_the_tree_is_not_blamed_on_the_tree(backed_up, tmp_path, cli):
    """A raw_len written wrong into the index (not the tree) was said to be the tree's fault, and the snapshot to
    be forgotten whole: read, the chunk fails at that length, and repair-index and a backup mend the snapshot."""
    vault, src, snap = backed_up
    victim = next(e for e in vault.files(snap) if e.path == "optimizer.pt").chunks[0]
    repo = vault._repo
    for info in repo.store.list(INDEX_PREFIX):
        index_id = id_from_key(info.key)
        packs = decode_index(repo.codec.decode(Kind.INDEX, index_id, repo.store.get(info.key)))
        if any(e.chunk_id == victim for entries in packs.values() for e in entries):
            packs = {
                p: [replace(e, raw_len=e.raw_len + 1) if e.chunk_id == victim else e for e in es]
                for p, es in packs.items()
            }
            repo.store.put(info.key, repo.codec.encode(Kind.INDEX, index_id, encode_index(packs)))
    vault.close()
    read = cli("check", "--repo", vault.url, "--read-data", check=False)
    out, err = read.stdout.decode(), read.stderr.decode()
    assert read.returncode == 30 and "the tree was written wrong" not in out, out
    assert f"chunk {victim.hex()[:12]} of it read back damaged at the length the index gives it" in out, out
    assert f"affects snapshot {snap.id[:8]}: optimizer.pt" in out and "repair-index" in err and "new backup" in err
    cli("repair-index", "--repo", vault.url, "--read-data")
    cli("backup", "--repo", vault.url, str(src))
    cli("restore", "--repo", vault.url, snap.id[:8], str(tmp_path / "target"))
    assert tree_digest(tmp_path / "target") == tree_digest(src)


def test_a_bad_file_in_a_folder_the_target_lacks_is_refused_before_anything_is_written(vault: Vault, tmp_path: Path):
    """The plan checks every file's chunks, also those below a folder the target does not have yet (whose
    place it no longer looks up): a bad one fails the restore before it writes anything."""
    src = tmp_path / "src"
    (src / "shards").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "shards" / "rank0.pt").write_bytes(os.urandom(100_000))
    snap = vault.backup(src)
    entries = [replace(e, size=e.size + 1) if e.path == "shards/rank0.pt" else e for e in vault.files(snap)]
    crafted = plant_tree(vault, snap, entries)
    with pytest.raises(MalformedObjectError, match=r"shards/rank0\.pt"):
        vault.restore(crafted, tmp_path / "target")
    assert not (tmp_path / "target").exists()


def test_rerun_skips_correct_files_and_refuses_to_clobber(backed_up, tmp_path: Path):
    vault, src, snap = backed_up
    target = tmp_path / "target"
    first = vault.restore(snap, target)
    assert first.skipped_files == 0 and first.files == 3
    (target / "optimizer.pt").unlink()  # as if the first restore had been killed before this file
    second = vault.restore(snap, target)
    assert second.skipped_files == 2 and second.bytes_written == 100_000
    assert (target / "optimizer.pt").read_bytes() == (src / "optimizer.pt").read_bytes()

    (target / "model" / "config.json").write_text("edited by hand")
    with pytest.raises(RestoreConflictError, match=r"model/config\.json.*rerun with overwrite=True"):
        vault.restore(snap, target)
    assert (target / "model" / "config.json").read_text() == "edited by hand"
    vault.restore(snap, target, overwrite=True)
    assert (target / "model" / "config.json").read_text() == '{"a": 1}'

    # the right bytes under the wrong mode and mtime: --overwrite puts the snapshot's back
    weights = target / "model" / "weights.bin"
    os.chmod(weights, 0o600)
    os.utime(weights, ns=(10**18, 10**18))
    assert vault.restore(snap, target).skipped_files == 3 and weights.stat().st_mode & 0o777 == 0o600
    vault.restore(snap, target, overwrite=True)
    original = (src / "model" / "weights.bin").stat()
    assert weights.stat().st_mode == original.st_mode and weights.stat().st_mtime_ns == original.st_mtime_ns


def test_files_named_like_temporaries_are_restored_and_only_true_leftovers_removed(vault: Vault, tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"real file")
    # backed up from a folder that held leftovers of a killed restore: they are files of the snapshot now
    (src / f"{temp_stem('a')}0000beef").write_bytes(b"looks like a leftover of a")
    (src / ".a.ckptvault-tmp-0000beef").write_bytes(b"the old form of a leftover's name")
    snap = vault.backup(src)
    target = tmp_path / "target"
    target.mkdir()
    leftover = target / f"{temp_stem('a')}12345678"  # what a restore killed while writing "a" leaves
    leftover.write_bytes(b"half a file")
    mine = target / ".a.ckptvault-tmp-cafe0000"  # a user's file the restore has no reason to touch
    mine.write_bytes(b"user data")

    result = vault.restore(snap, target)

    assert result.files == 3 and not leftover.exists() and mine.read_bytes() == b"user data"
    for path in src.iterdir():
        assert (target / path.name).read_bytes() == path.read_bytes(), path.name
    rerun = vault.restore(snap, target)  # they are in place now: skipped, and not swept as leftovers
    assert rerun.skipped_files == 3, rerun
    for path in src.iterdir():
        assert (target / path.name).read_bytes() == path.read_bytes(), path.name


def _snapshot_and_temp_file(vault: Vault, tmp_path: Path, content: bytes) -> tuple[Snapshot, Path, Path]:
    """A snapshot of one file "a", and a target folder holding a temporary file of "a" (a restore's)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"real file")
    snap = vault.backup(src)
    target = tmp_path / "target"
    target.mkdir()
    temp = target / f"{temp_stem('a')}12345678"
    temp.write_bytes(content)
    return snap, target, temp


def test_a_temporary_file_another_restore_is_writing_is_left_alone(vault: Vault, tmp_path: Path):
    """Ranks restoring one checkpoint into one shared folder: a restore removes the temporary files
    killed restores left (unlocked), never one a live restore holds (its flock)."""
    snap, target, live = _snapshot_and_temp_file(vault, tmp_path, b"being written")
    with open(live, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        vault.restore(snap, target)
        assert live.read_bytes() == b"being written"  # another restore's: left to it
    (target / "a").unlink()
    vault.restore(snap, target)  # the lock is gone, as a killed process's is
    assert not live.exists() and (target / "a").read_bytes() == b"real file"


def test_a_leftover_is_removed_also_when_every_file_is_already_present(vault: Vault, tmp_path: Path):
    """A restore killed while another one into the same folder finished the files: the rerun writes
    nothing, and still removes what the killed one left (status would call the folder not backed up)."""
    snap, target, leftover = _snapshot_and_temp_file(vault, tmp_path, b"half a file")
    (target / "a").write_bytes(b"real file")
    result = vault.restore(snap, target)
    assert result.skipped_files == 1 and result.bytes_written == 0
    assert not leftover.exists() and [p.name for p in target.iterdir()] == ["a"]


def _one_file_restored_while(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, meanwhile: Callable[[FileEntry], None]
) -> tuple[Path, Snapshot]:
    """The source (one 100 KB file, w.bin) and its snapshot; a restore of it runs ``meanwhile(entry)`` once
    the file's temporary is written, before it takes its name: what another process does at that moment."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(100_000))
    real = restore_module._write_chunks

    def written_then(repo, pool, fd, entry, *args):
        written = real(repo, pool, fd, entry, *args)
        meanwhile(entry)
        return written

    monkeypatch.setattr(restore_module, "_write_chunks", written_then)
    return src, vault.backup(src)


@pytest.mark.parametrize("same", [True, False])
def test_a_file_another_restore_put_in_place_meanwhile_is_never_replaced_by_another_snapshots(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, same: bool
):
    """Two restores into one empty folder at once: both planned on an empty folder, and each renamed its
    files over the other's, exit 0, a mix of two snapshots. The same file of the same snapshot (ranks of a
    job) is fine; another one is a conflict."""
    target = tmp_path / "target"

    def another_restore_finishes_first(entry):
        other = target / entry.path
        mine = (src / "w.bin").read_bytes()
        other.write_bytes(mine if same else bytes(len(mine)))  # another snapshot's: same size and mtime here
        os.utime(other, ns=(entry.mtime_ns, entry.mtime_ns))

    src, snap = _one_file_restored_while(vault, tmp_path, monkeypatch, another_restore_finishes_first)
    if same:
        vault.restore(snap, target)
        assert (target / "w.bin").read_bytes() == (src / "w.bin").read_bytes()
    else:
        with pytest.raises(RestoreConflictError, match=r"w\.bin was written meanwhile, with other content"):
            vault.restore(snap, target)
        assert not any((target / "w.bin").read_bytes())  # the other restore's file stays
    assert [p.name for p in target.iterdir()] == ["w.bin"]  # no temporary file left


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_made_where_a_file_goes_while_it_is_written_is_refused_and_kept(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overwrite: bool
):
    """The plan refuses a folder where the snapshot has a file; one made after the plan looked is found
    when the file's rename or link fails on it (not by a look before each rename): refused, kept."""
    target = tmp_path / "target"

    def a_folder_appears(entry):
        (target / entry.path).mkdir()
        (target / entry.path / "user-data").write_bytes(b"keep me")

    _, snap = _one_file_restored_while(vault, tmp_path, monkeypatch, a_folder_appears)
    with pytest.raises(RestoreConflictError, match=r"w\.bin is a directory; remove it by hand"):
        vault.restore(snap, target, overwrite=overwrite)
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == ["w.bin", "w.bin/user-data"]
    assert (target / "w.bin" / "user-data").read_bytes() == b"keep me"


def test_restores_into_one_folder_at_once_all_succeed(cli, tmp_path: Path):
    """Ranks of a job restoring one checkpoint into one shared folder: six processes, two thousand small
    files and links, all at once. They removed each other's temporary files (a rename that found none),
    and raced to remove each finished file before replacing it."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2000):
        (src / f"f{i:04}.json").write_bytes(os.urandom(2000))
    for i in range(50):
        os.symlink(f"f{i:04}.json", src / f"link-{i}")
    repo = str(tmp_path / "repo")
    cli("init", repo)
    cli("backup", str(src), "-r", repo, "-q")
    target = tmp_path / "target"
    args = [sys.executable, "-m", "ckptvault", "restore", "latest", str(target), "-r", repo, "-q"]
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg")}
    procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(6)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()
    assert tree_digest(target) == tree_digest(src)


def test_a_leftover_is_removed_where_flock_needs_a_file_open_for_writing(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """NFS turns flock into a POSIX lock, which an exclusive lock takes only on a file open for writing
    (EBADF otherwise): a rerun after a killed restore failed there on the leftover."""
    from ckptvault.ops import restore as restore_module

    snap, target, leftover = _snapshot_and_temp_file(vault, tmp_path, b"half a file")
    real_flock = fcntl.flock

    def nfs_flock(fd, operation):
        if operation & fcntl.LOCK_EX and not fcntl.fcntl(fd, fcntl.F_GETFL) & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return real_flock(fd, operation)

    monkeypatch.setattr(restore_module.fcntl, "flock", nfs_flock)
    vault.restore(snap, target)
    assert not leftover.exists() and (target / "a").read_bytes() == b"real file"


def test_overwrite_skips_files_already_in_place(backed_up, tmp_path: Path):
    """--overwrite replaces what differs; a file already whole and alone is left as it is, not written again."""
    vault, _, snap = backed_up
    vault.restore(snap, tmp_path / "target")
    again = vault.restore(snap, tmp_path / "target", overwrite=True)
    assert (again.skipped_files, again.bytes_written) == (3, 0), again


def test_overwrite_gives_a_hard_linked_twin_a_file_of_its_own(backed_up, tmp_path: Path):
    vault, src, snap = backed_up
    target = tmp_path / "target"
    vault.restore(snap, target)
    outside = tmp_path / "outside.pt"  # the same bytes, linked into the target from elsewhere
    os.link(target / "optimizer.pt", outside)
    os.chmod(outside, 0o600)
    os.utime(outside, ns=(10**18, 10**18))
    vault.restore(snap, target, overwrite=True)
    assert outside.stat().st_mode & 0o777 == 0o600 and outside.stat().st_mtime_ns == 10**18  # untouched
    restored, original = (target / "optimizer.pt").stat(), (src / "optimizer.pt").stat()
    assert restored.st_nlink == 1 and restored.st_mode == original.st_mode
    assert restored.st_mtime_ns == original.st_mtime_ns and outside.read_bytes() == (src / "optimizer.pt").read_bytes()


def test_a_name_of_255_bytes_restores(vault: Vault, tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    name = "n" * 251 + ".bin"  # the longest name ext4 takes: no room for a suffix on a temporary name
    (src / name).write_bytes(os.urandom(5000))
    snap = vault.backup(src)
    vault.restore(snap, tmp_path / "target")
    assert (tmp_path / "target" / name).read_bytes() == (src / name).read_bytes()


def test_include_restores_part_of_a_snapshot(backed_up, tmp_path: Path):
    vault, _src, snap = backed_up
    result = vault.restore(snap, tmp_path / "t1", include=["model"])
    assert result.files == 2
    assert sorted(os.listdir(tmp_path / "t1")) == ["model"]
    vault.restore(snap, tmp_path / "t2", include=["*.json"])
    assert [str(p.relative_to(tmp_path / "t2")) for p in (tmp_path / "t2").rglob("*") if p.is_file()] == [
        "model/config.json"
    ]


def _flip_byte_of_chunk(vault: Vault, repo_dir: Path, chunk_id: bytes) -> None:
    loc = vault._repo.index.get(chunk_id)
    pack_hex = loc.pack_id.hex()
    (pack,) = (p for p in repo_dir.rglob(pack_hex) if p.is_file())
    with open(pack, "r+b") as f:
        f.seek(loc.offset + loc.stored_len // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_damaged_file_fails_alone_while_the_others_restore(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    shards = {f"shard-{i}.bin": os.urandom(700_000) for i in range(6)}
    for name, data in shards.items():
        (src / name).write_bytes(data)
    repo_dir = tmp_path / "repo"
    vault = Vault.init(str(repo_dir), pack_size=1 << 20)
    snap = vault.backup(src)
    damaged = next(e for e in vault.files(snap) if e.path == "shard-2.bin")
    _flip_byte_of_chunk(vault, repo_dir, damaged.chunks[0])

    out = tmp_path / "out"
    with pytest.raises(IntegrityError, match=r"restore incomplete: 1 file\(s\).*shard-2\.bin") as info:
        Vault.open(str(repo_dir)).restore(snap.id, out)
    assert str(info.value).endswith("; run: vault.check(read_data=1.0) (it says what to do)"), info.value
    assert sorted(p.name for p in out.iterdir()) == sorted(n for n in shards if n != "shard-2.bin")  # no temp files
    for name in shards:
        if name != "shard-2.bin":
            assert (out / name).read_bytes() == shards[name]


def test_a_failing_write_stops_every_writer_before_the_file_is_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A full disk (or any error that is not a damaged chunk) must not leave workers writing into a
    descriptor that is closed, or already reused by another file."""
    import errno
    import threading

    from ckptvault.ops import restore as restore_module

    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(6 << 20))
    vault = Vault.init(str(tmp_path / "repo"), pack_size=1 << 20)
    snap = vault.backup(src)

    closed: set[int] = set()
    late: list[int] = []
    calls = 0
    lock = threading.Lock()
    real_pwrite, real_close, real_open = os.pwrite, os.close, os.open

    def pwrite(fd, data, offset):
        nonlocal calls
        with lock:
            calls += 1
            if fd in closed:
                late.append(fd)
            if calls == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    def close(fd):
        closed.add(fd)
        real_close(fd)

    def open_(*args, **kwargs):
        fd = real_open(*args, **kwargs)
        closed.discard(fd)  # the number is in use again
        return fd

    monkeypatch.setattr(restore_module.os, "pwrite", pwrite)
    monkeypatch.setattr(restore_module.os, "close", close)
    monkeypatch.setattr(restore_module.os, "open", open_)
    with pytest.raises(StorageFullError, match="No space left"):
        vault.restore(snap.id, tmp_path / "out")
    monkeypatch.undo()
    assert late == []
    assert not [p for p in (tmp_path / "out").rglob("*") if ".ckptvault-tmp-" in p.name]


def test_a_write_that_makes_no_progress_fails_instead_of_spinning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from ckptvault.ops import restore as restore_module

    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(os.urandom(1 << 20))
    vault = Vault.init(str(tmp_path / "repo"))
    snap = vault.backup(src)
    real_pwrite = os.pwrite

    def stalled(fd, data, offset):  # a stalled device, under the restored file only
        return 0 if ".ckptvault-tmp-" in os.readlink(f"/proc/self/fd/{fd}") else real_pwrite(fd, data, offset)

    monkeypatch.setattr(restore_module.os, "pwrite", stalled)
    with pytest.raises(StorageError, match="made no progress"):
        vault.restore(snap.id, tmp_path / "out")
    monkeypatch.undo()
    assert not list((tmp_path / "out").iterdir())  # no temp file, no half-written file


@pytest.mark.parametrize("tamper", ["wrong file hash", "chunks reordered"])
def test_a_file_whose_chunks_verify_but_whose_whole_hash_does_not_is_not_written(
    vault: Vault, tmp_path: Path, tamper: str
):
    """Every chunk checks out against its ID, yet the file would be wrong: the whole-file hash, taken
    over the written bytes in file order, must refuse it (and the other files still restore)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(2 << 20))
    (src / "config.json").write_text('{"a": 1}')
    snap = vault.backup(src)
    entries = vault.files(snap)
    victim = next(e for e in entries if e.path == "weights.bin")
    assert len(set(victim.chunks)) >= 2
    if tamper == "wrong file hash":
        bad = replace(victim, blake3="00" * 32)
    else:  # same chunks, same size, other order
        bad = replace(victim, chunks=[*victim.chunks[1:], victim.chunks[0]])
    crafted = plant_tree(vault, snap, [bad if e is victim else e for e in entries])
    target = tmp_path / "target"
    with pytest.raises(IntegrityError, match=r"weights\.bin: restored bytes do not match"):
        vault.restore(crafted, target)
    assert not (target / "weights.bin").exists()
    assert (target / "config.json").read_text() == '{"a": 1}'
    assert not [p for p in target.rglob("*") if ".ckptvault-tmp-" in p.name]


@pytest.mark.parametrize("tamper", ["wrong file hash", "chunks reordered"])
def test_read_file_refuses_a_file_whose_chunks_verify_but_whose_whole_hash_does_not(
    vault: Vault, tmp_path: Path, tamper
):
    """``read_file`` checks each chunk against its ID, and the file as a whole after its last chunk, as a
    restore does: a tree naming the right chunks in the wrong order (or the wrong hash) is refused."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(2 << 20))
    snap = vault.backup(src)
    entries = vault.files(snap)
    (victim,) = [e for e in entries if e.type == "file"]
    assert len(set(victim.chunks)) >= 2
    if tamper == "wrong file hash":
        bad = replace(victim, blake3="00" * 32)
    else:
        bad = replace(victim, chunks=[*victim.chunks[1:], victim.chunks[0]])
    crafted = plant_tree(vault, snap, [bad if e is victim else e for e in entries])
    with pytest.raises(IntegrityError, match=r"weights\.bin: bytes do not match the snapshot's file hash"):
        b"".join(vault.read_file(crafted, "weights.bin"))


@pytest.mark.parametrize(("encrypted", "impostor"), [(False, "random"), (True, "random"), (True, "zeros")])
def test_a_chunk_stored_under_the_wrong_id_is_refused_and_named(tmp_path: Path, encrypted: bool, impostor: str):
    """The restore checks each chunk's envelope (bound to its ID) and hashes the file as a whole,
    instead of also hashing each chunk against its ID. A blob whose envelope is valid but whose
    plaintext is not the chunk it is stored as (a dedup-poisoned or mis-stored chunk) must still be
    refused, and the error must name that chunk, not only the file. All zeros takes the restore's
    other path: such a chunk is left as a hole and remembered, not written."""
    keyfile = Keyfile.create("pw", scrypt_n=2**10)[0].save(tmp_path / "key").path if encrypted else None
    vault = Vault.init(str(tmp_path / "repo"), keyfile=keyfile, passphrase="pw" if encrypted else None)
    repo = vault._repo
    wanted, stored = os.urandom(50_000), os.urandom(50_000) if impostor == "random" else bytes(50_000)
    chunk_id = repo.chunk_id(wanted)
    repo.add_chunk(chunk_id, repo.codec.encode(Kind.CHUNK, chunk_id, stored), len(stored))
    repo.flush()
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(wanted)  # one chunk, deduplicated against the impostor
    (src / "config.json").write_text('{"a": 1}')
    snap = vault.backup(src)
    assert next(e for e in vault.files(snap) if e.path == "weights.bin").chunks == [chunk_id]
    target = tmp_path / "target"
    with pytest.raises(IntegrityError, match=rf"weights\.bin: chunk {chunk_id.hex()[:12]} .*does not match its hash"):
        vault.restore(snap, target)
    assert not (target / "weights.bin").exists()
    assert (target / "config.json").read_text() == '{"a": 1}'
    with pytest.raises(IntegrityError, match="does not match its hash"), vault.open_file(snap, "weights.bin") as f:
        f.read()  # the random-access reader hashes no whole file: it checks each chunk against its ID
    vault.close()


def test_files_ending_in_zeros_restore_whole(tmp_path: Path):
    """All-zero chunks are not written (the file keeps a hole there) and are hashed as zeros, so a
    file whose last chunks are zeros gets its length from ftruncate alone: without it, 2.3 MB came
    back as 0.5 MB and the whole-file hash, fed the zeros, still passed. A chunk of zeros but its last
    byte is data, not a hole."""
    vault = Vault.init(
        str(tmp_path / "repo"), chunker=ChunkerParams(min_size=16 << 10, avg_size=64 << 10, max_size=256 << 10)
    )
    src = tmp_path / "src"
    src.mkdir()
    (src / "zero-tail.bin").write_bytes(os.urandom(300_000) + bytes(2_000_000))
    (src / "zeros-then-one.bin").write_bytes(os.urandom(300_000) + bytes(2_000_000) + b"\x01")
    (src / "all-zeros.bin").write_bytes(bytes(1_000_000))
    (src / "one-zero-chunk.bin").write_bytes(bytes(100_000))  # written by the reading thread alone
    snap = vault.backup(src)
    vault.restore(snap, tmp_path / "out")
    for path in src.iterdir():
        restored = tmp_path / "out" / path.name
        assert restored.stat().st_size == path.stat().st_size, path.name
        assert restored.read_bytes() == path.read_bytes(), path.name
    vault.close()


def test_a_damaged_chunk_read_through_the_file_reader_is_damage_not_a_removed_snapshot(backed_up, repo_url: str):
    """The reader asks whether its snapshot is still stored when a read fails (a prune may have removed
    it meanwhile): damage in a snapshot that is still there must be called damage."""
    vault, _, snap = backed_up
    chunk = next(e for e in vault.files(snap) if e.path == "optimizer.pt").chunks[0]
    loc = vault._repo.index.get(chunk)
    (pack,) = [p for p in (Path(repo_url) / "packs").rglob("*") if p.name == loc.pack_id.hex()]
    raw = bytearray(pack.read_bytes())
    raw[loc.offset + loc.stored_len // 2] ^= 0x40
    pack.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="is damaged"), vault.open_file(snap, "optimizer.pt") as f:
        f.read()


def test_seeking_the_file_reader_before_its_start_is_refused(backed_up):
    vault, _, snap = backed_up
    with vault.open_file(snap, "optimizer.pt") as f, pytest.raises(ValueError):
        f.seek(-1)


def test_nothing_is_restored_into_the_vaults_own_folder(vault: Vault, repo_url: str, tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config").write_text("a file that happens to share the vault config's name")
    snap = vault.backup(src)
    config_before = (Path(repo_url) / "config").read_bytes()
    for target in (Path(repo_url), Path(repo_url) / "index", Path(repo_url) / "new-folder"):
        with pytest.raises(UsageError, match="inside the vault"):
            vault.restore(snap, target, overwrite=True)
    parent_src = tmp_path / "parent-src"  # a snapshot whose paths land in the vault when restored above it
    (parent_src / Path(repo_url).name).mkdir(parents=True)
    (parent_src / Path(repo_url).name / "config").write_text("replaced")
    outer = vault.backup(parent_src)
    with pytest.raises(UsageError, match="inside the vault"):
        vault.restore(outer, Path(repo_url).parent, overwrite=True)
    with Vault.open(f"local://{repo_url}") as same, pytest.raises(UsageError, match="inside the vault"):
        same.restore(outer, Path(repo_url).parent, overwrite=True)  # another URL for the same folder
    assert (Path(repo_url) / "config").read_bytes() == config_before
    assert not (Path(repo_url) / "new-folder").exists()
    vault.restore(snap, tmp_path / "elsewhere")  # anywhere else is fine


def test_nothing_is_restored_into_another_vault(vault: Vault, tmp_path: Path):
    """The vault at hand is not the only one a restore could break: the default vault, a mirror, a
    copy's destination. A checkpoint holding a file named ``config`` restored over one with --overwrite
    replaced its config, and every command on it then failed (exit 0 for the restore)."""
    src = tmp_path / "src"
    (src / "inner").mkdir(parents=True)
    (src / "config").write_text('{"lr": 1}')
    (src / "inner" / "w.bin").write_bytes(b"w")
    snap = vault.backup(src)
    other_folder = tmp_path / "other"
    Vault.init(other_folder).close()
    config_before = (other_folder / "config").read_bytes()
    for target in (other_folder, other_folder / "packs", other_folder / "new" / "deeper"):
        with pytest.raises(UsageError, match=f"inside the vault at {re.escape(str(other_folder))}; restore elsewhere"):
            vault.restore(snap, target, overwrite=True)
    holder = tmp_path / "holder"  # a vault where one of the snapshot's folders goes
    Vault.init(holder / "inner").close()
    with pytest.raises(UsageError, match=f"inside the vault at {re.escape(str(holder / 'inner'))}"):
        vault.restore(snap, holder)
    assert (other_folder / "config").read_bytes() == config_before
    assert not (other_folder / "new").exists() and not (holder / "config").exists()
    with Vault.open(other_folder) as other:
        assert other.snapshots() == []


@pytest.mark.skipif(os.geteuid() != 0, reason="a bind mount needs root")
def test_nothing_is_restored_into_the_vault_through_a_bind_mount(vault: Vault, repo_url: str, tmp_path: Path):
    """Another path to the same folder (a bind mount, a volume mounted twice) that the vault's own
    path does not resolve to."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config").write_text('{"lr": 1}')
    snap = vault.backup(src)
    alias = tmp_path / "alias"
    alias.mkdir()
    if subprocess.run(["mount", "--bind", repo_url, str(alias)], capture_output=True).returncode != 0:
        pytest.skip("mount --bind is not allowed here")
    try:
        config_before = (Path(repo_url) / "config").read_bytes()
        for target in (alias, alias / "sub"):
            with pytest.raises(UsageError, match="inside the vault at"):
                vault.restore(snap, target, overwrite=True)
        assert (Path(repo_url) / "config").read_bytes() == config_before
    finally:
        subprocess.run(["umount", str(alias)], check=True)


def test_what_the_target_holds_beside_the_snapshot_is_named_and_refused_on_the_resume_path(
    vault: Vault, tmp_path: Path, cli
):
    """A restore leaves what the target held; resuming from such a folder mixed two saves (a Lightning
    resume globbing *.ckpt found two files the second time it resumed into the same folder)."""
    run = tmp_path / "run"
    (run / "sub").mkdir(parents=True)
    (run / "epoch=0-step=6.ckpt").write_bytes(b"six")
    (run / "sub" / "w.bin").write_bytes(b"w")
    vault.backup(run, tags={"run": "r", "step": "6"})
    (run / "epoch=0-step=6.ckpt").unlink()
    (run / "epoch=0-step=8.ckpt").write_bytes(b"eight")
    vault.backup(run, tags={"run": "r", "step": "8"})

    resume = tmp_path / "resume"
    first = vault.restore_latest(resume, run="r")  # an empty (new) folder: fine
    assert first.not_in_snapshot == () and (resume / "epoch=0-step=8.ckpt").read_bytes() == b"eight"
    assert vault.restore_latest(resume, run="r").skipped_files == 2  # again: nothing beside it
    older = vault.snapshots()[0]
    mixed = tmp_path / "mixed"
    vault.restore(older, mixed)
    (mixed / "sub" / "stale").mkdir()
    (mixed / "sub" / "stale" / "x").write_bytes(b"x")
    (mixed / ".ckptvault-tmp-0123456789abcdef-01234567").write_bytes(b"")  # a killed restore's: not counted
    with pytest.raises(
        RestoreConflictError, match=r"mixed holds what this snapshot does not: epoch=0-step=6.ckpt, sub/stale; resuming"
    ):
        vault.restore_latest(mixed, run="r")
    assert not (mixed / "epoch=0-step=8.ckpt").exists()  # refused before anything was written

    proc = cli("restore", "latest", str(mixed), "--tag", "run=r", "--repo", vault.url, "--json")
    assert json.loads(proc.stdout)["not_in_snapshot"] == ["epoch=0-step=6.ckpt", "sub/stale"]
    assert proc.stderr.decode().strip() == (
        f"warning: {mixed} also holds 2 entries that snapshot {vault.snapshots()[-1].short_id} does not "
        "(epoch=0-step=6.ckpt, sub/stale), left as they were: restore into a new or empty folder for the snapshot alone"
    )
    assert (mixed / "epoch=0-step=8.ckpt").read_bytes() == b"eight"
    assert cli("restore", "latest", str(tmp_path / "new"), "--repo", vault.url).stderr == b""

    mount = tmp_path / "mount"  # a fresh volume mounted to resume onto, used from a desktop
    for litter in ("lost+found", ".ipynb_checkpoints"):
        (mount / litter).mkdir(parents=True)
    (mount / ".DS_Store").write_bytes(b"")
    (mount / ".nfs000000000123").write_bytes(b"")
    assert vault.restore_latest(mount, run="r").not_in_snapshot == ()

    linked = tmp_path / "linked"  # where the snapshot has a folder, a link to another is not looked into
    linked.mkdir()
    (linked / "sub").symlink_to(run / "sub")
    (run / "sub" / "elsewhere.bin").write_bytes(b"e")
    result = vault.restore(vault.snapshots()[-1], linked, include=["epoch=0-step=8.ckpt"])
    assert result.not_in_snapshot == ()


def test_a_tree_that_lists_no_folders_still_restores_its_files_in_their_folders(backed_up, tmp_path: Path):
    """A tree needs no entry for each folder (validate_tree asks none): each file's folder is made as the
    file is written, once for the files it holds."""
    vault, src, snap = backed_up
    files_only = [e for e in vault.files(snap) if e.type == "file"]
    assert any("/" in e.path for e in files_only)
    crafted = plant_tree(vault, snap, files_only)
    vault.restore(crafted, tmp_path / "out")
    for entry in files_only:
        assert (tmp_path / "out" / entry.path).read_bytes() == (src / entry.path).read_bytes()


@pytest.mark.parametrize("as_root", [True, False])
def test_setuid_and_setgid_bits_of_files_are_not_restored_by_root(vault: Vault, tmp_path: Path, monkeypatch, as_root):
    """fs44 #1: owners are not stored, so root restored another user's setuid program (mode 4755, uid 1234) as a
    setuid-root one, "verified", exit 0 (a shared vault could plant one too). Root now restores files without
    those bits, and says so; another user gets files of its own, which run as it whatever their bits. A
    folder's setgid bit (its files take its group) is kept; a rerun and the drill agree with what was written."""
    src = tmp_path / "src"
    (src / "shared").mkdir(parents=True)
    for name, mode in [("tool", 0o4755), ("grp", 0o2750), ("plain", 0o644)]:
        (src / name).write_bytes(name.encode())
        (src / name).chmod(mode)
    (src / "shared").chmod(0o2775)
    snap = vault.backup(src)
    monkeypatch.setattr(restore_module, "_clears_setid", lambda: as_root)
    target = tmp_path / "out"
    for overwrite in (False, True):  # the rerun, which gives files already there the snapshot's mode
        result = vault.restore(snap, target, overwrite=overwrite)
        modes = {p.name: p.stat().st_mode & 0o7777 for p in target.iterdir()}
        if as_root:
            assert modes == {"tool": 0o755, "grp": 0o750, "plain": 0o644, "shared": 0o2775}, modes
            assert result.setid_cleared == 2
        else:
            assert modes == {"tool": 0o4755, "grp": 0o2750, "plain": 0o644, "shared": 0o2775}, modes
            assert result.setid_cleared == 0
    assert vault.drill(snap).ok


def test_the_cli_says_when_root_restored_files_without_their_setuid_bits(tmp_path: Path, cli):
    if os.geteuid() != 0:
        pytest.skip("only root restores files without their setuid bits (the API test above covers both)")
    src = tmp_path / "src"
    src.mkdir()
    (src / "tool").write_bytes(b"#!/bin/sh\n")
    (src / "tool").chmod(0o4755)
    repo = str(tmp_path / "repo")
    cli("init", repo)
    cli("backup", str(src), "--repo", repo)
    proc = cli("restore", "latest", str(tmp_path / "out"), "--repo", repo)
    assert "1 file(s) restored without their setuid/setgid bits" in proc.stderr.decode(), proc.stderr
    assert (tmp_path / "out" / "tool").stat().st_mode & 0o7777 == 0o755
    cli("drill", "--repo", repo)  # exit 0: the mode restored is the one expected
