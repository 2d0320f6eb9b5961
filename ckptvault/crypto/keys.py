"""The master key and the subkeys derived from it (HKDF-SHA256, one per purpose)."""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass

MASTER_KEY_SIZE = 32
_INFO_PREFIX = b"ckptvault v1 "


def derive(master: bytes, purpose: str, length: int = 32) -> bytes:
    # cryptography is loaded by the first use of a key (~20 ms of start-up on a slow VM that an
    # unencrypted vault's commands do without), as in keyfile.py and repository.py
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=_INFO_PREFIX + purpose.encode()).derive(
        master
    )


@dataclass(frozen=True, repr=False)
class MasterKey:
    """Random key material; everything the repository needs is derived from it."""

    material: bytes

    def __post_init__(self) -> None:
        if len(self.material) != MASTER_KEY_SIZE:
            raise ValueError("master key must be 32 bytes")

    @classmethod
    def generate(cls) -> MasterKey:
        return cls(secrets.token_bytes(MASTER_KEY_SIZE))

    @property
    def blob_key(self) -> bytes:
        """AES-256-GCM key for every stored blob."""
        return derive(self.material, "blob aes-256-gcm")

    @property
    def chunk_id_key(self) -> bytes:
        """Keyed-BLAKE3 key for chunk IDs."""
        return derive(self.material, "chunk-id blake3")

    @property
    def fingerprint(self) -> str:
        """Public name of the key (reveals nothing about it): 16 bytes, hex."""
        return derive(self.material, "fingerprint", 16).hex()

    def __repr__(self) -> str:
        return f"MasterKey(fingerprint={self.fingerprint})"


_VERIFIER_PLAINTEXT = b"ckptvault key verifier v1"


def make_verifier(master: MasterKey, authenticated: bytes) -> str:
    """Proof, stored in the repository config, that a master key is this repository's, bound to
    ``authenticated`` (the repository ID as ASCII in formats 1 and 2; the config's settings in 3).
    It is an AEAD blob under a derived key: it helps no one guess the passphrase."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = secrets.token_bytes(12)
    sealed = nonce + AESGCM(derive(master.material, "verifier")).encrypt(nonce, _VERIFIER_PLAINTEXT, authenticated)
    return base64.b64encode(sealed).decode()


def check_verifier(master: MasterKey, authenticated: bytes, verifier: str) -> bool:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    try:
        sealed = base64.b64decode(verifier, validate=True)
        plain = AESGCM(derive(master.material, "verifier")).decrypt(sealed[:12], sealed[12:], authenticated)
    except (InvalidTag, ValueError):
        return False
    return plain == _VERIFIER_PLAINTEXT
