"""Restore: verified, resumable, and never writing outside the target.

Plan first, then write. Planning validates every selected entry (path safety, sizes
against the index, no symlinked ancestors in the target) and finds conflicts, so a bad
snapshot or a conflicting target fails before anything is written. Each file is written
to a temporary name beside it with positioned writes of chunks fetched and verified in
parallel (a file of one chunk by one thread, without a hand-off: ``_FileWriter``), checked
against its whole-file BLAKE3 (taken over the written bytes in file order), then renamed into place.
A file that fails verification is reported and the others still restore.

A filesystem error while writing the target (disk full, read-only, permissions) ends the restore
as an ``OSError`` naming the restored path (never a temporary name); the file being written is
removed, files already renamed into place are complete and a rerun skips them. ``target_error``
turns such an error into the one-line ``CkptVaultError`` that ``Vault.restore`` raises.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import os
import posixpath
import re
import secrets
import stat
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..durable import pwrite_all
from ..errors import (
    CkptVaultError,
    IntegrityError,
    MalformedObjectError,
    RestoreConflictError,
    RestoreIncompleteError,
    StorageError,
    StorageFullError,
    UnsafePathError,
    UsageError,
    check_hint,
    first_few,
    spelled,
)
from ..hashing import checksum, new_file_hasher
from ..repository import Repository
from ..repository.format import holds_vault_config, vault_at_or_above
from ..snapshot.manifest import validate_tree
from ..snapshot.model import FileEntry, Snapshot, stored_name
from ..store.failures import Kind, classify, object_fault, once_mended, out_of_inodes
from .memory import INFLIGHT_BYTES, releasing_freed_memory
from .pin import NO_LINK_ERRNOS
from .progress import NullProgress, Progress

TEMP_MARK = ".ckptvault-tmp-"
_TEMP_RANDOM = 8  # hex digits after a name's temp stem
_TEMP_NAME_BYTES = len(TEMP_MARK) + 16 + 1 + _TEMP_RANDOM  # see temp_stem
PATH_MAX = 4096  # Linux: bytes in a path given to a system call, its closing NUL included
_LEFTOVER_NAME = re.compile(rf"{re.escape(TEMP_MARK)}[0-9a-f]{{16}}-[0-9a-f]{{{_TEMP_RANDOM}}}")  # see temp_stem
READ_BLOCK = 4 * 1024 * 1024


@dataclass(frozen=True)
class RestoreResult:
    files: int
    dirs: int
    symlinks: int
    bytes_written: int
    skipped_files: int  # already present with the right content
    duration_s: float
    # The snapshot restored (its ID, tags, step): what restore_latest took, without asking latest() again,
    # when a backup may have landed since.
    snapshot: Snapshot
    unmatched_globs: tuple[str, ...] = ()  # --include globs that matched no path (others did)
    # What the target held that the snapshot does not (a folder named once, not what is in it), left as it
    # was: files of another save beside the restored ones. At most OTHERS_LISTED are named.
    not_in_snapshot: tuple[str, ...] = ()
    setid_cleared: int = 0  # files of the snapshot with setuid/setgid bits that root restores without them


# Owners are not stored: restored by root, every file is root's, and a setuid or setgid bit saved on
# another user's program (or planted in a shared vault) would make it run as root. Root restores files
# without them; another user gets files of its own, which run as it whatever their bits.
SETID = stat.S_ISUID | stat.S_ISGID
SEARCH = stat.S_IRUSR | stat.S_IXUSR  # what the owner needs to look into a folder


def _clears_setid() -> bool:
    return os.geteuid() == 0


def restored_mode(entry: FileEntry) -> int:
    """The mode a restored file or folder gets: the stored one, less a file's setuid/setgid bits for root."""
    if entry.type == "file" and _clears_setid():
        return entry.mode & ~SETID
    return entry.mode


OTHERS_LISTED = 100
# Names that never hold a save: a fresh filesystem's lost+found (a volume mounted to resume onto), what
# desktops, notebooks and NFS leave beside files
NEVER_A_SAVE = frozenset({"lost+found", ".DS_Store", "Thumbs.db", "desktop.ini", ".ipynb_checkpoints", ".snapshot"})


def _never_a_save(name: str) -> bool:
    return name in NEVER_A_SAVE or name.startswith(".nfs") or bool(_LEFTOVER_NAME.match(name))


def entries_not_in(
    target: str, tree: list[FileEntry], enter: Callable[[str], bool] = lambda folder: False
) -> tuple[str, ...]:
    """The paths below ``target`` that ``tree`` does not hold (a folder it lacks is named, not entered;
    a link is never followed, where the snapshot has a folder too), but names that never hold a save
    (``NEVER_A_SAVE``, ``.nfs*``, a killed restore's temporary files): the first OTHERS_LISTED by name.
    Only the snapshot's own folders are walked, so the cost follows the snapshot. ``enter(folder)``: make a
    folder that cannot be listed readable, and say whether it did (``_Planner.enter``)."""
    folders = {e.path for e in tree if e.type == "dir"}
    known = {e.path for e in tree}
    found: list[str] = []
    pending = [""]
    while pending:
        prefix = pending.pop()
        folder = os.path.join(target, *prefix.split("/")) if prefix else target
        try:
            entries = _listed(folder, enter)
        except (FileNotFoundError, NotADirectoryError):  # no target yet, or a file where the snapshot has a folder
            continue
        for entry in entries:
            rel = f"{prefix}/{entry.name}" if prefix else entry.name
            if rel in folders and entry.is_dir(follow_symlinks=False):
                pending.append(rel)
            elif rel not in known and not _never_a_save(entry.name):
                found.append(rel)
        if len(found) >= OTHERS_LISTED:
            break
    return tuple(sorted(found)[:OTHERS_LISTED])


