import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from ckptvault import Vault
from ckptvault.errors import SourceError, UsageError
from ckptvault.ops import backup as backup_module
from ckptvault.ops import pin as pins
from ckptvault.ops.names import WATCH_STATE_FOLDER
from tests.conftest import DEEP, deep_tree


def test_unchanged_files_are_not_read_again(vault: Vault, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(backup_module, "RACY_NS", 0)  # written just before: trusted all the same (below)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(os.urandom(500_000))
    (src / "b").write_bytes(os.urandom(1000))
    vault.backup(src)
    (src / "b").write_bytes(os.urandom(1000))  # changed
    second = vault.backup(src)
    assert second.summary.read_bytes == 1000
    assert second.parent is not None
    third = vault.backup(src, force_read=True)
    assert third.summary.read_bytes == 501_000


def test_a_file_changed_just_before_it_was_read_is_read_again_next_time(vault: Vault, tmp_path: Path, monkeypatch):
    """Before Linux 6.13 (and on NFS, FUSE, FAT) a file's stamps come from a clock ticking every few ms
    or whole seconds: a file saved again in place within the tick in which it was read keeps its size,
    mtime and ctime, and the next backup skipped it, keeping the old bytes. A file changed that recently
    is now read again by the next backup. (The stamps cannot be held still here: the clock is moved.)"""
    src = tmp_path / "src"
    src.mkdir()
    (src / "ckpt.pt").write_bytes(os.urandom(100_000))
    (src / "config.json").write_bytes(b"{}")
    os.utime(src / "config.json", ns=(1, 1))
    stamped = os.stat(src / "ckpt.pt")
    real = backup_module.time.time_ns
    # ckpt.pt's read began in the tick it was written in (its stamps still say now), and took a second
    read: list[int] = []
    real_chunks = backup_module.ChunkHelpers.chunks

    def chunks(self, f, fd, size):
        yield from real_chunks(self, f, fd, size)
        read.append(1)

    def clock() -> int:
        return real() + 1_000_000_000 if read else max(stamped.st_mtime_ns, stamped.st_ctime_ns) + 1

    monkeypatch.setattr(backup_module.ChunkHelpers, "chunks", chunks)
    monkeypatch.setattr(backup_module.time, "time_ns", clock)
    first = vault.backup(src)
    assert read, "ckpt.pt was not cut by content"
    monkeypatch.setattr(backup_module.time, "time_ns", lambda: real() + 1_000_000_000)  # read a second later
    second = vault.backup(src)
    assert second.summary.read_bytes == 100_000  # config.json was read a second after its change
    third = vault.backup(src)
    assert third.summary.read_bytes == 0  # once read long enough after its change, it is trusted
    assert first.parent is None and second.parent == first.id


def test_racy_stamps_by_the_filesystem_granularity():
    second = 1_000_000_000
    fine = SimpleNamespace(st_mtime_ns=10 * second + 100, st_ctime_ns=10 * second + 123)
    whole = SimpleNamespace(st_mtime_ns=10 * second, st_ctime_ns=10 * second)
    assert backup_module.changed_too_recently(fine, 10 * second + 123 + backup_module.RACY_NS - 1)
    assert not backup_module.changed_too_recently(fine, 10 * second + 123 + backup_module.RACY_NS)
    assert backup_module.changed_too_recently(whole, 11 * second)  # FAT stamps even seconds
    assert not backup_module.changed_too_recently(whole, 12 * second)


def test_parent_is_per_host_and_paths(vault: Vault, tmp_path: Path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_bytes(b"1")
    first = vault.backup(tmp_path / "x", hostname="h1")
    assert vault.backup(tmp_path / "x", hostname="h2").parent is None
    assert vault.backup(tmp_path / "x", hostname="h1").parent == first.id


def test_special_files_are_skipped_with_a_warning(vault: Vault, tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"data")
    os.mkfifo(src / "pipe")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(src / "sock"))
    warnings: list[str] = []
    snap = vault.backup(src, on_warning=warnings.append)
    sock.close()
    assert [e.path for e in vault.files(snap)] == ["f"]
    assert len(warnings) == 2 and all("special file" in w for w in warnings)


def test_unreadable_file_fails_unless_skipped(vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok").write_bytes(b"fine")
    (src / "secret").write_bytes(b"no")
    real_open = backup_module._open_source

    def guarded_open(item):  # root reads anything: fake the EACCES
        if item.abs_path.endswith("secret"):
            raise PermissionError(13, "Permission denied", item.abs_path)
        return real_open(item)

    monkeypatch.setattr(backup_module, "_open_source", guarded_open)
    with pytest.raises(SourceError, match=r"secret: Permission denied \(use skip_unreadable=True"):
        vault.backup(src)
    assert vault.snapshots() == []
    warnings: list[str] = []
    snap = vault.backup(src, skip_unreadable=True, on_warning=warnings.append)
    assert [e.path for e in vault.files(snap)] == ["ok"]
    assert "secret" in warnings[0]


def test_a_file_failing_with_an_io_error_is_skipped_too_when_asked(vault: Vault, tmp_path: Path):
    """A failing disk gives EIO, not EACCES: --skip-unreadable skipped only the latter (restic skips both).
    /proc/self/mem is a real file whose read fails with EIO at offset 0."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok").write_bytes(b"fine")
    with pytest.raises(SourceError, match=r"cannot read /proc/self/mem: Input/output error"):
        vault.backup([src, "/proc/self/mem"])
    warnings: list[str] = []
    snap = vault.backup([src, "/proc/self/mem"], skip_unreadable=True, on_warning=warnings.append)
    assert [e.path for e in vault.files(snap) if e.type == "file"] == ["src/ok"]
    assert any("skipped unreadable file /proc/self/mem: Input/output error" in w for w in warnings), warnings


def test_skip_unreadable_never_skips_a_failure_of_the_vaults_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """No memory for a pack buffer is not an unreadable source file: skipping the file being read
    left an earlier file naming a chunk that was never stored, in a committed snapshot."""
    import errno

    from ckptvault.repository import repository as repository_module

    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"shard-{i}.bin").write_bytes(os.urandom(3_000_000))
    vault = Vault.init(tmp_path / "repo", pack_size=1 << 20)
    calls = [0]
    real = repository_module.new_pack_buffer

    def no_memory_once(size):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        return real(size)

    monkeypatch.setattr(repository_module, "new_pack_buffer", no_memory_once)
    with pytest.raises((SourceError, OSError), match="Cannot allocate memory"):  # while reading, or at the end
        vault.backup(src, skip_unreadable=True)
    assert calls[0] >= 2 and vault.snapshots() == []
    monkeypatch.undo()
    vault.backup(src, skip_unreadable=True)
    assert vault.check(read_data=1.0).ok


def test_several_sources_are_stored_under_their_names(vault: Vault, tmp_path: Path):
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / "w").write_bytes(b"1")
    (tmp_path / "notes.txt").write_text("hi")
    snap = vault.backup([tmp_path / "run1", tmp_path / "notes.txt"])
    assert [e.path for e in vault.files(snap)] == ["notes.txt", "run1", "run1/w"]
    assert snap.paths == [str(tmp_path / "run1"), str(tmp_path / "notes.txt")]


def test_bad_sources(vault: Vault, tmp_path: Path):
    with pytest.raises(SourceError, match="no such file"):
        vault.backup(tmp_path / "missing")
    with pytest.raises(UsageError):
        vault.backup([])
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "a").mkdir(parents=True)
    with pytest.raises(UsageError, match="share the name"):
        vault.backup([tmp_path / "a", tmp_path / "b" / "a"])


def test_snapshot_records_metadata(vault: Vault, tmp_path: Path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "f").write_bytes(b"12345")
    snap = vault.backup(tmp_path / "s", tags={"run": "x", "step": "1200"}, description="after epoch 3")
    again = vault.snapshot(snap.id[:6])
    assert again == snap
    assert again.tags == {"run": "x", "step": "1200"} and again.description == "after epoch 3"
    assert again.summary.files == 1 and again.summary.logical_bytes == 5
    assert again.time.tzinfo is not None
    assert vault.latest({"run": "x"}).id == snap.id


def _changing_reads(monkeypatch: pytest.MonkeyPatch, path: Path, times: int) -> list[int]:
    """Rewrite ``path`` while backup reads it (after its first chunk), ``times`` times."""
    real = backup_module.ChunkHelpers.chunks
    reads: list[int] = []

    def iter_and_touch(self, stream, fd, size):
        for i, chunk in enumerate(real(self, stream, fd, size)):
            yield chunk
            if i == 0 and len(reads) < times and stream.name == str(path):
                reads.append(1)
                with open(path, "ab") as f:  # a writer appends while we read
                    f.write(b"more")

    monkeypatch.setattr(backup_module.ChunkHelpers, "chunks", iter_and_touch)
    return reads


@pytest.mark.parametrize("mode", ["warn", "skip", "fail"])
def test_file_changing_while_read(vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str):
    src = tmp_path / "src"
    src.mkdir()
    (src / "stable").write_bytes(b"fine")
    (src / "growing.bin").write_bytes(os.urandom(300_000))
    _changing_reads(monkeypatch, src / "growing.bin", times=1)
    snap = vault.backup(src, on_change=mode)  # changed once: read again, stored as it is now
    entry = next(e for e in vault.files(snap) if e.path == "growing.bin")
    assert entry.size == 300_004

    _changing_reads(monkeypatch, src / "growing.bin", times=2)
    warnings: list[str] = []
    if mode == "fail":
        with pytest.raises(SourceError, match="changed while it was read, twice"):
            vault.backup(src, on_change=mode, force_read=True)
        assert len(vault.snapshots()) == 1
        return
    snap = vault.backup(src, on_change=mode, force_read=True, on_warning=warnings.append)
    paths = [e.path for e in vault.files(snap)]
    assert ("growing.bin" in paths) == (mode == "warn")
    assert len(warnings) == 1 and "growing.bin" in warnings[0]
    vault.restore(snap, tmp_path / f"out-{mode}")
    assert (tmp_path / f"out-{mode}" / "stable").read_bytes() == b"fine"


def test_a_file_saved_again_by_a_rename_while_it_is_read_is_one_whole_save_not_a_change(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The save the training docs recommend (write a temporary name, rename it over the old one) changes
    the old file's ctime (its last link goes) and not a byte of it: --on-change fail failed 6 runs of 8."""
    src = tmp_path / "src"
    src.mkdir()
    old = os.urandom(300_000)
    (src / "model.pt").write_bytes(old)
    real = backup_module.ChunkHelpers.chunks

    def saved_again_meanwhile(self, stream, fd, size):
        for i, chunk in enumerate(real(self, stream, fd, size)):
            yield chunk
            if i == 0:
                (src / "model.pt.tmp").write_bytes(b"the next save")
                os.replace(src / "model.pt.tmp", src / "model.pt")

    monkeypatch.setattr(backup_module.ChunkHelpers, "chunks", saved_again_meanwhile)
    warnings: list[str] = []
    snap = vault.backup(src, on_change="fail", on_warning=warnings.append)
    assert b"".join(vault.read_file(snap, "model.pt")) == old and warnings == []


def _changed_after_the_scan(monkeypatch: pytest.MonkeyPatch, change) -> None:
    """Run ``change()`` once the backup has scanned its sources, before it reads any file."""
    real = backup_module.scan_sources

    def scan_then_change(*args, **kwargs):
        scan = real(*args, **kwargs)
        change()
        return scan

    monkeypatch.setattr(backup_module, "scan_sources", scan_then_change)


def _rotated(src: Path) -> None:
    (src / "a" / "model.pt").unlink()


def _folder_replaced_by_a_file(src: Path) -> None:
    (src / "a" / "model.pt").unlink()
    (src / "a").rmdir()
    (src / "a").write_text("a file now")


def _replaced_by_a_folder(src: Path) -> None:
    (src / "a" / "model.pt").unlink()
    (src / "a" / "model.pt").mkdir()


def _replaced_by_a_fifo(src: Path) -> None:
    (src / "a" / "model.pt").unlink()
    os.mkfifo(src / "a" / "model.pt")  # opened as it was scanned, a FIFO would block the backup forever


def _secret(src: Path) -> Path:
    """A file outside the source (root-only, say): what a link swapped in would point at."""
    secret = src.parent / "elsewhere" / "model.pt"
    secret.parent.mkdir(exist_ok=True)
    secret.write_bytes(b"not part of the checkpoint")
    return secret


def _replaced_by_a_link(src: Path) -> None:
    (src / "a" / "model.pt").unlink()
    (src / "a" / "model.pt").symlink_to(_secret(src))


def _folder_replaced_by_a_link(src: Path) -> None:
    """A folder on the way swapped for a link: the file's own name is no link, the path goes through one."""
    (src / "a" / "model.pt").unlink()
    (src / "a").rmdir()
    (src / "a").symlink_to(_secret(src).parent)


@pytest.mark.parametrize(
    "change",
    [
        _rotated,
        _folder_replaced_by_a_file,
        _replaced_by_a_folder,
        _replaced_by_a_fifo,
        _replaced_by_a_link,
        _folder_replaced_by_a_link,
    ],
)
@pytest.mark.parametrize("mode", ["warn", "fail"])
def test_a_file_gone_after_the_scan_is_skipped_or_fails_the_backup_with_on_change_fail(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change, mode: str
):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "model.pt").write_bytes(os.urandom(100_000))
    (src / "stable").write_bytes(b"fine")
    _changed_after_the_scan(monkeypatch, lambda: change(src))
    if mode == "fail":  # a rotation that took a file must not leave a snapshot without it as `latest`
        with pytest.raises(
            SourceError,
            match=r"model\.pt: it was (deleted|replaced).* during the backup \(use on_change=warn or skip\)",
        ):
            vault.backup(src, on_change=mode)
        assert vault.snapshots() == []
        return
    warnings: list[str] = []
    snap = vault.backup(src, on_change=mode, on_warning=warnings.append)
    assert [e.path for e in vault.files(snap) if e.type == "file"] == ["stable"]
    assert len(warnings) == 1 and "skipped" in warnings[0] and "model.pt" in warnings[0]


def _link_deleted(src: Path) -> None:
    (src / "latest").unlink()


def _link_replaced_by_a_file(src: Path) -> None:  # DeepSpeed's `latest` is a text file naming the step
    (src / "latest.tmp").write_text("a")
    os.replace(src / "latest.tmp", src / "latest")


def _link_replaced_by_a_folder(src: Path) -> None:
    (src / "latest").unlink()
    (src / "latest").mkdir()


@pytest.mark.parametrize("change", [_link_deleted, _link_replaced_by_a_file, _link_replaced_by_a_folder])
@pytest.mark.parametrize("mode", ["warn", "fail"])
def test_a_link_gone_after_the_scan_is_skipped_or_fails_the_backup_with_on_change_fail(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change, mode: str
):
    """fs44 #4: a trainer's `latest -> checkpoint-N` link rotated while the backup read the checkpoint was an
    internal error (readlink unguarded: FileNotFoundError, or EINVAL once it was a file), exit 1."""
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "model.pt").write_bytes(os.urandom(100_000))
    (src / "latest").symlink_to("a")
    _changed_after_the_scan(monkeypatch, lambda: change(src))
    if mode == "fail":
        with pytest.raises(
            SourceError, match=r"latest: it was (deleted|replaced by something that is not a link) during the backup"
        ):
            vault.backup(src, on_change=mode)
        assert vault.snapshots() == []
        return
    warnings: list[str] = []
    snap = vault.backup(src, on_change=mode, on_warning=warnings.append)
    assert [e.path for e in vault.files(snap)] == ["a", "a/model.pt"]
    assert len(warnings) == 1 and "skipped" in warnings[0] and "latest" in warnings[0], warnings


