"""What a backend exception means: missing, exists, denied, full, passing or permanent.

fsspec backends fail in their own vocabularies: s3fs turns S3 error codes into OSErrors (a 412
becomes FileExistsError only when the server names the If-None-Match condition, otherwise
``OSError(EINVAL)``) and leaves connection errors as botocore/aiohttp exceptions; gcsfs raises
``HttpError`` with a ``code``; adlfs passes Azure's ``HttpResponseError`` with ``status_code`` and
``error_code``; paramiko raises ``SSHException`` and ``IOError``. ``classify`` reads the exception and
its causes (``__cause__``/``__context__``) by status code, error code, class name and errno, without
importing any backend, and returns a ``Failure``. The one place that acts on it is
``storage_error``.

Retryable: connection refused/reset/closed, timeouts, HTTP 408/429/5xx, throttling codes. Permanent:
other 4xx (bad request, denied, precondition), a missing bucket, unknown programming errors.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import sys
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..errors import ObjectExistsError, ObjectNotFoundError, StorageError, StorageFullError


class Kind(Enum):
    NOT_FOUND = "not found"  # the object is missing
    NO_BUCKET = "no bucket"  # the bucket or container itself is missing
    EXISTS = "exists"  # a create-if-absent write lost (FileExistsError, 412, ConditionNotMet)
    DENIED = "denied"  # credentials or permissions
    FULL = "full"  # no space / quota
    TRANSIENT = "transient"  # may pass: retry with backoff
    PERMANENT = "permanent"  # will not pass by retrying


@dataclass(frozen=True)
class Failure:
    kind: Kind
    reason: str  # one line for the user

    @property
    def retryable(self) -> bool:
        return self.kind is Kind.TRANSIENT


RETRYABLE_STATUS = frozenset({408, 429})
RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestTimeout",
        "InternalError",
        "InternalServerError",
        "ServiceUnavailable",
        "ServerBusy",
        "OperationTimedOut",
        "OperationAborted",
        "RequestTimeTooSkewed",  # the client's clock is resynced from the answer before the retry
    }
)
NO_BUCKET_CODES = frozenset({"NoSuchBucket", "ContainerNotFound", "BucketNotFound", "ContainerBeingDeleted"})
NOT_FOUND_CODES = frozenset({"NoSuchKey", "BlobNotFound", "ResourceNotFound", "NotFound"})
EXISTS_CODES = frozenset({"PreconditionFailed", "ConditionNotMet", "BlobAlreadyExists", "ConditionalRequestConflict"})
# S3's signed requests carry the client's time: one more than 15 minutes off is refused with a 403
CLOCK_CODES = frozenset({"RequestTimeTooSkewed"})
_CLOCK_TEXT = re.compile(r"RequestTimeTooSkewed|request time and the server's time is too large", re.IGNORECASE)
DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "AuthenticationFailed",
        "AuthorizationFailure",
        "AuthorizationPermissionMismatch",
        "AccountIsDisabled",
        "InsufficientAccountPermissions",
        "AllAccessDisabled",
    }
)
# Exception class names (anywhere in the cause chain) of failures that may pass: botocore,
# aiohttp, urllib3/requests, azure-core, paramiko, fsspec.
RETRYABLE_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ProxyConnectionError",
        "HTTPClientError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "IncompleteRead",
        "ResponseParserError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ClientConnectorError",
        "ClientConnectionError",
        "ClientOSError",
        "ServerTimeoutError",
        "ConnectionTimeoutError",
        "SocketTimeoutError",
        "ServiceRequestError",
        "ServiceResponseError",
        "ServiceRequestTimeoutError",
        "ServiceResponseTimeoutError",
        "ChunkedEncodingError",
        "ProtocolError",
        "ReadTimeout",
        "ConnectTimeout",
        "SSHException",
        "NoValidConnectionsError",
        "FSTimeoutError",
        "TransportError",
        "RetryError",
        "RemoteProtocolError",  # httpx (WebDAV): a server that closed the connection without an answer
        "ChecksumError",  # gcsfs with -o consistency=md5|crc32c: a body damaged on its way; sent again
    }
)
CONNECTION_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EAGAIN,
        errno.EIO,
        errno.EBUSY,  # s3fs: 503 SlowDown / ServiceUnavailable
        getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs: 500 InternalError
    }
)
ANSWERED_ERRNOS = frozenset({errno.EBUSY, errno.EIO, getattr(errno, "EREMOTEIO", errno.EIO)})  # s3fs's 5xx
PERMANENT_ERRNOS = frozenset(
    {
        errno.EINVAL,
        errno.ENOSYS,
        errno.EPERM,
        errno.ENAMETOOLONG,
        errno.EMSGSIZE,
        errno.EROFS,
        errno.EISDIR,
        errno.ENOTDIR,  # a file where the repository (or one of its folders) should be
        errno.ELOOP,
    }
)
# paramiko's login failures; "saw EOF", "transport shut down" and a timeout are a connection that
# dropped or a server that went silent meanwhile
SSH_AUTH_NAMES = frozenset({"AuthenticationException", "BadAuthenticationType", "PasswordRequiredException"})
_SSH_NO_GREETING = "Error reading SSH protocol banner"
_SSH_DROPPED_TEXT = re.compile(r"saw EOF|transport shut down|Authentication timeout", re.IGNORECASE)
# TLS that cannot pass by retrying: a certificate that does not verify, or TLS spoken to a plain HTTP
# port (or the reverse); a TLS connection dropped midway (SSLEOFError) stays transient
_TLS_MISMATCH = re.compile(r"CERTIFICATE_VERIFY_FAILED|WRONG_VERSION_NUMBER|certificate verify failed")
_PRECONDITION_TEXT = re.compile(r"pre-?condition|conditionnotmet|if-none-match", re.IGNORECASE)
_BUCKET_TEXT = re.compile(r"(bucket|container)[^.]*(does not exist|not found|NoSuch)|NoSuchBucket", re.IGNORECASE)


def exception_chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    node: BaseException | None = exc
    while node is not None and node not in seen and len(seen) < 10:
        seen.append(node)
        node = node.__cause__ or node.__context__
    return seen


def _status_and_code(exc: BaseException) -> tuple[int | None, str | None]:
    """HTTP status and service error code, where the exception carries them."""
    response: Any = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        meta = response.get("ResponseMetadata") or {}
        error = response.get("Error") or {}
        status = meta.get("HTTPStatusCode")
        return (int(status) if isinstance(status, int) else None), (error.get("Code") or None)
    for attr in ("status_code", "status"):  # azure-core HttpResponseError, aiohttp ClientResponseError
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            code = getattr(exc, "error_code", None)
            code = getattr(code, "value", code)  # azure-core gives an enum member
            return value, (str(code) if code else None)
    code = getattr(exc, "code", None)  # gcsfs HttpError
    # but not aiohttp's HttpProcessingError (ContentLengthError: a connection cut mid-body), whose code is
    # always 400: no server said so, and a cut download is retried
    if isinstance(code, int) and 100 <= code < 600 and not type(exc).__module__.startswith("aiohttp"):
        return code, None
    return None, None


def _ssh_login_cut(node: BaseException) -> bool:
    """paramiko's login failure that is a connection gone away or silent, not a refused login."""
    return type(node).__name__ in SSH_AUTH_NAMES and bool(_SSH_DROPPED_TEXT.search(str(node)))