def _listed(folder: str, enter: Callable[[str], bool]) -> list[os.DirEntry[str]]:
    """``folder``'s entries by name (read to the end: the iterator closes); one its owner cannot list is
    opened to it first, where ``enter`` may."""
    try:
        return sorted(os.scandir(folder), key=lambda entry: entry.name)
    except PermissionError:
        if not enter(folder):
            raise
        return sorted(os.scandir(folder), key=lambda entry: entry.name)


def select_entries(
    tree: list[FileEntry], include: list[str] | None, snapshot_id: str = "SNAPSHOT"
) -> tuple[list[FileEntry], tuple[str, ...]]:
    """Entries matching any glob (an entry matches when it or a parent directory does), plus the
    directories above them; and the globs that matched nothing.

    When no glob matches anything, nothing would be restored: UsageError, before anything is
    written. A glob that matches nothing while others match is reported, not refused (a generic
    resume call may ask for ``*.safetensors`` and ``*.pt`` of a checkpoint holding one kind): the
    CLI prints a warning naming it, the API returns it in ``RestoreResult.unmatched_globs``."""
    if not include:
        return list(tree), ()
    if blank := [pat for pat in include if not pat.strip()]:
        # --include "$PATTERN" with the variable unset: not "matched no path", as if the snapshot lacked it
        raise UsageError(
            f"{spelled('--include', 'include')} pattern {blank[0]!r} is empty (is a variable unset?); give a glob "
            "of paths from the snapshot's root (e.g. 'model/*.bin'), or leave it out to restore everything"
        )
    chosen: set[str] = set()
    as_stored = {pat: posixpath.normpath(pat).lstrip("/") for pat in include}  # "./model/*" is "model/*"
    unmatched = _choose(tree, as_stored, chosen)
    # a pattern that matched nothing as given may name files as listings show them (``new\nline``,
    # ``w\xffx.bin``); asked only then, as cat asks: a name may hold a backslash of its own
    shown = {pat: stored for pat in unmatched if (stored := stored_name(as_stored[pat]))}
    unmatched = [pat for pat in unmatched if pat not in shown] + _choose(tree, shown, chosen)
    if len(unmatched) == len(dict.fromkeys(include)):
        globs = ", ".join(repr(pat) for pat in unmatched)
        raise UsageError(
            f"{spelled('--include', 'include')} {globs} matched no path in the snapshot, so nothing was restored; "
            "globs match paths from the snapshot's root (e.g. 'model/*.bin'): list them with: "
            + spelled(f"ckptvault ls {snapshot_id}", "Vault.files(snapshot)")
        )
    return [e for e in tree if e.path in chosen], tuple(dict.fromkeys(pat for pat in include if pat in unmatched))


def _choose(tree: list[FileEntry], globs: dict[str, str], chosen: set[str]) -> list[str]:
    """Add to ``chosen`` the paths a glob matches (an entry matches when it or a parent directory does)
    and the directories above them; the patterns that matched nothing."""
    unmatched = dict.fromkeys(globs)
    for e in tree:
        parts = e.path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        matched = [pat for pat, glob in globs.items() if any(fnmatch.fnmatchcase(p, glob) for p in prefixes)]
        if matched:
            chosen.add(e.path)
            chosen.update(prefixes[:-1])
            for pat in matched:
                unmatched.pop(pat, None)
    return list(unmatched)


def file_hash(path: str) -> str:
    hasher = new_file_hasher()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(READ_BLOCK):
            hasher.update(block)
    return hasher.hexdigest()


def _same_content(dest: str, entry: FileEntry) -> bool:
    st = os.lstat(dest)
    if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
        return False
    try:
        return file_hash(dest) == entry.blake3
    except PermissionError:
        return st.st_uid == os.geteuid() and _same_content_unreadable(dest, st, entry)
    except OSError:  # unreadable (EIO): it differs, and --overwrite replaces it
        return False


def _same_content_unreadable(dest: str, st: os.stat_result, entry: FileEntry) -> bool:
    """A file of ours without the owner's read permission (restored before from a snapshot that holds
    it as 0o200): read with it for a moment (a rerun said "exists and differs", exit 22)."""
    try:
        give_owner(dest, st, stat.S_IRUSR)
    except OSError:
        return False
    try:
        return file_hash(dest) == entry.blake3
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.chmod(dest, stat.S_IMODE(st.st_mode))


