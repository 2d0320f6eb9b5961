"""What differs between fsspec backends, in one table: how a put is made atomic, whether a
create-if-absent write is enforced by the server, which defaults make the backend's own retries
and caches step aside for ckptvault's, and what a crashed writer can leave behind.

Why each default (see docs/backends.md):
- ``use_listings_cache=False``: s3fs/gcsfs/adlfs cache directory listings per instance, and an
  ``exists`` answered from a stale listing would hide objects other writers added since.
- S3: botocore's flexible checksums only where S3 requires them: ckptvault seals and verifies every
  blob itself (checksum or AES-GCM tag), so a CRC32 of every body in Python is CPU for nothing.
- S3: one attempt per call inside s3fs and botocore (``retries``/``total_max_attempts`` = 1) so that
  retries, backoff and the deadline are ckptvault's alone (RetryingStore); otherwise up to 5 x 5
  hidden attempts multiply the wait. Connect and read timeouts bound a silent server on reads; a
  PUT can still wait forever for "100 Continue", which the per-call deadline ends.
- GCS against an emulator (``endpoint_url`` or ``STORAGE_EMULATOR_HOST``): gcsfs's experimental
  filesystem probes each bucket's type over gRPC, which hangs for a minute per bucket there, so
  gcsfs's plain filesystem is used (``filesystem_class``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import difflib
import inspect
import os
import re
import types
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError
from .failures import HIDDEN, BackendAdvice, hide_credentials
from .options import names_a_file

OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "memory"})
RENAME_PUT = frozenset({"sftp", "ssh"})  # no atomic PUT: write a temp name, then rename
# One session serves one call at a time (paramiko's SFTP client deadlocks under concurrent threads), and
# a dropped session is not re-established by the filesystem: these get a pool of sessions.
POOLED = frozenset({"sftp", "ssh"})
CONDITIONAL_PUT = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"})
S3 = frozenset({"s3", "s3a"})
# Where a storage option the filesystem does not name goes. Local and memory filesystems, and gcsfs, hand it
# to fsspec, which drops it (gcsfs went on with other credentials than -o anon=true or -o credentials=...
# meant); fsspec's SFTP to paramiko's connect, and s3fs to aiobotocore's session (which takes ``profile``),
# whose TypeError would surface as a storage failure inside the first call: any such option is refused.
# adlfs passes extras on to DefaultAzureCredential: only a near miss of a name it takes is refused, a
# misspelt ``account_name``.
STRICT_OPTIONS = frozenset({"file", "local", "memory", "sftp", "ssh", "s3", "s3a", "gs", "gcs"})
TYPO_CHECKED_OPTIONS = frozenset({"az", "abfs", "abfss"})
# What a user of one backend may give another by habit: said as the option that does it there
INSTEAD = {("gs", "anon"): "token=anon", ("gcs", "anon"): "token=anon", ("gs", "credentials"): "token=/path/key.json"}
SFTP = frozenset({"sftp", "ssh"})
WEBDAV = frozenset({"webdav", "dav"})
# fsspec's own options, taken by every filesystem: listing and instance caches, the event loop
FSSPEC_OPTIONS = frozenset(
    {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache", "asynchronous", "loop"}
)


@dataclass(frozen=True)
class Profile:
    protocol: str
    remote: bool  # bytes cross a network: metadata cache, more parallel transfers
    object_store: bool  # flat keys, one atomic PUT per object, no directories to make
    rename_put: bool  # atomic put = temp name + rename (and rename without overwrite = create-if-absent)
    conditional_put: bool  # the server enforces create-if-absent (If-None-Match: * and equivalents)
    pooled: bool  # a pool of sessions, one per concurrent call; a session that failed is closed


def profile_for(protocols: str | tuple[str, ...], *, local_disk: bool = False, in_memory: bool = False) -> Profile:
    """``local_disk``/``in_memory``: the filesystem class is (a subclass of) fsspec's local or memory
    one, whatever protocol name it registers (the tests' faulty:// is a memory filesystem)."""
    names = (protocols,) if isinstance(protocols, str) else tuple(protocols)
    protocol = names[0] if names else "file"
    known = set(names)
    return Profile(
        protocol=protocol,
        remote=not (local_disk or in_memory),
        object_store=in_memory or bool(known & OBJECT_STORES),
        rename_put=bool(known & RENAME_PUT),
        conditional_put=local_disk or in_memory or bool(known & (CONDITIONAL_PUT | RENAME_PUT)),
        pooled=bool(known & POOLED),
    )


def default_options(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    """Options the user did not set, filled with ckptvault's defaults for the protocol."""
    out = dict(options)
    if protocol in OBJECT_STORES and protocol != "memory":
        out.setdefault("use_listings_cache", False)
    if protocol in S3:
        _check_settings(out, ("client_kwargs", "config_kwargs"))
        config = dict(out.get("config_kwargs") or {})
        config.setdefault("connect_timeout", 10)
        config.setdefault("read_timeout", 60)
        config.setdefault("retries", {"total_max_attempts": 1})
        # every blob carries its own checksum or AEAD tag, verified on each read; botocore's extra
        # CRC32 of every body costs client CPU for nothing ckptvault does not already check
        config.setdefault("request_checksum_calculation", "when_required")
        config.setdefault("response_checksum_validation", "when_required")
        out["config_kwargs"] = config
        _check_ca_bundle(out)
        _check_endpoint(out)
    if protocol in AZURE:
        _check_azure_key(out)
    if protocol in GCS and out.get("token") is None:
        _check_google_credentials()
    if protocol in ("sftp", "ssh"):  # a shell expands ~ only at the start of a word, not in -o key_filename=~/k
        key = out.get("key_filename")
        keys = [_expanded(k) for k in key] if isinstance(key, (list, tuple)) else [_expanded(key)]
        if key is not None:
            out["key_filename"] = keys if isinstance(key, (list, tuple)) else keys[0]
        for path in keys:  # named now, not once a server answers: an unreachable host was retried for minutes
            _check_readable(path)
        from .ssh_hosts import host_key_policy  # paramiko, only for an SFTP vault

        out["host_key_policy"] = host_key_policy(out.get("host_key_policy", "warn"))
    auth = out.get("auth")
    if protocol in WEBDAV and isinstance(auth, list) and len(auth) == 2 and all(isinstance(a, str) for a in auth):
        # -o 'auth=["user","password"]' is typed as a JSON list; httpx takes a pair only as a tuple, and refused it
        # ("Invalid auth argument"), quoting the password: no -o gave a WebDAV server credentials
        out["auth"] = tuple(auth)
    token = out.get("token")
    if protocol in ("gs", "gcs") and isinstance(token, str) and names_a_file(token):
        # gcsfs takes any other string for an access token: a mistyped key file path would be sent to
        # Google, and fail as a network or authentication error that never names the file
        out["token"] = os.path.expanduser(token)
        if not os.path.isfile(out["token"]):
            raise UsageError(
                f"-o token={token}: no such file on this machine; give the path of a service-account JSON key "
                "(~ is expanded), or leave token out to use the environment's credentials"
            )
    return out


def _check_settings(options: dict[str, Any], names: tuple[str, ...]) -> None:
    """Options that hold settings (``-o client_kwargs.verify=...``) given one word instead (``-o client_kwargs=x``):
    ``client_kwargs`` escaped as an internal error (AttributeError, a traceback saved), ``config_kwargs`` as
    "repository ... is not a valid URL: dictionary update sequence element #0 has length 1"."""
    for name in names:
        value = options.get(name)
        if value is not None and not isinstance(value, dict):
            raise UsageError(
                f"storage option {name} holds settings, not {type(value).__name__} {str(value)[:40]!r}; give each "
                f"as -o {name}.NAME=VALUE"
            )


def _check_ca_bundle(options: dict[str, Any]) -> None:
    """A CA bundle (``-o client_kwargs.verify=PATH``, else ``AWS_CA_BUNDLE``) that is no file on this machine:
    botocore failed every request with "HTTPClientError: An HTTP Client raised an unhandled exception: [Errno 2]
    No such file or directory", retried as an outage for 2 minutes, naming neither the setting nor the file."""
    verify = (options.get("client_kwargs") or {}).get("verify")
    setting, bundle = ("-o client_kwargs.verify", verify) if verify is not None else ("AWS_CA_BUNDLE", None)
    if verify is None:
        bundle = os.environ.get("AWS_CA_BUNDLE") or None
    if isinstance(bundle, str) and not os.path.isfile(os.path.expanduser(bundle)):
        raise UsageError(
            f"{setting}={bundle}: no such file on this machine; give the path of a PEM file of the certificate "
            "authorities to trust, or leave it unset for the system's"
        )


def _check_endpoint(options: dict[str, Any]) -> None:
    """An S3 endpoint botocore cannot use (``-o endpoint_url=`` left empty, a host with no ``http://``): it
    refused it inside the first call, "storage failed: GET config on s3://...: ValueError: Invalid endpoint: ",
    exit 20, naming no setting."""
    from botocore.utils import (  # type: ignore[import-untyped]  # only for an s3:// vault
        is_valid_endpoint_url,
        is_valid_ipv6_endpoint_url,
    )

    for setting, value in (
        ("endpoint_url", options.get("endpoint_url")),
        ("client_kwargs.endpoint_url", (options.get("client_kwargs") or {}).get("endpoint_url")),
    ):
        if value is None:
            continue
        if not isinstance(value, str) or not (is_valid_endpoint_url(value) or is_valid_ipv6_endpoint_url(value)):
            # a login before an @ is never shown, with a scheme (hide_credentials) or without one
            shown = re.sub(r"^[^/@]*@", f"{HIDDEN}@", hide_credentials(value)) if isinstance(value, str) else value
            said = "is empty" if value == "" else f"{shown!r} is not a URL botocore can use"
            raise UsageError(
                f"storage option {setting} {said}; give the S3 server's address with its scheme "
                "(-o endpoint_url=http://HOST:PORT), or leave it out for AWS"
            )


# adlfs's account-key settings (it reads the connection string first, and the key only without one)
AZURE_CONNECTION_ENV, AZURE_KEY_ENV = "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_KEY"


def _check_azure_key(options: dict[str, Any]) -> None:
    """An account key that is not base64 failed every request inside the SDK's signing ("AzureSigningError:
    Invalid base64-encoded string", exit 20) naming no setting."""
    connection = _given(options, "connection_string", AZURE_CONNECTION_ENV)
    if connection is not None:
        setting, text = connection
        key = _connection_string_key(text)
        if key is not None and not _base64(key):
            raise UsageError(
                f"the AccountKey in {setting} is not base64; copy the connection string again from the storage "
                "account's Access keys"
            )
        return
    key_given = _given(options, "account_key", AZURE_KEY_ENV)
    if key_given is not None:
        setting, key = key_given
        if not _base64(key):
            raise UsageError(
                f"{setting} is not base64 (an Azure storage account key is 88 characters, from the storage "
                "account's Access keys); give the account's key"
            )


def _given(options: dict[str, Any], name: str, env: str) -> tuple[str, str] | None:
    """The setting adlfs takes ``name`` from, as a message names it, and its text: the option, else ``env``
    (adlfs's ``option or os.getenv(env)``: an empty option falls through to the environment)."""
    value = options.get(name)
    if isinstance(value, str) and value:
        return f"-o {name}", value
    if value is not None and not isinstance(value, str):
        return None  # an object given through the API: the SDK's to judge
    from_env = os.environ.get(env)
    return (env, from_env) if from_env else None


def _connection_string_key(text: str) -> str | None:
    """The AccountKey of an Azure connection string (``Name=value;...``, names in any case), if it has one."""
    for part in text.split(";"):
        name, sep, value = part.partition("=")
        if sep and name.strip().lower() == "accountkey":
            return value.strip()
    return None


def _base64(text: str) -> bool:
    """Whether the SDK's ``base64.b64decode`` (not validating: other characters dropped) takes ``text``."""
    try:
        return bool(base64.b64decode(text))
    except (binascii.Error, ValueError):
        return False


def _check_google_credentials() -> None:
    """GOOGLE_APPLICATION_CREDENTIALS that cannot be used: gcsfs tries it, then others, and falls back to anonymous
    access without a word (a mistyped path went on anonymously: "access denied" from GCS, naming no variable)."""
    path = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if not path:
        return
    import google.auth  # gcsfs's own dependency, only for a gs:// vault

    try:
        google.auth.load_credentials_from_file(os.path.expanduser(path))
    except Exception as exc:  # google-auth's DefaultCredentialsError: its first argument says what is wrong
        said = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
        raise UsageError(
            f"GOOGLE_APPLICATION_CREDENTIALS={path} cannot be used ({said}); give the path of a service-account or "
            "authorized-user JSON key, or unset it (gcsfs would go on without credentials)"
        ) from None


def filesystem_class(cls: type, protocol: str, options: dict[str, Any]) -> type:
    """``cls``, but gcsfs's plain filesystem against an emulator (``endpoint_url`` or
    ``STORAGE_EMULATOR_HOST``): the experimental one that gcsfs registers (unless
    GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set before it was imported) probes each bucket's
    type over gRPC, which an emulator does not serve: a minute per bucket."""
    if protocol in GCS and (options.get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST")):
        return next((c for c in cls.__mro__ if c.__module__ == "gcsfs.core" and c.__name__ == "GCSFileSystem"), cls)
    return cls


AZURE = frozenset({"az", "abfs", "abfss"})
GCS = frozenset({"gs", "gcs"})
AZURE_RETRY_COUNTS = ("total_retries", "connect_retries", "read_retries", "status_retries")


def _expanded(key_file: Any) -> Any:
    """A path with ~ expanded; anything else (None, a key object) as it is."""
    return os.path.expanduser(os.fspath(key_file)) if isinstance(key_file, (str, os.PathLike)) else key_file


def _check_readable(key_file: Any) -> None:
    if not isinstance(key_file, str):
        return
    try:
        with open(key_file, "rb"):
            pass
    except OSError as exc:
        raise UsageError(
            f"-o key_filename={key_file}: cannot read {key_file} ({exc.strerror or exc}); give the path of an SSH "
            "private key on this machine (~ is expanded)"
        ) from None


def tune(fs: Any, protocol: str, options: dict[str, Any]) -> None:
    """Settings that are class attributes rather than constructor options."""
    if protocol in S3 and "retries" not in options:
        fs.retries = 1  # S3FileSystem(retries=...) is rejected by its session; it is an attribute
    if protocol in AZURE:
        # adlfs passes no retry settings to azure-storage-blob, whose ExponentialRetry (15 s, then x3, 3 times)
        # ran inside each of ckptvault's attempts: an outage was first said after ~64 s, a busy 503 ended as
        # "no answer" at the call's deadline, a restore gave up after ~15 minutes. Its policy object is shared
        # by every client made from the service client: one try each, ckptvault's retries the only ones.
        policy = getattr(getattr(getattr(fs, "service_client", None), "_config", None), "retry_policy", None)
        for name in AZURE_RETRY_COUNTS:
            if isinstance(getattr(policy, name, None), int):
                setattr(policy, name, 0)
    if protocol in GCS:
        # gcsfs retries every request itself, 6 tries up to 32 s apart (~35 s), a count fixed when the
        # library is imported, inside each of ckptvault's attempts and out of its sight: a failing call
        # took ~220 s whatever CKPTVAULT_RETRY_FOR said, and no outage was ever said. Its retry decorator
        # keeps the plain method as ``__wrapped__``: this filesystem calls that, one try each, but for
        # what the decorator also did that is not an outage (_gcs_request).
        plain = getattr(getattr(type(fs), "_request", None), "__wrapped__", None)
        if callable(plain):
            fs._request = types.MethodType(_gcs_request(plain), fs)


GCS_AUTH_TRIES = 3  # a token refused as it expires, or its refresh failing once, passes on the next try
GCS_AUTH_PAUSE_S = 0.5


def _gcs_request(plain: Any) -> Any:
    """gcsfs's ``_request`` without its retries of outages (ckptvault's own), keeping two things its
    retry decorator did: a 401 "Invalid Credentials" is tried again at once, up to GCS_AUTH_TRIES in
    all, since a token that expired between the check and the call is refreshed by the next one; and a
    requester-pays bucket is named."""

    async def request(self: Any, *args: Any, **kwargs: Any) -> Any:
        tries = 1
        while True:
            try:
                return await plain(self, *args, **kwargs)
            except Exception as exc:
                code, message = getattr(exc, "code", None), str(getattr(exc, "message", ""))
                if code == 400 and "requester pays" in message:
                    raise BackendAdvice(
                        "the bucket is requester pays: give -o requester_pays=true (storage_options) to be billed "
                        "for its requests"
                    ) from exc
                # (gcsfs turns a token refresh that failed into this 401 too)
                if code != 401 or "Invalid Credentials" not in message or tries == GCS_AUTH_TRIES:
                    raise
            tries += 1
            await asyncio.sleep(GCS_AUTH_PAUSE_S)

    return request


def bucket_of(protocol: str, root: str) -> str:
    """The bucket (or container) part of an object store root, for messages."""
    if protocol in OBJECT_STORES and protocol != "memory":
        return root.lstrip("/").split("/", 1)[0]
    return ""


def option_error(cls: type, protocol: str, names: set[str]) -> str | None:
    """What is wrong with the option ``names`` given for a ``protocol`` filesystem of class ``cls``,
    or None (see STRICT_OPTIONS). Known: every parameter the class's ``__init__`` names, and its
    bases' as far as each passes ``**kwargs`` on."""
    if protocol not in STRICT_OPTIONS | TYPO_CHECKED_OPTIONS or not names:
        return None
    if protocol in SFTP:
        import paramiko  # type: ignore[import-untyped]

        known = {"temppath", "host_key_policy", *_named(paramiko.SSHClient.connect)} - {"hostname"}
    else:
        known = set(FSSPEC_OPTIONS)
        if protocol in S3:  # s3fs hands what it does not name to aiobotocore's session
            import aiobotocore.session  # type: ignore[import-untyped]

            known.update(_named(aiobotocore.session.AioSession.__init__))
        for klass in cls.__mro__:
            init = vars(klass).get("__init__")
            if init is None:
                continue
            known.update(_named(init))
            if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(init).parameters.values()):
                break
    for name in sorted(names - known):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8) or [INSTEAD.get((protocol, name), "")]
        if close[0] or protocol in STRICT_OPTIONS:
            suggestion = f" (did you mean {close[0]}?)" if close[0] else ""
            where = "a local folder" if protocol in ("file", "local") else f"{protocol}://"
            return f"{where} takes no storage option {name!r}{suggestion}; the options are in docs/backends.md"
    return None


def nested_option_error(protocol: str, options: dict[str, Any], explicit: set[str]) -> str | None:
    """What is wrong with the names inside s3fs's ``client_kwargs`` (botocore's ``create_client``) and
    ``config_kwargs`` (botocore's ``Config``), given by the URL or the call, or None. Both refuse a name
    they do not take with a TypeError inside the first call, which was a storage failure (exit 20)."""
    if protocol not in S3:
        return None
    for group in sorted({"client_kwargs", "config_kwargs"} & explicit):
        given = options.get(group)
        if not isinstance(given, dict):
            continue  # the backend's to judge
        if group == "client_kwargs":
            import botocore.session  # type: ignore[import-untyped]

            known = _named(botocore.session.Session.create_client) - {"service_name", "config"}
        else:
            import botocore.config  # type: ignore[import-untyped]

            known = set(botocore.config.Config.OPTION_DEFAULTS)
        for name in sorted(set(given) - known):
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
            suggestion = f" (did you mean {group}.{close[0]}?)" if close else ""
            return f"s3:// takes no storage option '{group}.{name}'{suggestion}; the options are in docs/backends.md"
    return None


# options whose value must be a number (in any backend that takes them, at any depth: botocore's
# ``config_kwargs.read_timeout``), and any ``*_timeout``: a typo found at once, not as a network failure
# retried (SFTP's port) or a TypeError inside the first call (s3fs's max_concurrency). Only what typing
# text can make is refused (text, booleans, JSON lists and objects): an object given through the API (aiohttp's
# ClientTimeout as gcsfs's ``session_kwargs.timeout``) is the backend's to judge.
NUMERIC_OPTIONS = frozenset(
    (
        "port",
        "max_concurrency",
        "timeout",
        "block_size",
        "default_block_size",
        "max_pool_connections",
        "max_attempts",
    )
)


# options whose value is yes or no: text other than true/false/yes/no/on/off (options.parse_value) was passed
# on as it was, and any non-empty text is true: -o anon=maybe read S3 anonymously
BOOLEAN_OPTIONS = frozenset(
    (
        "anon",
        "use_ssl",
        "version_aware",
        "requester_pays",
        "look_for_keys",
        "allow_agent",
        "compress",
        "gss_auth",
        "gss_kex",
        "fixed_upload_size",
        "cache_regions",
        "use_listings_cache",
        "skip_instance_cache",
        "assume_container_exists",
        "secure_serialize",
        "check_connection",
        "default_fill_cache",
        "auto_mkdir",
    )
)


def _numeric(name: Any) -> bool:
    return isinstance(name, str) and (name in NUMERIC_OPTIONS or name.endswith("_timeout"))


def option_value_error(options: dict[str, Any], within: str = "") -> str | None:
    """What is wrong with a value in ``options`` (typed as options.parse_value types them), or None."""
    for name, value in options.items():
        dotted = f"{within}{name}"
        if _numeric(name) and isinstance(value, (str, bool, list, dict)):
            return f"storage option {dotted} must be a number, not {value!r}"
        if name in BOOLEAN_OPTIONS and isinstance(value, (str, list, dict)):
            return f"storage option {dotted} must be true or false, not {value!r}"
        if isinstance(value, dict):
            problem = option_value_error(value, f"{dotted}.")
            if problem:
                return problem
    return None


def _named(function: Any) -> set[str]:
    """The parameters that ``function`` takes by name."""
    params = inspect.signature(function).parameters.values()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}


def install_hint(protocol: str) -> str:
    extra = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
    extra.update({"sftp": "sftp", "ssh": "sftp"})
    name = extra.get(protocol)
    return f"pip install 'ckptvault[{name}]'" if name else "install the fsspec implementation for it"