def test_a_file_whose_path_is_over_the_systems_limit_fails_the_backup_unless_skipped(vault: Vault, tmp_path: Path):
    """fs44 #3: a file under folders whose path passes PATH_MAX (4,096 bytes) was left out with a warning of
    5,000 characters, exit 0, whatever --skip-unreadable said: its snapshot lacked it and became `latest`."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "top").write_bytes(b"top")
    folder = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(25):  # 25 x 201 bytes below src
        os.mkdir("D" * 200, dir_fd=folder)
        inner = os.open("D" * 200, os.O_RDONLY | os.O_DIRECTORY, dir_fd=folder)
        os.close(folder)
        folder = inner
    fd = os.open("deepfile", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=folder)
    os.write(fd, b"deep")
    os.close(fd)
    os.close(folder)
    try:
        with pytest.raises(SourceError, match=r"File name too long \(a path of [\d,]+ bytes") as raised:
            vault.backup(src)
        assert vault.snapshots() == [] and len(str(raised.value)) < 700, str(raised.value)  # the path cut short
        warnings: list[str] = []
        snap = vault.backup(src, skip_unreadable=True, on_warning=warnings.append)
        assert [e.path for e in vault.files(snap) if e.type == "file"] == ["top"]
        assert len(warnings) == 1 and "skipped unreadable" in warnings[0] and len(warnings[0]) < 700, warnings
    finally:
        subprocess.run(["rm", "-rf", str(src)], check=True)


def test_a_file_saved_again_by_a_rename_after_the_scan_is_stored_with_its_own_mode(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The mode came from the scan and the bytes from the file read: a 0o600 save that replaced a 0o644
    one was stored, and restored, as 0o644."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.pt").write_bytes(b"old save")
    (src / "model.pt").chmod(0o644)

    def saved_again() -> None:
        (src / "model.pt.tmp").write_bytes(b"new private save")
        (src / "model.pt.tmp").chmod(0o600)
        os.replace(src / "model.pt.tmp", src / "model.pt")

    _changed_after_the_scan(monkeypatch, saved_again)
    snap = vault.backup(src)
    (entry,) = [e for e in vault.files(snap) if e.path == "model.pt"]
    assert (entry.mode, b"".join(vault.read_file(snap, "model.pt"))) == (0o600, b"new private save")


def test_a_tree_deeper_than_pythons_recursion_backs_up(vault: Vault, tmp_path: Path):
    """1,000 nested folders (2,000 bytes of path) were an internal error, RecursionError."""
    with deep_tree(tmp_path / "src"):
        snap = vault.backup(tmp_path / "src")
        assert b"".join(vault.read_file(snap, "/".join(["d"] * DEEP + ["w.bin"]))) == b"deep"


def test_a_backup_whose_every_file_was_left_out_while_read_commits_nothing(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The only file changed twice while read and --on-change skip left it out: an empty snapshot
    would become `latest`, and a resume would restore nothing."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "growing.bin").write_bytes(os.urandom(300_000))
    _changing_reads(monkeypatch, src / "growing.bin", times=2)
    with pytest.raises(SourceError, match=r"nothing left to back up.*growing\.bin") as failed:
        vault.backup(src, on_change="skip")
    assert failed.value.exit_code == 3
    assert vault.snapshots() == []


def test_bad_on_change_value(vault: Vault, tmp_path: Path):
    with pytest.raises(UsageError, match="on_change 'maybe' is not one of"):
        vault.backup(tmp_path, on_change="maybe")


def test_the_vault_is_never_backed_up_into_itself(tmp_path: Path):
    # a vault kept inside the checkpoint folder: its packs and its live lock are left out, with a
    # warning, by every way of shipping (backup, backup_async's pins, watch); naming it is refused
    ckpts = tmp_path / "ckpts"
    (ckpts / "step-1").mkdir(parents=True)
    (ckpts / "step-1" / "model.bin").write_bytes(os.urandom(50_000))
    os.symlink(ckpts / "vault" / "packs", tmp_path / "alias")
    warnings: list[str] = []
    with Vault.open(ckpts / "vault", create=True) as vault:
        vault.backup(ckpts / "step-1")  # the vault holds packs now
        snap = vault.backup(ckpts, on_warning=warnings.append)
        assert [e.path for e in vault.files(snap)] == ["step-1", "step-1/model.bin"]
        assert any("the vault this backup writes to" in w for w in warnings)
        shipped = vault.backup_async(ckpts).result(timeout=60)
        assert [e.path for e in vault.files(shipped)] == ["step-1", "step-1/model.bin"]
        watched = vault.watch(ckpts, once=True, settle=0)
        assert [s.name for s in watched.shipped] == ["step-1"]
        status = vault.backup_status(ckpts)  # as the backup saw it
        assert status.backed_up and status.files == 1
        for inside in (ckpts / "vault", ckpts / "vault" / "config", tmp_path / "alias"):
            for call in (vault.backup, vault.backup_async, vault.backup_status, vault.watch):
                if call == vault.watch and inside.is_file():
                    continue  # "is not a directory" first
                with pytest.raises(UsageError, match=r"is (the vault|inside the vault) at .*; name the checkpoints"):
                    call(inside)
        assert len(vault.snapshots()) == 4
    assert not list(ckpts.glob(".ckptvault-*/**/config"))  # no pin of the vault's files was made


def test_a_pin_resumed_after_a_restart_still_leaves_out_a_vault_nested_in_the_checkpoint(tmp_path: Path):
    # the watcher pinned step-1 (leaving out the vault inside it) and died before shipping it; the
    # next watcher resumes the pin and syncs it again before shipping: the vault stays out
    ckpts = tmp_path / "ckpts"
    (ckpts / "step-1").mkdir(parents=True)
    (ckpts / "step-1" / "model.bin").write_bytes(os.urandom(50_000))
    vault_folder = ckpts / "step-1" / "vault"
    with Vault.open(vault_folder, create=True) as vault:
        vault.backup(ckpts / "step-1" / "model.bin")  # the vault holds packs now
        st = os.stat(vault_folder)
        pins_dir = ckpts / WATCH_STATE_FOLDER / "pins"
        left = pins.create(str(ckpts / "step-1"), str(pins_dir), skip_dir=(st.st_dev, st.st_ino))
        assert sorted(os.listdir(left.data)) == ["model.bin"]
        watched = vault.watch(ckpts, once=True, settle=0)
        assert [s.name for s in watched.shipped] == ["step-1"]
        assert [e.path for e in vault.files(watched.shipped[0].snapshot)] == ["model.bin"]


def test_a_small_chunk_is_coded_by_the_reading_thread_and_a_big_one_on_the_pool(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A small file's chunk handed to a worker and back cost more than coding it (10,000 files of 1-60 KB:
    2.5 s against 1.9); a big file's chunks are coded on the pool, side by side, however small they are."""
    src = tmp_path / "src"
    src.mkdir()
    small = os.urandom(10_000)  # under the test vault's smallest chunk: one chunk
    (src / "small").write_bytes(small)
    (src / "big").write_bytes(os.urandom(3 << 20))
    coded_on: dict[bool, set[str]] = {}
    real_prepare = backup_module._prepare_chunk

    def recording(repo, data, *args):
        # told apart by content, not length: the big file's last chunk may be 10,000 bytes too
        coded_on.setdefault(bytes(data) == small, set()).add(threading.current_thread().name)
        return real_prepare(repo, data, *args)

    monkeypatch.setattr(backup_module, "_prepare_chunk", recording)
    snap = vault.backup(src)
    here = threading.current_thread().name
    assert coded_on[True] == {here}
    big = [names for is_small, names in coded_on.items() if not is_small]
    assert big and all(name.startswith("ckptvault-chunk") for names in big for name in names)
    vault.restore(snap, tmp_path / "out")
    assert (tmp_path / "out" / "small").read_bytes() == (src / "small").read_bytes()