class _Planner:
    def __init__(self, repo: Repository, target: str, overwrite: bool) -> None:
        self.repo = repo
        self.target = target
        self.overwrite = overwrite
        self.conflicts: list[str] = []  # differing files and symlinks: --overwrite replaces them
        self.clashes: dict[str, str] = {}  # a folder against a non-folder: never replaced (path -> why)
        self.skip: set[str] = set()
        self.too_long: list[str] = []  # paths the system cannot take under this target
        # files a chunk (or a delta base) of which is in no index (a pack gone, dropped by repair-index):
        # not written, named as failed (path -> why), while the other files restore
        self.unavailable: dict[str, str] = {}
        # snapshot folders found missing from the target: nothing below them is looked up (a restore into
        # a new folder stat'ed each file and its folder in vain: ~10 µs a file)
        self.absent: set[str] = set()
        self.entered: dict[str, int] = {}  # folders of ours given u+rx to look into (path -> mode before)
        self._below_target = os.path.join(target, "")  # ends in one "/"

    def dest(self, entry: FileEntry) -> str:
        # validate_tree: relative, no empty, "." or ".." part: a concatenation is the join (0.04 µs, not 1.2)
        return self._below_target + entry.path

    def check_target(self) -> None:
        """The target must be a folder, or creatable as one: neither it nor a folder above it may be
        a file (or a broken symlink). A symlink to a folder is a folder here."""
        probe = self.target
        while True:
            try:
                st = os.stat(probe)
                break
            except (FileNotFoundError, NotADirectoryError):
                if os.path.lexists(probe) and os.path.islink(probe):
                    self._refuse_target(probe, "a broken symlink")
                parent = os.path.dirname(probe)
                if parent == probe:
                    return
                probe = parent
        if not stat.S_ISDIR(st.st_mode):
            self._refuse_target(probe, "a file" if stat.S_ISREG(st.st_mode) else "a device, FIFO or socket")

    def _refuse_target(self, path: str, what: str) -> None:
        if path == self.target:
            raise RestoreConflictError(
                f"restore target {path} is {what}, not a folder; give a new or existing folder to restore into"
            )
        raise RestoreConflictError(
            f"restore target {self.target} cannot be created: {path} is {what}, not a folder; restore elsewhere"
        )

    def check(self, entry: FileEntry) -> None:
        if self._too_long(entry, self.dest(entry)):
            return
        self._check_in_place(entry)
        if entry.type == "file" and entry.path not in self.skip and entry.path not in self.unavailable:
            # written under a temporary name first (one that is not written needs none)
            self._too_long(entry, os.path.join(os.path.dirname(self.dest(entry)), "x" * _TEMP_NAME_BYTES))

    def _check_in_place(self, entry: FileEntry) -> None:
        folders_there = self._folders_above_there(entry)
        if entry.type == "file" and (missing := self._check_chunks(entry)) is not None:
            if not (folders_there and self._in_place_already(entry)):
                self.unavailable[entry.path] = missing
            return
        if not folders_there:
            return
        dest = self.dest(entry)
        try:
            st = self._lstat(dest)
        except (FileNotFoundError, NotADirectoryError):  # not there (or a folder above was replaced meanwhile)
            if entry.type == "dir":
                self.absent.add(entry.path)
            return
        if entry.type == "dir":
            if not stat.S_ISDIR(st.st_mode):
                self._clash(entry.path, f"is {_kind(st)} in the target where the snapshot has a folder")
        elif stat.S_ISDIR(st.st_mode):
            self._clash(entry.path, f"is a folder in the target where the snapshot has a {entry.type}")
        elif entry.type == "symlink":
            if stat.S_ISLNK(st.st_mode) and os.readlink(dest) == entry.target:
                self.skip.add(entry.path)
            else:
                self._conflict(entry, "exists and differs")
        elif self._keeps(dest, entry, st):
            self.skip.add(entry.path)
        else:
            self._conflict(entry, "exists and differs")

    def _lstat(self, path: str) -> os.stat_result:
        """``os.lstat``; in a folder of ours without the owner's r or x (a snapshot holding one as 0o000 or
        0o644, restored before: a rerun failed with "Permission denied"), after giving the owner u+rx on it.
        Every folder of the snapshot gets its mode again at the end; a plan that fails puts them back
        (``put_back``)."""
        try:
            return os.lstat(path)
        except PermissionError:
            if not self.enter(os.path.dirname(path)):
                raise
            return os.lstat(path)

    def enter(self, folder: str) -> bool:
        """Give the owner u+rx on a folder of the snapshot in the target that is ours and lacks either, and
        say whether it was (the target itself is not the snapshot's: its mode is the user's)."""
        if folder == self.target:
            return False
        st = os.stat(folder)
        if st.st_uid != os.geteuid() or st.st_mode & SEARCH == SEARCH:
            return False
        give_owner(folder, st, SEARCH)
        self.entered.setdefault(folder, stat.S_IMODE(st.st_mode))
        return True

    def put_back(self) -> None:
        """The folders opened (``enter``) get their modes back: the plan was refused, nothing was restored."""
        for folder, mode in reversed(self.entered.items()):
            with contextlib.suppress(OSError):
                os.chmod(folder, mode)

    def _too_long(self, entry: FileEntry, path: str) -> bool:
        """A path over PATH_MAX, found now, not as a write error once other files are in place."""
        length = len(os.fsencode(path))
        if length < PATH_MAX:
            return False
        self.too_long.append(f"{entry.path} would need a path of {length:,} bytes")
        return True

    def _conflict(self, entry: FileEntry, why: str) -> None:
        if not self.overwrite or self.dest(entry) == self.target:
            self.conflicts.append(f"{entry.path} {why}")

    def _clash(self, path: str, why: str) -> None:
        """A folder where the snapshot has a file or symlink, or the reverse: refused even with
        --overwrite, which replaces files but never deletes a user's folder (or a file to make one)."""
        self.clashes.setdefault(path, f"{path} {why}")

    def _folders_above_there(self, entry: FileEntry) -> bool:
        """Whether every folder above the entry is a folder in the target: if not, the entry is not there
        either. A link among them is refused, a file among them noted as a clash."""
        parts = entry.path.split("/")
        for i in range(1, len(parts)):
            folder = "/".join(parts[:i])
            if folder in self.absent:
                return False
            parent = os.path.join(self.target, *parts[:i])
            try:
                st = self._lstat(parent)
            except FileNotFoundError:
                self.absent.add(folder)
                return False
            if stat.S_ISLNK(st.st_mode):
                raise UnsafePathError(
                    entry.path,
                    f"would be written through the symlink {parent} in the target (a restore never writes through "
                    "a link); remove the link, or restore elsewhere",
                )
            if not stat.S_ISDIR(st.st_mode):
                self._clash(folder, f"is {_kind(st)} in the target where the snapshot has a folder")
                return False
        return True

    def _in_place_already(self, entry: FileEntry) -> bool:
        """Whether the target already holds ``entry``'s bytes (a rerun): then a chunk missing from the
        repository costs nothing."""
        dest = self.dest(entry)
        try:
            if not self._keeps(dest, entry, os.lstat(dest)):
                return False
        except (FileNotFoundError, NotADirectoryError):
            return False
        self.skip.add(entry.path)
        return True

    def _keeps(self, dest: str, entry: FileEntry, st: os.stat_result) -> bool:
        """Whether the file at ``dest`` (lstat ``st``) stays as it is: it holds ``entry``'s bytes, and is no
        hard link to be replaced (with --overwrite a hard link gets a file of its own: setting the snapshot's
        mode and mtime in place would change the linked file outside the target too)."""
        return _same_content(dest, entry) and not (self.overwrite and st.st_nlink > 1)

    def _check_chunks(self, entry: FileEntry) -> str | None:
        """Why ``entry`` cannot be restored (a chunk, or a delta base, in no index), else None. A file
        whose chunks hold another size than the tree says fails the plan (a damaged tree)."""
        total = 0
        for chunk_id in entry.chunks:
            loc = self.repo.find(chunk_id)
            if loc is None:
                return f"{entry.path}: chunk {chunk_id.hex()[:12]} is missing from the repository{check_hint()}"
            total += loc.raw_len
            if (missing := self._check_bases(chunk_id, loc.base_id)) is not None:
                return f"{entry.path}: {missing}"
        if total != entry.size:
            raise MalformedObjectError(f"{entry.path}: snapshot says {entry.size} bytes but its chunks hold {total}")
        return None

    def _check_bases(self, chunk_id: bytes, base_id: bytes | None) -> str | None:
        """A delta chunk restores only with its base (and the base's, if it is a delta too): why it
        cannot, naming both chunks, when one is missing; found before anything is written."""
        seen = {chunk_id}
        while base_id is not None and base_id not in seen:
            base = self.repo.find(base_id)
            if base is None:
                return (
                    f"chunk {chunk_id.hex()[:12]} is stored as a delta against chunk "
                    f"{base_id.hex()[:12]}, which is missing from the repository{check_hint()}"
                )
            seen.add(base_id)
            chunk_id, base_id = base_id, base.base_id
        return None


