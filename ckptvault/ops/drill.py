"""The restore drill: prove that a snapshot restores and loads, and time what recovery costs.

Three phases, each timed: **fetch** (the verified restore into a fresh temporary folder: every
chunk's checksum or AEAD tag checked, every file against its hash as it is written), **verify** (an
independent pass over the restored tree: every entry present with its type, size, mode, link
target and whole-file BLAKE3), and optionally **load** (each ``.safetensors`` file read tensor by
tensor with safetensors, each ``.pt``/``.pth``/``.ckpt`` and zip ``.bin`` file with
``torch.load(weights_only=True)`` and its zip records' CRC-32, which torch.load does not check; JSON
files, shard indexes and torch.distributed.checkpoint folders as load_checks.py says). The folder
is deleted afterwards, whatever happened.

A torch file that holds pickled Python objects (optimizer hyper-parameters, RNG states of
numpy, a Lightning ``.ckpt``) is refused by a weights-only load; the drill then checks its zip
archive record by record (CRC-32) instead of running its pickled code.

The temporary folder is made in ``workdir`` (``--tmp-dir``), else in the system's, and held under
an exclusive ``flock`` (of a lock file in it) while the drill runs. A drill that was killed
(SIGKILL, the OOM killer, a lost spot instance) leaves its folder behind, as big as the snapshot;
the next drill in the same place removes such folders: the kernel dropped a dead process's lock,
so a folder whose lock can be taken has no live drill (``DrillReport.swept``). The lock is taken
before anything else is written into the folder, so one holding nothing else may be a drill that
has not locked it yet, and is left.

A ``workdir`` that is empty, a file, or not writable is a UsageError; a disk that fills up during
the restore is StorageFullError (exit 21) naming the folder; any other filesystem error is a
one-line StorageError.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pickle
import stat
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..errors import (
    CkptVaultError,
    FileFormatError,
    IntegrityError,
    StorageError,
    StorageFullError,
    UsageError,
    first_few,
    spelled,
)
from ..formats import pread_at
from ..formats.safetensors import parse as parse_safetensors
from ..formats.zipmembers import looks_like as looks_like_zip
from ..localtree import remove_tree
from ..snapshot.model import FileEntry, Snapshot
from ..store.failures import Kind, classify
from .legacy_torch import legacy_torch_problem
from .load_checks import LoadCheck, archive_crc_problem, check_dcp, check_json, is_dcp_metadata, seconds_since
from .restore import file_hash, give_owner, restored_mode, target_error

DRILL_PREFIX = "ckptvault-drill-"
LOCK_FILE = ".drill-lock"
SAFETENSORS = (".safetensors",)
TORCH = (".pt", ".pth", ".ckpt", ".bin")
LOADED = (*SAFETENSORS, *TORCH, ".json")  # and a torch.distributed.checkpoint folder's .metadata


NOT_INSTALLED = "is not installed"  # in the reason of a file skipped for want of a library


@dataclass(frozen=True)
class DrillReport:
    snapshot_id: str
    step: int | None
    files: int
    bytes: int
    fetch_s: float
    verify_s: float
    load_s: float | None  # None without --load
    total_s: float
    loads: list[LoadCheck] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # files not loaded, with the reason
    swept: list[str] = field(default_factory=list)  # folders of killed drills removed before this one
    swept_bytes: int = 0  # the bytes they held

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.loads)

    @property
    def lacking_a_library(self) -> int:
        """Files checked less than loaded, or skipped, because torch or safetensors is not installed."""
        return sum(check.partial for check in self.loads) + sum(NOT_INSTALLED in why for why in self.skipped)


def run_drill(
    snapshot: Snapshot,
    tree: list[FileEntry],
    restore: Callable[[str], object],
    *,
    load: bool = False,
    workdir: str | None = None,
) -> DrillReport:
    started = time.monotonic()
    holder, made = _make_tmp(workdir)
    where = workdir or tempfile.gettempdir()
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(_remove_empty, made)  # the --tmp-dir folders the drill made, after its own
        tmp = cleanup.enter_context(holder)
        target = os.path.join(tmp, "restore")
        try:
            cleanup.enter_context(_locked(holder))
            swept, swept_bytes = sweep_killed_drills(where, owner=os.stat(tmp).st_uid)
            t0 = time.monotonic()
            restore(target)
        except CkptVaultError:
            raise
        except OSError as exc:  # named below the --tmp-dir folder, which outlives the drill's own
            tmp_dir = spelled("--tmp-dir DIR", "workdir=")
            hint = f"free space in {where}, or pass {tmp_dir} on a disk with room for the snapshot"
            raise target_error(exc, where, full_hint=hint) from exc
        t1 = time.monotonic()
        problems = verify_tree(target, tree)
        t2 = time.monotonic()
        if problems:
            raise IntegrityError(f"drill of snapshot {snapshot.short_id}: {first_few(problems, 1)}")
        loads: list[LoadCheck] = []
        skipped: list[str] = []
        if load:
            loads, skipped = load_files(target, tree)
        t3 = time.monotonic()
    files = [e for e in tree if e.type == "file"]
    return DrillReport(
        snapshot_id=snapshot.id,
        step=snapshot.step,
        files=len(files),
        bytes=sum(e.size for e in files),
        fetch_s=round(t1 - t0, 3),
        verify_s=round(t2 - t1, 3),
        load_s=round(t3 - t2, 3) if load else None,
        total_s=round(time.monotonic() - started, 3),
        loads=loads,
        skipped=skipped,
        swept=swept,
        swept_bytes=swept_bytes,
    )


@contextlib.contextmanager
def _locked(holder: tempfile.TemporaryDirectory[str]) -> Iterator[None]:
    """Hold the exclusive flock of the drill folder's lock file until all else in the folder is
    removed (the kernel drops it when the process dies, however). A file opened for writing, not
    the folder: NFS locks need one."""
    fd = os.open(os.path.join(holder.name, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with contextlib.suppress(OSError):  # no locks on this filesystem: no drill can sweep the folder either
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        try:
            _remove_all_but_the_lock(holder.name)  # under the lock: no sweep takes it for a dead drill's
        finally:
            os.close(fd)
        _remove_lock_and_folder(holder.name)  # TemporaryDirectory's own cleanup then finds nothing


def sweep_killed_drills(where: str, owner: int | None = None) -> tuple[list[str], int]:
    """Remove the folders that killed drills left in ``where``; return their paths and their bytes.

    A folder is emptied only while this process holds its lock, which a live drill never lets go:
    two drills sweeping at once never remove a folder twice, and never a live drill's. A folder
    without a lock file, or with nothing else, may be a drill that has not locked it yet: left.
    Only folders of ``owner`` (default: this user; a drill passes the owner its own folder got,
    which is how the filesystem maps this user) are looked at: root would remove other users'."""
    owner = os.geteuid() if owner is None else owner
    swept: list[str] = []
    total = 0
    try:
        names = sorted(n for n in os.listdir(where) if n.startswith(DRILL_PREFIX))
    except OSError:
        return swept, total
    for name in names:
        folder = os.path.join(where, name)
        try:
            st = os.lstat(folder)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != owner:
                continue
            fd = os.open(os.path.join(folder, LOCK_FILE), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:  # no lock file, a link, another user's: not ours to remove
            continue
        try:
            if os.fstat(fd).st_uid != owner:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.listdir(folder) == [LOCK_FILE]:
                continue
            size = _remove_all_but_the_lock(folder)
        except OSError:  # locked by a live drill (EWOULDBLOCK), or not removable by this user
            continue
        finally:
            os.close(fd)
        # after the close: NFS keeps a file unlinked while open as .nfsXXXX, which keeps its folder
        if _remove_lock_and_folder(folder):
            swept.append(folder)
            total += size
    return swept, total


def _remove_all_but_the_lock(folder: str) -> int:
    """``rm -rf`` of the folder's entries but its lock file, also through folders restored with a
    read-only mode (as TemporaryDirectory does); returns the bytes its files held on the disk. The
    lock file goes last: what a kill or an error leaves is still locked, so a later drill sweeps it."""
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    return sum(remove_tree(os.path.join(folder, name)) for name in names if name != LOCK_FILE)


def _remove_lock_and_folder(folder: str) -> bool:
    """The lock file and the folder, when nothing else is left in it; whether the folder is gone."""
    with contextlib.suppress(OSError):
        if os.listdir(folder) == [LOCK_FILE]:
            os.unlink(os.path.join(folder, LOCK_FILE))
        os.rmdir(folder)
    return not os.path.lexists(folder)


def _make_tmp(workdir: str | None) -> tuple[tempfile.TemporaryDirectory[str], list[str]]:
    """The drill's temporary folder, in ``workdir`` (created if missing) or the system's, and the
    folders made for ``workdir``, innermost first (removed again after the drill)."""
    if workdir is not None and not workdir.strip():
        raise UsageError(f"{spelled('--tmp-dir', 'workdir')} is empty; give a folder, or leave it out for the system's")
    where = workdir or tempfile.gettempdir()
    made: list[str] = []
    try:
        if workdir:
            folder = os.path.abspath(workdir)
            while not os.path.exists(folder) and folder != os.path.dirname(folder):
                made.append(folder)
                folder = os.path.dirname(folder)
            os.makedirs(workdir, exist_ok=True)
        return tempfile.TemporaryDirectory(prefix="ckptvault-drill-", dir=workdir), made
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if classify(exc).kind is Kind.FULL:  # the same test as a restore's writes
            raise StorageFullError("mkdir", "the drill's temporary folder", where, reason) from exc
        if not workdir:
            raise StorageError(
                "mkdir",
                "the drill's temporary folder",
                where,
                reason,
                message=f"cannot make a temporary folder in {where} ({reason}); "
                f"pass {spelled('--tmp-dir DIR', 'workdir=')}, a writable folder",
            ) from exc
        if os.path.exists(workdir) and not os.path.isdir(workdir):
            reason = "it is a file, not a folder"
        elif exc.errno == errno.ENOTDIR:
            reason = "a folder above it is a file"
        raise UsageError(
            f"{spelled('--tmp-dir', 'workdir')} {workdir}: cannot make a temporary folder there ({reason}); "
            "give a writable folder"
        ) from exc


def _remove_empty(folders: list[str]) -> None:
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:  # something else was put there meanwhile: it stays, and so do its parents
            return


def verify_tree(target: str, tree: list[FileEntry]) -> list[str]:
    """Everything the snapshot says, checked against the restored folder; returns the problems. The
    drill's own copy of a folder or file stored without the owner's permission to read it (0o555,
    0o200) is given that permission once its mode is checked, so that what is below it, or in it, can
    be read (by a user other than root: it was an internal error)."""
    problems = []
    for entry in tree:
        path = os.path.join(target, *entry.path.split("/"))
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            problems.append(f"{entry.path} was not restored")
            continue
        if entry.type == "dir":
            if not stat.S_ISDIR(st.st_mode):
                problems.append(f"{entry.path} is not a directory")
            else:
                give_owner(path, st, stat.S_IRWXU)
        elif entry.type == "symlink":
            if not stat.S_ISLNK(st.st_mode) or os.readlink(path) != entry.target:
                problems.append(f"{entry.path} is not the symlink the snapshot holds")
        elif not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
            problems.append(f"{entry.path} has {st.st_size} bytes, the snapshot {entry.size}")
        elif stat.S_IMODE(st.st_mode) != (mode := restored_mode(entry)):
            problems.append(f"{entry.path} has mode {oct(stat.S_IMODE(st.st_mode))}, the snapshot {oct(mode)}")
        else:
            give_owner(path, st, stat.S_IRUSR)
            if file_hash(path) != entry.blake3:
                problems.append(f"{entry.path} does not match the snapshot's BLAKE3 hash")
    return problems


def load_files(target: str, tree: list[FileEntry]) -> tuple[list[LoadCheck], list[str]]:
    loads: list[LoadCheck] = []
    skipped: list[str] = []
    names = {e.path for e in tree if e.type != "dir"}
    for entry in tree:
        lower = entry.path.lower()
        dcp = is_dcp_metadata(entry.path, names)
        if entry.type == "dir" or not (lower.endswith(LOADED) or dcp):
            continue
        path = os.path.join(target, *entry.path.split("/"))
        if entry.type == "symlink" and not _inside(target, path):
            # weights linked from elsewhere (an earlier checkpoint, rotated away since): not in the vault
            why = (
                f"a symlink to {entry.target}, which is no file of the snapshot: its bytes are not in the vault "
                "(back up what it points at, or a folder holding both)"
            )
            loads.append(LoadCheck(entry.path, "link", False, why, 0.0))
            continue
        check: LoadCheck | str
        started = time.monotonic()
        try:
            if lower.endswith(SAFETENSORS):
                check = _load_safetensors(entry.path, path)
            elif lower.endswith(".json"):
                check = check_json(entry.path, path)
            elif dcp:
                check = check_dcp(entry.path, path)
            elif lower.endswith(".bin") and _torch_layout(path) not in ("zip", "legacy"):
                check = "not a torch checkpoint (no zip archive, no legacy torch file): not of a kind it loads"
            else:
                check = _load_torch(entry.path, path)
        except Exception as exc:  # one odd file is that file's failure, never the drill's end
            check = LoadCheck(entry.path, "error", False, f"{type(exc).__name__}: {exc}"[:300], seconds_since(started))
        if isinstance(check, str):
            skipped.append(f"{entry.path}: {check}")
        else:
            loads.append(check)
    return loads, skipped


def _load_safetensors(name: str, path: str) -> LoadCheck | str:
    started = time.monotonic()
    try:  # optional: only the drill's --load needs them; torch, as numpy lacks bfloat16 and float8
        import torch  # noqa: F401
        from safetensors import safe_open
    except ImportError:  # what can be told without them: the header parses and every tensor lies in the file
        try:
            with open(path, "rb") as f:
                parse_safetensors(pread_at(f.fileno()), os.fstat(f.fileno()).st_size, name)
        except FileFormatError as exc:
            return LoadCheck(name, "safetensors-header", False, exc.reason, seconds_since(started), partial=True)
        detail = "header and tensor extents checked, not loaded (loading needs safetensors and torch)"
        return LoadCheck(name, "safetensors-header", True, detail, seconds_since(started), partial=True)
    try:
        with safe_open(path, framework="pt") as f:
            keys = list(f.keys())
            for key in keys:
                f.get_tensor(key)
    except Exception as exc:  # any failure to parse is what the drill is for
        return LoadCheck(name, "safetensors", False, f"{type(exc).__name__}: {exc}", seconds_since(started))
    return LoadCheck(name, "safetensors", True, f"{len(keys)} tensors", seconds_since(started))


def _load_torch(name: str, path: str) -> LoadCheck | str:
    started = time.monotonic()
    layout = _torch_layout(path)
    if layout == "torn-zip":  # torch says "failed finding central directory"; "another file" misled (tr43)
        detail = "a zip archive without its directory, which torch.save writes last: cut short (killed while saving?)"
        return LoadCheck(name, "torch", False, detail, seconds_since(started))
    try:
        import torch  # optional: only the drill's --load needs it
    except ImportError:  # its records' CRC-32 still tell a torn or flipped file
        if layout != "zip":
            return f"torch {NOT_INSTALLED}, and it is no zip archive whose records could be checked without it"
        problem = archive_crc_problem(lambda: zipfile.ZipFile(path))
        detail = problem or f"every archive record's CRC-32 verified, not loaded (torch {NOT_INSTALLED})"
        return LoadCheck(name, "torch-archive", problem is None, detail, seconds_since(started), partial=True)
    if layout == "other":  # torch's own error advises an unsafe load
        detail = "not a torch checkpoint: neither a zip archive nor a pickle of protocol 2+ (zeroed, or another file)"
        return LoadCheck(name, "torch", False, detail, seconds_since(started))
    if layout == "pickle":  # torch says "Invalid magic number; corrupt file?"
        detail = "not a torch checkpoint: a pickle that torch.save did not write (pickle.dump's, say; not unpickled)"
        return LoadCheck(name, "torch", False, detail, seconds_since(started))
    try:
        with warnings.catch_warnings():  # the check's line says what went wrong; torch's warnings add noise
            warnings.filterwarnings("ignore", module=r"torch\.")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # Not weights-only: check the archive without executing its pickled code.
        if layout == "legacy":  # its storages are checked for a cut instead (legacy_torch.py)
            try:
                with open(path, "rb") as f:
                    problem = legacy_torch_problem(f)
            except (OSError, MemoryError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            detail = problem or "every storage whole (a legacy torch file holding pickled objects: not unpickled)"
            return LoadCheck(name, "torch-legacy", problem is None, detail, seconds_since(started))
        problem = archive_crc_problem(lambda: zipfile.ZipFile(path))
        detail = problem or "every archive record's CRC-32 verified (holds pickled objects: not unpickled)"
        return LoadCheck(name, "torch-archive", problem is None, detail, seconds_since(started))
    except Exception as exc:  # any failure to load is what the drill is for
        return LoadCheck(name, "torch", False, f"{type(exc).__name__}: {exc}", seconds_since(started))
    # torch.load checks no CRC: a bit flipped on the trainer's disk before the backup loads silently
    problem = archive_crc_problem(lambda: zipfile.ZipFile(path)) if layout == "zip" else None
    detail = problem or f"loaded {type(obj).__name__}"
    return LoadCheck(name, "torch", problem is None, detail, seconds_since(started))


# torch.save(..., _use_new_zipfile_serialization=False) pickles this number first (a pickled 10-byte long)
_LEGACY_TORCH_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _torch_layout(path: str) -> str:
    """ "zip" (torch.save's archive), "torn-zip" (one that starts as a zip archive and has no directory at
    its end), "legacy" (torch.save's older pickles), "pickle" (another pickle of protocol 2+) or "other",
    from the file's first bytes and zip directory, each read once."""
    if zipfile.is_zipfile(path):
        return "zip"
    with open(path, "rb") as f:
        head = f.read(32)
    if looks_like_zip(head):
        return "torn-zip"
    if not head.startswith(b"\x80"):
        return "other"
    return "legacy" if _LEGACY_TORCH_MAGIC in head else "pickle"


def _inside(target: str, path: str) -> bool:
    """Whether ``path`` (a link in the restored tree) resolves to a file that the restore wrote."""
    resolved = os.path.realpath(path)
    return os.path.isfile(resolved) and resolved.startswith(os.path.join(os.path.realpath(target), ""))
