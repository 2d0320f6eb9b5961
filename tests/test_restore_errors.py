"""Restore and drill: a target that cannot be written is a one-line error, never an internal error.

Each case drives the real CLI and checks the exit code, that stderr is one line without a
traceback, and that nothing half-written (a temporary file, a partial file) is left behind. The
read-only and full-disk cases use real tmpfs mounts (root only; skipped when mount fails).
"""

from __future__ import annotations

import contextlib
import os
import pty
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import StorageFullError
from ckptvault.ops.restore import TEMP_MARK

from .conftest import write_file

Cli = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def snap(vault: Vault, tmp_path: Path) -> str:
    """A snapshot of a small tree: a.json (tiny, restored first), big.bin (1 MiB), model/w.bin."""
    src = tmp_path / "src"
    write_file(src / "a.json", b'{"step": 1}')
    write_file(src / "big.bin", os.urandom(1 << 20))
    write_file(src / "model" / "w.bin", os.urandom(50_000))
    return vault.backup(src).id


@pytest.fixture
def run(cli: Cli, repo_url: str, tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """The CLI against the test vault; a crash report (an internal error) would land in tmp_path."""
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()

    def run_(*args: str) -> subprocess.CompletedProcess:
        return cli(*args, "--repo", repo_url, check=False, TMPDIR=str(crash_dir))

    return run_


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str, str], Path]]:
    """Mount a tmpfs with the given options at tmp_path/NAME; unmounted after the test."""
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        point = tmp_path / name
        point.mkdir()
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs needs root and mount(8)")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", str(point)], check=True)


def one_line_error(proc: subprocess.CompletedProcess, exit_code: int, *needles: str) -> str:
    err = proc.stderr.decode()
    assert proc.returncode == exit_code, f"exit {proc.returncode}, expected {exit_code}: {err}"
    assert "internal error" not in err and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if TEMP_MARK in p.name] if root.exists() else []


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ---- clashes found while planning: nothing is written -------------------------------------


def test_a_target_that_is_a_file_is_a_conflict(run, snap, tmp_path: Path):
    target = write_file(tmp_path / "afile", b"mine")
    line = one_line_error(run("restore", snap, str(target)), 22, str(target), "is a file")
    assert "restore" in line
    assert target.read_bytes() == b"mine"


def test_a_target_below_a_file_is_a_conflict(run, snap, tmp_path: Path):
    afile = write_file(tmp_path / "afile", b"mine")
    one_line_error(run("restore", snap, str(afile / "sub")), 22, str(afile), "is a file")
    assert afile.read_bytes() == b"mine"


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_a_file_where_the_snapshot_has_a_folder_is_refused_before_writing(run, snap, tmp_path: Path, overwrite):
    target = tmp_path / "target"
    write_file(target / "model", b"a file named like the snapshot's folder")
    args = ["restore", snap, str(target), *(["--overwrite"] if overwrite else [])]
    one_line_error(run(*args), 22, "model", "is a file", "folder")
    assert listing(target) == ["model"], "nothing may be written when the plan fails"
    assert (target / "model").read_bytes() == b"a file named like the snapshot's folder"


def test_a_file_where_the_snapshot_has_a_folder_is_refused_with_include_too(run, snap, tmp_path: Path):
    target = tmp_path / "target"
    write_file(target / "model", b"mine")
    one_line_error(run("restore", snap, str(target), "--include", "model/w.bin", "--overwrite"), 22, "model")
    assert listing(target) == ["model"]


def test_a_folder_where_the_snapshot_has_a_file_is_refused_even_with_overwrite(run, snap, tmp_path: Path):
    target = tmp_path / "target"
    (target / "big.bin").mkdir(parents=True)
    write_file(target / "big.bin" / "user-data", b"keep me")
    one_line_error(run("restore", snap, str(target), "--overwrite"), 22, "big.bin", "is a folder", "--overwrite")
    assert listing(target) == ["big.bin", "big.bin/user-data"], "refused at planning time: no folder made, no file"
    assert (target / "big.bin" / "user-data").read_bytes() == b"keep me"