def _ssh_link_gone(node: BaseException) -> bool:
    """paramiko's words for a connection gone (a pooled session whose link dropped, a handshake cut): an
    EOFError, or an OSError without errno, "Socket is closed". Counted as no answer, so an SFTP outage is
    outlasted (CKPTVAULT_RETRY_FOR) as an S3 one is: a 30 s one failed a backup after its 6 attempts."""
    return isinstance(node, EOFError) or (
        isinstance(node, OSError) and node.errno is None and "Socket is closed" in str(node)
    )


def status_in_chain(exc: BaseException) -> tuple[int | None, str | None]:
    """The first HTTP status and service error code found in ``exc`` and its causes."""
    for node in exception_chain(exc):
        found = _status_and_code(node)
        if found != (None, None):
            return found
    return None, None


# getaddrinfo's answers that the name is not there (the resolver answered: "Name or service not known"; a name
# without an address), unlike EAI_AGAIN ("Temporary failure in name resolution": no resolver answered)
_NO_SUCH_NAME = frozenset({socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)})


def unknown_host(exc: BaseException) -> bool:
    """Whether the connection failed because DNS knows no such host name (a typo in the URL's host or the
    endpoint's), as every backend reports it: a ``socket.gaierror`` somewhere in the chain."""
    return any(isinstance(node, socket.gaierror) and node.errno in _NO_SUCH_NAME for node in exception_chain(exc))


