"""``ckptvault://``: snapshots as a read-only fsspec filesystem (registered through an entry point).

    with fsspec.open("ckptvault://latest/model.safetensors", repo="s3://bucket/vault") as f:
        f.seek(offset); f.read(n)                # fetches only the chunks those bytes live in

Paths are ``<snapshot>/<path in the snapshot>``, where ``<snapshot>`` is ``latest``, an ID or a
unique ID prefix; the root lists snapshots by ID. ``tags=`` and ``hosts=`` (as ``Vault.snapshots`` takes
them) narrow the snapshots the filesystem holds, as restic's ``mount --tag/--host`` do: ``latest`` is the newest
of those, the root lists those alone, and an ID outside them is no such path. Any other keyword (``tag=``,
``host=``, ``run=``) is refused, not ignored: a selection that is silently dropped would load another run's
weights. Files are ``Vault.open_file`` objects: seekable,
each fetched chunk verified, a few decoded chunks cached per open file. Snapshot resolution and
trees are cached per filesystem instance (``invalidate_cache()`` forgets them, so ``latest`` is
looked up again); fsspec hands every ``fsspec.open`` with the same arguments the same instance.
fsspec conventions win at this boundary: a missing path is FileNotFoundError. A symlink to a file
of the same snapshot reads as that file (so ``get`` copies it, like ``cp -L``); other links are left
out of listings (``info`` still describes them), so a recursive copy never stops half way.
"""

from __future__ import annotations

import posixpath
import threading
from typing import Any

from fsspec.spec import AbstractFileSystem

from .arguments import KeyfileArg, hosts_arg, tags_arg
from .crypto.keyfile import PassphraseSource
from .errors import PathNotInSnapshotError, SnapshotNotFoundError, UsageError
from .ops.reader import DEFAULT_CACHE_CHUNKS, SnapshotFile
from .snapshot.model import FileEntry, Snapshot
from .vault import Vault

# AbstractFileSystem's own options (skip_instance_cache is taken by fsspec's instance cache before __init__)
_FSSPEC_OPTIONS = frozenset({"use_listings_cache", "listings_expiry_time", "max_paths", "asynchronous", "loop"})