def _kind(st: os.stat_result) -> str:
    if stat.S_ISREG(st.st_mode):
        return "a file"
    if stat.S_ISLNK(st.st_mode):
        return "a symlink"
    return "a special file"


def _writable_until_the_end(folder: str) -> None:
    """A folder of the snapshot already in the target without the owner's write permission (restored
    before from a snapshot that holds it as 0o555) gets it: the restore writes into it (a newer step
    with --overwrite stopped there once the other files were replaced, a mix of two steps), and every
    folder gets the snapshot's mode again at the end."""
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        give_owner(folder, st, stat.S_IWUSR | stat.S_IXUSR)


def give_owner(path: str, st: os.stat_result, bits: int) -> None:
    """Add the owner's permission ``bits`` (u+r, u+wx) that ``path`` (stat ``st``) lacks."""
    if st.st_mode & bits != bits:
        os.chmod(path, stat.S_IMODE(st.st_mode) | bits)


def _set_mode_and_mtime(path: str, entry: FileEntry) -> None:
    """Only what differs: a rerun of a finished restore changes nothing, so it also passes on a target
    mounted read-only since, or with folders owned by another user."""
    st = os.stat(path)
    mode = restored_mode(entry)
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)
    if st.st_mtime_ns != entry.mtime_ns:
        os.utime(path, ns=(entry.mtime_ns, entry.mtime_ns))


def restore_full_hint() -> str:
    """A restore the disk stopped has put some files in place (with --overwrite, beside older ones)."""
    again = spelled("run the command again", "restore again")
    return (
        f"until a rerun finishes it the target holds part of the snapshot; free space and {again} "
        "(it keeps the files already restored)"
    )


