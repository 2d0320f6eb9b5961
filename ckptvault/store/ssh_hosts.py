"""Which SSH servers an SFTP vault trusts: the host keys of ``~/.ssh/known_hosts`` (and the system's).

fsspec's SFTP filesystem hands paramiko a policy for keys it does not know, and loads no known_hosts file:
every server's key was accepted, a changed one too (a server in between reads and rewrites the vault's
objects; with an unencrypted vault, all of it). A key that differs from the one recorded for the host is
refused, as OpenSSH refuses it; a host not recorded is accepted with a warning (``-o host_key_policy=warn``,
the default: the first connection to a new server works, as with restic's ssh asking once), or refused
(``-o host_key_policy=reject``, as ``ssh -o StrictHostKeyChecking=yes``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import paramiko  # type: ignore[import-untyped]

from ..errors import UsageError
from .failures import BackendAdvice

log = logging.getLogger("ckptvault.store")  # a storage notice: the CLI shows these
POLICIES = ("warn", "reject", "auto_add")  # auto_add: fsspec's own, any key accepted (the user's choice)
KNOWN_HOSTS_FILES = ("~/.ssh/known_hosts", "/etc/ssh/ssh_known_hosts")
_told: set[str] = set()  # hosts whose unrecorded key was said once in this process
_told_lock = threading.Lock()


def host_key_policy(setting: object) -> Any:
    """The paramiko policy for ``-o host_key_policy=SETTING`` (a policy object given through the Python API
    is the caller's own)."""
    if not isinstance(setting, str):
        return setting
    if setting not in POLICIES:
        raise UsageError(f"-o host_key_policy={setting} is not one of {', '.join(POLICIES)}")
    if setting == "auto_add":
        return setting
    return KnownHostsPolicy(reject_unknown=setting == "reject")


class KnownHostsPolicy(paramiko.MissingHostKeyPolicy):  # type: ignore[misc]
    def __init__(self, *, reject_unknown: bool) -> None:
        self.reject_unknown = reject_unknown

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        """``hostname`` as known_hosts names it (``[host]:port`` off port 22)."""
        known = paramiko.HostKeys()
        for path in KNOWN_HOSTS_FILES:
            try:
                known.load(os.path.expanduser(path))
            except (OSError, paramiko.SSHException, ValueError):  # missing, or a line paramiko cannot read
                continue
        recorded = known.lookup(hostname)
        fingerprint = f"{key.get_name()} {key.fingerprint}"
        if recorded is None:
            if self.reject_unknown:
                raise BackendAdvice(
                    f"the host key of {hostname} ({fingerprint}) is in no known_hosts file, and the host key "
                    "policy refuses such a host: connect once with ssh to record it (or ssh-keyscan), then try again"
                )
            with _told_lock:
                first = hostname not in _told
                _told.add(hostname)
            if first:
                log.warning(
                    "the host key of %s (%s) is in no known_hosts file: accepted unchecked; record it (connect once "
                    "with ssh, or ssh-keyscan >> ~/.ssh/known_hosts) so that a different key is refused",
                    hostname,
                    fingerprint,
                )
            return
        if recorded.get(key.get_name()) == key:
            return
        raise BackendAdvice(
            f"the host key of {hostname} ({fingerprint}) is not the one ~/.ssh/known_hosts records for it: refused "
            "(the server's key changed, or another machine answers in its place); if its key really changed, "
            f"remove the old one with: ssh-keygen -R '{hostname}'"
        )


# What paramiko says when the peer sent no "SSH-" line: EOF or silence first ("Error reading SSH protocol
# banner"), or 100 other lines ("Indecipherable protocol version")
NO_SSH_GREETING = ("Error reading SSH protocol banner", "Indecipherable protocol version")
PROBE_WAIT_S = 3.0  # how long the probe waits for a peer's first words (an HTTP server answers at once)
PROBE_READ_LIMIT = 4096
# What OpenSSH's sshd says before closing a connection it will not take now (drop_connection: MaxStartups
# exceeded, a per-source penalty; 9.8 and later say the second): an SSH server busy, an outage retried
SSH_BUSY_LINES = ("Exceeded MaxStartups", "Not allowed at this time")


def not_ssh_advice(exc: BaseException, host: str, port: int) -> BackendAdvice | None:
    """After a login that got no SSH greeting: whether what answers at ``host:port`` is something other than
    an SSH server (an HTTP server at a mistyped port), asked once more with a connection of its own, which
    sends an SSH client's greeting and reads what comes back. A peer that answers with other words is a
    mistake of the URL, said at once: retrying it as an outage took two minutes of "the storage is down or
    busy" (nf54 #1). None where it says nothing (a server that is frozen, busy or dropping connections: an
    outage, retried), speaks SSH after all, or is an SSH server refusing new connections for now (OpenSSH's
    "Exceeded MaxStartups": many logins at once, or a password scanner on its port)."""
    if not any(text in str(exc) for text in NO_SSH_GREETING):
        return None
    received = b""
    try:
        with socket.create_connection((host, port), timeout=PROBE_WAIT_S) as sock:
            sock.sendall(b"SSH-2.0-ckptvault_probe\r\n")
            deadline = time.monotonic() + PROBE_WAIT_S
            while len(received) < PROBE_READ_LIMIT and (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                chunk = sock.recv(PROBE_READ_LIMIT)
                if not chunk:
                    break
                received += chunk
    except OSError:  # refused, reset, or silent until the wait ended: judged on what came, if anything
        pass
    lines = [line.strip() for line in received.decode("utf-8", "replace").splitlines() if line.strip()]
    if not lines or any(line.startswith(("SSH-", *SSH_BUSY_LINES)) for line in lines):
        return None
    first = " ".join(lines[0].split())
    first = first if len(first) <= 60 else first[:57] + "..."
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return BackendAdvice(f'{where} answers, but not with SSH (got "{first}"): check the port in the sftp:// URL')