def file_at_path_length(src: Path, length: int) -> Path:
    """A file "x" (b"far") deep under ``src`` whose path is ``length`` bytes, in folders of 200 bytes."""
    deep = src
    while len(os.fsencode(deep)) < length - 201:
        deep /= "p" * 200
    deep /= "q" * (length - len(os.fsencode(deep)) - 3)
    deep.mkdir(parents=True)
    (deep / "x").write_bytes(b"far")
    return deep / "x"


def test_a_path_too_long_for_the_target_is_refused_before_writing(run, vault: Vault, tmp_path: Path):
    """A file whose path under the target leaves no room for its 40-byte temporary name below
    PATH_MAX failed as a write ("check that disk", exit 20) once earlier files were in place."""
    src = tmp_path / "s"
    file_at_path_length(src, 4080)  # legal, and backed up
    write_file(src / "a.bin", b"near")
    snap_id = vault.backup(src).id
    target = tmp_path / "t"  # as long as src: x's folder plus a temporary name is over 4,095 bytes
    line = one_line_error(run("restore", snap_id, str(target)), 22, "would need a path of 4,119 bytes", "shorter path")
    assert not target.exists(), line
    assert run("restore", snap_id, str(target), "--include", "a.bin").returncode == 0
    assert (target / "a.bin").read_bytes() == b"near"
    (src / "a.bin").unlink()  # back into the folder it came from: x is there, whole, and is not written
    assert run("restore", snap_id, str(src)).returncode == 0
    assert (src / "a.bin").read_bytes() == b"near"


def test_a_path_of_exactly_path_max_bytes_is_refused_too(run, vault: Vault, tmp_path: Path):
    """PATH_MAX counts the closing NUL: a path of 4,096 bytes fails in the kernel as one over it does."""
    src = tmp_path / "s"
    file_at_path_length(src, 4057)  # its temporary name's path is 4,096 bytes
    snap_id = vault.backup(src).id
    target = tmp_path / "t"
    one_line_error(run("restore", snap_id, str(target)), 22, "would need a path of 4,096 bytes", "shorter path")
    assert not target.exists()


