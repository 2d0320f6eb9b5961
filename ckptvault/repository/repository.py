"""``Repository``: chunks in packs, index objects, trees and snapshot objects on a Store.

Write order (the invariant that makes a crash harmless): a pack is uploaded completely
before any index object names it, and index objects are written before the snapshot that
needs them. A backup killed midway leaves at worst packs that nothing references yet.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from ..blob import MAX_METADATA_BLOB, BlobCodec, BlobParts, ChecksumSealer, Kind, Sealer
from ..bytegroup import Grouped, joined
from ..codec import Compressor
from ..crypto.keyfile import Keyfile, PassphraseSource, fingerprint_damaged_from, resolve_passphrase
from ..crypto.keys import MasterKey, check_verifier, make_verifier
from ..errors import (
    CkptVaultError,
    ConfigDowngradedError,
    ForeignRepositoryError,
    IntegrityError,
    KeyfileMismatchError,
    KeyfileNotFoundError,
    LockLostError,
    MalformedObjectError,
    ObjectExistsError,
    ObjectNotFoundError,
    ShortReadError,
    StorageError,
    UnsupportedFormatError,
    VaultExistsError,
    VaultNotFoundError,
    check_command,
    check_hint,
    config_from_a_copy,
    prune_command,
    repair_index_command,
    spelled,
    unused_keyfile_error,
)
from ..hashing import ChunkIdFunction
from ..store import Store
from ..store.base import ObjectInfo
from ..store.failures import object_fault, unreachable
from .cache import MetadataCache
from .config import ConfigNotJsonError, ConfigNotOursError, RepoConfig
from .format import (
    CONFIG_KEY,
    FORMAT_NAME,
    INDEX_PREFIX,
    KOPIA_FORMAT_BLOBS,
    PACKS_PREFIX,
    SETTINGS_FORMAT_VERSION,
    SNAPSHOTS_PREFIX,
    TREES_PREFIX,
    id_from_key,
    index_key,
    new_object_id,
    pack_key,
    snapshot_key,
    tree_key,
)
from .index import ChunkIndex, ChunkLocation, decode_index, encode_index
from .locks import LockManager, briefly
from .pack import (
    TRAILER,
    PackEntry,
    PackWriter,
    buffer_in_use,
    decode_header,
    header_range,
    new_pack_buffer,
    trailer_version,
)

# A backup writes an index object every this many packs; then it also picks up the index objects that
# concurrent backups wrote, so they stop uploading what the other already stored.
PACKS_PER_INDEX = 8
PACK_SLACK = 1 << 20  # room past the target size for the last blob and the header
# Readers follow chains of delta bases this deep; writers make depth 1 (ops/deltabase.py), so a
# deeper chain can only come from racing writers, and one this deep is a loop.
MAX_DELTA_DEPTH = 16
# A listed index object that is gone when read was replaced (by prune, repair-index or a backup's
# compaction, which write what replaces it first): list again, this many times at most.
INDEX_RELISTS = 4
REREADS = 2  # reads of its own a chunk that failed in a whole-pack read gets before it is called damaged
DOWNGRADE_PROBES = 3  # stored objects a plain vault's first lock may wait for (refuse_if_downgraded_before_writing)
METADATA_READERS = 8  # index, snapshot objects read at once: each a round trip on remote storage
# How often a long-lived Repository's backups list every pack (reconcile_when_due) when nothing says to
RECONCILE_EVERY_S = 600.0
CATCH_UP_EVERY_S = 1.0  # chunks in no index look for index objects written since at most this often

log = logging.getLogger("ckptvault")
damage_log = logging.getLogger("ckptvault.damage")  # damaged metadata read around: the CLI shows these
T = TypeVar("T")
R = TypeVar("R")


@contextlib.contextmanager
def _naming_errors(what: str, hint: str = "") -> Iterator[None]:
    """Errors decoding ``what`` (an object, a chunk) name it: "<what> is damaged: ..." (the same
    IntegrityError subclass, so the exit code stays) or "<what> cannot be read: ..." (too new)."""
    try:
        yield
    except IntegrityError as exc:
        raise type(exc)(f"{what} is damaged: {exc}{hint}") from exc
    except UnsupportedFormatError as exc:
        raise UnsupportedFormatError(f"{what} cannot be read: {exc}") from exc


# a chunk's plaintext, and the ID and plaintext of the delta base it was decoded against (None, None: none)
Plain = bytes | memoryview
# (the chunk, its base's ID, its base); a base read for a restore is left as its streams (``_read_copy``)
ChunkRead = tuple[Plain | Grouped, bytes | None, Plain | Grouped | None]


def _holds_vault_objects(store: Store) -> bool:
    """Whether the store holds a vault's snapshots or index (asked only when its config cannot be read)."""
    return any(store.list(prefix) for prefix in (SNAPSHOTS_PREFIX, INDEX_PREFIX))


# Folders of other backup tools' repositories that a ckptvault vault never holds, asked only where the config
# cannot be read as a vault's: restic (and rustic) keep snapshots/ and index/ of 64-hex names too, beside a
# binary config, so their repository read as a ckptvault vault whose config is damaged ("put the config back
# from a copy", exit 30); every restic repository holds at least one key in keys/
FOREIGN_MARKERS = (("keys/", "a restic repository (its keys/ folder)"),)
# borg 1.x's config is INI text opening with this section (its README beside it says so too): it read as a
# vault's config that is "not valid JSON; is this a ckptvault repository?" (exit 30)
BORG_CONFIG = b"[repository]"


# borg 2 (borgstore) keeps its settings as objects under config/ (readme, id, version, manifest), beside
# archives/, packs/ (data/ in its betas), index/ and keys/: on a disk `config` is a folder, whose read failed
# as "storage failed: GET config: IsADirectoryError" (exit 20) and which made init say "a vault already exists";
# in an object store its index/ and keys/ read as a vault that lost its config, or as restic's keys
BORG2_README = "config/readme"
BORG_README_TEXT = b"Borg Backup repository"  # what borg's own is_repository looks for in its README


def _borg2_repository(store: Store) -> ForeignRepositoryError | None:
    """The error naming a borg 2 repository (by its config/readme), or None. A vault's ``config`` is one
    object, so nothing of ours can be under config/."""
    try:
        readme = store.get(BORG2_README)
    except CkptVaultError:  # no such object (a vault, or nothing), or a file where borg's folder would be
        return None
    if BORG_README_TEXT not in readme[:200]:
        return None
    return ForeignRepositoryError(store.url, "a borg 2 repository (its config/readme)")


def _foreign_repository(store: Store) -> ForeignRepositoryError | None:
    """The error naming the other tool whose repository the store holds (by its folders), or None."""
    for prefix, what in FOREIGN_MARKERS:
        if store.list(prefix):
            return ForeignRepositoryError(store.url, what)
    return None


def _config_missing(store: Store) -> MalformedObjectError:
    return MalformedObjectError(
        f"the config of {store.url} is missing, but the vault's snapshots or index are there; {config_from_a_copy()}"
    )


def _kopia_repository(store: Store) -> ForeignRepositoryError | None:
    """kopia keeps no config but its format blob: init made a vault beside it in an object store (a local folder
    of other files is refused anyway), and every other command said "no vault; create one with: ckptvault init"."""
    for name in KOPIA_FORMAT_BLOBS:
        if store.exists(name):
            return ForeignRepositoryError(store.url, f"a kopia repository (its {name})")
    return None


def _without_config(store: Store) -> CkptVaultError:
    """What a store with no config holds: another tool's repository, a vault that lost its config, or nothing
    (VaultNotFoundError: the only case where a new vault may be made there)."""
    borg2 = _borg2_repository(store)  # first: its index/ would read as a vault's, its keys/ as restic's
    if borg2 is not None:
        return borg2
    if _holds_vault_objects(store):  # "no vault here", or "create one", would send the user elsewhere
        return _foreign_repository(store) or _config_missing(store)
    return _kopia_repository(store) or VaultNotFoundError(store.url)


