"""Storage options: where they come from, how their text values are typed, and how a URL is shown.

Options reach fsspec from three places, later ones winning: the ``CKPTVAULT_STORAGE_OPTIONS``
environment variable (a JSON object, or ``key=value,key=value``), the repository URL's query string
(``s3://bucket/vault?endpoint_url=http://127.0.0.1:9000``), and the options given to the call (the
CLI's ``-o key=value``). The backends read their own environment as well (``AWS_*``,
``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_STORAGE_*``, fsspec's ``FSSPEC_<PROTOCOL>_<OPTION>``).
None of it is ever stored in the repository, and ``display_url`` keeps secrets out of messages.

Text values are typed the way a shell user means them: ``true``/``false``, numbers, JSON objects
and lists; a dotted key (``client_kwargs.region_name=eu-west-1``) sets a nested option. Values of
keys that name credentials or identities (``key``, ``secret``, ``token``, ``password``, ``project``,
...) always stay text, so a numeric password or project number is not turned into a number.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from ..errors import UsageError

ENV_OPTIONS = "CKPTVAULT_STORAGE_OPTIONS"
ENV_UPLOADS = "CKPTVAULT_UPLOADS"
ENV_DOWNLOADS = "CKPTVAULT_DOWNLOADS"
ENV_READAHEAD = "CKPTVAULT_READAHEAD_MIB"

# Name parts (split at "_") that make a key's value text even when it looks like a number or a
# boolean: credentials, identities and addresses. look_for_keys stays a boolean, key_filename text.
_TEXT_PARTS = frozenset(
    [
        "key",
        "secret",
        "token",
        "password",
        "passphrase",
        "credential",
        "credentials",
        "sas",
        "signature",
        "connection",
        "user",
        "username",
        "account",
        "project",
        "profile",
        "region",
        "host",
        "hostname",
        "name",
        "endpoint",
        "url",
        "tenant",
        "id",
        "bucket",
        "container",
        "path",
        "filename",
        "policy",
    ]
)


def _is_text_key(key: str) -> bool:
    name = key.rsplit(".", 1)[-1].lower()
    if name.endswith("timeout"):  # adlfs's connection_timeout=30 is a number, "connection" or not
        return False
    return any(part in _TEXT_PARTS for part in name.split("_"))


# Name parts of the options whose values are credentials, hidden from messages; not a file's path, nor
# the words that name a way to authenticate (gcsfs's token=anon, cloud, google_default, ...).
_SECRET_PARTS = frozenset(
    ["key", "secret", "token", "password", "passphrase", "credential", "credentials", "sas", "connection"]
)
_NOT_SECRETS = frozenset(["anon", "cloud", "google_default", "cache", "browser", "true", "false", "none"])


def credential_values(options: dict[str, Any]) -> tuple[str, ...]:
    """The text values of credential options (nested ones too: ``client_kwargs``), longest first."""
    found: list[str] = []
    for key, value in options.items():
        parts = set(str(key).lower().split("_"))
        if isinstance(value, dict):
            found += credential_values(value)
        elif isinstance(value, str) and parts & _SECRET_PARTS and not parts & {"filename", "file"} and _secret(value):
            found.append(value)
        elif isinstance(value, (list, tuple)) and parts & (_SECRET_PARTS | {"auth"}):  # webdav4's (user, password)
            found += [item for item in value if isinstance(item, str) and _secret(item)]
    return tuple(sorted(set(found), key=len, reverse=True))


def _secret(value: str) -> bool:
    return len(value) >= 4 and value.lower() not in _NOT_SECRETS and not names_a_file(value)


def names_a_file(value: str) -> bool:
    """Whether an option's text value reads as a file's path (gcsfs's ``token=/path/key.json``)."""
    return value.startswith(("/", "~", ".")) or value.endswith(".json")


def parse_value(key: str, text: str) -> Any:
    """Type one option value given as text (see the module docstring)."""
    if _is_text_key(key):
        return text
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    if lowered in ("none", "null"):
        return None
    if re.fullmatch(r"[+-]?\d+", lowered):
        return int(lowered)
    if re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+|\d+)(e[+-]?\d+)?", lowered):
        return float(lowered)
    if text.strip()[:1] in "{[":
        try:
            return json.loads(text)
        except ValueError:
            raise UsageError(f"storage option {key}: {text!r} is not valid JSON") from None
    return text


