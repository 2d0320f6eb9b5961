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
import threading
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
