"""Snapshot and tree documents <-> bytes (JSON; the repository compresses and seals them).

Decoding validates every path, so a damaged or crafted tree cannot make a restore
write outside its target: no absolute paths, no '..' or '.' or empty components, no
duplicates, and no entry below a symlink entry.

What a newer ckptvault wrote (a document ``version`` above ``DOC_VERSION``, or snapshot summary
fields this one does not know) raises UnsupportedFormatError (exit 17); everything else that does
not parse raises MalformedObjectError (exit 30). Neither names the object: callers do.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from datetime import datetime

from ..errors import MalformedObjectError, UnsafePathError, UnsupportedFormatError
from .model import FileEntry, Snapshot, SnapshotSummary

DOC_VERSION = 1
ENTRY_TYPES = ("file", "dir", "symlink")
_SUMMARY_FIELDS = frozenset(f.name for f in fields(SnapshotSummary))


def encode_snapshot(snap: Snapshot) -> bytes:
    doc = {
        "version": DOC_VERSION,
        "id": snap.id,
        "time": snap.time.isoformat(),
        "hostname": snap.hostname,
        "paths": snap.paths,
        "tags": snap.tags,
        "description": snap.description,
        "parent": snap.parent,
        "tree": snap.tree_id,
        "summary": _summary(snap.summary),
    }
    if snap.excludes:  # left out when empty: a snapshot without reads as before the field existed
        doc["excludes"] = snap.excludes
    return json.dumps(doc, separators=(",", ":")).encode()


def _summary(summary: SnapshotSummary) -> dict:
    # The delta counters are written only when a backup stored deltas, so a snapshot without
    # any reads the same as before codec 3 existed (and in an older ckptvault).
    return {k: v for k, v in asdict(summary).items() if not (k.startswith("delta_") and v == 0)}


def decode_snapshot(raw: bytes) -> Snapshot:
    try:
        doc = json.loads(raw)
        _check_version(doc, "snapshot")
        return Snapshot(
            id=doc["id"],
            time=datetime.fromisoformat(doc["time"]),
            hostname=doc["hostname"],
            paths=list(doc["paths"]),
            tags={str(k): str(v) for k, v in doc["tags"].items()},
            description=doc["description"],
            parent=doc["parent"],
            tree_id=doc["tree"],
            summary=_decode_summary(doc["summary"]),
            excludes=_decode_excludes(doc.get("excludes", [])),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise MalformedObjectError(f"snapshot document is malformed ({exc})") from exc


def _decode_excludes(excludes: object) -> list[str]:
    if not (isinstance(excludes, list) and all(isinstance(p, str) and p for p in excludes)):
        raise TypeError("excludes is not a list of patterns")
    return list(excludes)


def _decode_summary(summary: dict) -> SnapshotSummary:
    # Strict: a new summary field comes with a new snapshot document version, so a field this
    # ckptvault does not know means a newer one wrote the snapshot.
    if not isinstance(summary, dict):
        raise TypeError("the summary is not an object")
    unknown = sorted(set(summary) - _SUMMARY_FIELDS)
    if unknown:
        raise UnsupportedFormatError(
            f"snapshot summary has fields this ckptvault does not know ({', '.join(map(str, unknown))}); "
            "it was written by a newer ckptvault, which is needed to read it"
        )
    return SnapshotSummary(**summary)


def encode_tree(entries: list[FileEntry]) -> bytes:
    out = []
    for e in entries:
        d: dict = {"path": e.path, "type": e.type, "mode": e.mode, "mtime_ns": e.mtime_ns}
        if e.type == "file":
            d.update(size=e.size, blake3=e.blake3, chunks=[c.hex() for c in e.chunks])
            if e.inode is not None:
                d.update(inode=e.inode, ctime_ns=e.ctime_ns)
        elif e.type == "symlink":
            d["target"] = e.target
        out.append(d)
    return json.dumps({"version": DOC_VERSION, "entries": out}, separators=(",", ":")).encode()


def decode_tree(raw: bytes) -> list[FileEntry]:
    try:
        doc = json.loads(raw)
        _check_version(doc, "tree")
        entries = [
            FileEntry(
                path=d["path"],
                type=d["type"],
                mode=d["mode"],
                mtime_ns=d["mtime_ns"],
                size=int(d.get("size", 0)),
                blake3=d.get("blake3"),
                chunks=[bytes.fromhex(c) for c in d.get("chunks", [])],
                target=d.get("target"),
                inode=d.get("inode"),
                ctime_ns=d.get("ctime_ns"),
            )
            for d in doc["entries"]
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise MalformedObjectError(f"tree document is malformed ({exc})") from exc
    validate_tree(entries)
    return entries


def _check_version(doc: object, what: str) -> None:
    if not isinstance(doc, dict):
        raise TypeError(f"{what} is not an object")
    version = doc.get("version")
    if version == DOC_VERSION:
        return
    if isinstance(version, int) and not isinstance(version, bool) and version > DOC_VERSION:
        raise UnsupportedFormatError(
            f"{what} document version {version} is newer than this ckptvault reads ({DOC_VERSION}); "
            "a newer ckptvault is needed to read it"
        )
    raise MalformedObjectError(f"{what} document version {version!r} is not valid")


def validate_path(path: str) -> None:
    if not isinstance(path, str) or not path:
        raise UnsafePathError(str(path), "has an empty path")
    if "\0" in path:
        raise UnsafePathError(path, "contains a NUL byte")
    if path.startswith("/"):
        raise UnsafePathError(path, "is an absolute path")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise UnsafePathError(path, "escapes the target directory or is not normalized")


# What the filesystem calls take: whole seconds in a signed 64-bit time_t, and the nanoseconds beside
# them. Not a 64-bit count of nanoseconds: that ends in 2262, and Linux stores later times (ext4 to 2446).
_MTIME_NS_RANGE = range(-(2**63) * 10**9, 2**63 * 10**9)


def validate_tree(entries: list[FileEntry]) -> None:
    """Everything a restore relies on, checked before it writes anything: safe and unique paths,
    nothing below a symlink or a file, and modes and times the filesystem calls accept."""
    seen: set[str] = set()
    links: set[str] = set()
    files: set[str] = set()
    for e in entries:
        validate_path(e.path)
        if e.type not in ENTRY_TYPES:
            raise MalformedObjectError(f"tree entry {e.path!r} has unknown type {e.type!r}")
        if e.path in seen:
            raise UnsafePathError(e.path, "appears twice in the snapshot")
        seen.add(e.path)
        if not _is_int(e.mode) or not 0 <= e.mode <= 0o7777:
            raise MalformedObjectError(f"tree entry {e.path!r} has mode {e.mode!r}, not permission bits")
        if not _is_int(e.mtime_ns) or e.mtime_ns not in _MTIME_NS_RANGE:
            raise MalformedObjectError(f"tree entry {e.path!r} has an impossible mtime_ns {e.mtime_ns!r}")
        if e.type == "symlink":
            if not isinstance(e.target, str) or not e.target or "\0" in e.target:
                raise MalformedObjectError(f"tree entry {e.path!r} is a symlink without a valid target")
            links.add(e.path)
        if e.type == "file":
            if e.size < 0 or (e.size > 0 and not e.chunks):
                raise MalformedObjectError(f"tree entry {e.path!r} has size {e.size} but no chunks")
            files.add(e.path)
    for e in entries:
        parts = e.path.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent in links:
                raise UnsafePathError(e.path, "lies below a symlink in the snapshot")
            if parent in files:
                raise MalformedObjectError(f"tree entry {e.path!r} lies below the file {parent!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
