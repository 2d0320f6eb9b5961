"""One error hierarchy for ckptvault.

Every error a user can meet is a ``CkptVaultError``. ``str(err)`` is a single line
that says what went wrong and what to do; ``exit_code`` is what the CLI exits with.

    CkptVaultError                      1
    ├── UsageError                      2   bad argument value
    ├── SourceError                     3   a backup input cannot be read
    │   └── CheckpointLostError         3   watch: a checkpoint shipping in place went before it shipped
    ├── VaultNotFoundError             10   no repository at the URL
    ├── VaultExistsError               10   init on a URL that already holds one
    ├── ForeignRepositoryError         10   another tool's repository (restic's, borg's, kopia's) or config at the URL
    ├── VaultLockedError               11   a conflicting lock is held
    │   ├── LockLostError              11   a lock holder found its lock gone or expired before committing
    │   └── WatchLockedError           11   another watch runs on the same folder
    ├── WrongPassphraseError           12   the passphrase does not unlock the keyfile
    ├── KeyfileMismatchError           13   the keyfile belongs to another repository
    ├── KeyfileNotFoundError           14   keyfile missing, or an encrypted vault opened without one
    ├── KeyfileCorruptError            15   keyfile unreadable / unparsable
    ├── PassphraseRequiredError        16   no terminal and no passphrase source
    ├── UnsupportedFormatError         17   repository format too new / unknown
    ├── SnapshotNotFoundError          18   no match, or an ambiguous ID prefix
    ├── PathNotInSnapshotError         19   ls/cat of a path the snapshot lacks
    ├── StorageError                   20   the backend failed (op + key named)
    │   ├── ObjectNotFoundError        20   a stored object is missing
    │   ├── ShortReadError             20   an object ends before the range read (truncated)
    │   ├── ObjectExistsError          20   a create-if-absent write found the object there
    │   └── StorageFullError           21   no space left / quota
    ├── RestoreConflictError           22   target holds differing files
    ├── FileFormatError                23   a file header show/diff cannot parse
    ├── IntegrityError                 30   hash / checksum / decode mismatch
    │   ├── MalformedObjectError       30   a stored object cannot be parsed
    │   ├── RestoreIncompleteError     30   restore: files whose data failed or is missing were not written
    │   └── CopyIncompleteError        30   copy: snapshots that could not be read in the source were not copied
    │       └── CopyNeedsUpgradeError  17   ... all of them because a newer ckptvault wrote them
    ├── ConfigDowngradedError          30   the config says unencrypted, the objects are encrypted
    ├── UnsafePathError                31   a manifest entry would escape the target
    ├── NotBackedUpError               40   status: a local checkpoint has no durable snapshot; ship-pins: a dead
    │                                           watch sidecar's pins are left
    ├── DrillFailedError               41   drill: a restored file could not be loaded
    ├── BackupSupersededError           1   backup_async: dropped for a newer one (queue full)
    ├── BackupCancelledError            1   backup_async: cancelled before it started (cancel(), close cut short)
    └── FlushTimeoutError               1   flush: queued backups still running at the timeout
        └── BackupTimeoutError          1   a backup_async handle's result/exception: still running at the timeout

A cancelled command (Ctrl-C) exits 130 from the CLI's error boundary; it needs no class here.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from concurrent.futures import CancelledError
from datetime import datetime
from typing import ClassVar

_command_line = False  # set by the CLI: messages name its options, not the API's parameters


def name_command_line_options() -> None:
    """Called once by the CLI: from then on, messages name a setting as it is typed there."""
    global _command_line
    _command_line = True


def spelled(command_line: str, python: str) -> str:
    """A setting as the user gives it, for a message: on the command line (``--keep-latest``) in
    the CLI, else as the Python API's parameter (``keep_latest``)."""
    return command_line if _command_line else python


def check_command(read_data: bool = False) -> str:
    """The advice to check the vault, as the user runs it: ``ckptvault check`` in the CLI,
    ``vault.check()`` from the Python API (``--read-data``: every chunk read, ``read_data=1.0``)."""
    if read_data:
        return spelled("ckptvault check --read-data", "vault.check(read_data=1.0)")
    return spelled("ckptvault check", "vault.check()")


def check_hint() -> str:
    """ "; run: ckptvault check" (or the API's call), the suffix of damage a plain check finds."""
    return f"; run: {check_command()}"


