"""What the watcher knows of each checkpoint (watch.py), and the small rules its parts share about them."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from ..errors import CheckpointLostError, CkptVaultError
from ..snapshot.model import TAG_TEXT_MAX
from . import pin as pins
from .names import checkpoint_step, is_unfinished


@dataclass
class Candidate:
    """A checkpoint pinned (or shipping in place) and not shipped yet."""

    pin: pins.Pin
    seen: float
    last_change: float
    sig: pins.Signature = ()
    first_sig: pins.Signature | None = None
    state: Literal["settling", "queued", "failed"] = "settling"
    retry_at: float = 0.0
    failures: int = 0
    digest: str = ""
    shipped_sig: pins.Signature = ()  # what its backup was started on (the pin may change under it)
    step: int | None = None
    source_stat: os.stat_result | None = None  # the source when the pin was last synced
    error: CkptVaultError | None = None  # the last backup failure, while it is not shipped
    unpinned: str = ""  # shipping in place: why no pin could be made
    pin_retry_at: float = 0.0  # shipping in place: when to try pinning it again
    frozen: bool = False  # its source is gone or replaced: the pin is not looked at (until the source is back)
    gone: bool = False  # frozen, and its source surely gone or replaced (not a stat that failed)
    behind: str = ""  # why its pin lacks part of what its source holds (a sync that failed: a full disk); "": none
    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # at the last look: path -> (size, mtime)
    steady: bool = False  # unchanged at the last look
    rewrites: int = 0  # saves in place seen since it last settled
    rewrites_since: float = 0.0  # when the first of them was seen
    saved_anew: bool = False  # a look found another save in its folder (``saved_anew``) since it was first seen
    looked: float = 0.0  # when its pin was last looked at, and how long that took
    look_s: float = 0.0
    not_whole: tuple[pins.Signature, str] | None = None  # its files as last read, and which is not whole ("": none)
    tags: dict[str, str] | None = None  # the tags an earlier run pinned it under (None: this run's)
    # whether its pin.json says it settled (a restart that finds a pin never settled with its source gone
    # warns); None: not recorded (shipping in place, or a pin of an older version)
    settled_noted: bool | None = None

    def settled(self, now: float, settle: float) -> bool:
        """Unchanged for ``settle`` seconds, or its source gone (the trainer's rotation deleted it) or
        replaced, so nothing more can come into its pin. A trainer that saves faster than ``settle``
        and keeps few saves deletes each before it would settle by time, and a disk with room for one
        pin would then drop every one of them (watch_room.py) and ship none."""
        return (self.frozen and self.gone) or now - self.last_change >= settle


@dataclass
class Done:
    """What a name held when its checkpoint was shipped, to notice when it holds a new one."""

    ino: int
    size: int
    mtime_ns: int
    sig: pins.Signature
    looked: float = 0.0  # when a folder's files were last compared with ``sig``
    look_s: float = 0.0  # how long that comparison took (its share of LOOK_INSIDE_SHARE)


SignatureOf = Callable[[pins.Pin], pins.Signature]  # what a pin (in place: its source) holds
WarnOnce = Callable[[tuple[str, str], str], None]  # says a message once for its key, until that stage succeeds
# says a checkpoint will never ship: (it, its step, why: "dropped", "deleted" or "replaced", the error of the run)
ReportLost = Callable[[Candidate, int | None, str, CheckpointLostError], None]


def tag_text(name: str) -> str:
    """A checkpoint's name as a tag value: control characters escaped (a tag holds printable text),
    cut to the tag limit. The tag only names the checkpoint; watch finds what it shipped by digest."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)
    return text[:TAG_TEXT_MAX]


def step_of(cand: Candidate) -> int | None:
    return cand.step if cand.step is not None else checkpoint_step(cand.pin.data)


def stat_if_same(pin: pins.Pin) -> os.stat_result | None:
    """The source's stat, taken before a sync, while the name still holds the pinned checkpoint.

    A folder replaced under its name (``rmtree``, then a new folder) may get the old one's inode
    number (ext4 hands it out again at once): it is told apart by its files, none of which is one of
    the pin's hard links. Then the pin keeps what it holds, for good (it ships as it is), and the new
    folder is a checkpoint of its own."""
    try:
        st = os.stat(pin.source)
    except OSError:
        return None
    if st.st_ino != pin.source_ino:
        return None
    if stat.S_ISDIR(st.st_mode) and pins.shares_a_file(pin) is False:
        pin.source_ino = -1  # in memory only: a restart tells it apart again
        return None
    return st


def gone_or_replaced(pin: pins.Pin) -> bool:
    """Whether the pinned source is surely no more under its name: not there, or another file or folder
    (``stat_if_same`` also gives None for a stat that failed: EACCES, EIO, a stale NFS handle)."""
    try:
        st = os.stat(pin.source)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return st.st_ino != pin.source_ino or pin.source_ino == -1


def file_paths(sig: pins.Signature) -> set[str]:
    """The paths of a signature's files (a file checkpoint's own is "")."""
    return {rel for rel, _, _ in pins.files_of(sig)}


def saved_anew(before: pins.Signature, after: pins.Signature, steady: bool) -> bool:
    """Whether the files of ``after`` hold another save than those of ``before`` (the last look's; ``steady``: that
    look found nothing changed): a file changed without growing (rewritten: a file being written only grows), or
    one that came after its save was done. A file that grew, or came while it was still changing, may be the
    same save still being written."""
    held = {rel: (size, mtime) for rel, size, mtime in pins.files_of(before)}
    files = {rel: (size, mtime) for rel, size, mtime in pins.files_of(after)}
    return rewritten(held, files) or (steady and bool(files.keys() - held.keys()))


def rewritten(held: dict[str, tuple[int, int]], files: dict[str, tuple[int, int]]) -> bool:
    """Whether a file of ``files`` (path -> size, mtime) changed from ``held`` without growing: saved again in
    place, as a file being written only grows."""
    return any(rel in held and state != held[rel] and state[0] <= held[rel][0] for rel, state in files.items())


def unpinnable(excluded: pins.Excluded | None, rel: str, is_dir: bool) -> bool:
    """What a pin leaves out of a checkpoint: names still being written (pin.py), and ``excluded``."""
    return is_unfinished(rel.rpartition("/")[2]) or (excluded is not None and excluded(rel, is_dir))


def temporary_activity(pin: pins.Pin) -> pins.Signature:
    """Files still being written inside the source folder (not pinned) count as activity, but for
    those in what the exclude patterns leave out."""
    if not os.path.isdir(pin.source) or not pins.source_alive(pin):
        return ()
    out = []
    try:
        for rel, entry in pins.walk(pin.source, pin.excluded):
            if is_unfinished(entry.name):  # a folder's too: its files come and go
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat(follow_symlinks=False)
                    out.append(("~" + rel, str(st.st_size), str(st.st_mtime_ns)))
    except OSError:
        return ()  # gone meanwhile: the pin holds what was seen
    return tuple(sorted(out))


def unchanged(signature: SignatureOf, pin: pins.Pin, sig: pins.Signature) -> bool:
    """Whether the pin's files (in place: the source's) are as ``sig`` recorded them."""
    try:
        return signature(pin) == sig
    except OSError:
        return False
