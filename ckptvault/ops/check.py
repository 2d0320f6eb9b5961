"""``check``: verify the repository's structure and, optionally, every stored byte.

Damage is collected, not thrown: the report lists each damaged object and every snapshot
and file it affects, so a user knows what is lost and what still restores. An object the storage
refuses to hand over (access denied, an I/O error, an archived storage class) is not damage: it is
reported as unreadable, with the snapshots and files that cannot be checked or restored until it
can be read, and never with the advice to forget them. A delta chunk (codec 3)
is only as good as its base: a missing or damaged base is reported naming both chunks, and the
files of every chunk that needs it are affected.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

from ..blob import Kind
from ..errors import (
    CkptVaultError,
    IntegrityError,
    ObjectNotFoundError,
    ShortReadError,
    StorageError,
    UnsupportedFormatError,
    check_command,
    forget_command,
    prune_command,
    repair_index_command,
    spelled,
)
from ..repository import Repository
from ..repository.format import INDEX_PREFIX, id_from_key
from ..repository.index import decode_index
from ..repository.pack import PackEntry, lies_whole_in, read_pack_header
from ..repository.repository import INDEX_RELISTS
from ..snapshot.manifest import decode_snapshot, decode_tree
from ..snapshot.model import FileEntry, Snapshot
from ..store.failures import object_fault, unreachable
from ..units import counted, format_bytes
from .gc import STALE_TEMP_AGE_S
from .memory import read_few_at_a_time


@dataclass(frozen=True)
class Problem:
    object: str  # what is damaged, e.g. "pack 51d2c0a1b2c3"
    detail: str
    newer: bool = False  # not damage: written by a newer ckptvault, which this one cannot read
    unreadable: bool = False  # not damage: the storage refused to hand it over
    failing: bool = False  # unreadable, a pack the storage answers for but fails on every attempt (object_fault)


@dataclass
class CheckReport:
    """What ``Vault.check`` found (``check --json`` prints these fields, plus ``ok``).

    - ``problems``: each damaged or unreadable object, with what was found and what to do (``Problem``).
    - ``warnings``: what is no damage but worth knowing (packs in no index, old temporary files, chunks damaged
      only on their way here).
    - ``affected``: snapshot ID -> its files that cannot be restored as they are (``["*"]``: the whole snapshot).
    - ``unavailable``: snapshot ID -> its files in objects the storage will not hand over (not damage).
    - ``written_wrong``: snapshot ID -> files whose size in the tree disagrees with their chunks and whose chunks
      read back whole at the index's lengths: the tree was written wrong (no backup mends it).
    - ``sizes_unknown``: such a disagreement was found in a file whose chunks were not read (no ``read_data``),
      so which side is wrong is not known.
    - ``damaged_index``: an index object is damaged (``repair-index`` may bring back what looks lost).
    - ``needs_repair_index``: a pack is gone or a chunk reads back damaged: ``repair-index`` (with
      ``--read-data`` for damaged chunks) before a backup can store those chunks again.
    - ``snapshots``, ``packs``, ``chunks``: what was checked; ``packs_read``, ``chunks_read``: what was read with
      ``read_data``; ``damaged_chunks``: chunks that read back damaged.
    """

    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    affected: dict[str, list[str]] = field(default_factory=dict)  # snapshot ID -> damaged files ("*" = all)
    unavailable: dict[str, list[str]] = field(default_factory=dict)  # ... -> files in objects that cannot be read
    snapshots: int = 0
    packs: int = 0
    damaged_index: bool = False  # an index object is damaged: repair-index may bring back what looks lost
    chunks: int = 0
    packs_read: int = 0
    chunks_read: int = 0
    damaged_chunks: int = 0  # chunks that read back damaged (repair-index --read-data finds them)
    # what only repair-index mends before a backup can store the chunks again (a pack gone, a damaged chunk: the
    # index still names them, and backups reuse them); a cut pack and a chunk in no index need the backup alone
    needs_repair_index: bool = False
    # files whose size in the tree disagrees with their chunks' in the index: a restore of their snapshot is
    # refused whole (its other files restore with --include). Those whose chunks read back whole at the index's
    # lengths have a tree written wrong, which no backup mends; where nothing tells which is wrong, sizes_unknown
    written_wrong: dict[str, list[str]] = field(default_factory=dict)
    sizes_unknown: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def counts(self) -> str:
        read = f", read {counted(self.chunks_read, 'chunk')} in {counted(self.packs_read, 'pack')}"
        counts = [counted(self.snapshots, "snapshot"), counted(self.packs, "pack"), counted(self.chunks, "chunk")]
        return ", ".join(counts) + (read if self.packs_read else "")

    def error(self, url: str) -> CkptVaultError | None:
        """The one error that sums up what was found (None: nothing), with what to do first: a
        ``check`` that found problems raises it; in Python, ``raise report.error(vault.url)``."""
        if self.ok:
            return None
        counts = self.counts()
        if all(p.newer for p in self.problems):
            return UnsupportedFormatError(
                f"check found {len(self.problems)} object(s) written by a newer ckptvault, which this one cannot "
                f"read or check ({counts}); upgrade ckptvault, then check again"
            )
        unreadable = sum(p.unreadable for p in self.problems)
        failing = sum(p.failing for p in self.problems)
        refused = (
            f"{unreadable - failing} object(s) could not be read (access denied, an I/O error, an archived storage "
            "class: not damage; fix the access)"
        )
        fails = (
            f"{failing} pack(s) the storage fails on every attempt (a server error: damaged "
            f"where stored, or a fault that passes; if it persists, {repair_index_command(drop_failing=True)} drops "
            "them, so that the next backup stores their chunks again)"
        )
        unread = ", ".join(([refused] if unreadable > failing else []) + ([fails] if failing else [])) + (
            f", which leaves {len(self.unavailable)} snapshot(s) unchecked; check again once they can be read"
        )
        if unreadable == len(self.problems):  # nothing found damaged: forgetting anything would be wrong
            return StorageError("CHECK", "", url, "unreadable objects", message=f"check: {unread} ({counts})")
        remedy = ""
        if self.affected and self.damaged_index:  # what looks lost may be named by the damaged object
            remedy = (
                f"; run {repair_index_command()} first (it indexes again what the damaged index object(s) named, where "
                "the packs still say or verify it), then check again before forgetting anything"
            )
        elif self.affected and self.sizes_unknown:  # a backup mends a wrong index entry, never a wrong tree
            remedy = (
                f"; run {check_command(read_data=True)} first (reading the chunks of a file whose sizes disagree "
                "tells whether its tree or the index is wrong), then follow its advice before forgetting anything"
            )
        elif self.affected:
            # Healing first: the same bytes backed up again make every snapshot that needs them whole. Only
            # what cannot be had again makes the snapshots go (prune refuses while they need missing data).
            whole = all(files == ["*"] for files in self.affected.values())  # a tree lost: nothing brings it back
            repair = repair_index_command(read_data=bool(self.damaged_chunks))  # a missing pack needs no full read
            mend = (
                f"{repair} and a new backup of them store" if self.needs_repair_index else "a new backup of them stores"
            )
            mendable = any(
                files != ["*"] and set(files) - set(self.written_wrong.get(snapshot_id, ()))
                for snapshot_id, files in self.affected.items()
            )
            heal = (
                "; "
                if not mendable
                else f"; where the files named are still on disk, {mend} those chunks again and the snapshots "
                "restore again; otherwise "
            )
            salvage = "" if whole else "restore the files not named (restore --include), then "
            if len(self.affected) <= LISTED_IN_REMEDY:  # every one: the remedy is a command
                ids = [snapshot_id[:8] for snapshot_id in self.affected]
                remedy = f"{heal}{salvage}remove the damaged snapshot(s) with: {forget_command(ids)}"
            else:  # hundreds of IDs make an unreadable line, and a command that forgets history unread
                remedy = (
                    f"{heal}{salvage}remove the damaged snapshots named above ('affects snapshot'; "
                    + spelled('`check --json` lists them under "affected"', "the report's affected lists them")
                    + f") with {forget_command()}, after reading which they are"
                )
        elif self.problems:
            remedy = (
                "; no snapshot is affected: each still restores (every chunk they need is stored whole), though "
                "lines may name one; follow the hint on each line"
            )
        error = IntegrityError(
            f"check found {len(self.problems) - unreadable} problem(s) affecting {len(self.affected)} snapshot(s) "
            f"({counts}){remedy}" + (f"; {unread}" if unreadable else "")
        )
        error.wants_read_data_hint = False  # the remedy above, or each line's hint, is the way on
        return error


LISTED_IN_REMEDY = 10  # more damaged snapshots than this are named in a check's lines, not in its error


def _short(b: bytes) -> str:
    return b.hex()[:12]


def _unreadable(exc: BaseException) -> bool:
    """A read the storage refused or failed (access denied, EIO, a timeout): the object may be whole.
    A missing object and one shorter than its index says are damage."""
    return isinstance(exc, StorageError) and not isinstance(exc, (ObjectNotFoundError, ShortReadError))


def _missing(exc: ObjectNotFoundError) -> str:
    """A snapshot's tree (or snapshot) object that is gone, said for check's own report: the error's
    "run: ckptvault check" sent the user to the command that printed it (the summary says what to do)."""
    folder, _, object_id = exc.key.rpartition("/")
    what = {"trees": "tree object", "snapshots": "snapshot object"}.get(folder, "object")
    return (
        f"{what} {object_id[:12]} is missing ({exc.key}); a copy of the vault that still holds it can put it back, "
        "which makes the snapshot whole again"
    )


class _Checker:
    def __init__(self, repo: Repository, report: CheckReport) -> None:
        self.repo = repo
        self.report = report
        self.bad_chunks: set[bytes] = set()
        self.unread_chunks: set[bytes] = set()  # every whole copy is in a pack that could not be read
        self.unread_packs: set[bytes] = set()
        self.intact: set[bytes] = set()  # chunks read back whole (--read-data)
        self.copies: dict[bytes, set[bytes]] = {}  # chunk -> the stored packs holding a whole copy of it
        self.indexed: dict[bytes, list[PackEntry]] = {}
        self.bases: dict[bytes, set[bytes]] = {}  # delta chunk -> the bases its stored copies name
        self.reported: set[bytes] = set()  # chunks already named in a problem
        self.bad_headers: set[bytes] = set()  # packs whose header problem is reported
        self.header_only: dict[bytes, bytes] = {}  # chunk -> the pack in no index whose header names it
        self.unreadable_index = False  # an index object could not be read: packs may be in no index
        self.damaged_index = False  # ... because it is damaged (not newer than this ckptvault)
        # deltas whose base is in no index: (object, detail, deltas), judged once the snapshots' chunks are
        # known (``judge_lost_bases``): what no snapshot needs is a leftover, not damage
        self.lost_bases: list[tuple[str, str, list[bytes]]] = []
        self.lost_bases_at = 0  # where in the problems they go

    def problem(
        self, obj: str, detail: str, *, newer: bool = False, unreadable: bool = False, failing: bool = False
    ) -> None:
        self.report.problems.append(Problem(obj, detail, newer, unreadable, failing))

    def unreadable_pack(self, pack_id: bytes, exc: BaseException) -> None:
        self.unread_packs.add(pack_id)
        if not object_fault(exc):
            self.problem(f"pack {_short(pack_id)}", f"cannot be read: {exc}", unreadable=True)
            return
        detail = (
            f"cannot be read: {exc}; the storage answers, but fails this object on every attempt: it may be damaged "
            f"where it is stored. If that persists, {repair_index_command(read_data=True, drop_failing=True)} drops it "
            "from the index, so that the next backup of the files holding its chunks stores them again"
        )
        self.problem(f"pack {_short(pack_id)}", detail, unreadable=True, failing=True)

    def newer_chunk(self, chunk_id: bytes, pack: str, exc: UnsupportedFormatError) -> None:
        """A chunk coded by a newer ckptvault, which reads it: no damage, so its snapshots are not to be
        forgotten and repair-index --read-data keeps it (check called it damage and advised both)."""
        if chunk_id not in self.reported:
            self.reported.add(chunk_id)
            self.problem(f"chunk {_short(chunk_id)}", f"in {pack} {exc}", newer=True)

    def check_index(self) -> None:
        for index_id, packs, exc in self._read_index_objects():
            if exc is not None:
                damaged = isinstance(exc, IntegrityError)
                self.problem(
                    f"index {_short(index_id)}",
                    f"{exc}; run: {repair_index_command()}" if damaged else str(exc),
                    newer=isinstance(exc, UnsupportedFormatError),
                )
                self.unreadable_index = True
                self.damaged_index = self.damaged_index or damaged
                self.report.damaged_index = self.damaged_index
                continue
            for pack_id, entries in packs.items():
                self.indexed.setdefault(pack_id, entries)

    def _read_index_objects(self) -> list[tuple[bytes, dict[bytes, list[PackEntry]], CkptVaultError | None]]:
        """Every listed index object, read from the store: (ID, packs, None), or (ID, {}, the error).
        A backup's compaction (or a prune seen by a lockless check) replaces objects while check reads:
        a listed object that is gone and no longer listed means listing again (what replaced it was
        written first), not damage."""
        relists = INDEX_RELISTS
        while True:
            out: list[tuple[bytes, dict[bytes, list[PackEntry]], CkptVaultError | None]] = []
            replaced = False
            for info in self.repo.store.list(INDEX_PREFIX):
                index_id = id_from_key(info.key)
                if index_id is None:
                    continue
                try:
                    raw = self.repo.store.get(info.key)
                    out.append((index_id, decode_index(self.repo.codec.decode(Kind.INDEX, index_id, raw)), None))
                except ObjectNotFoundError as exc:
                    if relists and index_id not in self.repo.list_index_sizes():
                        replaced = True
                        break
                    out.append((index_id, {}, exc))
                except (IntegrityError, UnsupportedFormatError) as exc:
                    out.append((index_id, {}, exc))
            if not replaced:
                return out
            relists -= 1

    def check_delta_bases(self) -> None:
        """Every delta's base must be somewhere: in the index, or in a pack read by its header."""
        chunk_ids = {e.chunk_id for entries in self.indexed.values() for e in entries}
        self.report.chunks = len(chunk_ids)
        self.lost_bases_at = len(self.report.problems)
        based_in: dict[bytes, list[bytes]] = {}  # pack in no index -> deltas whose base it holds
        for entries in self.indexed.values():
            for e in entries:
                if e.base_id is None:
                    continue
                self.bases.setdefault(e.chunk_id, set()).add(e.base_id)
                if e.base_id not in chunk_ids and e.base_id in self.header_only:
                    based_in.setdefault(self.header_only[e.base_id], []).append(e.chunk_id)
                elif e.base_id not in chunk_ids:
                    self.lost_bases.append(
                        (
                            f"chunk {_short(e.chunk_id)}",
                            f"is stored as a delta against chunk {_short(e.base_id)}, which is in no index; the next "
                            "prune drops it from the index",
                            [e.chunk_id],
                        )
                    )
                    self.bad_chunks.add(e.chunk_id)
                    self.reported.add(e.chunk_id)
        for pack_id, deltas in based_in.items():  # one line per pack: a lost index object names thousands
            self.lost_bases.append(
                (
                    f"pack {_short(pack_id)}",
                    f"is in no index and holds the bases of {len(deltas)} delta chunk(s) (e.g. {_short(deltas[0])}; "
                    "readers find them there)",
                    deltas,
                )
            )

    def _with_bases(self, chunks: set[bytes]) -> set[bytes]:
        """``chunks`` and every chunk they are stored as deltas against, at any depth."""
        needed, todo = set(chunks), list(chunks)
        while todo:
            for base in self.bases.get(todo.pop(), ()):
                if base not in needed:
                    needed.add(base)
                    todo.append(base)
        return needed

    def judge_lost_bases(self, needed: set[bytes] | None) -> None:
        """``needed``: every chunk the checked snapshots read, deltas' bases included (None: a snapshot
        could not be read, so that is not known). A delta no snapshot needs whose base is in no index is
        what a prune killed while it removed index objects or packs leaves (the dead delta's old index
        object outlived its base's): a warning, which the next prune clears, not damage."""
        damage = []
        for obj, detail, deltas in self.lost_bases:
            if needed is None or needed.intersection(deltas):
                fix = (
                    f"run: {repair_index_command()}"
                    if obj.startswith("pack")
                    else "a snapshot that needs it is named here; a backup of its file stores it again"
                )
                self.report.needs_repair_index |= obj.startswith("pack")
                damage.append(Problem(obj, f"{detail}; {fix}"))
            else:
                self.report.warnings.append(
                    f"{obj} {detail}; no snapshot needs it (what an interrupted prune leaves): the next prune "
                    "removes it"
                )
        self.report.problems[self.lost_bases_at : self.lost_bases_at] = damage  # where they were found

    def check_packs(self) -> None:
        stored = self.repo.list_packs()
        self.report.packs = len(stored)
        self._check_indexed_packs(stored)
        self._read_unindexed_headers(stored)

    def _check_indexed_packs(self, stored: dict[bytes, int]) -> None:
        """Every pack the index names: there, long enough for its chunks, its header readable and agreeing."""
        # a chunk with a whole copy in a stored pack is not lost with another copy's pack (readers fall back)
        for pack_id, entries in self.indexed.items():
            for e in entries:
                if pack_id in stored and lies_whole_in(e.offset, e.stored_len, stored[pack_id]):
                    self.copies.setdefault(e.chunk_id, set()).add(pack_id)
        held = set(self.copies)
        gone_but_held = []
        for pack_id, entries in self.indexed.items():
            if not entries:
                continue  # repair-index dropped every chunk (damaged, or the storage fails it): prune removes it
            name = f"pack {_short(pack_id)}"
            size = stored.get(pack_id)
            if size is None and all(e.chunk_id in held for e in entries):
                gone_but_held.append(pack_id)  # nothing is lost (a repair-index killed once it removed a pack it
                continue  # had copied leaves this): not damage
            if size is None:
                self.problem(
                    name, f"is missing (listed in the index); {repair_index_command()} drops it from the index"
                )
                self.report.needs_repair_index = True
                self.bad_chunks.update(e.chunk_id for e in entries if e.chunk_id not in held)
                continue
            if size > self.repo.max_pack_size:
                self.problem(
                    name,
                    f"is damaged: {self.repo.oversized_pack(size)}; its chunks are read one by one, and "
                    f"{repair_index_command(read_data=True)} copies those that verify into a new pack and removes it",
                )
                self.report.needs_repair_index = True
            cut = [e.chunk_id for e in entries if not lies_whole_in(e.offset, e.stored_len, size)]
            try:
                header = self.repo.read_pack_header(pack_id, size)
            except CkptVaultError as exc:
                self._stop_if_down(exc)
                header = None
                if _unreadable(exc):
                    self.unreadable_pack(pack_id, exc)
                    continue
                self.bad_headers.add(pack_id)
                if not cut:  # a pack cut short lost its header with its end: the advice below is the one that helps
                    self.problem(
                        name,
                        f"header is damaged: {exc}; its chunks are found through the index while it names them: "
                        f"{repair_index_command(read_data=True)} copies them into a new pack and removes this one",
                    )
            if cut:
                lost = [c for c in cut if c not in held]
                then = (
                    f"a backup of the files holding them stores them again; then {prune_command()} copies out its "
                    "whole chunks and removes it"
                    if lost
                    else f"other packs hold them: {prune_command()} copies out its whole chunks and removes it"
                )
                self.problem(name, f"is shorter than the index says: {len(cut)} chunk(s) lie past its end; {then}")
                self.bad_chunks.update(lost)
            # the index may leave out chunks the header lists (repair-index --read-data drops damaged ones)
            if header is not None and not set(entries) <= set(header):
                self.problem(name, "header and index disagree about its chunks")
        if gone_but_held:
            self.report.warnings.append(
                f"{len(gone_but_held)} pack(s) the index names are gone (e.g. {_short(min(gone_but_held))}), but "
                "every chunk of theirs is whole in another pack, so nothing is lost (an interrupted repair-index "
                f"leaves this); {repair_index_command()} drops them from the index"
            )

    def _read_unindexed_headers(self, stored: dict[bytes, int]) -> None:
        unindexed = [p for p in stored if p not in self.indexed]
        headless = 0
        # Their own headers say what they hold: leftovers of a killed backup or prune, or what a lost
        # or unreadable index object described (a snapshot that needs them is recoverable, not lost).
        for pack_id in unindexed:
            try:
                entries = self.repo.read_pack_header(pack_id, stored[pack_id])
            except CkptVaultError as exc:
                self._stop_if_down(exc)
                if self.unreadable_index:
                    self.problem(f"pack {_short(pack_id)}", f"is in no readable index and its header is damaged: {exc}")
                headless += 1
                continue
            if self.unreadable_index:  # readers take them from their headers too (Repository.load_index)
                self.indexed[pack_id] = entries
            else:
                self.header_only.update({e.chunk_id: pack_id for e in entries})
        if unindexed and self.unreadable_index:
            then = (
                f"{repair_index_command()} indexes them again (prune refuses until then)"
                if self.damaged_index
                else "an index object is newer than this ckptvault reads: upgrade ckptvault"
            )
            self.report.warnings.append(
                f"{len(unindexed)} pack(s) are in no readable index; they were checked by their own headers, and {then}"
            )
        elif unindexed:
            self.report.warnings.append(
                f"{len(unindexed)} pack(s) are in no index (uploaded by a backup running now, left by an interrupted "
                f"backup or prune, or an index object is gone); once no backup runs, {repair_index_command()} indexes "
                "them again, prune removes the ones no snapshot needs"
                + (
                    f" ({headless} of them with a damaged header: nothing can name their chunks, and prune removes "
                    "them; a snapshot that needed one is named above)"
                    if headless
                    else ""
                )
            )

    def read_data(self, fraction: float, seed: int | None) -> None:
        # a pack whose header could not be read is named already: reading it whole would wait out the retries again
        stored = self.repo.list_packs()
        pack_ids = sorted(
            p for p, entries in self.indexed.items() if entries and p in stored and p not in self.unread_packs
        )
        if fraction < 1.0:
            rng = random.Random(seed)
            pack_ids = rng.sample(pack_ids, max(1, round(len(pack_ids) * fraction))) if pack_ids else []
        intact: set[bytes] = set()
        reread = 0  # chunks and headers that failed in the pack's read and verified on a read of their own
        for pack_id in pack_ids:
            name = f"pack {_short(pack_id)}"
            # one too big to be a pack (named by the structure check) is not read whole: chunk by chunk
            whole = stored[pack_id] <= self.repo.max_pack_size
            data = b""
            try:
                if whole:
                    data = self.repo.read_pack(pack_id, stored[pack_id])
            except CkptVaultError as exc:
                self._stop_if_down(exc)
                if _unreadable(exc):
                    self.unreadable_pack(pack_id, exc)
                else:
                    self.problem(name, f"cannot be read: {exc}")
                continue
            self.report.packs_read += 1
            try:
                if whole:
                    read_pack_header(self.repo.codec, pack_id, data)
            except CkptVaultError as exc:
                if self.repo.header_reads_back(pack_id, len(data)):
                    reread += 1
                elif pack_id not in self.bad_headers:  # the structure check may have named it already
                    self.problem(name, f"header is damaged: {exc}")
            for e in self.indexed[pack_id]:
                try:
                    blob = data[e.offset : e.offset + e.stored_len] if whole else self.repo.read_pack_blob(pack_id, e)
                    self.repo.decode_chunk(e.chunk_id, blob, e.raw_len, e.base_id)  # through its base
                    intact.add(e.chunk_id)
                except UnsupportedFormatError as exc:  # a newer ckptvault's codec (here or in its base): no damage
                    self.newer_chunk(e.chunk_id, name, exc)
                except CkptVaultError as exc:
                    self._stop_if_down(exc)
                    if not whole and _unreadable(exc):  # the storage failed the read, as for a whole pack
                        self.unreadable_pack(pack_id, exc)
                        break
                    if self.repo.reads_back(pack_id, e):  # the read was damaged on its way, not the pack
                        reread += 1
                        intact.add(e.chunk_id)
                    elif e.chunk_id not in self.reported:
                        self.problem(
                            f"chunk {_short(e.chunk_id)}",
                            f"in {name} {exc}; while it stays indexed, backups reuse it: "
                            f"{repair_index_command(read_data=True)} drops it, and the next backup of its file stores "
                            "it again",
                        )
                        self.report.damaged_chunks += 1
                        self.report.needs_repair_index = True
                    self.bad_chunks.add(e.chunk_id)
                    self.reported.add(e.chunk_id)
                self.report.chunks_read += 1
        self.bad_chunks -= intact  # a damaged copy loses nothing where another copy reads back whole
        self.intact = intact
        if reread:
            self.report.warnings.append(
                f"{reread} chunk(s) or pack header(s) failed verification as read and verified when read again: "
                "reads damaged on their way (a flaky network link, a proxy, this machine's memory), not the "
                "stored bytes; if this recurs, look at that path"
            )

    def spread_to_deltas(self) -> None:
        """Every delta whose base (at any depth) is bad is bad too, named with its base."""
        changed = True
        while changed:
            changed = False
            for chunk_id, bases in self.bases.items():
                bad_base = next((b for b in sorted(bases) if b in self.bad_chunks), None)
                if chunk_id in self.bad_chunks or bad_base is None:
                    continue
                self.bad_chunks.add(chunk_id)
                changed = True
                if chunk_id not in self.reported:
                    self.reported.add(chunk_id)
                    self.problem(
                        f"chunk {_short(chunk_id)}",
                        f"is stored as a delta against chunk {_short(bad_base)}, which is missing or damaged",
                    )
        self.unread_chunks = {
            c for c, packs in self.copies.items() if packs <= self.unread_packs and c not in self.intact
        }
        while True:  # and a delta whose base cannot be read cannot be read either
            more = {c for c, bases in self.bases.items() if c not in self.unread_chunks and bases & self.unread_chunks}
            if not more:
                break
            self.unread_chunks |= more

    def _snapshots_and_trees(
        self, snapshot_ids: list[bytes]
    ) -> Iterator[tuple[bytes, tuple[Snapshot, list[FileEntry]] | CkptVaultError]]:
        """Each snapshot object and its tree (``read_few_at_a_time``), or what reading it raised."""

        def load(snapshot_id: bytes) -> tuple[Snapshot, list[FileEntry]] | CkptVaultError:
            try:
                snap = decode_snapshot(self.repo.load_snapshot(snapshot_id))
                return snap, decode_tree(self.repo.load_tree(bytes.fromhex(snap.tree_id)))
            except CkptVaultError as exc:
                return exc

        return read_few_at_a_time(self.repo, load, snapshot_ids)

    def _stop_if_down(self, exc: BaseException) -> None:
        """Raise ``exc`` when the storage does not answer at all (a frozen or unreachable server): that stops
        the check (``run_check`` says so). Going on, every other object was tried in turn, each waiting out its
        whole deadline (~1 minute a pack by default: hours for a big vault), and the end said "could not be read
        (access denied ...): fix the access" of a server that was down. One object whose reads are cut while
        the storage answers is named unreadable, and the check goes on."""
        if self.repo.storage_down(exc):
            raise exc

    def _sizes_disagree(self, name: str, snapshot_id: str, entry: FileEntry, held: int) -> None:
        """``entry``'s size in its tree is not the ``held`` bytes the index gives its chunks: the tree or an index
        entry is wrong, which only reading the chunks tells (a chunk decodes to the length its entry gives, or
        fails to verify)."""
        damaged = next((c for c in entry.chunks if c in self.bad_chunks), None)
        if damaged is not None:
            known = (
                f"chunk {_short(damaged)} of it read back damaged at the length the index gives it (above), so that "
                "index entry is likely what is wrong: stored again as that line says, the sizes agree if so"
            )
        elif set(entry.chunks) <= self.intact:
            known = "its chunks read back whole at those lengths, so the tree was written wrong, which no backup mends"
            self.report.written_wrong.setdefault(snapshot_id, []).append(entry.path)
        else:
            known = f"which of the two is wrong is not known until its chunks are read: run {check_command(True)}"
            self.report.sizes_unknown = True
        self.problem(
            name,
            f"file {entry.path}: the tree says {entry.size} bytes but the index gives its chunks {held}; {known}; "
            "while they disagree a restore of the snapshot is refused whole (nothing is written), and its other "
            "files restore with restore --include leaving this one out",
        )

    def check_snapshots(self, snapshot_ids: list[bytes]) -> None:
        """``snapshot_ids``: listed before the index objects were (see ``run_check``)."""
        self.spread_to_deltas()
        # chunk -> its raw length, as the index says: a restore sums them against the size the tree gives a file
        chunk_ids = {e.chunk_id: e.raw_len for entries in self.indexed.values() for e in entries}
        taken: dict[str, datetime] = {}  # the affected are listed oldest first, as `snapshots` lists them
        needed: set[bytes] | None = set()  # every chunk a snapshot reads (None once a tree could not be read)
        for snapshot_id, loaded in self._snapshots_and_trees(snapshot_ids):
            name = f"snapshot {_short(snapshot_id)}"
            if isinstance(loaded, CkptVaultError):
                exc = loaded
                self._stop_if_down(exc)
                if isinstance(exc, ObjectNotFoundError) and snapshot_id not in self.repo.list_snapshot_ids():
                    continue  # forgotten meanwhile (forget deletes the snapshot before its tree): not damage
                self.report.snapshots += 1
                needed = None
                if isinstance(exc, UnsupportedFormatError):  # not damage: it may be readable by a newer ckptvault
                    self.problem(name, str(exc), newer=True)
                    continue
                if _unreadable(exc):
                    self.problem(name, f"cannot be read: {exc}", unreadable=True)
                    self.report.unavailable[snapshot_id.hex()] = ["*"]
                    continue
                self.problem(name, _missing(exc) if isinstance(exc, ObjectNotFoundError) else str(exc))
                self.report.affected[snapshot_id.hex()] = ["*"]
                continue
            snap, tree = loaded
            self.report.snapshots += 1
            taken[snap.id] = snap.time
            if needed is not None:
                needed.update(c for entry in tree for c in entry.chunks)
            for entry in tree:
                sizes_disagree = False
                missing = [c for c in entry.chunks if c not in chunk_ids]
                lost = [c for c in missing if c not in self.header_only]
                if lost:
                    self.problem(name, f"file {entry.path}: chunk {_short(lost[0])} is in no index")
                elif missing:
                    self.problem(
                        name,
                        f"file {entry.path}: chunk {_short(missing[0])} is in no index, but pack "
                        f"{_short(self.header_only[missing[0]])} holds it (the snapshot still restores); run: "
                        f"{repair_index_command()}",
                    )
                elif entry.type == "file" and (held := sum(chunk_ids[c] for c in entry.chunks)) != entry.size:
                    # a restore refuses the snapshot for it (exit 30) and sent the user here, where nothing was said
                    self._sizes_disagree(name, snap.id, entry, held)
                    sizes_disagree = True
                if lost or sizes_disagree or any(c in self.bad_chunks for c in entry.chunks):
                    self.report.affected.setdefault(snap.id, []).append(entry.path)
                elif any(c in self.unread_chunks for c in entry.chunks):
                    self.report.unavailable.setdefault(snap.id, []).append(entry.path)
        self.judge_lost_bases(None if needed is None else self._with_bases(needed))
        for listing in (self.report.affected, self.report.unavailable):  # those that could not be read last
            ordered = sorted(listing.items(), key=lambda item: (item[0] not in taken, taken.get(item[0]), item[0]))
            listing.clear()
            listing.update(ordered)