def _unknown_host_reason(chain: list[BaseException], detail: str) -> str:
    host = next((h for n in chain if isinstance(h := getattr(n, "host", None), str)), "")  # aiohttp names it
    name = f"host name {host!r}" if host else "the host name"
    return (
        f"{name} is not known to DNS ({detail}); check the host in the URL, -o endpoint_url (base_url) or the "
        "connection string"
    )


_REFUSED_TEXT = re.compile(r"Connection refused|Connect call failed|Could not connect to the endpoint", re.IGNORECASE)


def refused(exc: BaseException) -> bool:
    """Whether nothing accepted the connection (a wrong host or port, or a server not running)."""
    return any(
        isinstance(node, ConnectionRefusedError)
        or (isinstance(node, OSError) and node.errno == errno.ECONNREFUSED)
        or bool(_REFUSED_TEXT.search(str(node)))
        for node in exception_chain(exc)
    )


def range_past_the_end(exc: BaseException) -> bool:
    """A range read refused because it starts at or past the object's end (HTTP 416): the object is
    shorter than asked, which is what a short read says, not a storage failure."""
    status, code = status_in_chain(exc)
    return status == 416 or code == "InvalidRange"


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# SDK messages quote URLs: the query parameters that carry credentials (an OAuth access_token in a
# token-info URL, a SAS or presigned URL's signature) and a URL's password are never shown.
_CREDENTIAL_PARAM = re.compile(
    r"([?&;][\w.-]*(?:token|key|secret|password|passwd|signature|sig|credential|auth)[\w.-]*=)[^&;\s'\"<>)]+", re.I
)
_URL_PASSWORD = re.compile(r"(\b[a-z][\w+.-]*://[^/\s:@]+:)[^@\s]+@", re.I)
HIDDEN = "***"