class CkptVaultFileSystem(AbstractFileSystem):
    protocol = "ckptvault"
    root_marker = ""

    def __init__(
        self,
        repo: str | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        keyfile: KeyfileArg = None,
        passphrase: PassphraseSource = None,
        vault: Vault | None = None,
        cache_chunks: int = DEFAULT_CACHE_CHUNKS,
        tags: dict[str, str] | None = None,
        hosts: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        """``repo``: the vault URL (default: ``$CKPTVAULT_REPO`` or the default vault); or pass an
        open ``vault``. ``cache_chunks``: decoded chunks kept per open file. ``tags``, ``hosts``: only the
        snapshots carrying every tag and of any of the hosts (``latest`` is the newest of them)."""
        unknown = sorted(set(kwargs) - _FSSPEC_OPTIONS)
        if unknown:
            raise UsageError(
                f"ckptvault:// takes no option {', '.join(map(repr, unknown))}; it takes repo, storage_options, "
                "keyfile, passphrase, vault, cache_chunks, and selects snapshots with tags={'run': 'x'} and "
                "hosts=['nodeB']"
            )
        if hosts is not None and not isinstance(hosts, (list, tuple)):  # fsspec keeps it to pickle the filesystem
            raise UsageError(f"ckptvault:// takes hosts as a list, e.g. hosts=['nodeB']; got {type(hosts).__name__}")
        self.tags = tags_arg(tags)
        self.hosts = hosts_arg(hosts)
        super().__init__(**kwargs)
        self.vault = vault or Vault.open(repo, storage_options=storage_options, keyfile=keyfile, passphrase=passphrase)
        self.cache_chunks = cache_chunks
        self._snapshots: dict[str, Snapshot] = {}
        self._trees: dict[str, dict[str, FileEntry]] = {}  # by snapshot ID: entries by path
        self._lock = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        if isinstance(path, list):  # fsspec passes lists through here too
            return [cls._strip_protocol(p) for p in path]  # type: ignore[return-value]
        path = str(path)
        if path.startswith("ckptvault://"):
            path = path[len("ckptvault://") :]
        return path.strip("/")

    def invalidate_cache(self, path: str | None = None) -> None:
        with self._lock:
            self._snapshots.clear()
            self._trees.clear()
        super().invalidate_cache(path)

    # ---- resolution ----------------------------------------------------------------------

    def _resolve(self, path: str) -> tuple[Snapshot, str]:
        spec, _, inner = self._strip_protocol(path).partition("/")
        with self._lock:
            snap = self._snapshots.get(spec)
        if snap is None:
            try:
                snap = self.vault.snapshot(spec, self.tags, hosts=self.hosts)
            except (SnapshotNotFoundError, UsageError) as exc:  # also no snapshot ID: too short, not hex
                raise FileNotFoundError(f"ckptvault://{spec}: {exc}") from exc
            with self._lock:
                self._snapshots[spec] = snap
        return snap, inner

    def _tree(self, snap: Snapshot) -> dict[str, FileEntry]:
        """The snapshot's entries by path, each link to a file of the snapshot replaced by that file."""
        with self._lock:
            tree = self._trees.get(snap.id)
        if tree is None:
            try:
                entries = self.vault.files(snap)
            except SnapshotNotFoundError as exc:  # forgotten since it was looked up
                raise _forgotten(exc) from exc
            tree = _following_file_links({e.path: e for e in entries})
            with self._lock:
                self._trees[snap.id] = tree
        return tree

    @staticmethod
    def _info(name: str, entry: FileEntry) -> dict[str, Any]:
        kind = {"file": "file", "dir": "directory"}.get(entry.type, "other")
        info: dict[str, Any] = {"name": name, "size": entry.size if entry.type == "file" else 0, "type": kind}
        info.update(mode=entry.mode, mtime=entry.mtime_ns / 1e9, blake3=entry.blake3, target=entry.target)
        return info

    # ---- the fsspec interface ----------------------------------------------------------------

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        _refuse_a_selection_per_call(kwargs)
        stripped = self._strip_protocol(path)
        if not stripped:
            out: list[dict[str, Any]] = [
                {"name": s.id, "size": 0, "type": "directory", "time": s.time.isoformat(), "tags": s.tags}
                for s in self.vault.snapshots(self.tags, hosts=self.hosts)
            ]
        else:
            spec = stripped.partition("/")[0]
            snap, inner = self._resolve(stripped)
            tree = self._tree(snap)
            match = tree.get(inner)
            if match is not None and match.type != "dir":
                return [self._info(f"{spec}/{inner}", match)] if detail else [f"{spec}/{inner}"]
            prefix = inner + "/" if inner else ""
            out = [
                self._info(f"{spec}/{path}", e)
                for path, e in tree.items()
                if path.startswith(prefix) and "/" not in path[len(prefix) :] and e.type != "symlink"
            ]
            if not out and match is None and inner:
                raise FileNotFoundError(f"ckptvault://{stripped}")
        return out if detail else [o["name"] for o in out]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        _refuse_a_selection_per_call(kwargs)
        stripped = self._strip_protocol(path)
        if not stripped:
            return {"name": "", "size": 0, "type": "directory"}
        spec = stripped.partition("/")[0]
        snap, inner = self._resolve(stripped)
        if not inner:
            return {"name": spec, "size": 0, "type": "directory", "id": snap.id}
        match = self._tree(snap).get(inner)
        if match is None:
            raise FileNotFoundError(f"ckptvault://{stripped}")
        return self._info(f"{spec}/{inner}", match)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True, **kwargs: Any):
        if mode != "rb":
            raise PermissionError(f"ckptvault:// is read-only; cannot open {path} with mode {mode!r}")
        _refuse_a_selection_per_call(kwargs)
        snap, inner = self._resolve(path)
        entry = self._tree(snap).get(inner)
        try:
            return self.vault.open_file(snap, entry.path if entry else inner, cache_chunks=self.cache_chunks)
        except PathNotInSnapshotError as exc:
            raise FileNotFoundError(f"ckptvault://{self._strip_protocol(path)}: {exc}") from exc
        except SnapshotNotFoundError as exc:
            raise _forgotten(exc) from exc

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        _refuse_a_selection_per_call(kwargs)
        with self._open(path) as f:
            assert isinstance(f, SnapshotFile)
            size = f.size
            lo = 0 if start is None else (start if start >= 0 else max(0, size + start))
            hi = size if end is None else (end if end >= 0 else max(0, size + end))
            f.seek(lo)
            return f.read(max(0, hi - lo))


_SELECTIONS = ("tags", "hosts", "tag", "host")


def _refuse_a_selection_per_call(kwargs: dict[str, Any]) -> None:
    """A selection given to one call (``fs.info("latest", tags=...)``) would be dropped by fsspec's
    per-call ``**kwargs`` and ``latest`` taken from every run: it belongs to the filesystem."""
    given = [key for key in _SELECTIONS if key in kwargs]
    if given:
        raise UsageError(
            f"ckptvault:// selects snapshots when the filesystem is made, not per call ({given[0]}= given to a "
            "call): fsspec.filesystem('ckptvault', repo=..., tags={'run': 'x'}, hosts=['nodeB']), or the same "
            "to fsspec.open"
        )


def _forgotten(exc: SnapshotNotFoundError) -> FileNotFoundError:
    """A snapshot forgotten since this filesystem looked it up (``latest`` of an hour ago)."""
    return FileNotFoundError(f"{exc}; call invalidate_cache() on the ckptvault filesystem to look snapshots up again")


MAX_LINK_HOPS = 8


def _following_file_links(tree: dict[str, FileEntry]) -> dict[str, FileEntry]:
    """``tree`` with each symlink that leads, within the snapshot, to a file replaced by that file's
    entry (a link to a folder, out of the snapshot, or dangling stays a link)."""
    out = dict(tree)
    for path, entry in tree.items():
        hops, seen = entry, 0
        while hops.type == "symlink" and hops.target and seen < MAX_LINK_HOPS:
            target = posixpath.normpath(posixpath.join(posixpath.dirname(hops.path), hops.target))
            if hops.target.startswith("/") or target.startswith("../") or target not in tree:
                break
            hops, seen = tree[target], seen + 1
        if entry.type == "symlink" and hops.type == "file":
            out[path] = hops
    return out
