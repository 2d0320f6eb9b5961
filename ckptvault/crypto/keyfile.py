"""Passphrase-protected keyfiles.

A keyfile is JSON holding the random master key wrapped with AES-256-GCM under a key
derived from the passphrase with scrypt (memory-hard; its parameters are in the file):

    {"format": "ckptvault-keyfile", "version": 1, "created": "...",
     "kdf": {"name": "scrypt", "n": 131072, "r": 8, "p": 1, "salt": "<base64, 16 bytes>"},
     "wrapped_key": "<base64: nonce:12 | AES-GCM(kek, nonce, master:32, aad) | tag:16>",
     "fingerprint": "<32 hex>"}

    kek = scrypt(passphrase, salt, n, r, p, length 32);  aad = b"ckptvault-keyfile v1"

The passphrase is taken as UTF-8 without its trailing CR/LF, whatever it came from (a file, the
environment, a prompt, the API): a secret mounted from a file often ends in a newline, and the same
secret in an environment variable may or may not. Bytes that are not UTF-8 (an environment variable
or a file in another encoding) are used as they are. The same visible passphrase may come in either
Unicode normal form (a password manager, a macOS clipboard: "é" as one character or as "e" and an accent):
where the one given does not unlock the keyfile, its other forms (NFC, NFD) are tried as well.

It is written atomically with mode 0600. Changing the passphrase rewraps the same master
key, so the repository's data is untouched.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import hashlib
import json
import numbers
import os
import re
import secrets
import stat
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

from ..durable import fsync_dir, pwrite_all
from ..errors import (
    NOT_A_KEYFILE,
    KeyfileCorruptError,
    KeyfileNotFoundError,
    PassphraseRequiredError,
    StorageFullError,
    UnsupportedFormatError,
    UsageError,
    WrongPassphraseError,
    elided,
    spelled,
)
from .keys import MASTER_KEY_SIZE, MasterKey

FORMAT = "ckptvault-keyfile"
VERSION = 1
MAX_KEYFILE_BYTES = 64 * 1024  # a keyfile is ~400 bytes of JSON
WRAP_AAD = b"ckptvault-keyfile v1"
DEFAULT_SCRYPT_N = 2**17  # 128 MiB and ~0.3 s here; raise it, never lower it, for real keys
MAX_SCRYPT_N = 2**24  # what `key generate --kdf-cost` allows at most (16 GiB of memory)
# What a keyfile's scrypt may cost at most, in N * r * p (memory grows with N * r, time with all three): that of
# the dearest keyfile ckptvault makes (N=2^24, r=8, p=1: 16 GiB, ~40 s here). A keyfile asking for more (r=64 and
# p=64 with N=2^24: 128 GiB and hours per guess) was not made by ckptvault: refused as corrupt, not run.
MAX_SCRYPT_WORK = MAX_SCRYPT_N * 8
KDF_COSTS = range(14, 25)  # log2 of scrypt's N that a new keyfile may take: 16 MiB .. 16 GiB of memory
DEFAULT_KDF_COST = DEFAULT_SCRYPT_N.bit_length() - 1
MIN_NEW_PASSPHRASE = 8  # characters of a new passphrase, not counting spaces at its ends
SALT_SIZE = 16
NONCE_SIZE = 12
_FINGERPRINT = re.compile(r"[0-9a-f]{32}")  # MasterKey.fingerprint: 16 bytes, lowercase hex
# Two fingerprints this close are one, damaged: two keys' fingerprints (random 16 bytes) differ in ~30 of the 32
# digits, and the chance that they differ in at most 4 is under 1e-29
FINGERPRINT_DAMAGE_DIGITS = 4


def fingerprint_damaged_from(fingerprint: str, other: str) -> bool:
    """Whether two well-formed fingerprints that differ are one of them damaged (a few digits changed), not the
    fingerprints of two keys."""
    if not (_FINGERPRINT.fullmatch(fingerprint) and _FINGERPRINT.fullmatch(other)):
        return False
    return 0 < sum(a != b for a, b in zip(fingerprint, other, strict=True)) <= FINGERPRINT_DAMAGE_DIGITS


# A passphrase, or a function that asks for one (called only when a keyfile must be unlocked).
PassphraseSource = str | Callable[[], str] | None


def check_kdf_cost(kdf_cost: int, name: str = "kdf_cost") -> int:
    if isinstance(kdf_cost, bool) or not isinstance(kdf_cost, numbers.Integral) or kdf_cost not in KDF_COSTS:
        raise UsageError(
            f"{name} {kdf_cost!r} is out of range; use {KDF_COSTS[0]}..{KDF_COSTS[-1]} (log2 of scrypt's N)"
        )
    return int(kdf_cost)


def scrypt_params_in_range(n: int, r: int, p: int) -> bool:
    """Whether scrypt (n, r, p) is one a keyfile may have: n a power of two up to 2^24, r and p from 1, and at most
    ``MAX_SCRYPT_WORK`` in all (a keyfile is not trusted to set how much memory and time an unlock takes)."""
    power_of_two = 2 <= n <= MAX_SCRYPT_N and n & (n - 1) == 0
    return power_of_two and 1 <= r <= 64 and 1 <= p <= 64 and n * r * p <= MAX_SCRYPT_WORK


def too_short(new_passphrase: str) -> bool:
    """Whether a new passphrase is under MIN_NEW_PASSPHRASE characters (spaces count only between others)."""
    return len(new_passphrase.strip()) < MIN_NEW_PASSPHRASE


def resolve_passphrase(source: PassphraseSource) -> str:
    passphrase = source() if callable(source) else source
    if passphrase is None:  # the CLI always passes a source: this is the Python API
        raise PassphraseRequiredError(
            message="no passphrase for the keyfile: give passphrase= (the passphrase, or a function that returns it)"
        )
    if not isinstance(passphrase, str):  # never shown: it may be the secret
        given = "a function that returned " if callable(source) else ""
        raise UsageError(
            f"the passphrase must be text (a str), not {given}{type(passphrase).__name__}"
            + ("; decode it first (passphrase.decode())" if isinstance(passphrase, bytes | bytearray) else "")
        )
    return passphrase


def passphrase_from_env(env: str = "CKPTVAULT_PASSPHRASE") -> str:
    """The passphrase in ``env``; PassphraseRequiredError when it is not set, UsageError when it is
    set but empty (an unset CI secret, say: not a wrong passphrase)."""
    passphrase = os.environ.get(env)
    if passphrase is None:
        raise PassphraseRequiredError(env=env)
    if not passphrase.rstrip("\r\n"):
        raise UsageError(f"{env} is set but empty; set it to the passphrase, or unset it to be asked")
    return passphrase


def passphrase_secret(passphrase: str) -> bytes:
    """What scrypt is given for ``passphrase`` (see the module docstring)."""
    return _encoded(passphrase.rstrip("\r\n"))


def _encoded(passphrase: str) -> bytes:
    try:
        # surrogateescape gives back the very bytes of an environment variable or a file read with it
        return passphrase.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise UsageError("the passphrase holds characters that are not text (lone surrogates); type it again") from None


class _NoMemoryForScrypt(Exception):
    """scrypt could not get the memory its parameters ask for."""


@dataclass(frozen=True)
class KdfParams:
    n: int = DEFAULT_SCRYPT_N
    r: int = 8
    p: int = 1
    salt: bytes = field(default=b"", repr=False)  # with the wrapped key, what a guess at the passphrase needs

    @property
    def weaker_by(self) -> float:
        """How many times cheaper a guess of the passphrase is than under the default settings (under 1:
        dearer)."""
        default = KdfParams()
        return (default.n * default.r * default.p) / (self.n * self.r * self.p)

    def derive(self, secret: bytes) -> bytes:
        with _AHEAD_LOCK:
            ahead = _AHEAD.pop((self, hashlib.sha256(secret).digest()), None)
        try:
            return ahead.result() if ahead is not None else self._scrypt(secret)
        except _NoMemoryForScrypt:  # said here, not on the thread that derived ahead (the CLI's words)
            raise self._no_memory() from None

    def _scrypt(self, secret: bytes) -> bytes:
        # libsodium's scrypt (PyNaCl), not OpenSSL's (cryptography): the same function, ~25 % faster here
        # (0.32 s against 0.40-0.43 for N=2^17, r=8), and every encrypted command waits for it
        from nacl.bindings import crypto_pwhash_scryptsalsa208sha256_ll as scrypt
        from nacl.exceptions import RuntimeError as ScryptFailed

        try:
            return scrypt(secret, self.salt, self.n, self.r, self.p, dklen=32, maxmem=self._memory())
        except (ScryptFailed, MemoryError):  # libsodium says only "failure": its one cause is the memory
            raise _NoMemoryForScrypt from None

    def _memory(self) -> int:
        """What scrypt needs: its table of n blocks and p more, each 128 * r bytes (and a little over)."""
        return 128 * self.r * (self.n + self.p + 2) + (1 << 20)

    def _no_memory(self) -> UsageError:
        return UsageError(
            f"the keyfile's scrypt setting (N=2^{self.n.bit_length() - 1}, r={self.r}, p={self.p}) needs "
            f"{self._memory() / 2**30:.1f} GiB of memory, more than this machine gives; unlock it on a bigger one "
            "and lower its cost there with: "
            + spelled(
                f"ckptvault key passwd --keyfile KEYFILE --kdf-cost {DEFAULT_KDF_COST}",
                f"Vault.change_keyfile_passphrase(..., kdf_cost={DEFAULT_KDF_COST})",
            )
        )

    def derive_ahead(self, secret: bytes) -> bool:
        """Start ``derive`` on another thread (scrypt releases the GIL, so it runs on another core);
        the next ``derive`` with these parameters and this passphrase takes its result. Returns
        False, starting nothing, when such a derivation is under way already (the CLI's, say)."""
        future: Future[bytes] = Future()

        def run() -> None:
            try:
                future.set_result(self._scrypt(secret))
            except BaseException as exc:  # handed to whoever takes the result
                future.set_exception(exc)

        with _AHEAD_LOCK:
            if _AHEAD.setdefault((self, hashlib.sha256(secret).digest()), future) is not future:
                return False
        threading.Thread(target=run, name="ckptvault-kdf", daemon=True).start()
        return True

    @contextlib.contextmanager
    def deriving_ahead(self, secret: bytes) -> Iterator[None]:
        """``derive_ahead`` for the length of the block: a result that no ``derive`` took by its end
        (the vault was not found, the keyfile is not its key) is dropped, not kept in memory."""
        started = self.derive_ahead(secret)
        try:
            yield
        finally:
            if started:
                with _AHEAD_LOCK:
                    _AHEAD.pop((self, hashlib.sha256(secret).digest()), None)


# A keyfile is written under ``.<name>.tmp-<random>`` first, then renamed. A writer killed in between
# (SIGKILL, a power loss) leaves that file: a whole keyfile, under the passphrase that was being set.
TEMP_MARK = ".tmp-"
# An empty one is a writer's that has not locked it yet, or one killed before it wrote a byte: past this
# age, no live writer (it locks the file right after making it) can own it.
EMPTY_TEMP_GRACE_S = 60.0


def _lock_while_written(fd: int) -> None:
    """flock the temporary file for as long as its writer lives (the kernel drops the lock of a
    dead process): how the next writer tells a leftover from a file being written."""
    with contextlib.suppress(OSError):  # no locks here (some network filesystems): never swept then
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def keyfile_exists(path: str) -> UsageError:
    return UsageError(f"{path} already exists; a keyfile is never overwritten (pick another path)")


def remove_leftover_temps(path: str) -> None:
    """Remove the temporary copies of the keyfile at ``path`` that killed writers left, as its next writer does:
    ``key generate`` refuses a name that exists before it writes anything, so a generate killed after the
    keyfile took its name (a hard link), before its temporary name was removed, left that second name for good
    when run again (a copy of the key that a later ``key passwd`` away from its passphrase is meant to retire)."""
    path = os.path.expanduser(path)
    _remove_dead_writers_temps(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}{TEMP_MARK}")


def _remove_dead_writers_temps(directory: str, temp_prefix: str) -> None:
    """Remove what killed writers of this keyfile left: each a copy of the master key under a
    passphrase that a later rotation was meant to retire. One whose lock cannot be taken is a live
    writer's (or on a filesystem without locks) and stays."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(temp_prefix)]
    except OSError:
        return
    for name in names:
        leftover = os.path.join(directory, name)
        try:
            fd = os.open(leftover, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = os.fstat(fd)
            # empty and new: a writer that made it a moment ago and has not locked it yet
            if _dead_writers(held) and os.path.samestat(held, os.lstat(leftover)):
                os.unlink(leftover)
        except OSError:
            pass  # held by a live writer, renamed or removed meanwhile, or no locks here
        finally:
            os.close(fd)


def _dead_writers(held: os.stat_result) -> bool:
    """Whether a temporary keyfile whose lock was just taken is a killed writer's: one with a key in it, or
    an empty one older than a live writer's can be (killed between making it and writing)."""
    return held.st_size > 0 or time.time() - held.st_mtime > EMPTY_TEMP_GRACE_S


def _publish(tmp: str, path: str, overwrite: bool) -> None:
    """Give the written ``tmp`` its name. Without ``overwrite``, a hard link fails if the name
    appeared meanwhile (two ``key generate`` at once: one loses, neither silently loses its key)."""
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # no hard links here (EPERM, ENOTSUP, ENOSYS, ...): check, then rename
        if os.path.lexists(path):
            raise FileExistsError(path) from None
        os.replace(tmp, path)


# Derivations started ahead of need (``KdfParams.derive_ahead``), keyed without the passphrase itself.
_AHEAD: dict[tuple[KdfParams, bytes], Future[bytes]] = {}
_AHEAD_LOCK = threading.Lock()


def _named_fifo(path: str) -> bool:
    """Whether ``path`` is a FIFO in a folder (mkfifo), followed through links; not a pipe handed over as
    ``/dev/fd/N`` (``--keyfile <(...)``), whose link names no file (``pipe:[N]``) and whose writer is there."""
    try:
        return stat.S_ISFIFO(os.lstat(os.path.realpath(path)).st_mode)
    except (OSError, ValueError):  # no such file, or a pipe: open() says what it is
        return False


@dataclass(frozen=True)
class Keyfile:
    kdf: KdfParams
    wrapped_key: bytes = field(repr=False)  # a Keyfile printed into a log must not hand out the material to guess at
    fingerprint: str
    created: str
    path: str = ""
    # The lowest repository format a vault of this key may have: 1 for keyfiles made before format 3,
    # 3 for those made since (`key generate`), which no vault of an older format ever used, so a config
    # rolled back to one (with the ID and verifier of another vault of the key) is refused.
    min_vault_format: int = 1

    # ---- creating and unlocking ------------------------------------------------------

    @classmethod
    def create(
        cls,
        passphrase: str,
        *,
        master: MasterKey | None = None,
        scrypt_n: int = DEFAULT_SCRYPT_N,
        scrypt_r: int = KdfParams.r,
        scrypt_p: int = KdfParams.p,
        salt: bytes | None = None,
        nonce: bytes | None = None,
        created: str | None = None,
        min_vault_format: int = 1,
    ) -> tuple[Keyfile, MasterKey]:
        """A new keyfile for ``master`` (a fresh random key by default). ``salt``, ``nonce``
        and ``created`` exist for known-answer tests; leave them unset."""
        secret = passphrase_secret(passphrase)
        if not secret:
            raise UsageError("the passphrase is empty; choose a long passphrase")
        if not 2 <= scrypt_n <= MAX_SCRYPT_N or scrypt_n & (scrypt_n - 1):
            raise UsageError(f"scrypt n={scrypt_n} must be a power of two, at most 2^24")
        if not scrypt_params_in_range(scrypt_n, scrypt_r, scrypt_p):
            raise UsageError(
                f"scrypt n={scrypt_n} r={scrypt_r} p={scrypt_p} is out of range: r and p from 1, n * r * p at most 2^27"
            )
        master = master or MasterKey.generate()
        kdf = KdfParams(n=scrypt_n, r=scrypt_r, p=scrypt_p, salt=salt or secrets.token_bytes(SALT_SIZE))
        nonce = nonce or secrets.token_bytes(NONCE_SIZE)
        try:
            kek = kdf._scrypt(secret)
        except _NoMemoryForScrypt:
            raise UsageError(
                f"a keyfile of scrypt N=2^{scrypt_n.bit_length() - 1} needs {kdf._memory() / 2**30:.1f} GiB of memory "
                f"to unlock, more than this machine gives; choose a lower {spelled('--kdf-cost', 'kdf_cost')}"
            ) from None
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        wrapped = nonce + AESGCM(kek).encrypt(nonce, master.material, WRAP_AAD)
        created = created or datetime.now(timezone.utc).isoformat(timespec="seconds")
        keyfile = cls(
            kdf=kdf,
            wrapped_key=wrapped,
            fingerprint=master.fingerprint,
            created=created,
            min_vault_format=min_vault_format,
        )
        return keyfile, master

    def unlock(self, passphrase: str) -> MasterKey:
        secret = passphrase_secret(passphrase)
        # A keyfile made before trailing newlines were dropped, from a passphrase ending in one: as given,
        # or as a file that held it (the file's newline is gone by now); then the other Unicode forms
        legacy = _encoded(passphrase) if passphrase != passphrase.rstrip("\r\n") else secret + b"\n"
        forms = [passphrase_secret(unicodedata.normalize(form, passphrase)) for form in ("NFC", "NFD")]
        tried: set[bytes] = set()
        for candidate in (secret, legacy, *forms):
            if candidate not in tried:
                tried.add(candidate)
                if (material := self._unwrap(candidate)) is not None:
                    break
        else:
            raise WrongPassphraseError(self.path or "(in memory)")
        master = MasterKey(material)
        if master.fingerprint != self.fingerprint:
            raise KeyfileCorruptError(self.path, "its fingerprint does not match its key")
        return master

    def _unwrap(self, secret: bytes) -> bytes | None:
        # loaded while scrypt runs on the other core (keys.py says why not at start-up)
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        try:
            return AESGCM(self.kdf.derive(secret)).decrypt(
                self.wrapped_key[:NONCE_SIZE], self.wrapped_key[NONCE_SIZE:], WRAP_AAD
            )
        except InvalidTag:
            return None

    def with_passphrase(self, master: MasterKey, new_passphrase: str, scrypt_n: int | None = None) -> Keyfile:
        """The same master key under a new passphrase (and a new salt), with this keyfile's scrypt
        settings but for ``scrypt_n`` when given."""
        fresh, _ = Keyfile.create(
            new_passphrase,
            master=master,
            scrypt_n=scrypt_n or self.kdf.n,
            scrypt_r=self.kdf.r,
            scrypt_p=self.kdf.p,
            created=self.created,
            min_vault_format=self.min_vault_format,
        )
        return replace(fresh, path=self.path)

    # ---- files -----------------------------------------------------------------------

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "created": self.created,
            "kdf": {
                "name": "scrypt",
                "n": self.kdf.n,
                "r": self.kdf.r,
                "p": self.kdf.p,
                "salt": base64.b64encode(self.kdf.salt).decode(),
            },
            "wrapped_key": base64.b64encode(self.wrapped_key).decode(),
            "fingerprint": self.fingerprint,
        }
        if self.min_vault_format > 1:  # keyfiles made before it stay as they were
            doc["min_vault_format"] = self.min_vault_format
        return json.dumps(doc, indent=2).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes, path: str = "") -> Keyfile:
        try:
            doc = json.loads(raw)
            if doc.get("format") != FORMAT:  # a keyfile's other fields with it: its format field was damaged
                raise ValueError(
                    f"format {doc.get('format')!r}" if {"kdf", "wrapped_key"} <= doc.keys() else NOT_A_KEYFILE
                )
            version = doc.get("version")
            if type(version) is int and version > VERSION:  # not damage: a newer ckptvault wrote it
                raise UnsupportedFormatError(
                    f"{f'keyfile {path}' if path else 'the keyfile'} is of version {version}, newer than this "
                    f"ckptvault reads (up to {VERSION}); upgrade ckptvault: pip install -U ckptvault"
                )
            if version != VERSION:
                raise ValueError(f"keyfile version {version!r} is not supported")
            kdf = doc["kdf"]
            if kdf["name"] != "scrypt":
                raise ValueError(f"unknown KDF {kdf['name']!r}")
            wrapped = base64.b64decode(doc["wrapped_key"], validate=True)
            if len(wrapped) != NONCE_SIZE + MASTER_KEY_SIZE + 16:
                raise ValueError("wrapped key has the wrong length")
            n, r, p = (kdf[name] for name in ("n", "r", "p"))
            if not all(type(v) is int for v in (n, r, p)):
                raise ValueError("its scrypt parameters are not whole numbers")
            if not scrypt_params_in_range(n, r, p):
                raise ValueError(
                    f"its scrypt parameters n={n} r={r} p={p} are out of range (n a power of two up to 2^24, r and p "
                    "from 1, n * r * p at most 2^27: the most any ckptvault keyfile asks for)"
                )
            salt = base64.b64decode(kdf["salt"], validate=True)
            if len(salt) != SALT_SIZE:
                raise ValueError(f"its salt has {len(salt)} bytes, not {SALT_SIZE}")
            fingerprint = doc["fingerprint"]
            if not isinstance(fingerprint, str) or not _FINGERPRINT.fullmatch(fingerprint):
                # damage, not another vault's key (a fingerprint is 32 lowercase hex digits): said as such, where
                # the comparison with the vault's named it a keyfile of another vault (exit 13)
                raise ValueError(f"its fingerprint {elided(repr(fingerprint), 40)} is not 32 lowercase hex digits")
            min_vault_format = doc.get("min_vault_format", 1)
            if type(min_vault_format) is not int or min_vault_format < 1:
                raise ValueError(f"its min_vault_format {min_vault_format!r} is not a format number")
            return cls(
                kdf=KdfParams(n=n, r=r, p=p, salt=salt),
                wrapped_key=wrapped,
                fingerprint=fingerprint,
                created=str(doc["created"]),
                path=path,
                min_vault_format=min_vault_format,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KeyfileCorruptError(path, str(exc) or type(exc).__name__) from exc

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Keyfile:
        path = os.path.expanduser(os.fspath(path))
        if _named_fifo(path):  # its open waits for a writer, and its read for the writer's end: it hung for good
            raise KeyfileNotFoundError(
                f"keyfile {path} is not a regular file (a FIFO, whose read waits for a writer); give the keyfile's "
                "path (a pipe is taken as --keyfile <(...))"
            )
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_KEYFILE_BYTES + 1)  # not a whole checkpoint, or /dev/zero, given by mistake
        except FileNotFoundError:
            given = spelled("--keyfile (or CKPTVAULT_KEYFILE)", "keyfile=")
            raise KeyfileNotFoundError(f"keyfile {path} does not exist; give the right path with {given}") from None
        except IsADirectoryError:
            raise KeyfileNotFoundError(f"keyfile {path} is a directory; give the keyfile's path") from None
        except PermissionError:
            raise KeyfileNotFoundError(
                f"keyfile {path} cannot be read (permission denied); run as its owner or give a copy you can read"
            ) from None
        except OSError as exc:
            raise KeyfileCorruptError(path, exc.strerror or str(exc)) from exc
        if len(raw) > MAX_KEYFILE_BYTES or b"{" not in raw[:16]:
            # no JSON object at its start (a passphrase file given as the keyfile; a byte-order mark or
            # UTF-16 may come first, as json reads them), or far bigger than any keyfile
            raise KeyfileCorruptError(path, NOT_A_KEYFILE)
        return cls.from_json(raw, path)

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Keyfile:
        """Write atomically with mode 0600; refuses to replace an existing file unless ``overwrite``,
        and then replaces the file a symlink points to, keeping its owner's and group's permissions
        (and, as root, its owner): a keyfile shared through a link or a group must stay shared."""
        shown = os.path.expanduser(os.fspath(path))
        path = os.path.realpath(shown) if overwrite else shown
        directory = os.path.dirname(os.path.abspath(path))
        exists = keyfile_exists(shown)
        temp_prefix = f".{os.path.basename(path)}{TEMP_MARK}"
        tmp = os.path.join(directory, temp_prefix + secrets.token_hex(4))
        try:
            old = os.stat(path) if overwrite and os.path.exists(path) else None
            os.makedirs(directory, mode=0o700, exist_ok=True)
            _remove_dead_writers_temps(directory, temp_prefix)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _lock_while_written(fd)
                pwrite_all(fd, self.to_json(), 0, tmp)
                os.fsync(fd)
                if old is not None:
                    os.chmod(tmp, stat.S_IMODE(old.st_mode) & 0o770)  # a team's group keeps it; others never
                    if os.geteuid() == 0:  # root rewriting another user's keyfile gives it back to them
                        with contextlib.suppress(OSError):  # root_squash, user namespaces: stays root's
                            os.chown(tmp, old.st_uid, old.st_gid)
                try:
                    _publish(tmp, path, overwrite)
                except FileExistsError:
                    raise exists from None
            finally:
                try:
                    if os.path.lexists(tmp):
                        os.unlink(tmp)
                finally:
                    os.close(fd)  # its lock with it
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # the disk, not the argument: exit 21 as elsewhere
                raise StorageFullError(
                    "write",
                    f"keyfile {shown}",
                    "this machine",
                    exc.strerror or str(exc),
                    hint="free space and run the command again; nothing was changed",
                ) from None
            raise UsageError(f"cannot write keyfile {shown}: {exc.strerror or exc}; nothing was changed") from None
        # the new name survives a power loss, like the bytes; if that fails, the keyfile is still in place
        with contextlib.suppress(OSError):
            fsync_dir(directory)
        return replace(self, path=shown)