def target_error(exc: OSError, target: str, *, full_hint: str = "") -> CkptVaultError:
    """A filesystem error met while writing into ``target``, as a one-line error naming the path
    (relative to the target where it lies inside it), the cause, and what to do. A full disk or
    quota is StorageFullError (exit 21, the errno test is the store's ``classify``); a file/folder
    clash that appeared during the restore is RestoreConflictError; any other is StorageError."""
    filename = exc.filename if isinstance(exc.filename, str) else ""
    path = filename or target
    inside = filename and os.path.abspath(filename).startswith(os.path.join(os.path.abspath(target), ""))
    where = os.path.relpath(filename, target) if inside else path
    reason = exc.strerror or str(exc)
    if classify(exc).kind is Kind.FULL:
        if out_of_inodes(exc, target):  # free blocks, no file entry left: freeing space is not the advice
            reason = "no inode (file entry) left on its filesystem, which has free blocks"
            full_hint = "delete files there, or restore to a filesystem with more inodes"
        if full_hint:
            return StorageFullError("write", where, target, reason, hint=full_hint)
        return StorageFullError("write", where, target, reason)
    if exc.errno in (errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
        return RestoreConflictError(
            f"cannot restore into {target}: {path}: {reason} (the target changed during the restore); "
            "check it and run the command again, or restore elsewhere"
        )
    if classify(exc).kind is Kind.DENIED or exc.errno == errno.EROFS:
        hint = "restore into a writable folder"
    elif exc.errno == errno.ELOOP:
        hint = "a symbolic link on the way points back at itself; fix it, or restore elsewhere"
    elif exc.errno == errno.ENAMETOOLONG:
        hint = "a name there is longer than the filesystem takes (255 bytes on most); restore elsewhere"
    else:
        hint = "check that disk, then run the command again or restore elsewhere"
    return StorageError(
        "write", where, target, reason, message=f"cannot restore into {target}: writing {path} failed: {reason}; {hint}"
    )


def _refuse_vault_folders(entries: list[FileEntry], vault_folder: str | None, target: str) -> None:
    """Restoring into a vault's folder could replace its config or objects (a snapshot of a folder
    that held a file named ``config``): refused, whatever --overwrite says. That is the vault read
    from, which may lie in the target where an entry's path leads into it, and any local vault (the
    one read from too, reached by another path: a bind mount) that the target is or lies in, or
    that is a folder of the snapshot in the target."""
    target_real = os.path.realpath(target)
    if vault_folder is not None:
        vault_real = os.path.realpath(vault_folder)
        below_target = os.path.relpath(vault_real, target_real).replace(os.sep, "/")
        if os.path.join(target_real, "").startswith(os.path.join(vault_real, "")) or any(
            e.path == below_target or e.path.startswith(below_target + "/") for e in entries
        ):
            raise _into_vault(target, vault_folder)
    if (vault := vault_at_or_above(target_real)) is not None:
        raise _into_vault(target, vault)
    for entry in entries:
        if entry.type == "dir" and holds_vault_config(inside := os.path.join(target, entry.path)):
            raise _into_vault(target, inside)


def _into_vault(target: str, vault: str) -> UsageError:
    return UsageError(f"cannot restore into {target}: it would write inside the vault at {vault}; restore elsewhere")


def _refuse_directory(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        raise RestoreConflictError(f"{path} is a directory; remove it by hand to restore a file there")


def _remove(path: str) -> None:
    _refuse_directory(path)
    with contextlib.suppress(FileNotFoundError):  # removed meanwhile by a restore into the same folder
        os.unlink(path)


@releasing_freed_memory
def run_restore(
    repo: Repository,
    snapshot: Snapshot,
    tree: list[FileEntry],
    target: str,
    *,
    include: list[str] | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    workers: int = 8,
    vault_folder: str | None = None,
    alone: bool = False,
    kept: bool = True,
) -> RestoreResult:
    """Plan, then write (see the module docstring). Everything that can be found before writing is
    raised before the target is even created: an empty target (UsageError), an --include glob that
    matches nothing (UsageError), a target that is or lies under a file, and a folder in the target
    where the snapshot has a file or the reverse (RestoreConflictError, also with ``overwrite``).
    ``vault_folder``: the vault's own local folder; nothing is restored into it, nor into any other
    local vault. ``alone``: refuse a target that holds anything the snapshot does not (the resume path:
    a folder mixing two saves). ``tree``: ``snapshot``'s files. ``kept``: False where the caller removes the
    target after (a drill's temporary copy): a storage error then says nothing of what it holds."""
    progress = progress or NullProgress()
    started = time.monotonic()
    if not target.strip():
        raise UsageError("the restore target is empty; give the folder to restore into")
    validate_tree(tree)
    entries, unmatched_globs = select_entries(tree, include, snapshot.short_id)
    target = os.path.abspath(target)

    planner = _Planner(repo, target, overwrite)
    planner.check_target()
    _refuse_vault_folders(entries, vault_folder, target)
    try:
        for entry in entries:
            planner.check(entry)
        others = _refuse_what_the_plan_found(planner, target, tree, alone)
    except BaseException:
        planner.put_back()
        raise
    os.makedirs(target, exist_ok=True)

    left_out = planner.skip | planner.unavailable.keys()
    files = [e for e in entries if e.type == "file" and e.path not in left_out]
    progress.start(sum(e.size for e in files), len(files))
    written, failed = _write(repo, planner, tree, entries, files, progress, workers, overwrite, kept)
    failures = planner.unavailable | failed
    progress.finish()
    result = RestoreResult(
        files=sum(e.type == "file" for e in entries) - len(failures),
        dirs=sum(e.type == "dir" for e in entries),
        symlinks=sum(e.type == "symlink" for e in entries),
        bytes_written=written,
        skipped_files=sum(1 for e in entries if e.type == "file" and e.path in planner.skip),
        duration_s=round(time.monotonic() - started, 3),
        snapshot=snapshot,
        unmatched_globs=unmatched_globs,
        not_in_snapshot=others,
        setid_cleared=sum(e.type == "file" and restored_mode(e) != e.mode for e in entries),
    )
    if failures:
        raise RestoreIncompleteError(failures, result)
    return result


def _stopped_part_way(exc: StorageError, target: str, done: int, total: int, lost: int, *, all_of_them: bool) -> str:
    """What a restore the vault's storage stopped leaves in the target, and the way on: the storage error
    alone (a frozen server) left a folder holding some of the files, with nothing said of it. ``done``: the
    files in place (restored, or there already), of the ``total`` it was to restore: every file of the snapshot
    when ``all_of_them``, else those --include chose (not "the snapshot's", which has more). ``lost``: files
    whose chunks are in no index, which no rerun brings (``check`` names them)."""
    again = spelled("run the command again", "restore again")
    files = f"the snapshot's {total} files" if all_of_them else f"the {total} files asked for"
    others = "the others are not there yet"
    if lost:
        others = f"{lost} of the others cannot be restored, their chunks are in no index: check names them; " + (
            "the rest are not there yet" if total - done > lost else "no other is missing"
        )
    return (
        f"the restore stopped part way: {target} holds {done} of {files} (each one whole and verified; {others}); "
        f"{again}{once_mended(exc)} to finish it (it keeps the files already restored)"
    )


def _refuse_what_the_plan_found(planner: _Planner, target: str, tree: list[FileEntry], alone: bool) -> tuple[str, ...]:
    """Raise what the plan found before anything is written; returns what the target holds that the
    snapshot does not (named in the result; refused when ``alone``)."""
    if planner.too_long:
        raise RestoreConflictError(
            f"cannot restore into {target}: {first_few(planner.too_long, 1)}, over the {PATH_MAX - 1:,} the system "
            f"allows (a file is written under a {_TEMP_NAME_BYTES}-byte temporary name first); restore into a "
            f"folder with a shorter path (a drill: {spelled('--tmp-dir', 'workdir=')}), or leave such paths out "
            f"with {spelled('--include', 'include')}"
        )
    if planner.clashes:
        raise RestoreConflictError(
            f"cannot restore into {target}: {first_few(list(planner.clashes.values()), 3)}; "
            f"{spelled('--overwrite', 'overwrite')} never deletes a folder or puts one in place of a file: "
            "move them away, or restore elsewhere"
        )
    if planner.conflicts:
        raise RestoreConflictError(
            f"target {target} already holds differing data: {first_few(planner.conflicts, 3)}; "
            f"rerun with {spelled('--overwrite', 'overwrite=True')} to replace it, or restore elsewhere"
        )
    others = entries_not_in(target, tree, planner.enter)
    if alone and others:
        raise RestoreConflictError(
            f"{target} holds what this snapshot does not: {first_few(others, 3, ', ')}; resuming from a folder "
            "that mixes two saves could load the wrong one: restore into a new or empty folder, or remove them"
        )
    return others


def _write(
    repo: Repository,
    planner: _Planner,
    tree: list[FileEntry],
    entries: list[FileEntry],
    files: list[FileEntry],
    progress: Progress,
    workers: int,
    overwrite: bool,
    kept: bool,
) -> tuple[int, dict[str, str]]:
    """Make the folders, write the files (each chunk verified by its envelope, each file by its hash),
    then the links and the folders' modes and mtimes. Returns the bytes written and the files that
    failed verification (path -> why), which were not written."""
    writes = files or any(e.type == "symlink" and e.path not in planner.skip for e in entries)
    for entry in entries:
        if entry.type == "dir":
            dest = planner.dest(entry)
            if writes:
                _writable_until_the_end(dest)
            os.makedirs(dest, exist_ok=True)
    zero_chunks: set[bytes] = set()  # all-zero chunks: left as holes, fetched once (the file hash covers them)
    snapshot_paths = frozenset(planner.dest(e) for e in tree)
    _remove_leftover_temps({os.path.dirname(planner.dest(e)) for e in entries if e.type == "file"}, snapshot_paths)
    made: set[str] = set()
    with ThreadPoolExecutor(workers, thread_name_prefix="ckptvault-restore") as pool:
        writer = _FileWriter(repo, pool, workers, zero_chunks, overwrite, progress)
        try:
            for entry in files:
                dest = planner.dest(entry)
                if (parent := os.path.dirname(dest)) not in made:
                    os.makedirs(parent, exist_ok=True)
                    made.add(parent)
                writer.write(entry, dest)
            writer.finish()
        except BaseException as exc:
            writer.abandon()
            # the vault's storage (the target's failures are OSErrors); one failing a pack for good says its own way on
            if kept and isinstance(exc, StorageError) and not object_fault(exc):
                total = sum(e.type == "file" for e in entries)
                # in place: those there already and those written; not those whose chunks are in no index
                done = sum(e.type == "file" and e.path in planner.skip for e in entries) + writer.files_written
                all_of_them = total == sum(e.type == "file" for e in tree)
                lost = len(planner.unavailable)
                said = _stopped_part_way(exc, planner.target, done, total, lost, all_of_them=all_of_them)
                exc.args = (f"{exc.args[0]}; {said}",)
            raise
    if overwrite:  # files already holding the right bytes get the snapshot's mode and mtime too
        for entry in entries:
            if entry.type == "file" and entry.path in planner.skip:
                _set_mode_and_mtime(planner.dest(entry), entry)
    for entry in entries:
        if entry.type == "symlink":
            _put_link(planner.dest(entry), entry)
    for entry in sorted((e for e in entries if e.type == "dir"), key=lambda e: e.path.count("/"), reverse=True):
        _set_mode_and_mtime(planner.dest(entry), entry)
    return writer.written, writer.failures


class _FileWriter:
    """Writes the files, in the snapshot's order, and tallies the bytes written and the files that failed
    verification (in that order too).

    A file of one chunk is written whole by one thread, with no hand-off: from a local disk by the calling
    thread, one file after another (waiting for each chunk's worker was most of a small file's time, and
    more threads only fought over the GIL: 10,000 files of 30 KB on 2 cores took 4.2-4.5 s with a hand-off
    per chunk, 2.8-2.9 s inline, 4.6-4.8 s with 8 files at once); from a remote store, where each file
    waits a round trip, up to ``workers`` of them at once on the pool, within INFLIGHT_BYTES. A file of
    more chunks waits for those, then has its chunks fetched, verified and written by the pool, in a
    window of ``2 * workers``."""

    def __init__(
        self,
        repo: Repository,
        pool: ThreadPoolExecutor,
        workers: int,
        zero_chunks: set[bytes],
        overwrite: bool,
        progress: Progress,
    ) -> None:
        self._repo = repo
        self._pool = pool
        self._workers = workers
        self._at_once = workers if repo.remote else 0
        self._zero_chunks = zero_chunks
        self._overwrite = overwrite
        self._progress = progress
        self._inflight: deque[tuple[Future[None], FileEntry]] = deque()
        self._inflight_bytes = 0
        self.written = 0
        self.failures: dict[str, str] = {}
        self.files_written = 0  # put in place, whole and verified

    def write(self, entry: FileEntry, dest: str) -> None:
        repo, progress, zero, overwrite = self._repo, self._progress, self._zero_chunks, self._overwrite
        if len(entry.chunks) > 1:
            self.finish()  # first the small files in flight: their failures, and their memory
            window = 2 * self._workers
            self._record(entry, lambda: _restore_file(repo, self._pool, entry, dest, progress, window, zero, overwrite))
        elif self._at_once == 0:
            self._record(entry, lambda: _restore_file(repo, None, entry, dest, progress, 1, zero, overwrite))
        else:
            while self._inflight and (
                len(self._inflight) >= self._at_once or self._inflight_bytes + entry.size > INFLIGHT_BYTES
            ):
                self._finish_oldest()
            args = (repo, None, entry, dest, NullProgress(), 1, zero, overwrite)  # progress: in _finish_oldest
            self._inflight.append((self._pool.submit(_restore_file, *args), entry))
            self._inflight_bytes += entry.size

    def finish(self) -> None:
        while self._inflight:
            self._finish_oldest()

    def abandon(self) -> None:
        """After a failure or Ctrl-C: drop the files not started and wait for those being written (each
        removes its temporary file when it fails), so that none is written after the restore raised."""
        for future, _ in self._inflight:
            future.cancel()
        for future, _ in self._inflight:
            if not future.cancelled():
                future.exception()
        self._inflight.clear()
        self._inflight_bytes = 0

    def _finish_oldest(self) -> None:
        future, entry = self._inflight.popleft()
        self._inflight_bytes -= entry.size
        self._record(entry, future.result)
        self._progress.advance(entry.size)

    def _record(self, entry: FileEntry, restore: Callable[[], None]) -> None:
        try:
            restore()
        except IntegrityError as exc:
            self.failures[entry.path] = str(exc)
        else:
            self.written += entry.size
            self.files_written += 1


def _put_link(dest: str, entry: FileEntry) -> None:
    """The snapshot's symlink at ``dest``, with its mtime. Restores into one folder at once each make
    it: one that finds it already made (by another, or by a killed run before its mtime was set)
    leaves it, never removes it from under the other."""
    target = entry.target or ""  # validate_tree ensured a target
    if not _is_link_to(dest, target):
        if os.path.lexists(dest):
            _remove(dest)
        try:
            os.symlink(target, dest)
        except FileExistsError:  # made meanwhile by a restore into the same folder: fine if the same
            if not _is_link_to(dest, target):
                raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), dest) from None
        except OSError as exc:  # named by the link's target, a path the restore never writes
            raise OSError(exc.errno, exc.strerror, dest) from None
    try:
        if os.lstat(dest).st_mtime_ns != entry.mtime_ns:
            os.utime(dest, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)
    except FileNotFoundError:
        pass  # replaced meanwhile by a restore into the same folder, which sets it


