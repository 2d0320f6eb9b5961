"""Passphrase-protected keyfiles.

A keyfile is JSON holding the random master key wrapped with AES-256-GCM under a key
derived from the passphrase with scrypt (memory-hard; its parameters are in the file):

    {"format": "ckptvault-keyfile", "version": 1, "created": "...",
     "kdf": {"name": "scrypt", "n": 131072, "r": 8, "p": 1, "salt": "<base64, 16 bytes>"},
     "wrapped_key": "<base64: nonce:12 | AES-GCM(kek, nonce, master:32, aad) | tag:16>",
     "fingerprint": "<32 hex>"}

    kek = scrypt(passphrase utf-8, salt, n, r, p, length 32);  aad = b"ckptvault-keyfile v1"

It is written atomically with mode 0600. Changing the passphrase rewraps the same master
key, so the repository's data is untouched.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from datetime import datetime, timezone

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from ..errors import (
    KeyfileCorruptError,
    KeyfileNotFoundError,
    PassphraseRequiredError,
    UsageError,
    WrongPassphraseError,
)
from ..store.localwrite import fsync_dir
from .keys import MASTER_KEY_SIZE, MasterKey

FORMAT = "ckptvault-keyfile"
VERSION = 1
WRAP_AAD = b"ckptvault-keyfile v1"
DEFAULT_SCRYPT_N = 2**17  # 128 MiB and ~0.3 s here; raise it, never lower it, for real keys
SALT_SIZE = 16
NONCE_SIZE = 12

# A passphrase, or a function that asks for one (called only when a keyfile must be unlocked).
PassphraseSource = str | Callable[[], str] | None


def resolve_passphrase(source: PassphraseSource) -> str:
    passphrase = source() if callable(source) else source
    if passphrase is None:
        raise PassphraseRequiredError()
    return passphrase


@dataclass(frozen=True)
class KdfParams:
    n: int = DEFAULT_SCRYPT_N
    r: int = 8
    p: int = 1
    salt: bytes = b""

    def derive(self, passphrase: str) -> bytes:
        with _AHEAD_LOCK:
            ahead = _AHEAD.pop((self, _passphrase_digest(passphrase)), None)
        if ahead is not None:
            return ahead.result()
        return self._scrypt(passphrase)

    def _scrypt(self, passphrase: str) -> bytes:
        return Scrypt(salt=self.salt, length=32, n=self.n, r=self.r, p=self.p).derive(passphrase.encode("utf-8"))

    def derive_ahead(self, passphrase: str) -> None:
        """Start ``derive`` on another thread (scrypt releases the GIL, so it runs on another core);
        the next ``derive`` with these parameters and this passphrase takes its result."""
        future: Future[bytes] = Future()

        def run() -> None:
            try:
                future.set_result(self._scrypt(passphrase))
            except BaseException as exc:  # handed to whoever takes the result
                future.set_exception(exc)

        with _AHEAD_LOCK:
            _AHEAD[(self, _passphrase_digest(passphrase))] = future
        threading.Thread(target=run, name="ckptvault-kdf", daemon=True).start()


# Derivations started ahead of need (``KdfParams.derive_ahead``), keyed without the passphrase itself.
_AHEAD: dict[tuple[KdfParams, bytes], Future[bytes]] = {}
_AHEAD_LOCK = threading.Lock()


def _passphrase_digest(passphrase: str) -> bytes:
    return hashlib.sha256(passphrase.encode("utf-8")).digest()


@dataclass(frozen=True)
class Keyfile:
    kdf: KdfParams
    wrapped_key: bytes
    fingerprint: str
    created: str
    path: str = ""

    # ---- creating and unlocking ------------------------------------------------------

    @classmethod
    def create(
        cls,
        passphrase: str,
        *,
        master: MasterKey | None = None,
        scrypt_n: int = DEFAULT_SCRYPT_N,
        salt: bytes | None = None,
        nonce: bytes | None = None,
        created: str | None = None,
    ) -> tuple[Keyfile, MasterKey]:
        """A new keyfile for ``master`` (a fresh random key by default). ``salt``, ``nonce``
        and ``created`` exist for known-answer tests; leave them unset."""
        if not passphrase:
            raise UsageError("the passphrase is empty; choose a long passphrase")
        if scrypt_n < 2 or scrypt_n & (scrypt_n - 1):
            raise UsageError(f"scrypt n={scrypt_n} must be a power of two")
        master = master or MasterKey.generate()
        kdf = KdfParams(n=scrypt_n, salt=salt or secrets.token_bytes(SALT_SIZE))
        nonce = nonce or secrets.token_bytes(NONCE_SIZE)
        wrapped = nonce + AESGCM(kdf.derive(passphrase)).encrypt(nonce, master.material, WRAP_AAD)
        created = created or datetime.now(timezone.utc).isoformat(timespec="seconds")
        return cls(kdf=kdf, wrapped_key=wrapped, fingerprint=master.fingerprint, created=created), master

    def unlock(self, passphrase: str) -> MasterKey:
        kek = self.kdf.derive(passphrase)
        try:
            material = AESGCM(kek).decrypt(self.wrapped_key[:NONCE_SIZE], self.wrapped_key[NONCE_SIZE:], WRAP_AAD)
        except InvalidTag:
            raise WrongPassphraseError(self.path or "(in memory)") from None
        master = MasterKey(material)
        if master.fingerprint != self.fingerprint:
            raise KeyfileCorruptError(self.path, "its fingerprint does not match its key")
        return master

    def with_passphrase(self, master: MasterKey, new_passphrase: str) -> Keyfile:
        """The same master key under a new passphrase (and a new salt)."""
        fresh, _ = Keyfile.create(new_passphrase, master=master, scrypt_n=self.kdf.n, created=self.created)
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
        return json.dumps(doc, indent=2).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes, path: str = "") -> Keyfile:
        try:
            doc = json.loads(raw)
            if doc.get("format") != FORMAT:
                raise ValueError("not a ckptvault keyfile")
            if doc.get("version") != VERSION:
                raise ValueError(f"keyfile version {doc.get('version')!r} is not supported")
            kdf = doc["kdf"]
            if kdf["name"] != "scrypt":
                raise ValueError(f"unknown KDF {kdf['name']!r}")
            wrapped = base64.b64decode(doc["wrapped_key"], validate=True)
            if len(wrapped) != NONCE_SIZE + MASTER_KEY_SIZE + 16:
                raise ValueError("wrapped key has the wrong length")
            return cls(
                kdf=KdfParams(
                    n=int(kdf["n"]), r=int(kdf["r"]), p=int(kdf["p"]), salt=base64.b64decode(kdf["salt"], validate=True)
                ),
                wrapped_key=wrapped,
                fingerprint=str(doc["fingerprint"]),
                created=str(doc["created"]),
                path=path,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KeyfileCorruptError(path, str(exc) or type(exc).__name__) from exc

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Keyfile:
        path = os.path.expanduser(os.fspath(path))
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise KeyfileNotFoundError(f"keyfile {path} does not exist; give the right path with --keyfile") from None
        except IsADirectoryError:
            raise KeyfileNotFoundError(f"keyfile {path} is a directory; give the keyfile's path") from None
        except OSError as exc:
            raise KeyfileCorruptError(path, exc.strerror or str(exc)) from exc
        return cls.from_json(raw, path)

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Keyfile:
        """Write atomically with mode 0600; refuses to replace a different keyfile unless ``overwrite``."""
        path = os.path.expanduser(os.fspath(path))
        if os.path.exists(path) and not overwrite:
            raise UsageError(f"{path} already exists; a keyfile is never overwritten (pick another path)")
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, mode=0o700, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(directory)  # the new name survives a power loss, like the bytes
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return replace(self, path=path)