def hide_credentials(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` without credentials: ``secrets`` (the values of credential options) wherever they
    appear, and those that URLs in it carry."""
    for secret in secrets:
        text = text.replace(secret, HIDDEN)
    return _URL_PASSWORD.sub(rf"\1{HIDDEN}@", _CREDENTIAL_PARAM.sub(rf"\1{HIDDEN}", text))


_GOOGLE_KEY_FIELDS = frozenset(
    {"refresh_token", "client_id", "client_secret", "client_email", "private_key", "token_uri"}
)


def _describe(exc: BaseException) -> str:
    # the first line: SDKs put the summary there and request IDs, headers and XML bodies below it
    lines = [line for line in str(exc).splitlines() if line.strip()]
    message = one_line(hide_credentials(lines[0]) if lines else "", 200)
    name = type(exc).__name__
    if not message:
        return name
    if isinstance(exc, OSError) and type(exc) in (OSError, IOError):
        # s3fs's bare OSError(EBUSY, "Please reduce your request rate."): the errno number means nothing here
        return re.sub(r"^\[Errno -?\d+\] ", "", message)
    return f"{name}: {message}"


def _bucket_asked_for(chain: list[BaseException]) -> str:
    """The bucket an S3 error says was asked for (botocore's parsed ``BucketName``), else ''."""
    for node in chain:
        response = getattr(node, "response", None)
        if isinstance(response, dict):
            name = response.get("Error", {}).get("BucketName")
            if isinstance(name, str) and name:
                return name
    return ""


class BackendAdvice(Exception):
    """Raised by ckptvault's own adapter of a backend (backends.py) for a refusal it understands: its
    message says what to do and is reported as it is, never retried."""


def classify(exc: BaseException, bucket: str = "") -> Failure:
    if isinstance(exc, BackendAdvice):
        return Failure(Kind.PERMANENT, str(exc))
    chain = exception_chain(exc)
    status, code = status_in_chain(exc)
    names = {type(node).__name__ for node in chain}
    text = " ".join(str(node) for node in chain)
    detail = _describe(exc)
    if code and code not in str(exc):
        detail = f"{code}: {detail}"

    if any(isinstance(node, TypeError) and "unexpected keyword argument" in str(node) for node in chain):
        # s3fs hands its options to the SDK's session on the first call, which refuses a misspelt one
        return Failure(
            Kind.PERMANENT,
            f"{detail}: a storage option the backend does not take (from -o, the URL's query string or "
            "CKPTVAULT_STORAGE_OPTIONS); check its name in docs/backends.md",
        )
    if any(isinstance(n, KeyError) and str(n).strip("'") in _GOOGLE_KEY_FIELDS for n in chain):
        # google-auth reading a token file that is JSON but no key it knows
        return Failure(
            Kind.PERMANENT,
            f"the token file is not a Google service-account or authorized-user key ({detail}); check -o token=...",
        )
    if isinstance(exc, FileExistsError) or code in EXISTS_CODES or status == 412:
        return Failure(Kind.EXISTS, "the object already exists")
    if isinstance(exc, OSError) and exc.errno == errno.EINVAL and _PRECONDITION_TEXT.search(text):
        return Failure(Kind.EXISTS, "the object already exists")  # s3fs's 412 without the condition named
    if code in NO_BUCKET_CODES or ((isinstance(exc, FileNotFoundError) or status == 404) and _BUCKET_TEXT.search(text)):
        asked = _bucket_asked_for(chain)
        if bucket and asked and asked != bucket:  # e.g. an endpoint_url with a path: its first part was taken
            return Failure(
                Kind.NO_BUCKET,
                f"the storage was asked for bucket {asked!r}, not {bucket!r}: an endpoint_url takes no path "
                "(give the bucket in the repository URL)",
            )
        where = f"bucket {bucket!r}" if bucket else "the bucket (or container)"
        return Failure(Kind.NO_BUCKET, f"{where} does not exist; create it first or check the URL")
    if isinstance(exc, FileNotFoundError) or code in NOT_FOUND_CODES or status == 404:
        return Failure(Kind.NOT_FOUND, "object not found")
    if any(_ssh_login_cut(node) for node in chain):  # not a refused key: silence, or the server hung up
        if "timeout" in text.lower():
            return Failure(Kind.TRANSIENT, f"no answer from the SSH server while logging in ({detail})")
        return Failure(
            Kind.TRANSIENT,
            f"the SSH server closed the connection while logging in ({detail}): it went away, or a rule of its "
            "own turned this login away (MaxAuthTries with many keys offered, fail2ban)",
        )
    if "Garbage packet received" in text:  # paramiko: bytes where an SFTP packet should start (nf48 F4, rv48 M3)
        return Failure(
            Kind.TRANSIENT,
            f"the SFTP session is out of step ({detail}): the server stopped answering for a while, or its login "
            "shell prints text (make the server's shell startup files silent for non-interactive logins)",
        )
    if _SSH_NO_GREETING in text:  # silence, or something that is not an SSH server at that port (nf48 F3, F8)
        return Failure(
            Kind.TRANSIENT,
            f"no SSH greeting from the server ({detail}): it is not answering, or what answers at that host and "
            "port is not an SSH server (check the port)",
        )
    if "NoCredentialsError" in names:  # botocore found none: nothing was sent, so no server said "denied"
        return Failure(
            Kind.DENIED,
            "no credentials found (NoCredentialsError); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
            "AWS_PROFILE), give -o key=... -o secret=..., or -o anon=true for a public bucket",
        )
    if code in CLOCK_CODES or _CLOCK_TEXT.search(text):  # a 403, not about the credentials; retried (botocore
        return Failure(  # corrects its clock from the answer), and if it stays so, the clock is to set
            Kind.TRANSIENT,
            f"this machine's clock is too far from the storage's ({detail}); set it right (NTP: timedatectl "
            "set-ntp true), then try again",
        )
    if names & SSH_AUTH_NAMES or isinstance(exc, PermissionError) or code in DENIED_CODES or status in (401, 403):
        return Failure(Kind.DENIED, f"access denied ({detail}); check the credentials and permissions")
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return Failure(Kind.FULL, exc.strerror or "no space left")
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:  # named so, not as a temporary file's path
        return Failure(
            Kind.PERMANENT,
            "read-only file system: this vault can only be read here (restore, check, status and drill work)",
        )
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:  # retrying cannot pass it
        return Failure(Kind.PERMANENT, "file too large: a file size limit (ulimit -f) or the filesystem's largest file")
    ssl = sys.modules.get("ssl")  # not loaded (a local repository): no TLS error can have been raised
    verify_error = ssl.SSLCertVerificationError if ssl is not None else ()
    if _TLS_MISMATCH.search(text) or any(isinstance(n, verify_error) for n in chain):
        return Failure(
            Kind.PERMANENT, f"TLS failed ({detail}); check http:// or https:// in the endpoint and its certificate"
        )
    if status is not None:
        if status >= 500 or status in RETRYABLE_STATUS or code in RETRYABLE_CODES:
            return Failure(Kind.TRANSIENT, detail)
        return Failure(Kind.PERMANENT, detail)
    if code in RETRYABLE_CODES:
        return Failure(Kind.TRANSIENT, detail)
    if unknown_host(exc):  # may pass where DNS itself failed for a moment (retrying.py: not before anything answered)
        return Failure(Kind.TRANSIENT, _unknown_host_reason(chain, detail))
    if any(_ssh_link_gone(node) for node in chain) or "Server connection dropped" in text:
        # paramiko's bare words ("EOFError", "Socket is closed", "Server connection dropped:") said what happened
        return Failure(Kind.TRANSIENT, f"the connection to the server was lost ({detail.rstrip(':')})")
    if names & RETRYABLE_NAMES or any(isinstance(n, (ConnectionError, TimeoutError, EOFError)) for n in chain):
        return Failure(Kind.TRANSIENT, detail)
    if isinstance(exc, OSError):
        if exc.errno in PERMANENT_ERRNOS:
            return Failure(Kind.PERMANENT, detail)
        # errno-less OSErrors are what network filesystems raise for a dropped link (paramiko's
        # "Socket is closed", fsspec's generic IOError); the retry budget bounds a wrong guess.
        return Failure(Kind.TRANSIENT, detail)
    return Failure(Kind.PERMANENT, detail)


def storage_error(
    op: str,
    key: str,
    url: str,
    exc: BaseException,
    *,
    if_absent: bool = False,
    failure: Failure | None = None,
    in_folders: bool = False,
) -> StorageError:
    """The ckptvault error that reports ``exc``, raised by the ``op`` call on ``key``. ``failure``:
    what ``exc`` means, where the caller knows better than ``classify`` alone (a missing bucket).
    ``in_folders``: the storage keeps objects in folders (SFTP, WebDAV; local folders always do)."""
    failure = failure or classify(exc)
    if failure.kind is Kind.DENIED and isinstance(exc, PermissionError) and _is_local(url):  # no credentials here
        failure = Failure(Kind.DENIED, f"access denied ({_describe(exc)}); check the permissions of its folder")
    if failure.kind is Kind.NOT_FOUND:
        if op == "PUT" and (in_folders or _is_local(url) or url.startswith(("sftp://", "ssh://"))):
            # a write misses no object: the folder it goes into is gone (it was there before)
            reason = "the folder it goes into is missing (the vault moved, deleted, or its disk unmounted?)"
            return StorageError(op, key, url, reason, retryable=True)
        return ObjectNotFoundError(op, key, url)
    if failure.kind is Kind.EXISTS and if_absent:
        return ObjectExistsError(op, key, url)
    if failure.kind is Kind.FULL:
        if out_of_inodes(exc, url):
            return StorageFullError(
                op, key, url, "no inode (file entry) left on its filesystem, which has free blocks",
                hint="delete files there, or move the vault to a filesystem with more inodes",
            )  # fmt: skip
        return StorageFullError(op, key, url, failure.reason)
    return StorageError(op, key, url, failure.reason, retryable=failure.retryable)


# Answers that say the storage cannot serve this one object, rather than that it is out of reach: an
# internal error (HTTP 500; SeaweedFS answers so for every read of an object whose stored CRC no longer
# matches its bytes). Cloud stores answer so for a while too (Azure's and S3's InternalError), so a 500
# may be retried as an outage (down_or_busy; retrying.py says when), and points at the object after that.
OBJECT_FAULT_CODES = frozenset({"InternalError", "InternalServerError"})
# A body that ends before the length it announced: the server answered, and a connection reset or a
# middlebox cut the transfer. Nothing says the object is damaged (a damaged stored object is answered
# with an error, or in full and then fails its checksum): not an object fault, not "no answer".
CUT_SHORT_NAMES = frozenset(
    {"ClientPayloadError", "ContentLengthError", "IncompleteRead", "IncompleteReadError", "ChunkedEncodingError"}
)


def object_fault(exc: BaseException) -> bool:
    """Whether ``exc``, the last of a call's attempts, says the storage answers but fails this object:
    after every retry that points at the object as stored, not at the storage as a whole."""
    status, code = status_in_chain(exc)
    return status == 500 or code in OBJECT_FAULT_CODES


def cut_short(exc: BaseException) -> bool:
    """Whether ``exc`` is a transfer cut mid-body (see CUT_SHORT_NAMES)."""
    return any(type(node).__name__ in CUT_SHORT_NAMES for node in exception_chain(exc))


def once_mended(exc: BaseException) -> str:
    """When a command that ``exc`` stopped can be run again to finish: " once the storage answers" after an
    outage, else " once the storage failure above is fixed"."""
    return " once the storage answers" if unreachable(exc) else " once the storage failure above is fixed"


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the storage did not answer at all (a timeout, a refused or dropped
    connection), as opposed to answering with an error (a 5xx) or in part (a body cut short): then the
    storage itself is down, not one object or one transfer."""
    if status_in_chain(exc) != (None, None) or cut_short(exc):
        return False
    return any(
        isinstance(node, (ConnectionError, TimeoutError))
        or type(node).__name__ in RETRYABLE_NAMES
        or _ssh_login_cut(node)
        or _ssh_link_gone(node)
        or (isinstance(node, OSError) and node.errno in CONNECTION_ERRNOS - ANSWERED_ERRNOS)
        for node in exception_chain(exc)
    )


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith(("file://", "local://"))


# Answers that the storage as a whole is busy or unavailable for now (throttling, a 503 window while it
# scales or recovers), as opposed to failing one object
BUSY_STATUS = frozenset({429, 503})
BUSY_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests", "RequestLimitExceeded", "ServiceUnavailable",
     "ServerBusy"}
)  # fmt: skip


def down_or_busy(exc: BaseException) -> bool:
    """Whether ``exc`` may say the storage cannot serve anything now: it does not answer (``unreachable``),
    answers that it is busy or unavailable (429, 503, throttling; s3fs's EBUSY) or failing (500: Azure and
    S3 answer so for tens of seconds at times), or its transfers are cut mid-body (a flaky link). That
    passes by itself, and may last longer than a call's retries (retrying.py retries it for a time); a
    500 that outlasts them is then taken for a fault of the object (``object_fault``)."""
    if unreachable(exc) or cut_short(exc):
        return True
    status, code = status_in_chain(exc)
    if status in BUSY_STATUS or code in BUSY_CODES or object_fault(exc):
        return True
    return status is None and any(
        isinstance(node, OSError) and node.errno == errno.EBUSY for node in exception_chain(exc)
    )


def out_of_inodes(exc: BaseException, url: str) -> bool:
    """ENOSPC also means "no inode left" (many small files on a disk formatted for few big ones): told
    apart on a local folder, so that freeing space is not the advice. Inodes nearly all taken and
    blocks left: a failed write may have freed the inode of its temporary file before this looks."""
    folder = url.removeprefix("file://")
    if not isinstance(exc, OSError) or exc.errno != errno.ENOSPC or "://" in folder:
        return False
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_files > 0 and st.f_favail <= st.f_files // 100 + 16 and st.f_bavail > st.f_blocks // 100