def names_a_check(message: str) -> bool:
    """Whether ``message`` already sends the user to check, in either spelling."""
    return "ckptvault check" in message or "vault.check(" in message


def repair_index_command(read_data: bool = False, drop_failing: bool = False) -> str:
    """``ckptvault repair-index [--read-data] [--drop-failing-packs]``, or the API's ``vault.repair_index(...)``."""
    options = [("--read-data", "read_data=True")] if read_data else []
    options += [("--drop-failing-packs", "drop_failing=True")] if drop_failing else []
    return spelled(
        "ckptvault repair-index" + "".join(f" {cli}" for cli, _ in options),
        f"vault.repair_index({', '.join(api for _, api in options)})",
    )


def forget_command(snapshot_ids: Sequence[str] = ()) -> str:
    """``ckptvault forget ID ...``, or the API's ``vault.forget([...])`` (no IDs: the command alone)."""
    if not snapshot_ids:
        return spelled("ckptvault forget", "vault.forget()")
    return spelled(f"ckptvault forget {' '.join(snapshot_ids)}", f"vault.forget({list(snapshot_ids)!r})")


def init_command(url: str) -> str:
    """``ckptvault init URL``, the URL one shell word that ends where it ends: quoted where the shell needs it, or
    where it ends in a sentence's ".", "," or ";" (a suggestion that gets the vault's options finds the URL's end
    before such characters, as the sentence around it may add them; a ")" is quoted by the shell's rules)."""
    word = shlex.quote(url)
    if word == url and url[-1:] in ".,;":
        word = f"'{url}'"
    return f"ckptvault init {word}"


def prune_command() -> str:
    return spelled("ckptvault prune", "vault.prune()")


def unlock_command() -> str:
    return spelled("ckptvault unlock", "vault.unlock()")


def unused_keyfile_note(url: str, keyfile: str, env: str | None = None) -> str:
    """The warning of a command that only reads a vault that is not encrypted, given a keyfile (cli49 #8: a
    ``CKPTVAULT_KEYFILE`` exported for the main vault refused every read of a plain mirror). ``env``: the
    environment variable the keyfile came from (the CLI's), named with how to leave it out, as the writers'
    refusal says."""
    if env is not None:
        return (
            f"the vault at {url} is not encrypted; the keyfile {keyfile} (from {env}) is not used "
            f"(to leave it out: env -u {env} ckptvault ...)"
        )
    return f"the vault at {url} is not encrypted; the keyfile {keyfile} is not used" + spelled(
        "", " (reading goes on; a write to this vault is refused while a keyfile is given)"
    )


def unused_keyfile_error(url: str, keyfile: str) -> UsageError:
    """A write into a vault that is not encrypted, with a keyfile given for it: what was meant to be encrypted
    would be written in the clear."""
    return UsageError(
        f"vault {url} is not encrypted but a keyfile was given ({keyfile}); refusing to write to it, so that "
        f"nothing meant to be encrypted is written in the clear "
        + spelled(
            "(leave out --keyfile for this vault; one set in the environment is left out with: "
            "env -u CKPTVAULT_KEYFILE ckptvault ...)",
            "(leave out keyfile for this vault)",
        )
    )


def first_few(items: Sequence[str], shown: int, sep: str = "; ") -> str:
    """The first ``shown`` of ``items`` and how many more: a one-line message names a few, not thousands."""
    more = f" (and {len(items) - shown} more)" if len(items) > shown else ""
    return sep.join(items[:shown]) + more


def elided(text: str, keep: int = 200) -> str:
    """``text`` with its middle cut out when it is longer than twice ``keep`` (a path of thousands of
    characters in a one-line message)."""
    if len(text) <= 2 * keep + 3:
        return text
    return f"{text[:keep]}...{text[-keep:]}"


def _also(names: Sequence[str], shown: int) -> str:
    """ "; also a, b and N more": the others an incomplete restore or copy names after its first."""
    if not names:
        return ""
    more = len(names) - shown
    return f"; also {', '.join(names[:shown])}" + (f" and {more} more" if more > 0 else "")


class CkptVaultError(Exception):
    """Base class: every ckptvault failure a user can act on."""

    exit_code: ClassVar[int] = 1
    # False where the message already says the way on without naming a command (check's own summary):
    # the CLI then adds no generic "run: ckptvault check --read-data" (check would send the user to itself)
    wants_read_data_hint: bool = True