def _folder_of_files(src: Path, tag: bytes, count: int = 4) -> None:
    (src / "d").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (src / "d" / f"f{i}").write_bytes(tag * 1000 + bytes([i]))


def _after_first_file(monkeypatch: pytest.MonkeyPatch, first: str, action) -> None:
    real = backup_module._read_file
    done = []

    def hooked(item, *args, **kwargs):
        read = real(item, *args, **kwargs)
        if item.path == first and not done:
            done.append(True)
            action()
        return read

    monkeypatch.setattr(backup_module, "_read_file", hooked)


@pytest.mark.parametrize("on_change", ["warn", "fail"])
def test_a_folder_deleted_and_made_again_during_the_backup_is_read_as_before(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_change: str
):
    """A checkpoint folder written again under its own name (rm -rf latest; save to latest) while the
    backup is in it: each file is reached from the source folder by name, so the new files are read (a
    folder kept open between files, tried in the forty-first session, called them all deleted)."""
    src = tmp_path / "src"
    _folder_of_files(src, b"o")

    def rewrite() -> None:
        shutil.rmtree(src / "d")
        _folder_of_files(src, b"n")

    _after_first_file(monkeypatch, "d/f0", rewrite)
    warnings: list[str] = []
    snap = vault.backup(src, on_change=on_change, on_warning=warnings.append)  # raised SourceError with "fail"
    names = sorted(e.path for e in vault.files(snap) if e.type == "file")
    assert names == ["d/f0", "d/f1", "d/f2", "d/f3"], warnings
    assert not [w for w in warnings if "deleted" in w]