# ---- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["", " "], ids=["empty", "blank"])
def test_an_empty_target_is_a_usage_error(run, snap, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # the CLI runs here: an empty target must not restore into it
    one_line_error(run("restore", snap, target), 2, "target is empty")
    assert list(cwd.iterdir()) == []


def test_an_include_glob_that_matches_nothing_is_a_usage_error(run, snap, repo_url: str, tmp_path: Path):
    target = tmp_path / "target"
    line = one_line_error(run("restore", snap, str(target), "--include", "nomatch*"), 2, "--include 'nomatch*'")
    # the snapshot's ID, not a placeholder
    assert line.endswith(f"list them with: ckptvault ls --repo {repo_url} {snap[:8]}")
    assert not target.exists(), "nothing may be created before the globs are checked"


def test_an_include_glob_that_matches_nothing_beside_others_is_a_warning(run, snap, tmp_path: Path):
    # a generic resume call may ask for kinds of files a checkpoint does not have
    target = tmp_path / "target"
    proc = run("restore", snap, str(target), "-i", "model", "-i", "typo*", "-i", "*.json")
    assert proc.returncode == 0, proc.stderr.decode()
    (warning,) = [line for line in proc.stderr.decode().splitlines() if line.strip()]
    assert warning.startswith("warning: --include 'typo*' matched no path"), warning
    assert listing(target) == ["a.json", "model", "model/w.bin"]


# ---- the filesystem refuses: read-only, full ------------------------------------------------


def test_a_read_only_target_is_a_one_line_error(run, snap, tmpfs):
    ro = tmpfs("ro", "size=64k,ro")
    one_line_error(run("restore", snap, str(ro / "t")), 20, str(ro / "t"), "Read-only file system", "writable")
    one_line_error(run("restore", snap, str(ro)), 20, str(ro), "Read-only file system")
    assert list(ro.iterdir()) == []


def test_a_full_disk_is_storage_full_naming_the_target_and_leaves_nothing_half_written(run, snap, tmpfs):
    small = tmpfs("small", "size=256k")
    target = small / "t"
    one_line_error(
        run("restore", snap, str(target)), 21, "no space left", str(target), "big.bin", "holds part of the snapshot"
    )
    assert temp_files(small) == []
    assert not (target / "big.bin").exists(), "a partial file was left"
    assert (target / "a.json").read_bytes() == b'{"step": 1}', "files restored before the disk filled stay whole"


def test_a_disk_without_room_for_the_target_folder_says_so_once(run, snap, tmpfs):
    """fs44 #8: "no space left writing /mnt/r on /mnt/r": the folder that could not be made was named twice."""
    full = tmpfs("full", "size=256k,nr_inodes=1")  # the root folder takes the only inode
    line = one_line_error(run("restore", snap, str(full / "t")), 21, f"no space left on {full / 't'}: ")
    assert line.count(str(full / "t")) == 1 and "holds part of the snapshot" not in line, line


def test_a_disk_out_of_inodes_says_so_not_free_space(run, snap, tmpfs):
    """odd46 #5: a filesystem with free blocks and no inode left was "no space left ... free space", while
    `df -h` showed it nearly empty."""
    few = tmpfs("few", "size=20m,nr_inodes=4")
    proc = run("restore", snap, str(few / "t"))
    one_line_error(proc, 21, "no inode (file entry) left", "restore to a filesystem with more inodes")


def test_a_symlink_loop_on_the_way_says_so(run, snap, tmp_path: Path):
    """odd46 #4: "Too many levels of symbolic links; check that disk" sent the user to a disk that was fine."""
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    line = one_line_error(run("restore", snap, str(tmp_path / "loop-a" / "t")), 20, "points back at itself")
    assert "check that disk" not in line, line


def test_a_rerun_of_a_finished_restore_passes_on_a_target_mounted_read_only_since(run, snap, tmpfs):
    """Everything is there: a rerun changes nothing, so it needs no write (it set every folder's mode and
    mtime again, and failed, exit 20, on a target remounted read-only or with folders of another user)."""
    done = tmpfs("done", "size=4m")
    assert run("restore", snap, str(done / "t")).returncode == 0
    subprocess.run(["mount", "-o", "remount,ro", str(done)], check=True)
    again = run("restore", snap, str(done / "t"))
    assert again.returncode == 0 and "3 already present" in again.stdout.decode(), (again.stdout, again.stderr)


def test_a_symlink_that_cannot_be_made_is_named_by_its_own_path_not_its_target(run, vault: Vault, tmp_path, tmpfs):
    """symlink(2) errors carry the link's target as their file name: "no space left writing /etc/hostname"
    named a path outside the target that the restore never touches."""
    src = tmp_path / "links"
    src.mkdir()
    (src / "to_hostname").symlink_to("/etc/hostname")
    write_file(src / "w.bin", b"weights")
    snap_id = vault.backup(src).id
    full = tmpfs("inodes", "size=4m,nr_inodes=2")  # the root and the target folder: no room for the link
    line = one_line_error(run("restore", snap_id, str(full / "t"), "--include", "to_hostname"), 21, "no space left")
    assert "to_hostname" in line and "/etc/hostname" not in line, line


# ---- the drill's temporary folder -----------------------------------------------------------


def test_drill_tmp_dir_that_is_a_file_is_a_usage_error(run, snap, tmp_path: Path):
    afile = write_file(tmp_path / "afile", b"mine")
    one_line_error(run("drill", snap, "--tmp-dir", str(afile)), 2, "--tmp-dir", str(afile), "is a file")
    one_line_error(run("drill", snap, "--tmp-dir", str(afile / "sub")), 2, "--tmp-dir", str(afile / "sub"))
    assert afile.read_bytes() == b"mine"


def test_drill_empty_tmp_dir_is_a_usage_error(run, snap):
    one_line_error(run("drill", snap, "--tmp-dir", ""), 2, "--tmp-dir", "empty")


def test_drill_tmp_dir_on_a_read_only_filesystem_is_a_usage_error(run, snap, tmpfs):
    ro = tmpfs("ro", "size=64k,ro")
    one_line_error(run("drill", snap, "--tmp-dir", str(ro)), 2, "--tmp-dir", str(ro), "Read-only file system")


def test_drill_on_a_full_disk_is_storage_full_and_cleans_up(run, snap, tmpfs):
    small = tmpfs("small", "size=256k")
    one_line_error(run("drill", snap, "--tmp-dir", str(small)), 21, "no space left", str(small), "--tmp-dir")
    assert list(small.iterdir()) == [], "the drill's temporary folder is removed"


def test_overwrite_replaces_a_target_file_that_cannot_be_read(
    vault: Vault, snap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from ckptvault.ops import restore as restore_module

    out = tmp_path / "out"
    vault.restore(snap, out)
    (out / "big.bin").write_bytes(b"x" * (1 << 20))  # same size, other bytes: it must be hashed to compare
    real_hash = restore_module.file_hash

    def failing_read(path: str) -> str:
        if path.endswith("big.bin"):
            raise OSError(5, "Input/output error", path)  # a bad sector in the old copy
        return real_hash(path)

    monkeypatch.setattr(restore_module, "file_hash", failing_read)
    vault.restore(snap, out, overwrite=True)
    monkeypatch.undo()
    assert restore_module.file_hash(str(out / "big.bin")) == next(
        e.blake3 for e in vault.files(snap) if e.path == "big.bin"
    )


# ---- the API, and a terminal ----------------------------------------------------------------


def test_the_api_raises_storage_full_naming_the_target_not_a_bare_oserror(vault: Vault, snap, tmpfs):
    small = tmpfs("small", "size=256k")
    with pytest.raises(StorageFullError, match="no space left") as caught:  # was OSError: the docs promise ours
        vault.restore(snap, small / "t")
    assert str(small / "t") in str(caught.value)
    assert temp_files(small) == []


def restore_in_a_terminal(repo_url: str, snap: str, target: Path, term: str) -> tuple[int, str]:
    """The CLI's restore with a pseudo-terminal as its stdout and stderr: (exit code, what it showed)."""
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptvault", "restore", snap, str(target), "--repo", repo_url],
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
        env={**os.environ, "COLUMNS": "100", "TERM": term},
    )
    os.close(terminal)
    seen = b""
    with contextlib.suppress(OSError):  # EIO once the process has closed the terminal
        while block := os.read(controller, 65536):
            seen += block
    os.close(controller)
    return proc.wait(60), seen.decode(errors="replace")


def test_a_restore_failing_in_a_terminal_takes_its_progress_bar_down_first(repo_url: str, snap, tmpfs):
    """The error line was glued to the bar's line and the cursor stayed hidden after the exit."""
    small = tmpfs("small", "size=256k")
    code, text = restore_in_a_terminal(repo_url, snap, small / "t", "xterm")
    assert code == 21, text
    hidden, error = text.index("\x1b[?25l"), text.index("error: no space left")  # the bar was shown
    assert hidden < text.rindex("\x1b[?25h", 0, error), text  # and the cursor back before the error line


def test_a_restore_in_a_dumb_terminal_shows_no_bar(repo_url: str, snap, tmp_path: Path):
    """TERM=dumb (an editor's shell, some CI logs) cannot redraw a line: the bar left two empty lines."""
    code, text = restore_in_a_terminal(repo_url, snap, tmp_path / "t", "dumb")
    assert code == 0 and text.startswith(f"restored snapshot {snap[:8]} to "), text