def _is_link_to(path: str, target: str) -> bool:
    try:
        return os.readlink(path) == target
    except OSError:  # none there, or not a link
        return False


def temp_stem(name: str) -> str:
    """The start of the temporary names a file called ``name`` is written under: the same for every
    restore of that name, so a rerun finds what a killed one left, and of a fixed length, so that a
    name of up to the filesystem's 255 bytes still has a temporary name."""
    return f"{TEMP_MARK}{checksum(os.fsencode(name), size=8).hex()}-"


def _restore_file(
    repo: Repository,
    pool: ThreadPoolExecutor | None,
    entry: FileEntry,
    dest: str,
    progress: Progress,
    window: int,
    zero_chunks: set[bytes],
    overwrite: bool,
) -> None:
    directory, name = os.path.split(dest)
    tmp = os.path.join(directory, temp_stem(name) + secrets.token_hex(_TEMP_RANDOM // 2))
    try:
        _write_via_temp(repo, pool, entry, dest, tmp, progress, window, zero_chunks, overwrite)
    except OSError as exc:
        if not isinstance(exc, CkptVaultError) and exc.filename in (None, tmp):
            exc.filename, exc.filename2 = dest, None  # name the file restored, not its temporary name
        raise


def _write_via_temp(
    repo: Repository,
    pool: ThreadPoolExecutor | None,
    entry: FileEntry,
    dest: str,
    tmp: str,
    progress: Progress,
    window: int,
    zero_chunks: set[bytes],
    overwrite: bool,
) -> None:
    fd = _create_locked_temp(tmp)
    # the lock is held until the rename, or the removal after a failure: another restore's sweep must not take
    # the file first (its removal then would hide this failure behind "no such file")
    try:
        written_hash = _write_chunks(repo, pool, fd, entry, progress, window, zero_chunks)
        if written_hash != entry.blake3:
            # The fast path checks envelopes, and the plaintext only by this hash: the file is written again
            # with each chunk checked against its ID, which names a damaged chunk, or reads around a copy
            # wrong under a valid envelope (bad memory in its writer) to another copy (a racing backup's).
            # From an empty file: a range the second pass leaves as a hole (a zero chunk) must not keep the
            # first pass's bytes; and what the first pass took for zeros is fetched again.
            os.ftruncate(fd, 0)
            zero_chunks.difference_update(entry.chunks)
            written_hash = _write_chunks(repo, pool, fd, entry, NullProgress(), window, zero_chunks, verify_ids=True)
        if written_hash != entry.blake3:
            raise IntegrityError(f"{entry.path}: restored bytes do not match the snapshot's file hash")
        if entry.chunks and entry.chunks[-1] in zero_chunks:
            os.ftruncate(fd, entry.size)  # a hole at the end: no write set the file's size
        os.fchmod(fd, restored_mode(entry))
        os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))
        if overwrite:
            _replace(tmp, dest)
        else:
            _put_in_place(tmp, dest, entry)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)


