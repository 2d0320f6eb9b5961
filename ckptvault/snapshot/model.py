"""What a snapshot is: metadata, a summary, and a tree of entries (kept in its own object)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime

TAG_TEXT_MAX = 256  # characters in one tag key or value: longer ones wreck the snapshots table


WATCH_SIG_TAG = "watch-sig"  # the tag naming what the watch sidecar shipped (pin.digest), compared after a restart


@dataclass(slots=True)
class FileEntry:
    """One tree entry. ``path`` is '/'-separated and relative to the snapshot root."""

    path: str
    type: str  # "file" | "dir" | "symlink"
    mode: int  # permission bits only
    mtime_ns: int
    size: int = 0
    blake3: str | None = None  # whole-file BLAKE3, hex (files)
    chunks: list[bytes] = field(default_factory=list)  # chunk IDs in file order (files)
    target: str | None = None  # link target (symlinks)
    inode: int | None = None  # with ctime_ns: lets the next backup skip unchanged files
    ctime_ns: int | None = None


# How a listing shows a character of a name it cannot print as is (cli/output.py's one_line): an ASCII control
# character as Python writes it (\n, \x01), a byte that is not UTF-8 (surrogateescape keeps it as
# U+DC80-U+DCFF) as \xNN, a character that is not printable from U+0080 up as \uNNNN
_SHOWN_CHAR = re.compile(r"\\(?:([ntr])|x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))")
_CONTROL = {"n": "\n", "t": "\t", "r": "\r"}


def _unshown(match: re.Match[str]) -> str:
    control, byte, short, long = match.groups()
    if control:
        return _CONTROL[control]
    if byte:
        return chr(int(byte, 16)) if int(byte, 16) < 0x80 else chr(0xDC00 + int(byte, 16))
    return chr(int(short or long, 16))


def stored_name(shown: str) -> str | None:
    """The name a listing shows as ``shown`` (``new\\nline``, ``w\\xffx.bin``), when it escapes a
    character; None when it escapes none. Asked only after ``shown`` matched nothing as given: a name may
    hold a backslash of its own."""
    if "\\" not in shown:
        return None
    try:
        stored = _SHOWN_CHAR.sub(_unshown, shown)
    except ValueError:  # \U beyond U+10FFFF: no name has it
        return None
    return stored if stored != shown else None


@dataclass(frozen=True)
class SnapshotSummary:
    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    logical_bytes: int = 0  # sum of file sizes
    read_bytes: int = 0  # bytes actually read (unchanged files are skipped)
    new_bytes: int = 0  # raw bytes of chunks this backup added
    stored_bytes: int = 0  # bytes this backup added to the repository (packs, index, tree, snapshot)
    chunks: int = 0
    new_chunks: int = 0
    duration_s: float = 0.0
    # Delta coding (codec 3); left out of the stored summary when 0, as in every snapshot before it.
    delta_chunks: int = 0  # new chunks stored as deltas against a previous save's piece
    delta_bytes: int = 0  # their raw bytes
    delta_stored_bytes: int = 0  # their stored bytes
    delta_saved_bytes: int = 0  # estimated bytes the deltas saved over the plain coding

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else float("inf")


@dataclass(frozen=True)
class Snapshot:
    id: str  # 64 hex digits
    time: datetime  # UTC
    hostname: str
    paths: list[str]
    tags: dict[str, str]
    description: str
    parent: str | None
    tree_id: str
    summary: SnapshotSummary
    excludes: list[str] = field(default_factory=list)  # the backup's --exclude patterns, as given

    @property
    def short_id(self) -> str:
        return self.id[:8]

    @property
    def step(self) -> int | None:
        """The ``step`` tag as a number (``step_number``)."""
        return step_number(self.tags.get("step", ""))

    def matches(self, tags: dict[str, str] | None) -> bool:
        return all(self.tags.get(k) == v for k, v in (tags or {}).items())


def step_number(value: str) -> int | None:
    """A ``step`` tag's value as a number when it is written in ASCII digits, a leading minus allowed
    (``int()`` alone would also take ``1_000``, `` 12 `` or other scripts' digits, which no trainer writes)."""
    digits = value.removeprefix("-")
    return int(value) if digits.isascii() and digits.isdigit() else None


def format_tags(tags: dict[str, str], sep: str = ",") -> str:
    """``run=x,step=1200``; a key or value holding a comma, a quote or edge spaces is quoted
    (``note="a,b"``), so that it cannot read as two tags."""
    return sep.join(f"{shown_tag_part(k)}={shown_tag_part(v)}" for k, v in tags.items())


def shown_tag_part(text: str) -> str:
    if "," in text or '"' in text or text != text.strip():
        return json.dumps(text, ensure_ascii=False)
    return text