def _config_not_ours(store: Store, raw: bytes, exc: MalformedObjectError) -> CkptVaultError:
    """The error for a config that is not a vault's (``exc``: not JSON, or JSON that names no ckptvault format):
    another tool's repository, another program's file, or a vault's config damaged (its objects are beside it)."""
    if raw.lstrip().startswith(BORG_CONFIG):
        return ForeignRepositoryError(store.url, "a borg repository (its config is borg's)")
    foreign = _foreign_repository(store)
    if foreign is not None:
        return foreign
    # a vault's config, damaged: the format's name is near its top (config.py writes it first); a vault with no
    # snapshot yet has nothing else to tell it by
    cut_short = isinstance(exc, ConfigNotJsonError) and _cut_short_config(raw)
    if _holds_vault_objects(store) or not raw.strip() or f'"{FORMAT_NAME}"'.encode() in raw[:200] or cut_short:
        if cut_short:
            what = f"it is cut short, its {len(raw)} bytes only the opening of a config"
        elif isinstance(exc, ConfigNotJsonError):
            what = f"it is not valid JSON ({exc.__cause__})"
        else:
            what = f"it does not name the {FORMAT_NAME} format"
        return MalformedObjectError(f"the config of {store.url} is damaged: {what}; {config_from_a_copy()}")
    return ForeignRepositoryError(store.url, "another program's file named config")


# How every vault's config opens (config.py writes the format first), its spaces and newlines left out
CONFIG_OPENING = b'{"format":"' + FORMAT_NAME.encode() + b'",'


def _cut_short_config(raw: bytes) -> bool:
    """Whether ``raw``, which is not JSON, is the start of a vault's config cut short (``{"form``): a vault
    with no snapshot yet has nothing else to tell it by, and such a config read as another program's file
    (exit 10), where it is a vault's damaged one (a full disk, a copy stopped half way). Two characters at
    least (a lone ``{`` says nothing)."""
    opening = b"".join(raw[: 4 * len(CONFIG_OPENING)].split())  # json.dumps(indent=2) puts spaces between
    return len(opening) >= 2 and CONFIG_OPENING.startswith(opening)


def _verified_part(config: RepoConfig) -> bytes:
    """What the config's key verifier authenticates: its settings (format 3), else its ID."""
    return config.signed_settings() if config.settings_authenticated else config.repo_id.encode()


def _verified(fetch: Callable[[], bytes], decode: Callable[[bytes], T]) -> T:
    """Decode what ``fetch`` returns; when it fails verification, fetch once more before calling it
    damage: a flaky network or disk controller can corrupt a read without corrupting the object."""
    return _verified_raw(fetch, decode)[1]


def _verified_raw(fetch: Callable[[], bytes], decode: Callable[[bytes], T]) -> tuple[bytes, T]:
    """``_verified``, also returning the stored bytes (what the metadata cache keeps)."""
    raw = fetch()
    try:
        return raw, decode(raw)
    except IntegrityError:
        log.warning("a read failed verification; reading it again")
        raw = fetch()
        return raw, decode(raw)