def _put_in_place(tmp: str, dest: str, entry: FileEntry) -> None:
    """Give the restored file its name where the plan found none, without replacing one that a restore
    into the same folder put there meanwhile: the same file of the same snapshot (its content hash: the
    ranks of a job restoring one checkpoint) is fine, another one a conflict, so that two snapshots
    restored at once never leave a folder holding a mix of both."""
    try:
        os.link(tmp, dest, follow_symlinks=False)  # fails when the name exists, where a rename replaces it
    except FileExistsError:
        _refuse_directory(dest)
        try:
            same = _same_content(dest, entry)
        except FileNotFoundError:  # removed again meanwhile: this file takes the name after all
            os.link(tmp, dest, follow_symlinks=False)
            same = True
        if not same:
            raise RestoreConflictError(
                f"{dest} was written meanwhile, with other content (another restore into the same folder?); "
                "restore each snapshot into a folder of its own"
            ) from None
    except OSError as exc:
        if exc.errno not in NO_LINK_ERRNOS:
            raise
        _replace(tmp, dest)  # no hard links here: as before, the last one written wins
        return
    os.unlink(tmp)


def _replace(tmp: str, dest: str) -> None:
    """Rename ``tmp`` over a file or a link at ``dest`` in one step (no unlink first that a concurrent
    restore races). A folder there (made since the plan looked) is refused, not replaced: the rename
    fails on it, and only then is it looked at, not once per file."""
    try:
        os.replace(tmp, dest)
    except OSError:
        _refuse_directory(dest)
        raise


# A temporary file is flock()ed while it is written, so that a restore into the same folder (the
# ranks of a job restoring one checkpoint onto a shared filesystem) removes only what killed
# restores left: the kernel drops a dead process's lock. NFS maps flock to its own locks.


