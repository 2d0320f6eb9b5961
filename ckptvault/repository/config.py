"""The repository config: the one object read before anything else, stored as plain JSON."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone

from ..chunking import ChunkerParams
from ..codec import CompressionSettings
from ..errors import MalformedObjectError, UnsupportedFormatError, UsageError, config_from_a_copy, elided
from .format import DELTA_FORMAT_VERSION, FORMAT_NAME, FORMAT_VERSION, SETTINGS_FORMAT_VERSION, SUPPORTED_VERSIONS

# 16 MiB: a GB is ~64 objects (large enough for full object-store throughput), and the packs a
# backup holds in memory (one filling, up to two uploading locally) stay under 50 MB.
DEFAULT_PACK_SIZE = 16 * 1024 * 1024
MAX_PACK_SIZE = 1024 * 1024 * 1024  # offsets in pack headers and indexes are u32
ENCRYPTION_MODES = ("none", "aes-256-gcm")
_REPO_ID = re.compile("[0-9a-f]{32}")
_KEY_FINGERPRINT = re.compile("[0-9a-f]{32}")  # MasterKey.fingerprint; a keyfile's is checked so too


class ConfigNotJsonError(MalformedObjectError):
    """Not said as it is: ``Repository.read_config`` tells another tool's repository, another program's file and
    a vault's config damaged apart, and words each (``_config_not_ours``)."""


class ConfigNotOursError(MalformedObjectError):
    """JSON that does not name the ckptvault format: another program's file, unless the vault's objects are
    beside it (``Repository.read_config`` tells which)."""


@dataclass(frozen=True)
class RepoConfig:
    chunker: ChunkerParams = field(default_factory=ChunkerParams)
    compression: CompressionSettings = field(default_factory=CompressionSettings)
    pack_size: int = DEFAULT_PACK_SIZE
    encryption: str = "none"  # or "aes-256-gcm"
    key_fingerprint: str | None = None
    key_verifier: str | None = None
    repo_id: str = field(default_factory=lambda: secrets.token_hex(16))
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    version: int = 0  # 0: the lowest version that holds what this config asks for (format.py)

    def __post_init__(self) -> None:
        if self.version == 0:
            # An encrypted repository is format 3 (its settings authenticated); one with delta coding
            # needs format 2; every other one stays format 1, so an older ckptvault keeps reading it.
            if self.encrypted:
                wanted = SETTINGS_FORMAT_VERSION
            else:
                wanted = DELTA_FORMAT_VERSION if self.compression.delta else FORMAT_VERSION
            object.__setattr__(self, "version", wanted)
        if self.version >= SETTINGS_FORMAT_VERSION and not self.encrypted:
            raise MalformedObjectError(
                f"repository format {self.version} is only ever made encrypted, but the config says it is not: "
                f"the config was altered; {config_from_a_copy()}"
            )
        if self.compression.delta and self.version < DELTA_FORMAT_VERSION:
            raise MalformedObjectError(  # no ckptvault writes one: an older version put into the config by hand
                f"the config says repository format {self.version} with delta coding, which needs format "
                f"{DELTA_FORMAT_VERSION}: it was altered or rolled back; {config_from_a_copy()}"
            )
        if not 1024 * 1024 <= self.pack_size <= MAX_PACK_SIZE:
            raise UsageError(f"pack size {self.pack_size} is out of range; use 1 MiB..1 GiB")
        if self.encryption not in ENCRYPTION_MODES:
            raise UnsupportedFormatError(
                f"encryption mode {self.encryption!r} is not supported by this ckptvault; upgrade ckptvault"
            )

    @property
    def encrypted(self) -> bool:
        return self.encryption != "none"

    @property
    def settings_authenticated(self) -> bool:
        """Whether the key verifier covers ``signed_settings`` (format 3), not only the ID."""
        return self.version >= SETTINGS_FORMAT_VERSION

    def signed_settings(self) -> bytes:
        """Everything the config says but the verifier itself, in one canonical form: what a format-3
        verifier authenticates. Taken from the parsed fields, so a key holder's check compares what it
        will act on."""
        doc = self._doc(with_verifier=False)
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    def to_json(self) -> bytes:
        return json.dumps(self._doc(with_verifier=True), indent=2).encode() + b"\n"

    def _doc(self, *, with_verifier: bool) -> dict[str, object]:
        encryption: dict[str, str | None] = {"mode": self.encryption}
        if self.encrypted:
            encryption["key_fingerprint"] = self.key_fingerprint
            if with_verifier:
                encryption["key_verifier"] = self.key_verifier
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "id": self.repo_id,
            "created": self.created,
            "chunker": self.chunker.to_dict(),
            "compression": self.compression.to_dict(),
            "pack_size": self.pack_size,
            "encryption": encryption,
        }

    @classmethod
    def from_json(cls, raw: bytes, url: str) -> RepoConfig:
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigNotJsonError(f"the config of {url} is not valid JSON ({exc})") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ConfigNotOursError(f"the config of {url} does not name the {FORMAT_NAME} format")
        version = doc.get("version")
        if "version" not in doc:
            raise MalformedObjectError(f"the config of {url} lacks field 'version'; {config_from_a_copy()}")
        if not isinstance(version, int) or isinstance(version, bool):
            raise MalformedObjectError(
                f"the config of {url} is damaged: its version {elided(repr(version), 40)} is not a whole number; "
                f"{config_from_a_copy()}"
            )
        if version not in SUPPORTED_VERSIONS:
            newest = max(SUPPORTED_VERSIONS)
            if version > newest:
                raise UnsupportedFormatError(
                    f"repository format {version} at {url} is newer than this ckptvault supports "
                    f"(up to {newest}); upgrade ckptvault: pip install -U ckptvault"
                )
            # below 1: no ckptvault ever wrote it (formats count from 1), so the config was altered
            raise MalformedObjectError(
                f"the config of {url} is damaged: its version {version} is no repository format (they are "
                f"{min(SUPPORTED_VERSIONS)} to {newest}); {config_from_a_copy()}"
            )
        try:
            _check_fields(doc)
            return cls(
                chunker=ChunkerParams.from_dict(doc["chunker"]),
                compression=CompressionSettings.from_dict(doc["compression"]),
                pack_size=doc["pack_size"],
                encryption=doc["encryption"]["mode"],
                key_fingerprint=doc["encryption"].get("key_fingerprint"),
                key_verifier=doc["encryption"].get("key_verifier"),
                repo_id=doc["id"],
                created=doc["created"],
                version=version,
            )
        except KeyError as exc:
            raise MalformedObjectError(f"the config of {url} lacks field {exc}; {config_from_a_copy()}") from exc
        except (UsageError, ValueError) as exc:  # a value init would refuse (a size out of range): damage here
            raise MalformedObjectError(f"the config of {url} is damaged: {exc}; {config_from_a_copy()}") from exc
        except (TypeError, AttributeError) as exc:  # a field of a shape _check_fields does not know yet
            raise MalformedObjectError(
                f"the config of {url} is damaged: a field has the wrong type ({exc}); {config_from_a_copy()}"
            ) from exc