class Repository:
    def __init__(
        self,
        store: Store,
        config: RepoConfig,
        master: MasterKey | None = None,
        *,
        upload_concurrency: int | None = None,
        cache_root: Path | None = None,
    ) -> None:
        """``upload_concurrency``: packs uploaded at once (default: what the store suits, see
        store/options.py). ``cache_root``: where metadata caches live (cache.py); remote stores only."""
        self.store = store
        self.config = config
        if config.encrypted:
            if master is None:
                raise ValueError("an encrypted repository needs its master key")
            from ..crypto.aead import AesGcmSealer  # and with it cryptography (keys.py)

            sealer: Sealer = AesGcmSealer(master.blob_key)
            self.chunk_id = ChunkIdFunction(master.chunk_id_key)
        else:
            sealer = ChecksumSealer()
            self.chunk_id = ChunkIdFunction()
        self.codec = BlobCodec(Compressor(config.compression), sealer)
        self._index: ChunkIndex | None = None  # loaded on first use, or explicitly under a lock
        self._unindexed_read = False  # the packs in no index object were read by their headers (find)
        self._unindexed_said: set[bytes] = set()  # those packs, as the last warning named them
        self._listed_sizes: dict[str, int] = {}  # snapshot and tree keys -> size, from the last listing
        self._unindexed_mutex = threading.Lock()
        self._found_nothing_at = -CATCH_UP_EVERY_S  # when a look for new index objects last found none
        self.damaged_index: dict[bytes, str] = {}  # index objects load_index read around: ID -> error
        self._passed_over: set[bytes] = set()  # packs a read fell back from (warned once each)
        self._seen_index_ids: set[bytes] = set()
        self._packs_by_object: dict[bytes, set[bytes]] = {}  # index object -> the packs it names
        self._spare_buffers: list[bytearray | mmap.mmap] = []  # pack buffers whose upload has finished
        self._writer: PackWriter | None = None  # the open pack, from its first chunk until it is sealed
        self._pending: set[bytes] = set()  # chunks in the open pack or in packs being uploaded
        self._uploads: list[tuple[Future[None], bytes, list[PackEntry]]] = []
        self._unindexed: dict[bytes, list[PackEntry]] = {}
        self.uploaded_packs: dict[bytes, list[PackEntry]] = {}  # every pack this object wrote
        self.written_index_ids: set[bytes] = set()  # every index object this object wrote
        self._reconciled: tuple[float, set[bytes]] | None = None  # when, and the index objects that listing vetted
        transfers = getattr(store, "transfers", None)
        if upload_concurrency is None:
            upload_concurrency = transfers.uploads if transfers is not None else 2
        self.download_concurrency: int = transfers.downloads if transfers is not None else 8
        self._upload_slots = threading.BoundedSemaphore(upload_concurrency)
        self._executor: ThreadPoolExecutor | None = None
        self._upload_concurrency = upload_concurrency
        self._stats_lock = threading.Lock()
        self.bytes_written = 0  # everything this Repository object has put
        self.remote = bool(getattr(store, "remote", False))  # bytes cross a network (store/base.py)
        self.cache = MetadataCache.open(cache_root if self.remote else None, config.repo_id)
        self._bypass_cache = False
        self._clear_confirmed = False  # refuse_if_downgraded_before_writing looked (once)
        self.unused_keyfile: str | None = None  # a keyfile given for this vault, which is not encrypted (open)
        # one for the repository's life: it remembers what it said (the warning of a read without a lock, once)
        self.locks = LockManager(self)

    # ---- lifecycle -------------------------------------------------------------------

    @classmethod
    def init(
        cls,
        store: Store,
        config: RepoConfig,
        keyfile: Keyfile | None = None,
        master: MasterKey | None = None,
        *,
        cache_root: Path | None = None,
    ) -> Repository:
        """Create a repository; encrypted when a keyfile and its unlocked master key are given.
        The config is written create-if-absent, so of two racing inits exactly one wins."""
        if store.exists(CONFIG_KEY):
            # a damaged config is said so (exit 30, put it back from a copy), not "a vault exists: use it",
            # which every command then refuses
            try:
                cls.read_config(store)
            except (MalformedObjectError, ForeignRepositoryError):
                raise
            except CkptVaultError:  # a newer format, a storage fault: the vault is there all the same
                pass
            raise VaultExistsError(store.url)
        missing = _without_config(store)
        if not isinstance(missing, VaultNotFoundError):  # a new config there would hide what is there
            raise missing
        if keyfile is not None and master is not None:
            config = replace(
                config, encryption="aes-256-gcm", key_fingerprint=keyfile.fingerprint, version=SETTINGS_FORMAT_VERSION
            )
            config = replace(config, key_verifier=make_verifier(master, config.signed_settings()))
        raw = config.to_json()
        try:
            store.put(CONFIG_KEY, raw, if_absent=True)
        except ObjectExistsError:
            # our own write, when the HTTP client sent it again after a lost reply (aiohttp does, unseen by the
            # retries): the config holds a new random vault ID, so the same bytes can only be ours (audit gz45 #4)
            with contextlib.suppress(CkptVaultError):
                if store.get(CONFIG_KEY) == raw:
                    return cls(store, config, master, cache_root=cache_root)
            raise VaultExistsError(store.url) from None
        return cls(store, config, master, cache_root=cache_root)

    @staticmethod
    def read_config(store: Store) -> RepoConfig:
        try:
            raw = store.get(CONFIG_KEY)
        except ObjectNotFoundError:
            raise _without_config(store) from None
        except StorageError as exc:
            # a folder named config is borg 2's on a disk; an outage (retryable) is not asked twice
            if exc.retryable or (borg2 := _borg2_repository(store)) is None:
                raise
            raise borg2 from None
        try:
            return RepoConfig.from_json(raw, store.url)
        except (ConfigNotJsonError, ConfigNotOursError) as exc:
            raise _config_not_ours(store, raw, exc) from None

    @classmethod
    def open(
        cls,
        store: Store,
        keyfile: Keyfile | None = None,
        passphrase: PassphraseSource = None,
        *,
        cache_root: Path | None = None,
    ) -> Repository:
        """Open and load the index. For an encrypted repository the keyfile is checked
        against the config before the passphrase is asked for or the KDF is run."""
        config = cls.read_config(store)
        master = None
        if config.encrypted:
            if keyfile is None:
                raise KeyfileNotFoundError(
                    f"vault {store.url} is encrypted; give its keyfile with "
                    + spelled("--keyfile or CKPTVAULT_KEYFILE", "keyfile=")
                )
            if keyfile.fingerprint != config.key_fingerprint:
                if not fingerprint_damaged_from(keyfile.fingerprint, config.key_fingerprint or ""):
                    raise KeyfileMismatchError(
                        keyfile.path, store.url, (config.key_fingerprint or "", keyfile.fingerprint)
                    )
                # a few digits apart: the vault's key, with the keyfile's fingerprint or the config's damaged. The
                # key tells which: unlock refuses a keyfile whose fingerprint is not its key's (KeyfileCorruptError)
                keyfile.unlock(resolve_passphrase(passphrase))
                raise IntegrityError(
                    f"the config of {store.url} names key fingerprint {config.key_fingerprint}, a damaged copy of "
                    f"this keyfile's ({keyfile.fingerprint}), which is its key's; {config_from_a_copy()}"
                )
            if config.version < keyfile.min_vault_format:
                raise IntegrityError(
                    f"the config of {store.url} says repository format {config.version}, but keyfile {keyfile.path} "
                    f"was made for vaults of format {keyfile.min_vault_format} and later: the config was rolled "
                    "back (altered), or the vault was made by a ckptvault older than the keyfile; "
                    + config_from_a_copy()
                )
            master = keyfile.unlock(resolve_passphrase(passphrase))
            if not check_verifier(master, _verified_part(config), config.key_verifier or ""):
                if master.fingerprint != config.key_fingerprint:
                    raise KeyfileMismatchError(keyfile.path, store.url)
                raise IntegrityError(  # the right key: the config is what changed
                    f"the config of {store.url} does not verify under this keyfile's key, though its key fingerprint "
                    "is this key's: the config was altered or replaced (its settings, its ID or its format "
                    f"version); {config_from_a_copy()}"
                )
        repo = cls(store, config, master, cache_root=cache_root)
        if not config.encrypted and keyfile is not None:  # reads go on; a write is refused (refuse_unused_keyfile)
            repo.unused_keyfile = keyfile.path or "(in memory)"
        return repo

    def refuse_unused_keyfile(self) -> None:
        """Before anything is written (``LockManager.acquire``: every writer's lock): a keyfile given for this vault,
        which is not encrypted, says the user meant it to be encrypted; nothing goes into it in the clear."""
        if self.unused_keyfile is not None:
            raise unused_keyfile_error(self.store.url, self.unused_keyfile)

    @contextlib.contextmanager
    def cache_bypassed(self) -> Iterator[None]:
        """Read every metadata object from the store itself (check verifies the repository, not
        a copy of it)."""
        self._bypass_cache = True
        try:
            yield
        finally:
            self._bypass_cache = False

    def _read_metadata(self, key: str, decode: Callable[[bytes], T], size: int | None = None) -> T:
        """A metadata object, decoded and verified, through the cache."""
        if size is not None and size > MAX_METADATA_BLOB:  # never read: it would be held whole in memory
            raise MalformedObjectError(f"it is {size} bytes, more than a metadata object can be: not read")

        def fetch() -> tuple[bytes, T]:
            return _verified_raw(lambda: self.store.get(key), decode)

        if self._bypass_cache:
            return fetch()[1]
        return self.cache.read(key, fetch, decode, size)

    @property
    def index(self) -> ChunkIndex:
        if self._index is None:
            self.load_index()
        assert self._index is not None
        return self._index

    def load_index(self) -> None:
        """Load every index object. A damaged one does not make the repository unreadable: its
        packs are described by their own sealed headers instead (``damaged_index`` names it, and
        ``ckptvault repair-index`` rewrites it durably); prune refuses until then."""
        index = ChunkIndex()
        damaged: dict[bytes, str] = {}
        objects = self.read_index_objects(damaged=damaged)
        for packs in objects.values():
            for pack_id, entries in packs.items():
                index.add_pack(pack_id, entries)
        if damaged:
            described, unreadable = self.headers_of_unindexed_packs(index.packs)
            for pack_id, entries in described.items():
                index.add_pack(pack_id, entries)
            if damaged.keys() != self.damaged_index.keys():  # said once, not at every reload (status A B C)
                damage_log.warning(
                    "index object(s) %s damaged; read %d pack(s) in no other index from their own headers instead"
                    "%s; run: %s",
                    ", ".join(i.hex()[:12] for i in damaged),
                    len(described),
                    f" ({len(unreadable)} pack(s) with a damaged header are unreadable)" if unreadable else "",
                    repair_index_command(),
                )
        # A delta whose base is in no readable pack (damaged, or dropped by repair-index with its
        # header unreadable) cannot be read back: never deduplicate against it, nor call it stored.
        index.drop_deltas_without_base()
        self._index = index
        self._seen_index_ids = set(objects) | set(damaged)
        self._packs_by_object = {index_id: set(packs) for index_id, packs in objects.items()}
        self.damaged_index = damaged
        self._unindexed_read = bool(damaged)  # their packs were just read by their headers

    def load_index_as_stored(self) -> None:
        """The index as the store holds it now, for a command that writes or restores: the loaded one
        with the index objects written since added, when only objects were added since it was loaded;
        else loaded whole. A long-lived Vault (a training job's shipper) otherwise read every index
        object at every backup: its 1,000th backup of an unpruned vault read 1,000 objects.

        An object gone since means a prune, a repair-index or a compaction replaced it, and the first
        two may have left entries out of a pack they kept (a damaged chunk, a dead delta): merging keeps
        a pack's entries from every object that named it, so only a reload drops those."""
        with self._unindexed_mutex:
            index = self._index
            if index is None or self.damaged_index or self._unindexed_read:
                self.load_index()  # which lists the index objects itself: one round trip, not two
                return
            listed = set(self.list_index_ids())
            if not self._seen_index_ids <= listed or not self._all_packs_named(index):
                self.load_index()
            else:
                self._merge_new_index_objects(listed)

    @property
    def known_index_objects(self) -> int:
        """How many index objects the store held at this Repository's last look (a load, a merge)."""
        return len(self._seen_index_ids)

    def _all_packs_named(self, index: ChunkIndex) -> bool:
        """Whether every pack in ``index`` came from an index object this Repository tracks (one read
        by its header instead, say, would never be left out when a prune deletes it)."""
        named: set[bytes] = set().union(*self._packs_by_object.values())
        return index.packs <= named

    def _merge_new_index_objects(self, listed: set[bytes] | None = None, relists: int = INDEX_RELISTS) -> bool:
        """Add index objects written by other processes since the index was loaded (one that is
        damaged is left out, named in a warning), and leave out the packs of those deleted since (a
        prune replaced them) that no other object names; whether anything changed. Never a reload,
        so safe beside a backup on another thread of this process, whose packs are indexed as they
        land (not in any object yet, so never left out here). ``listed``: a listing just made."""
        if listed is None:
            listed = set(self.list_index_ids())
        new = listed - self._seen_index_ids
        vanished = False
        for index_id in new:
            try:
                packs = self.read_index_object(index_id)
            except ObjectNotFoundError:  # replaced by a prune meanwhile: what replaced it is listed now
                vanished = True
                continue
            except IntegrityError as exc:
                damage_log.warning("%s; left out", exc)
                self.damaged_index[index_id] = str(exc)
            else:
                for pack_id, entries in packs.items():
                    self.index.add_pack(pack_id, entries)
                self._packs_by_object[index_id] = set(packs)
            self._seen_index_ids.add(index_id)
        if new:
            self.index.readmit_deltas()  # a base may have come with them
        gone = self._seen_index_ids - listed
        if gone:
            named = set().union(*(self._packs_by_object.get(i, ()) for i in listed))
            dropped = set().union(*(self._packs_by_object.pop(i, ()) for i in gone)) - named
            self.index.forget_packs(dropped)
            self._seen_index_ids -= gone
        if vanished and relists:
            self._merge_new_index_objects(relists=relists - 1)
        return bool(new or gone)

    def headers_of_unindexed_packs(
        self, indexed: Collection[bytes], stored: dict[bytes, int] | None = None
    ) -> tuple[dict[bytes, list[PackEntry]], list[bytes]]:
        """The entries of every stored pack (``stored``: a listing already made) not in ``indexed``
        (pack IDs), from each pack's own sealed header; and the packs whose header does not verify."""
        described, unreadable = {}, []
        for pack_id, size in (self.list_packs() if stored is None else stored).items():
            if pack_id in indexed:
                continue
            try:
                described[pack_id] = self.read_pack_header(pack_id, size)
            except ConfigDowngradedError:
                if self.codec.downgraded:
                    raise  # not one damaged pack: the whole vault is misread
                unreadable.append(pack_id)  # a stray one among plain objects: damage
            except CkptVaultError:
                unreadable.append(pack_id)
        return described, unreadable

    def salvage_index_entries(self, index_id: bytes, pack_ids: Collection[bytes]) -> dict[bytes, list[PackEntry]]:
        """The entries a damaged index object still gives for ``pack_ids``, each kept only once its blob,
        read from the pack, verifies against its chunk ID (unencrypted repositories: an encrypted object
        whose tag fails gives nothing)."""
        try:
            data = self.codec.decode_unverified(self.store.get(index_key(index_id)))
            packs = decode_index(data) if data is not None else {}
        except Exception:  # a damaged object may fail to parse in any way
            return {}
        out: dict[bytes, list[PackEntry]] = {}
        for pack_id in set(packs) & set(pack_ids):
            for entry in packs[pack_id]:
                try:
                    blob = self.store.get_range(pack_key(pack_id), entry.offset, entry.stored_len)
                    self.decode_chunk(entry.chunk_id, blob, entry.raw_len, entry.base_id)
                except CkptVaultError:
                    continue
                out.setdefault(pack_id, []).append(entry)
        return out

    def reconcile_when_due(self) -> None:
        """``reconcile_with_stored_packs``, which lists every pack, when it may find something: at this
        Repository's first backup, after one that failed, once an index object written by another
        process has appeared since the last time (a writer that lost its lock to a prune may name packs
        the prune deleted), and every ``RECONCILE_EVERY_S`` (packs a killed writer uploaded without an
        index object; packs deleted or cut short by hand). At every backup, a long-lived Vault's backups
        on S3 grew slower with the vault (63 of 162 ms listing 900 packs; 64 more packs per new GB)."""
        known = set(self._seen_index_ids)  # taken first: an object merged during the listing is not vetted
        if self._reconciled is not None:
            when, vetted = self._reconciled
            if known - self.written_index_ids <= vetted and time.monotonic() - when < RECONCILE_EVERY_S:
                return
        self._reconciled = None  # until it has succeeded
        self.reconcile_with_stored_packs()
        self._reconciled = (time.monotonic(), known)

    def index_objects_absorbed(self, index_ids: Collection[bytes]) -> None:
        """Compaction replaced these by objects this Repository wrote: one that the last pack listing did
        not vet would hide what it named (packs a prune deleted) from the next backup's check."""
        vetted = self._reconciled[1] if self._reconciled is not None else set()
        if not set(index_ids) <= vetted | self.written_index_ids:
            self._reconciled = None

    def reconcile_next_time(self) -> None:
        """After a failed backup: what it uploaded and never indexed is adopted by the next one."""
        self._reconciled = None

    def reconcile_with_stored_packs(self) -> int:
        """Before a backup, under its lock, after ``load_index``: make the index say what the store
        holds, so that the backup neither uploads again what is stored nor deduplicates against
        what is gone. Packs that a killed backup uploaded but never indexed are indexed (each pack's
        own sealed header describes it; one whose header does not verify is left for prune). Index
        entries of packs that are gone (a writer that lost its lock to a prune indexed them after
        the prune deleted them) and of packs that end before a chunk the index places in them
        (truncated) are left out with a warning: their chunks are stored again (readers fall back
        to the new copies). Returns how many packs were adopted."""
        stored = self.list_packs()
        gone = self.index.packs - stored.keys()
        short = self.index.packs_shorter_than_indexed(stored)
        for packs, what, then in (
            (
                gone,
                "named by the index are missing from the store",
                f"{repair_index_command()} drops them from the index",
            ),
            (short, "are shorter than the index says (truncated)", f"{prune_command()} salvages their whole chunks"),
        ):
            if packs:
                damage_log.warning(
                    "%d pack(s) %s (e.g. %s); this backup stores their chunks again; %s",
                    len(packs),
                    what,
                    min(packs).hex()[:12],
                    then,
                )
        if gone or short:
            self.index.forget_packs(gone | short)
        adopted, _ = self.headers_of_unindexed_packs(self.index.packs | short, stored)
        if adopted:
            index_id = self.write_index(adopted)
            self._seen_index_ids.add(index_id)
            self._packs_by_object[index_id] = set(adopted)
            for pack_id, entries in adopted.items():
                self.index.add_pack(pack_id, entries)
            self.index.readmit_deltas()  # deltas whose base was in one: deduplicated against again
        return len(adopted)

    def close(self) -> None:
        self._stop_uploaders()

    def _stop_uploaders(self) -> None:
        """End the upload threads; the next write starts new ones. Each write gets its own: a thread
        has the CPU priority of the thread that started it, and backup_async's worker runs lower."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None:
        self.store.put(key, data, if_absent=if_absent)
        with self._stats_lock:
            self.bytes_written += len(data)

    # ---- writing chunks ----------------------------------------------------------------

    def has_chunk(self, chunk_id: bytes) -> bool:
        return chunk_id in self.index or chunk_id in self._pending

    def add_chunk(self, chunk_id: bytes, blob: bytes | BlobParts, raw_len: int, base_id: bytes | None = None) -> bool:
        """Queue an encoded chunk blob (``base_id``: the base of a delta blob, which must be stored
        and indexed already). Returns False when it was already stored."""
        if self.has_chunk(chunk_id):
            return False
        self.add_chunk_blob(chunk_id, blob, raw_len, base_id)
        return True

    def _seal_pack(self) -> None:
        if self._writer is None or not self._writer.entries:
            return
        pack_id = new_object_id()
        entries = self._writer.entries
        data = self._writer.finish(self.codec, pack_id)
        self._writer = None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._upload_concurrency, thread_name_prefix="ckptvault-upload")
        self._upload_slots.acquire()  # bounds memory: at most N sealed packs in flight
        failed = next((f for f, _, _ in self._uploads if f.done() and f.exception() is not None), None)
        if failed is not None:  # the slot came free because an upload failed: start no more
            self._upload_slots.release()
            failed.result()
        future = self._executor.submit(self._upload, pack_id, data)
        # freed once the future holds its outcome, so a failure is seen above by whoever takes the slot
        future.add_done_callback(lambda _f: self._upload_slots.release())
        self._uploads.append((future, pack_id, entries))

    def _new_writer(self) -> PackWriter:
        spare = self._spare_buffers.pop() if self._spare_buffers else None
        if spare is None:
            spare = new_pack_buffer(self.config.pack_size + PACK_SLACK)
        return PackWriter(spare)

    def _upload(self, pack_id: bytes, data: memoryview) -> None:
        buffer = data.obj
        try:
            self._put(pack_key(pack_id), data)
        finally:
            with contextlib.suppress(BufferError):  # a PUT given up on still reads it: _recycle sees that
                data.release()
        self._recycle(buffer)

    def _recycle(self, buffer: object) -> None:
        """Keep a sent pack's buffer for the next pack, unless something still reads it: a PUT that
        the retry layer gave up waiting for may still be sending it, and must see the bytes it had."""
        if not isinstance(buffer, bytearray | mmap.mmap) or buffer_in_use(buffer):
            return
        if len(self._spare_buffers) <= self._upload_concurrency:
            self._spare_buffers.append(buffer)

    def _reap(self, *, block: bool) -> None:
        still_running = []
        for future, pack_id, entries in self._uploads:
            if block or future.done():
                future.result()  # re-raises the upload's StorageError
                self.index.add_pack(pack_id, entries)
                self._pending.difference_update(e.chunk_id for e in entries)
                self._unindexed[pack_id] = entries
                self.uploaded_packs[pack_id] = entries
            else:
                still_running.append((future, pack_id, entries))
        self._uploads = still_running
        if len(self._unindexed) >= PACKS_PER_INDEX:
            self._write_index()

    def _write_index(self) -> None:
        if self._unindexed:
            index_id = self.write_index(self._unindexed)
            # Under the readers' lock: a reload on another thread (a restore beside backup_async) built the
            # index from the objects listed before this one, maybe without these packs. Marked seen with
            # its packs left out, the object was never merged, and a restore of the snapshot warned of
            # packs no index names (tp47 #1).
            with self._unindexed_mutex:
                for pack_id, entries in self._unindexed.items():
                    if pack_id not in self.index.packs:
                        self.index.add_pack(pack_id, entries)
                self._seen_index_ids.add(index_id)
                self._packs_by_object[index_id] = set(self._unindexed)
                self._unindexed = {}
                self._merge_new_index_objects()

    def write_index(self, packs: dict[bytes, list[PackEntry]]) -> bytes:
        # A writer that lost its lock (a prune may have deleted these packs) must not index them. The
        # check makes no storage call (one per index object would stall the writer; locks.py), and runs
        # after the PUT too: a writer suspended between the check and the PUT removes what it wrote.
        index_id = new_object_id()
        blob = self.codec.encode(Kind.INDEX, index_id, encode_index(packs))
        self._put_while_locked(index_key(index_id), blob, lambda: self.locks.check_held_age(exclusive=False))
        self.written_index_ids.add(index_id)
        return index_id

    def _put_while_locked(
        self, key: str, blob: bytes, confirm: Callable[[], object], *, if_absent: bool = False
    ) -> None:
        """Put ``blob`` unless the locks this process holds went stale, and remove it again when ``confirm``,
        run after the PUT, raises LockLostError: a writer suspended between the check and the PUT takes back
        what it wrote (a prune may have deleted what it names meanwhile)."""
        self.locks.check_held_age(exclusive=False)
        self._put(key, blob, if_absent=if_absent)
        try:
            confirm()
        except LockLostError:
            try:
                self._delete(key)
            except CkptVaultError as exc:  # best effort: the lost lock's error is the one to report
                log.warning("could not remove %s after losing the lock: %s", key, exc)
            raise

    def read_index_objects(
        self, *, damaged: dict[bytes, str] | None = None
    ) -> dict[bytes, dict[bytes, list[PackEntry]]]:
        """Every index object: index ID -> (pack ID -> entries). Damage raises IntegrityError, or
        with ``damaged`` given, the damaged objects are left out and named there (ID -> error).

        A prune replaces index objects by writing the consolidated one before deleting the old
        ones, so when a listed object has vanished, listing again gives a complete index."""
        retries = INDEX_RELISTS
        while True:
            found: dict[bytes, str] = {}
            try:
                out = self._read_index_objects_once(found if damaged is not None else None)
            except ObjectNotFoundError:
                if not retries:
                    raise
                retries -= 1
                continue
            if damaged is not None:
                damaged.update(found)
            return out

    def read_each(self, read: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``read`` of every item, in order. On remote storage several at a time: one round trip after
        another, a vault of 1,000 unpruned backups (an index object each) kept a fresh machine's first
        command waiting ~40 s on a 20 ms link. On a local disk one after another, where a thread
        hand-off costs more than the read: 1,000 snapshot objects in 30 ms, against 80-110 ms on 8 threads."""
        if not self.remote or len(items) < 2:
            return [read(item) for item in items]
        with ThreadPoolExecutor(METADATA_READERS) as pool:
            return list(pool.map(read, items))

    def _index_decoder(self, index_id: bytes) -> Callable[[bytes], dict[bytes, list[PackEntry]]]:
        return lambda raw: decode_index(self.codec.decode(Kind.INDEX, index_id, raw))

    def _read_index_objects_once(self, damaged: dict[bytes, str] | None) -> dict[bytes, dict[bytes, list[PackEntry]]]:
        listing = self.store.list(INDEX_PREFIX)
        self.cache.retain(INDEX_PREFIX, (info.key for info in listing))
        wanted = [(index_id, info) for info in listing if (index_id := id_from_key(info.key)) is not None]

        def read(item: tuple[bytes, ObjectInfo]) -> dict[bytes, list[PackEntry]] | IntegrityError:
            index_id, info = item
            try:
                with _naming_errors(f"index object {index_id.hex()[:12]}", f"; run: {repair_index_command()}"):
                    return self._read_metadata(info.key, self._index_decoder(index_id), info.size)
            except IntegrityError as exc:
                return exc

        results = self.read_each(read, wanted)
        out = {}
        for (index_id, _), result in zip(wanted, results, strict=True):
            if isinstance(result, IntegrityError):
                if damaged is None:
                    raise result
                damaged[index_id] = str(result)
            else:
                out[index_id] = result
        return out

    def add_chunk_blob(
        self, chunk_id: bytes, blob: bytes | BlobParts, raw_len: int, base_id: bytes | None = None
    ) -> None:
        """Queue an encoded blob without looking it up (repacking: the chunk is stored elsewhere)."""
        if self._writer is None:
            self._writer = self._new_writer()
        self._writer.add(chunk_id, blob, raw_len, base_id)
        self._pending.add(chunk_id)
        if len(self._writer) >= self.config.pack_size:
            self._seal_pack()
        self._reap(block=False)

    def flush(self) -> None:
        """Seal the open pack, wait for every upload, then write the index for them."""
        self._seal_pack()
        self._reap(block=True)
        self._write_index()
        # A Vault stays open between a training job's backups: it holds no pack buffer meanwhile.
        self._spare_buffers.clear()
        self._stop_uploaders()

    @contextlib.contextmanager
    def aborting_writes_on_error(self) -> Iterator[None]:
        """Run a write (a backup, a repack) so that if it raises, ``abort_writes`` cleans up after it
        before the caller releases its lock."""
        try:
            yield
        except BaseException:
            self.abort_writes()
            raise

    def abort_writes(self) -> None:
        """Give up what a failed write (a backup or repack that raised) left behind, so that the next
        one starts from what the repository durably holds. Call it while the lock is still held.

        Waits for the packs still uploading (a pack landing after the lock is released could be
        deleted by a prune, yet still be counted as stored here), then drops the open pack, the
        pending chunks and the uploaded packs no index object names yet: they stay in the store,
        unreferenced, for the next backup to adopt or a prune to remove. The in-memory index had
        those packs' chunks, so it is reloaded from the index objects on its next use. Never raises
        for the uploads: the error that made the caller give up is the one to report."""
        uploads, self._uploads = self._uploads, []
        cancelling = getattr(self.store, "cancelling_uploads", None)  # a bandwidth limit's
        with cancelling(PACKS_PREFIX) if cancelling else contextlib.nullcontext():  # packs held back: not sent
            wait([future for future, _, _ in uploads])
        landed = set(self._unindexed)
        landed.update(p for f, p, _ in uploads if not f.cancelled() and f.exception() is None)
        for pack_id in {*landed, *(p for _, p, _ in uploads)}:
            self.uploaded_packs.pop(pack_id, None)
        if landed:
            log.info("a write failed: %d uploaded pack(s) are left in no index (a backup adopts them)", len(landed))
        self._unindexed = {}
        self._pending = set()
        self._writer = None  # the open pack is dropped
        self._spare_buffers.clear()
        self._stop_uploaders()
        self._index = None  # reloaded from the durable index objects when next used
        self._seen_index_ids = set()
        self._packs_by_object = {}

    # ---- reading chunks ----------------------------------------------------------------

    def locate(self, chunk_id: bytes) -> ChunkLocation:
        loc = self.find(chunk_id)
        if loc is None:
            raise IntegrityError(f"chunk {chunk_id.hex()[:12]} is not in any index{check_hint()}")
        return loc

    def find(self, chunk_id: bytes) -> ChunkLocation | None:
        """The chunk's location. For a chunk in no index, the index objects written since the index
        was loaded are read first (a long-lived reader: another process backed up meanwhile), then
        the stored packs that no index object names (those of an index object that was deleted, or a
        killed backup's) by their own sealed headers, once per loaded index: what they hold still
        reads (a lookup of every pack on every command would cost a listing of the whole store)."""
        loc = self.index.get(chunk_id)
        if loc is None:
            with self._unindexed_mutex:
                if self.index.get(chunk_id) is None:
                    self._catch_up_with_index(throttled=True)
                if self.index.get(chunk_id) is None and not self._unindexed_read:
                    self._unindexed_read = True
                    self._read_unindexed_packs()
            loc = self.index.get(chunk_id)
        return loc

    def refresh_index(self) -> bool:
        """Catch up with what other processes indexed since the index was loaded; whether anything changed."""
        with self._unindexed_mutex:
            return self._catch_up_with_index()

    def _catch_up_with_index(self, *, throttled: bool = False) -> bool:
        """For a long-lived reader: add what other processes indexed since the index was loaded;
        whether there was anything. Merged, never reloaded: a backup on another thread of this
        process adds its packs to the index as they land. ``throttled`` (a chunk in no index: every
        chunk of a file whose index object is lost misses) looks again only a second after a look
        that found nothing."""
        if self._index is None:  # not loaded yet (or dropped after a failed write): read as stored now
            self.load_index()
            return True
        if throttled and time.monotonic() - self._found_nothing_at < CATCH_UP_EVERY_S:
            return False
        if self._merge_new_index_objects():
            return True
        self._found_nothing_at = time.monotonic()
        return False

    def _read_unindexed_packs(self) -> None:
        described, _ = self.headers_of_unindexed_packs(self.index.packs)
        for pack_id, entries in described.items():
            self.index.add_pack(pack_id, entries)
        self.index.readmit_deltas()  # a delta's base may be in one of them
        if described and described.keys() != self._unindexed_said:  # said once, not at every reload (status A B)
            self._unindexed_said = set(described)
            damage_log.warning(
                "%d pack(s) that no index object names hold chunks this needs; read them by their own headers; run: %s",
                len(described),
                repair_index_command(),
            )

    def read_chunk(self, chunk_id: bytes, *, verify_id: bool = True) -> bytes | memoryview:
        """Fetch, decode and verify one chunk (a delta's base first).

        The blob's envelope (AEAD tag or checksum, both bound to the chunk ID) and its length are
        always checked. ``verify_id=False`` skips hashing the plaintext against its ID: for callers
        that hash every byte they get against a whole-file hash anyway (restore), where that pass
        is ~15 % of the CPU; they read again with ``verify_id=True`` when that fails (to name the chunk, or
        read around a copy wrong under a valid envelope).

        A chunk stored more than once (two backups that raced, or stored again because its pack was
        gone) is read from its next copy when one is missing or damaged, with one warning per pack.

        The plaintext is ``bytes`` or, for a chunk of codec 2 or 3, a read-only memoryview of the buffer
        it was decoded into (not hashable: ``bytes(...)`` it to use it as a key)."""
        return joined(self._read_chunk(chunk_id, verify_id, 0, None)[0])  # (only bases come back grouped)

    def read_chunk_and_base(self, chunk_id: bytes) -> tuple[Plain, bytes | None, Plain | None]:
        """``read_chunk`` (verified against its ID), with the delta base the copy read was decoded
        against: (plaintext, base ID, base plaintext), the last two None for a chunk stored whole.
        A delta's base is read anyway to decode it; copy codes the chunk against it again."""
        data, base_id, base = self._read_chunk(chunk_id, True, 0, None)
        return joined(data), base_id, None if base is None else joined(base)

    def _read_chunk(self, chunk_id: bytes, verify_id: bool, depth: int, stale: frozenset[bytes] | None) -> ChunkRead:
        copies = self.index.locations(chunk_id) or [self.locate(chunk_id)]  # locate raises, naming it
        for loc, fallback in itertools.pairwise(copies):
            try:
                return self._read_copy(chunk_id, loc, verify_id, depth)
            except IntegrityError as exc:
                if loc.pack_id not in self._passed_over and loc.pack_id not in (stale or ()):
                    self._passed_over.add(loc.pack_id)
                    damage_log.warning("%s; reading its copy in pack %s instead", exc, fallback.pack_id.hex()[:12])
        try:
            return self._read_copy(chunk_id, copies[-1], verify_id, depth)
        except IntegrityError:
            # a long-lived reader whose index predates a prune that moved the chunk (its old pack is
            # gone): the index objects written since say where it is now; the copies that failed
            # are the stale ones, read around without a warning
            if stale is not None:
                raise
            with self._unindexed_mutex:
                moved = self._catch_up_with_index() and self.index.locations(chunk_id) != copies
            if not moved:
                raise
        return self._read_chunk(chunk_id, verify_id, depth, frozenset(loc.pack_id for loc in copies))

    def _read_copy(self, chunk_id: bytes, loc: ChunkLocation, verify_id: bool, depth: int) -> ChunkRead:
        where = f"chunk {chunk_id.hex()[:12]} in pack {loc.pack_id.hex()[:12]}"
        base = self._delta_base(chunk_id, loc.base_id, depth, verify_id)  # outside the try: its error names both

        def fetch() -> bytes:
            try:
                return self.store.get_range(pack_key(loc.pack_id), loc.offset, loc.stored_len)
            except ObjectNotFoundError:  # named by _naming_errors below: "<where> is damaged: ..."
                raise IntegrityError(f"the pack is missing{check_hint()}") from None
            except ShortReadError:
                raise IntegrityError(f"the pack ends before the chunk (truncated){check_hint()}") from None
            except StorageError as exc:
                if type(exc) is not StorageError or not object_fault(exc):
                    raise
                # the storage answered every try with an error: a server that cannot serve this pack (a
                # damaged volume) fails it for good, and the user needs a way on, not only "try again"
                raise exc.said_as(
                    f"{exc}; if every read of this pack fails: {check_command()} names the packs the storage "
                    f"cannot serve, and {repair_index_command(drop_failing=True)} sets their chunks aside"
                ) from exc

        # A base that only a restore's delta reads (its plaintext is hashed as the delta's file) is
        # left as its streams: the delta is undone on them, and the restore joins one chunk, not two.
        as_base = depth > 0 and not verify_id
        with _naming_errors(where):
            data = _verified(
                fetch,
                lambda blob: self._decode_chunk(chunk_id, blob, loc.raw_len, loc.base_id, base, verify_id, as_base),
            )
        return data, loc.base_id, base

    # ---- trees and snapshots -----------------------------------------------------------

    def save_tree(self, raw: bytes, tree_id: bytes | None = None) -> bytes:
        """Store a tree under a new random ID, or under ``tree_id`` (copy: an ID derived from what the
        tree holds, so that writing it again writes the same object)."""
        tree_id = tree_id or new_object_id()
        self._put(tree_key(tree_id), self.codec.encode(Kind.TREE, tree_id, raw))
        return tree_id

    def load_tree(self, tree_id: bytes) -> bytes:
        return self._load_object(Kind.TREE, tree_id, tree_key(tree_id), "tree")

    def save_snapshot(self, snapshot_id: bytes, raw: bytes, *, if_absent: bool = False) -> None:
        """The commit of a backup, copy or retag. The locks this process holds are verified on the storage
        after the PUT as well: a writer suspended past its lock's staleness between its last check and this
        write (a prune may have deleted its tree and packs meanwhile) removes the snapshot and raises
        LockLostError; it committed a snapshot of missing data with exit 0 before (audit mw45 M1, M2)."""
        blob = self.codec.encode(Kind.SNAPSHOT, snapshot_id, raw)
        self._put_while_locked(snapshot_key(snapshot_id), blob, self._locks_still_held, if_absent=if_absent)

    def _locks_still_held(self) -> None:
        try:
            self.locks.verify_held(exclusive=False)
        except StorageError:  # the storage did not say: the lock's age on the steady clock decides
            self.locks.check_held_age(exclusive=False)

    def has_snapshot(self, snapshot_id: bytes) -> bool:
        return self.store.exists(snapshot_key(snapshot_id))

    def load_snapshot(self, snapshot_id: bytes) -> bytes:
        return self._load_object(Kind.SNAPSHOT, snapshot_id, snapshot_key(snapshot_id), "snapshot")

    def list_snapshot_ids(self) -> list[bytes]:
        return list(self._list_metadata(SNAPSHOTS_PREFIX))

    def listed_snapshot_size(self, snapshot_id: bytes) -> int | None:
        """The size of the snapshot object as the last listing gave it (None: not listed)."""
        return self._listed_sizes.get(snapshot_key(snapshot_id))

    def listed_tree_size(self, tree_id: bytes) -> int | None:
        """The size of the tree object as the last listing of trees gave it (None: not listed)."""
        return self._listed_sizes.get(tree_key(tree_id))

    def _load_object(self, kind: Kind, object_id: bytes, key: str, what: str) -> bytes:
        """The verified plaintext of a whole-object blob. Errors name the object: IntegrityError (or
        MalformedObjectError) when it is damaged, UnsupportedFormatError when this ckptvault cannot
        read it (written by a newer one; for an unknown envelope version, possibly damage)."""
        with _naming_errors(f"{what} object {object_id.hex()[:12]}"):
            # a cached copy of another size than the listing's is fetched again (docs: backends.md)
            size = self._listed_sizes.get(key)
            return self._read_metadata(key, lambda raw: self.codec.decode(kind, object_id, raw), size)

    def refuse_if_downgraded_before_writing(self) -> None:
        """In a vault whose config says it is not encrypted, before the first object it writes in the clear
        (a lock: every command takes one first), stored objects are read until one verifies as plain (at
        most ``DOWNGRADE_PROBES``): index objects (read again next, from the cache), else snapshots, else
        packs' headers, what a keyless command reads first anyway. A config rewritten to "none" over an
        encrypted vault is then found (ConfigDowngradedError) before a lock naming this host goes into it
        in the clear. Damage is the command's to meet; a listing that fails is tried again at the next lock."""
        if self._clear_confirmed or not isinstance(self.codec.sealer, ChecksumSealer):
            return
        self.codec.refuse_if_downgraded()  # what was read before (a restore picks its snapshot first)
        if self.codec.plain_seen:
            self._clear_confirmed = True
            return
        readers: list[tuple[str, Callable[[ObjectInfo, bytes], object]]] = [
            (INDEX_PREFIX, lambda info, i: self._read_metadata(info.key, self._index_decoder(i), info.size)),
            (SNAPSHOTS_PREFIX, lambda info, i: self.load_snapshot(i)),
            (PACKS_PREFIX, lambda info, i: self.read_pack_header(i, info.size)),
        ]
        tries = DOWNGRADE_PROBES  # objects that fail to read (damaged, or the storage) do not tell: the next may
        for prefix, read in readers:
            listed = [(info, i) for info in self.store.list(prefix) if (i := id_from_key(info.key)) is not None]
            for item in listed[:tries]:
                tries -= 1
                try:
                    read(*item)
                except ConfigDowngradedError:
                    raise
                except CkptVaultError:
                    continue
                self._clear_confirmed = True  # a plain object verified
                return
        self._clear_confirmed = True  # nothing stored to compare with, or none of the few tried could be read

    def storage_down(self, exc: BaseException) -> bool:
        """Whether ``exc``, a call's failure through its retries, means the whole storage does not answer: it
        says no answer came (a timeout, a refused or dropped connection), and a STAT of the config, asked
        briefly (one attempt while the store's breaker is open), gets none either. One object whose every read
        is cut (a proxy resetting it, a server failing on it) is that object's: the others still answer."""
        if not (isinstance(exc, StorageError) and unreachable(exc)):
            return False
        try:
            with briefly(self.store):
                self.store.exists(CONFIG_KEY)
        except StorageError:
            return True
        return False

    def list_packs(self) -> dict[bytes, int]:
        """Pack ID -> size in bytes, for every pack object in the store."""
        return self._list_sizes(PACKS_PREFIX)

    def read_pack_header(self, pack_id: bytes, size: int) -> list[PackEntry]:
        """Fetch and verify a pack's header with two range reads (trailer, then header)."""
        key = pack_key(pack_id)
        trailer = self.store.get_range(key, size - TRAILER.size, TRAILER.size) if size >= TRAILER.size else b""
        start, length = header_range(trailer, size)
        blob = self.store.get_range(key, start, length)
        return decode_header(self.codec, pack_id, blob, start, trailer_version(trailer))

    @property
    def max_pack_size(self) -> int:
        """The most bytes a pack of this vault can hold: under ``pack_size`` before its last chunk is added
        (PackWriter seals it once it reaches that), the last chunk's blob and the header blob (each at most
        ``MAX_METADATA_BLOB``: no blob decodes to more than 1 GiB), and the trailer. A listed pack bigger
        than that was grown or replaced: ``read_pack`` refuses it, and it is read in chunks (``read_pack_blob``)."""
        return self.config.pack_size + 2 * MAX_METADATA_BLOB + TRAILER.size

    def read_pack(self, pack_id: bytes, size: int | None = None) -> bytes:
        """A whole pack, held in memory. ``size`` (its listed size, when known) bigger than ``max_pack_size``
        is damage: MalformedObjectError, not read (a planted or grown object of many GiB)."""
        if size is not None and size > self.max_pack_size:
            raise MalformedObjectError(self.oversized_pack(size))
        return self.store.get(pack_key(pack_id))

    def oversized_pack(self, size: int) -> str:
        return (
            f"it is {size} bytes, more than a pack of this vault can be ({self.max_pack_size}: bytes were added to "
            "it, or it was replaced): not read whole"
        )

    def read_pack_blob(self, pack_id: bytes, entry: PackEntry) -> bytes:
        """One chunk's blob, by a range read (a pack too big to read whole is read so)."""
        return self.store.get_range(pack_key(pack_id), entry.offset, entry.stored_len)

    def reads_back(self, pack_id: bytes, entry: PackEntry) -> bool:
        """Whether a chunk whose bytes in a whole-pack read failed verification decodes and verifies on a read
        of its own (up to REREADS of them; a storage error counts as no). check and repair-index read each
        pack once: a read damaged on its way (a flaky link, a TLS-terminating proxy, bad RAM), not the stored
        bytes, made healthy chunks "damaged", and repair dropped them from the index for good (audit gz45 #1)."""
        for _ in range(REREADS):
            try:
                blob = self.store.get_range(pack_key(pack_id), entry.offset, entry.stored_len)
                self.decode_chunk(entry.chunk_id, blob, entry.raw_len, entry.base_id)
            except IntegrityError:
                continue
            except CkptVaultError:
                return False
            return True
        return False

    def header_reads_back(self, pack_id: bytes, size: int) -> bool:
        """``reads_back`` for a pack's header."""
        for _ in range(REREADS):
            try:
                self.read_pack_header(pack_id, size)
                return True
            except IntegrityError:
                continue
            except CkptVaultError:
                return False
        return False

    def list_index_ids(self) -> list[bytes]:
        return list(self.list_index_sizes())

    def list_index_sizes(self) -> dict[bytes, int]:
        """Index ID -> size in bytes, for every index object in the store."""
        return self._list_sizes(INDEX_PREFIX)

    def _list_sizes(self, prefix: str) -> dict[bytes, int]:
        return {i: o.size for o in self.store.list(prefix) if (i := id_from_key(o.key)) is not None}

    def _list_metadata(self, prefix: str) -> dict[bytes, int]:
        """Snapshot or tree ID -> size; the listing's sizes are kept to tell a stale cached copy (and the
        cache drops what is no longer listed)."""
        listing = self.store.list(prefix)
        self.cache.retain(prefix, (o.key for o in listing))
        self._listed_sizes.update((o.key, o.size) for o in listing)
        return {i: o.size for o in listing if (i := id_from_key(o.key)) is not None}

    def read_index_object(self, index_id: bytes) -> dict[bytes, list[PackEntry]]:
        """One index object: pack ID -> entries. Errors name it."""
        with _naming_errors(f"index object {index_id.hex()[:12]}", f"; run: {repair_index_command()}"):
            return self._read_metadata(index_key(index_id), self._index_decoder(index_id))

    def decode_chunk(
        self, chunk_id: bytes, blob: bytes, raw_len: int, base_id: bytes | None = None
    ) -> bytes | memoryview:
        """Decode and verify a chunk blob against its ID; raises IntegrityError. ``base_id``: the
        delta base its index entry or pack header names, read (and verified) first."""
        return joined(self._decode_chunk(chunk_id, blob, raw_len, base_id, self._delta_base(chunk_id, base_id, 0)))

    def _decode_chunk(
        self,
        chunk_id: bytes,
        blob: bytes,
        raw_len: int,
        base_id: bytes | None,
        base: bytes | memoryview | Grouped | None,
        verify_id: bool = True,
        as_base: bool = False,
    ) -> bytes | memoryview | Grouped:
        based = False

        def give_base(wanted: bytes) -> bytes | memoryview | Grouped:
            nonlocal based
            if base is None or wanted != base_id:
                named = base_id.hex()[:12] if base_id else "none"
                raise IntegrityError(f"is a delta against chunk {wanted.hex()[:12]}, but its index entry names {named}")
            based = True
            return base

        data: bytes | memoryview | Grouped
        if as_base:
            data = self.codec.decode_base(chunk_id, blob, raw_len, give_base)
        else:
            data = self.codec.decode_buffer(Kind.CHUNK, chunk_id, blob, raw_len, give_base)
        if base_id is not None and not based:
            raise IntegrityError(f"is not a delta, but its index entry names base chunk {base_id.hex()[:12]}")
        if len(data) != raw_len or (verify_id and self.chunk_id(joined(data)) != chunk_id):
            raise IntegrityError("does not match its hash")
        return data

    def _delta_base(
        self, chunk_id: bytes, base_id: bytes | None, depth: int, verify_id: bool = True
    ) -> bytes | memoryview | Grouped | None:
        """The plaintext of a delta's base (for a restore, its streams: ``_read_copy``), checked as ``read_chunk``
        checks (None for a chunk without one)."""
        if base_id is None:
            return None
        if depth >= MAX_DELTA_DEPTH:
            raise IntegrityError(
                f"chunk {chunk_id.hex()[:12]}: its chain of delta bases is more than {MAX_DELTA_DEPTH} deep (a loop)"
                f"{check_hint()}"
            )
        try:
            return self._read_chunk(base_id, verify_id, depth + 1, None)[0]
        except IntegrityError as exc:
            raise IntegrityError(
                f"chunk {chunk_id.hex()[:12]} is stored as a delta against chunk {base_id.hex()[:12]}, "
                f"which cannot be read: {exc}"
            ) from exc

    def delete_pack(self, pack_id: bytes) -> None:
        self._delete(pack_key(pack_id))

    def delete_index(self, index_id: bytes) -> None:
        self._delete(index_key(index_id))

    def delete_snapshot(self, snapshot_id: bytes, tree_id: bytes | None) -> None:
        """The snapshot first: a crash in between leaves an unreferenced tree, never a dangling snapshot.
        ``tree_id`` None (a snapshot object that cannot be decoded): its tree is left for a prune,
        which deletes every tree no snapshot refers to."""
        self._delete(snapshot_key(snapshot_id))
        if tree_id is not None:
            self._delete(tree_key(tree_id))

    def list_tree_ids(self) -> list[bytes]:
        return list(self._list_metadata(TREES_PREFIX))

    def delete_tree(self, tree_id: bytes) -> None:
        self._delete(tree_key(tree_id))

    def _delete(self, key: str) -> None:
        self.cache.discard(key)
        with contextlib.suppress(ObjectNotFoundError):  # idempotent: a rerun after a crash finishes the job
            self.store.delete(key)