def _create_locked_temp(tmp: str) -> int:
    """Create ``tmp`` and lock it; made again if another restore's sweep removed it before the lock."""
    while True:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        if not _lock(fd, block=True):
            return fd  # a filesystem without locks: as before locks were taken
        try:
            if os.path.samestat(os.lstat(tmp), os.fstat(fd)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _remove_leftover_temps(directories: set[str], snapshot_paths: frozenset[str]) -> None:
    """Remove the temporary files killed restores left in ``directories`` (each listed once: a glob
    per file made a folder of 5,000 tiny files take 13.6 s instead of 3.1), also where no file is left to write (a
    restore into the same folder finished them). A file of the snapshot that only looks like one (it
    was backed up from a folder holding such a leftover) stays, and so do a live restore's (locked)."""
    for directory in directories:
        try:
            names = os.listdir(directory)
        except OSError:  # gone, not a folder, or not listable: nothing to sweep there
            continue
        for name in names:
            path = os.path.join(directory, name)
            if _LEFTOVER_NAME.fullmatch(name) and path not in snapshot_paths:
                _remove_unlocked_temp(path)


def _remove_unlocked_temp(path: str) -> None:
    """Remove a leftover temporary file unless a live restore holds its lock."""
    flags = os.O_NOFOLLOW | os.O_NONBLOCK
    read_only = False
    try:  # for writing: NFS turns flock into a POSIX lock, which takes a file open for writing
        fd = os.open(path, os.O_RDWR | flags)
    except PermissionError:  # given the snapshot's mode (0o444) just before its link: a kill left it so
        try:
            fd, read_only = os.open(path, os.O_RDONLY | flags), True
        except OSError:
            return
    except OSError:  # gone meanwhile, a symlink, or not ours: not a leftover to remove
        return
    try:
        held = os.fstat(fd)
        locked = _lock(fd, block=False)
        # read-only, a filesystem that would not lock it (NFS) cannot tell a live restore's from a leftover
        if not stat.S_ISREG(held.st_mode) or locked is False or (locked is None and read_only):
            return
        if os.path.samestat(os.lstat(path), held):
            os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def _lock(fd: int, *, block: bool) -> bool | None:
    """flock ``fd`` exclusively: True when locked, False when another process holds it (``block``
    false), None when the filesystem has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF):
            return None
        raise
    return True


def _is_zeros(data: bytes | memoryview) -> bool:
    # cheap rejects first: tensor data almost never starts, ends and centres on zero bytes
    if not data or data[0] != 0 or data[-1] != 0 or data[len(data) // 2] != 0:
        return False
    import numpy as np

    return not np.frombuffer(data, np.uint8).any()


def _write_chunks(
    repo: Repository,
    pool: ThreadPoolExecutor | None,
    fd: int,
    entry: FileEntry,
    progress: Progress,
    window: int,
    zero_chunks: set[bytes],
    *,
    verify_ids: bool = False,
) -> str:
    """Write the file's chunks and return the BLAKE3 of the bytes written, taken in file order.

    Workers fetch, verify and write chunks with positioned writes, out of order; this thread feeds
    each chunk's bytes to the whole-file hash in file order while the workers go on ahead.
    The hash covers exactly the buffers handed to ``pwrite``, at the offsets this walk computed
    (reading the file back instead cost a copy of every byte out of the page cache). Without a ``pool``
    this thread does it all, chunk after chunk (see ``_FileWriter``)."""

    # One writer a file at a time: a buffered write holds the file's lock in the kernel (ext4), where a
    # second writer spins on it (9 % of a 2-core restore's CPU under perf); waiting here it sleeps.
    write_lock = threading.Lock()

    def fetch_and_write(chunk_id: bytes, offset: int) -> bytes | memoryview | None:
        # A range never written reads as zeros (a hole: a write past it, or the ftruncate after a zero
        # last chunk, sets the size): a zero chunk is not written and, once seen, not even fetched again.
        if chunk_id in zero_chunks:
            return None
        # The envelope (AEAD tag or checksum, bound to the chunk ID) is checked here; the plaintext
        # is checked by the whole-file hash below instead of by a second BLAKE3 pass per chunk (which
        # ``verify_ids`` adds: the second try of a file whose hash failed).
        data = repo.read_chunk(chunk_id, verify_id=verify_ids)
        if _is_zeros(data):
            zero_chunks.add(chunk_id)
            return None
        with write_lock:
            pwrite_all(fd, data, offset, entry.path)
        return data

    def start(chunk_id: bytes, offset: int) -> Future[bytes | memoryview | None]:
        if pool is not None:
            return pool.submit(fetch_and_write, chunk_id, offset)
        done: Future[bytes | memoryview | None] = Future()
        done.set_result(fetch_and_write(chunk_id, offset))
        return done

    hasher = new_file_hasher()
    inflight: deque[tuple[Future[bytes | memoryview | None], int]] = deque()
    inflight_bytes = 0

    def finish_one() -> None:
        nonlocal inflight_bytes
        future, length = inflight.popleft()
        inflight_bytes -= length
        data = future.result()
        hasher.update(data if data is not None else bytes(length))
        progress.advance(length)

    offset = 0
    try:
        for chunk_id in entry.chunks:
            length = repo.locate(chunk_id).raw_len
            inflight.append((start(chunk_id, offset), length))
            inflight_bytes += length
            offset += length
            while len(inflight) >= window or inflight_bytes > INFLIGHT_BYTES:
                finish_one()
        while inflight:
            finish_one()
    except BaseException as exc:  # a damaged chunk, a full disk, Ctrl-C: stop this file's writers first
        for future, _ in inflight:
            future.cancel()
        for future, _ in inflight:
            if not future.cancelled():
                future.exception()  # wait: no write may land after the fd is closed
        if isinstance(exc, IntegrityError):
            raise IntegrityError(f"{entry.path}: {exc}") from exc
        raise
    return hasher.hexdigest()