def _set(options: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if not all(parts):
        raise UsageError(f"storage option {key!r} is not a valid name")
    node = options
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UsageError(f"storage option {key!r}: {part} is already set to a value, not a group of options")
        node = child
    node[parts[-1]] = value


def typed_options(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Options with text values typed and dotted keys nested; other values are kept as given."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        _set(out, key, parse_value(key, value) if isinstance(value, str) else value)
    return out


def _env_options(environ: Mapping[str, str]) -> dict[str, Any]:
    text = environ.get(ENV_OPTIONS, "").strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError:
            raise UsageError(f"{ENV_OPTIONS} is not a valid JSON object") from None
        if not isinstance(value, dict):
            raise UsageError(f"{ENV_OPTIONS} must be a JSON object or key=value,key=value")
        return value
    pairs: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise UsageError(f"{ENV_OPTIONS}: {part!r} is not key=value")
        pairs[key.strip()] = value
    return pairs


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_options(
    url: str, given: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> tuple[str, dict[str, Any], set[str]]:
    """The URL without its query string, the merged, typed options (environment < URL < given), and
    the names the URL and ``given`` set (those to check: the environment's may be meant for another
    backend than this vault's)."""
    environ = os.environ if environ is None else environ
    query: dict[str, Any] = {}
    if "://" in url and "?" in url:
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        url = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
    explicit = _merge(typed_options(query), typed_options(dict(given or {})))
    return url, _merge(typed_options(_env_options(environ)), explicit), set(explicit)


def display_url(url: str) -> str:
    """The URL as messages show it: no query string (options may hold secrets), no password."""
    if "://" not in url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:  # malformed ("sftp://u:pw@[::1/x"): refused later, shown meanwhile with no query nor userinfo
        scheme, _, rest = url.partition("://")
        return f"{scheme}://{rest.split('?', 1)[0].rpartition('@')[2]}"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        netloc = f"{userinfo.split(':', 1)[0]}@{hostport}"
    return f"{parts.scheme}://{netloc}{parts.path}"  # urlunsplit writes local:/x for local:///x


@dataclass(frozen=True)
class TransferLimits:
    """How many transfers run at once: pack uploads during a backup, range reads during a restore.

    Object stores pay a round trip per request and give each connection a share of the bandwidth,
    so they get more parallel transfers than a local disk, which only seeks more when asked to do
    more at once. Each pack upload holds one pack in memory (16 MiB by default). A restore from a
    local disk is CPU-bound (decode, verify, write): two reads per core keep the cores busy, and
    more threads only switch more (measured on 2 cores: 8 threads 1.52 s, 4 threads 1.40 s)."""

    uploads: int
    downloads: int

    @classmethod
    def from_env(cls, remote: bool, environ: Mapping[str, str] | None = None) -> TransferLimits:
        environ = os.environ if environ is None else environ
        local_reads = min(16, 2 * (os.cpu_count() or 2))
        default = cls(uploads=4, downloads=16) if remote else cls(uploads=2, downloads=local_reads)
        return cls(
            uploads=_env_count(environ, ENV_UPLOADS, default.uploads),
            downloads=_env_count(environ, ENV_DOWNLOADS, default.downloads),
        )


def env_number(
    name: str,
    default: float,
    *,
    lo: float = 0,
    hi: float = math.inf,
    whole: bool = False,
    environ: Mapping[str, str] | None = None,
) -> float:
    """A number setting from the environment: unset or blank is ``default``; anything but a finite
    number in lo..hi (a whole one when ``whole``) is refused, naming the variable."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw) if whole else float(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not a {'whole ' if whole else ''}number") from None
    if not (math.isfinite(value) and lo <= value <= hi):
        bounds = f"between {lo:g} and {hi:g}" if math.isfinite(hi) else f"a finite number of at least {lo:g}"
        raise UsageError(f"{name}={raw!r} must be {bounds}")
    return value


def _env_count(environ: Mapping[str, str], name: str, default: int) -> int:
    return int(env_number(name, default, lo=1, hi=256, whole=True, environ=environ))


def read_ahead_bytes(environ: Mapping[str, str] | None = None) -> int:
    """The read-ahead window for sequential range reads on remote stores (readahead.py); 0 = off."""
    return int(env_number(ENV_READAHEAD, 8, hi=1024, environ=environ) * 1024 * 1024)