class UsageError(CkptVaultError):
    exit_code = 2


class SourceError(CkptVaultError):
    exit_code = 3

    def __init__(self, path: str, reason: str, hint: str = "", *, action: str = "read") -> None:
        """``action``: what could not be done with ``path`` ("read"; watch's "pin", where its pins folder
        refused the write, not the checkpoint its read)."""
        self.path = path
        self.reason = reason
        self.hint = hint
        msg = f"cannot {action} {path}: {reason}"
        super().__init__(f"{msg} ({hint})" if hint else msg)


class CheckpointLostError(SourceError):
    """A checkpoint that could not be pinned went (deleted, cut down) before it shipped."""

    def __init__(self, path: str, reason: str, hint: str = "") -> None:
        self.path, self.reason, self.hint = path, reason, hint
        CkptVaultError.__init__(self, f"{path}: {reason} ({hint})" if hint else f"{path}: {reason}")


class VaultNotFoundError(CkptVaultError):
    exit_code = 10

    def __init__(self, url: str, hint: str = "") -> None:
        self.url = url
        create = spelled(init_command(url), f"Vault.init({url!r}), or Vault.open({url!r}, create=True)")
        super().__init__(f"no vault at {url}; {hint or f'create one with: {create}'}")


class VaultExistsError(CkptVaultError):
    exit_code = 10

    def __init__(self, url: str) -> None:
        self.url = url
        super().__init__(f"a vault already exists at {url}; use it, or pick an empty location")


class ForeignRepositoryError(CkptVaultError):
    """The location holds another tool's repository (restic's, borg's, kopia's) or another program's file named
    config: no ckptvault vault is there, and none may be made there."""

    exit_code = 10

    def __init__(self, url: str, what: str) -> None:
        self.url = url
        super().__init__(
            f"{url} holds {what}, not a ckptvault vault; give the URL of a ckptvault vault, or create one in an "
            "empty location"
        )


class VaultLockedError(CkptVaultError):
    exit_code = 11
    held_since: datetime | None = None  # when the conflicting lock was last refreshed, where known


class LockLostError(VaultLockedError):
    """A lock holder found its lock gone or expired before committing."""


class WrongPassphraseError(CkptVaultError):
    exit_code = 12

    def __init__(self, keyfile: str) -> None:
        self.keyfile = keyfile
        # AES-GCM cannot tell the two apart: a keyfile whose salt or wrapped key changed fails the same way
        super().__init__(
            f"wrong passphrase for keyfile {keyfile} (or the keyfile is damaged: with the right passphrase, "
            "use a backup copy of it)"
        )


class KeyfileMismatchError(CkptVaultError):
    exit_code = 13

    def __init__(self, keyfile: str, url: str, fingerprints: tuple[str, str] | None = None) -> None:
        self.keyfile = keyfile
        self.url = url
        # both public (the vault's config, `key info`): which keyfile to look for among several
        which = (
            f" (the vault's key fingerprint is {fingerprints[0]}, this keyfile's {fingerprints[1]})"
            if fingerprints
            else ""
        )
        super().__init__(
            f"keyfile {keyfile} does not belong to vault {url}{which}; use the keyfile the vault was created with"
        )


class KeyfileNotFoundError(CkptVaultError):
    exit_code = 14


NOT_A_KEYFILE = "not a ckptvault keyfile"


class KeyfileCorruptError(CkptVaultError):
    exit_code = 15

    def __init__(self, keyfile: str, reason: str) -> None:
        self.keyfile = keyfile
        if reason == NOT_A_KEYFILE:  # valid JSON of another kind: a file given in its place, not damage
            super().__init__(f"keyfile {keyfile} is {reason} (the wrong file?); give the path of a ckptvault keyfile")
        else:
            super().__init__(f"keyfile {keyfile} is corrupt ({reason}); use your backup copy of the keyfile")


class PassphraseRequiredError(CkptVaultError):
    exit_code = 16

    def __init__(
        self, env: str = "CKPTVAULT_PASSPHRASE", option: str = "--passphrase-file", *, message: str | None = None
    ) -> None:
        super().__init__(message or f"no passphrase: set {env}, pass {option} FILE, or run in a terminal to be asked")


class UnsupportedFormatError(CkptVaultError):
    exit_code = 17


class SnapshotNotFoundError(CkptVaultError, LookupError):
    exit_code = 18