# A temp file this old is no write in flight (a pack's upload is given up after ~2 minutes): check names it
TEMP_FILE_LEFT_S = 600.0


def run_check(repo: Repository, *, read_data: float = 0.0, seed: int | None = None) -> CheckReport:
    """``read_data``: the fraction of packs to read and verify chunk by chunk (0 = structure only)."""
    report = CheckReport()
    checker = _Checker(repo, report)
    try:
        # Snapshots are listed before the index objects: a backup writes its index objects before its
        # snapshot, so every snapshot listed here has its chunks in the index objects listed next, even
        # when a backup commits while check runs (both hold shared locks). Later snapshots are not checked.
        snapshot_ids = repo.list_snapshot_ids()
        checker.check_index()
        checker.check_packs()
        checker.check_delta_bases()
        if read_data > 0:
            checker.read_data(read_data, seed)
        checker.check_snapshots(snapshot_ids)
    except StorageError as exc:
        if not unreachable(exc):
            raise
        raise _stopped(exc, report) from exc
    # an encrypted object read under a config that says "none" was counted as damage above: it is
    # not, the config was altered, and that is the one thing to say
    repo.codec.refuse_if_downgraded()
    _say_temp_files(repo, report)
    return report


def _stopped(exc: StorageError, report: CheckReport) -> StorageError:
    """The storage stopped answering mid-check: what happened, what was found by then, what to do."""
    damage = sum(not (p.unreadable or p.newer) for p in report.problems)
    found = (
        f"{damage} problem(s) were found before it stopped (the next check lists them)"
        if damage
        else "nothing it read by then was damaged"
    )
    return exc.said_as(
        f"check stopped before it finished, the storage does not answer: {exc}; {found}; run the check again once "
        "the storage answers",
        op="CHECK",
    )


def _say_temp_files(repo: Repository, report: CheckReport) -> None:
    """Temp files of writes (local disks, SFTP) are no damage, but a killed command's stay until a prune
    removes them an hour on, and check said nothing of them (audit cr45: whole packs, index, tree and
    snapshot files after killed prunes, copies and backups)."""
    temp_files = getattr(repo.store, "temp_files", None)
    if temp_files is None:
        return
    try:
        temps = temp_files()
    except CkptVaultError:  # a listing that failed says nothing either way
        return
    left = [size for size, when in temps if when < time.time() - TEMP_FILE_LEFT_S]
    if left:
        report.warnings.append(
            f"{len(left)} temporary file(s) ({format_bytes(sum(left))}) of writes that never finished (killed "
            f"commands) are in the vault: no damage; prune removes them once they are "
            f"{round(STALE_TEMP_AGE_S / 60)} minutes old"
        )