def test_a_folder_renamed_away_during_the_backup_still_reads_the_files_at_the_scanned_paths(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The same, with the old folder renamed away (mv latest latest.old; save to latest): the files at the
    scanned paths are read (a folder kept open between files followed the renamed one, and stored its old
    bytes under paths that held new ones)."""
    src = tmp_path / "src"
    _folder_of_files(src, b"o")

    def rename_and_rewrite() -> None:
        os.rename(src / "d", tmp_path / "d.old")
        _folder_of_files(src, b"n")

    _after_first_file(monkeypatch, "d/f0", rename_and_rewrite)
    snap = vault.backup(src)
    vault.restore(snap, tmp_path / "out")
    assert (tmp_path / "out" / "d" / "f1").read_bytes() == (src / "d" / "f1").read_bytes()


def test_a_file_of_exactly_the_inline_size_is_coded_by_the_reading_thread_and_one_byte_more_on_the_pool(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """INLINE_FILE_BYTES is the largest file coded inline (the file's size decides, not its chunks')."""
    limit = backup_module.INLINE_FILE_BYTES
    src = tmp_path / "src"
    src.mkdir()
    # no byte value in common: a chunk of one file is never found in the other (a last chunk of a byte or two,
    # which a cut near the end leaves, is found in 64 KiB of random bytes, and was counted as both files')
    at_limit = os.urandom(limit).translate(bytes(b & 0xFE for b in range(256)))
    over = os.urandom(limit + 1).translate(bytes(b | 0x01 for b in range(256)))
    (src / "at_limit").write_bytes(at_limit)
    (src / "over").write_bytes(over)
    coded_on: list[tuple[bytes, str]] = []
    real_prepare = backup_module._prepare_chunk

    def recording(repo, data, *args):
        coded_on.append((bytes(data), threading.current_thread().name))
        return real_prepare(repo, data, *args)

    monkeypatch.setattr(backup_module, "_prepare_chunk", recording)
    vault.backup(src)
    here = threading.current_thread().name
    inline = {name == here for data, name in coded_on if data in at_limit}
    pooled = {name.startswith("ckptvault-chunk") for data, name in coded_on if data in over}
    assert inline == {True} and pooled == {True}, coded_on


@pytest.mark.parametrize(
    ("path", "root"),
    [
        ("/data/ckpt/rank0/shard.bin", "/data/ckpt"),
        ("/data/ckpt/shard.bin", "/data/ckpt/"),
        ("/etc/shard.bin", "/"),
        ("/data/ckpt-old/shard.bin", "/data/ckpt"),  # shares the root's letters, not its folder
    ],
)
def test_a_files_place_below_its_source_folder_is_what_relpath_says(path, root):
    # the scan's source folders are absolute and normalised (os.path.abspath), so no "." or ".." inside
    assert backup_module._below(path, root) == os.path.relpath(path, root)


@pytest.mark.parametrize("mode", ["warn", "fail"])
def test_a_file_deleted_between_its_folders_listing_and_its_stat_follows_on_change(
    vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
):
    """Review 44 #8: a file the rotation took between the scan's listing of its folder and its stat was only a
    warning, though --on-change fail refuses a snapshot missing a file deleted during the backup."""
    from ckptvault.ops import scan as scan_module

    src = tmp_path / "src"
    src.mkdir()
    (src / "model.pt").write_bytes(os.urandom(10_000))
    (src / "stable").write_bytes(b"fine")
    real = scan_module._listing

    def listed_then_rotated(directory, *args):
        entries = real(directory, *args)
        (src / "model.pt").unlink(missing_ok=True)
        return entries

    monkeypatch.setattr(scan_module, "_listing", listed_then_rotated)
    if mode == "fail":
        with pytest.raises(SourceError, match=r"model\.pt: it was deleted during the backup \(use on_change="):
            vault.backup(src, on_change=mode)
        assert vault.snapshots() == []
        return
    warnings: list[str] = []
    snap = vault.backup(src, on_change=mode, on_warning=warnings.append)
    assert [e.path for e in vault.files(snap)] == ["stable"]
    assert len(warnings) == 1 and "model.pt: it was deleted during the backup" in warnings[0], warnings
