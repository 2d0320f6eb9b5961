"""The storage contract the repository relies on.

Keys are '/'-separated names relative to the repository root. ``put`` is atomic: a reader
sees either no object or the whole object, never a prefix (temp file + rename locally and over
SFTP, a single PUT on object stores). Objects are immutable: the repository never overwrites one
with different content. ``put(..., if_absent=True)`` writes only when no object has the key and
raises ``ObjectExistsError`` otherwise; stores whose ``supports_if_absent`` is true make that
atomic (a conditional PUT, a link, a non-replacing rename), others check first (a race can lose).
Missing objects raise ``ObjectNotFoundError``; every other backend failure raises
``StorageError`` naming the operation and the key, with ``retryable`` set when it may pass.

``remote`` says bytes cross a network (the repository then caches metadata locally), and
``transfers`` how many uploads and downloads suit the store at once.

Optional capabilities, looked up with ``getattr`` and a default by the layers above (the wrappers,
retrying.py, throttle.py and readahead.py, pass them on from the store they wrap):

- ``transfers`` (TransferLimits; default: 2 uploads and 8 downloads at once);
- ``local_folder`` (str): the folder of a store on this machine's filesystem (sources inside it are refused);
- ``odd_path`` (keypath.OddPath): an object store path whose '//', '.' or '..' names other objects than the
  path resolved (no vault is made there, and "no vault" there says so);
- ``read_upto(key, start, length)``: a range read that may return fewer bytes at the object's end;
- ``needs_deadline`` / ``enforces_deadline`` (bool): whether a call needs a thread-held deadline, and
  whether the backend enforces its own (retrying.py);
- ``unanswered`` (bool): a call gave up lately because the storage did not answer (locks.py);
- ``briefly()``: a context in which this thread's calls get a short budget (housekeeping, locks.py);
- ``temp_files()``: (size, mtime) of each temp file of a write (local disks, SFTP), for ``check``;
- ``cancelling_uploads(prefix)``: a context in which uploads held back by a bandwidth limit fail at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Protocol

TEMP_PREFIX = ".tmp-"  # a put's file before its rename (local disks, SFTP): never listed
# (size, mtime) of each temp file; an alias, since inside a store class "list" names its method
TempFiles = list[tuple[int, float]]


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    time_value: object = None  # the listing's own value for when the storage wrote it, if it has one

    @property
    def modified(self) -> datetime | None:
        """When the storage wrote the object, as aware UTC (parsed only when asked: listings are long)."""
        return listed_time(self.time_value)


def listed_time(value: object) -> datetime | None:
    """A listing's modification time (a POSIX timestamp, a datetime, or ISO text) as aware UTC."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return datetime.fromtimestamp(value, timezone.utc)
    return None


class Store(Protocol):
    url: str
    remote: bool
    supports_if_absent: bool

    def put(self, key: str, data: bytes | bytearray | memoryview, *, if_absent: bool = False) -> None: ...

    def get(self, key: str) -> bytes: ...

    def get_range(self, key: str, start: int, length: int) -> bytes: ...

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> list[ObjectInfo]: ...

    def delete(self, key: str) -> None: ...

    def remove_stale_temp_files(self, older_than_s: float) -> int:
        """Remove what crashed writers left (temp files, unfinished multipart uploads) older than this."""
        ...