def quoted_name(name: str) -> str:
    """``repr(name)``, with the bytes of a name that is not UTF-8 (held as lone surrogates, surrogateescape)
    written as ``\\xff``, as every other message writes them, not as ``\\udcff``, which names no byte."""
    # an escape that an even number of backslashes precedes (a name's own backslash is doubled by repr)
    return re.sub(r"(?<!\\)((?:\\\\)*)\\udc([89a-f][0-9a-f])", r"\1\\x\2", repr(name))


class PathNotInSnapshotError(CkptVaultError, LookupError):
    exit_code = 19

    def __init__(self, path: str, snapshot_id: str, found: str | None = None) -> None:
        """``found``: the type of the entry at ``path`` when it is one but not a file ("dir", "symlink")."""
        self.path = path
        self.snapshot_id = snapshot_id
        short = snapshot_id[:12]
        what = f"is a {'folder' if found == 'dir' else found} in snapshot {short}, not a file" if found else ""
        listing = spelled(f"ckptvault ls {short}", "Vault.files(snapshot)")
        super().__init__(f"{quoted_name(path)} {what or f'is not in snapshot {short}'}; list its files with: {listing}")


class StorageError(CkptVaultError):
    """The storage backend failed; ``op`` and ``key`` name the call."""

    exit_code = 20

    def __init__(
        self, op: str, key: str, url: str, reason: str, *, retryable: bool = False, message: str | None = None
    ) -> None:
        """``message``: what the user reads, when the generic "storage failed: ..." would not say
        what to do (a restore's target, a missing object)."""
        self.op = op
        self.key = key
        self.url = url
        self.reason = reason
        self.retryable = retryable
        super().__init__(message or f"storage failed: {op} {key} on {url}: {reason}")

    def said_as(self, message: str, op: str | None = None) -> StorageError:
        """The same failure (a plain StorageError) told by ``message``: what it means to the command it stopped."""
        return StorageError(op or self.op, self.key, self.url, self.reason, retryable=self.retryable, message=message)


class ObjectNotFoundError(StorageError):
    def __init__(self, op: str, key: str, url: str) -> None:
        super().__init__(op, key, url, "object not found", message=f"object {key} is missing from {url}{check_hint()}")


class ShortReadError(StorageError):
    """The object ends before the range read from it: truncated, on a local disk for sure."""


class StorageFullError(StorageError):
    exit_code = 21

    def __init__(self, op: str, key: str, url: str, reason: str, *, hint: str = "") -> None:
        hint = hint or spelled("free space and run the command again", "free space and try again")
        where = f"writing {key} on {url}" if key != url else f"on {url}"  # the folder itself could not be made
        super().__init__(op, key, url, reason, message=f"no space left {where}: {reason}; {hint}")


class RestoreConflictError(CkptVaultError):
    exit_code = 22


class IntegrityError(CkptVaultError):
    """Stored bytes do not match what they claim to be."""

    exit_code = 30


class MalformedObjectError(IntegrityError):
    exit_code = 30


def read_data_hint() -> str:
    """For damage a plain check misses: the CLI's command, or the API's call."""
    return f"; run: {check_command(read_data=True)} (it says what to do)"


def config_from_a_copy() -> str:
    """For a config altered or damaged: until it is put back no command gets past it, check included."""
    return f"put the config back from a copy ({check_command(read_data=True)} then tells whether anything else was hit)"


class RestoreIncompleteError(IntegrityError):
    """Files whose stored bytes failed verification, or whose chunks are in no index, were not written;
    the rest were restored.
    ``failed``: each such file's path in the snapshot and why; ``result``: what was restored."""

    SHOWN = 3  # paths named in the message beyond the first file's reason; all are in ``failed``

    def __init__(self, failed: dict[str, str], result: object = None) -> None:
        self.failed = failed
        self.result = result
        reasons = list(failed.values())
        also = _also(list(failed)[1:], self.SHOWN)
        hint = "" if names_a_check(reasons[0]) else read_data_hint()
        super().__init__(
            f"restore incomplete: {len(failed)} file(s) could not be restored and were not written: {reasons[0]}{also}"
            f"{hint}"
        )