def _check_fields(doc: dict) -> None:
    """What the code reading a config relies on, checked where it is read: a field of the wrong type
    or shape is damage, named here, not a crash (or a "wrong keyfile") later."""
    if not isinstance(doc.get("id"), str) or not _REPO_ID.fullmatch(doc["id"]):
        raise ValueError(f"its id {doc.get('id')!r} is not 32 hex digits")
    if not isinstance(doc.get("created"), str):
        raise ValueError("its created time is not text")
    compression, encryption = doc.get("compression"), doc.get("encryption")
    chunker = doc.get("chunker", {})  # missing: "lacks field 'chunker'", where it is read
    if not (isinstance(chunker, dict) and isinstance(compression, dict) and isinstance(encryption, dict)):
        raise ValueError("its chunker, compression and encryption fields must be objects")
    if "pack_size" in doc and type(doc["pack_size"]) is not int:  # missing: "lacks field", below
        raise ValueError(f"its pack_size {doc.get('pack_size')!r} is not a whole number")
    for flag in ("bytegroup", "delta"):
        if not isinstance(compression.get(flag, False), bool):
            raise ValueError(f"compression.{flag} {compression[flag]!r} is not true or false")
    if encryption.get("mode") in ENCRYPTION_MODES[1:]:  # an unknown mode is refused as newer, not as damage
        for name in ("key_fingerprint", "key_verifier"):
            if not isinstance(encryption.get(name), str) or not encryption[name]:
                raise ValueError(f"the encrypted vault's config has no valid encryption.{name}")
        fingerprint = encryption["key_fingerprint"]
        if not _KEY_FINGERPRINT.fullmatch(fingerprint):  # damage, not another vault's key (exit 13 said that)
            raise ValueError(f"its key fingerprint {elided(repr(fingerprint), 40)} is not 32 lowercase hex digits")