class CopyIncompleteError(IntegrityError):
    """Snapshots that could not be read in the source vault (damaged data, a damaged snapshot or tree
    object, or data a newer ckptvault wrote) were not copied; the others were. ``failed``: each such
    snapshot's ID and why; ``newer``: those of them a newer ckptvault is needed to read (all of them:
    CopyNeedsUpgradeError); ``result``: what was copied (the CopyResult, whose ``failed`` this is)."""

    SHOWN = 3  # snapshots named in the message beyond the first one's reason; all are in ``failed``

    def __init__(
        self,
        source_url: str,
        dest_url: str,
        failed: dict[str, str],
        copied: int,
        already: int,
        result: object,
        *,
        newer: Sequence[str] = (),
    ) -> None:
        self.failed = failed
        self.newer = list(newer)
        self.result = result
        (first, reason), *rest = failed.items()
        also = _also([snapshot_id[:8] for snapshot_id, _ in rest], self.SHOWN)
        there = f", {already} were there already" if already else ""
        damaged = len(failed) - len(self.newer)
        super().__init__(
            f"copy incomplete: {len(failed)} snapshot(s) could not be read in {source_url} and were not copied: "
            f"snapshot {first[:8]}: {reason}{also}; {copied} other(s) were copied to {dest_url}{there}; "
            + _copy_advice(source_url, damaged, len(self.newer))
        )


class CopyNeedsUpgradeError(CopyIncompleteError):
    """A CopyIncompleteError whose every snapshot not copied holds data a newer ckptvault wrote: not damage (no
    check heals it), so it exits as UnsupportedFormatError does; an upgraded ckptvault copies them."""

    exit_code = 17


def _copy_advice(source_url: str, damaged: int, newer: int) -> str:
    """What to do about the snapshots a copy could not read: upgrade for those a newer ckptvault wrote, check the
    source for damaged ones."""
    upgrade = f"{newer} hold(s) data a newer ckptvault wrote: upgrade ckptvault (pip install -U ckptvault) to copy them"
    check = "to see what is damaged there and how to heal it, run: " + spelled(
        f"ckptvault check --read-data --repo {source_url}", "check(read_data=1.0) of the source Vault"
    )
    if not newer:
        return check
    return upgrade if not damaged else f"{upgrade}; for the other(s), {check}"


class ConfigDowngradedError(CkptVaultError):
    """The config says unencrypted, the stored objects are encrypted: the config was altered or
    replaced. Not an IntegrityError: no object is damaged, and every command must stop at once
    (a backup would write in the clear) instead of reading around one object."""

    exit_code = 30


class UnsafePathError(CkptVaultError):
    exit_code = 31

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        super().__init__(f"restore refused: entry {quoted_name(path)} {reason}")


class FileFormatError(CkptVaultError):
    """A file's header is not what its format requires (or the format is not one ckptvault reads)."""

    exit_code = 23

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        sep = " " if reason.startswith(("is ", "has ")) else ": "  # "x.json is not ...", "x.pt: zip member ..."
        super().__init__(f"{path}{sep}{reason}")


class WatchLockedError(VaultLockedError):
    """Another ``ckptvault watch`` holds the same checkpoint folder, or the same state folder."""


class NotBackedUpError(CkptVaultError):
    exit_code = 40


class DrillFailedError(CkptVaultError):
    """The restore drill restored and verified every byte, but a file did not load."""

    exit_code = 41


class BackupSupersededError(CkptVaultError):
    """``backup_async``: the queue was full and a newer backup took this one's place, or a later save
    rewrote its pinned files in place (``rewritten``: those sources)."""

    def __init__(self, message: str, *, rewritten: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.rewritten = rewritten


class BackupCancelledError(CkptVaultError, CancelledError):
    """``backup_async``: the backup was cancelled before it started (``BackupHandle.cancel()``, or Ctrl-C
    while ``Vault.close`` waited); also a ``concurrent.futures.CancelledError``, as a Future's would be."""


class FlushTimeoutError(CkptVaultError, TimeoutError):
    """``flush(timeout)`` returned with queued backups still unfinished."""


class BackupTimeoutError(FlushTimeoutError):
    """A ``backup_async`` handle's ``result(timeout)`` or ``exception(timeout)`` returned before its
    backup ended. A FlushTimeoutError too, which handles raised before it existed."""


class ObjectExistsError(StorageError):
    """A create-if-absent write found the object already there (another writer made it first)."""

    def __init__(self, op: str, key: str, url: str) -> None:
        super().__init__(op, key, url, "the object already exists")
