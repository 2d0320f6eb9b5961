"""Pins a dead process left behind, taken over by the next ``backup_async`` beside them.

``backup_async`` pins a checkpoint on the caller's thread and releases the pin once its snapshot
is durable. A process that dies first (SIGKILL, the OOM killer, a second Ctrl-C, an exit wait that
ran out) leaves the pin: a checkpoint the trainer's rotation may already have deleted, holding
disk space no one frees. So each pin's metadata records its job (the vault's ID, the tags, the
description, the hostname) and its owner (host, process table, PID and the PID's start time), and
the next ``backup_async`` that pins into the same folder, in this process or a later one, ships
the pins whose owner is gone, oldest first, before its own checkpoint.

An owner this process cannot check (another host sharing the folder, another PID namespace) is
taken for gone only when its pin is a day old; a pin folder without metadata (a crash while
pinning or releasing) is removed after ten minutes.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import time
from dataclasses import dataclass
from typing import Literal

from ..repository.locks import pid_alive, process_table
from . import pin as pins
from .pin import Pin

JOB_KEY = "job"
OWNER_KEY = "owner"
UNCHECKABLE_OWNER_AFTER_S = 24 * 3600.0
UNFINISHED_AFTER_S = 600.0
_PIN_NAME = re.compile(r"^(\d{20})-[0-9a-f]{6}$")  # pin.new_pin_root's names

OwnerState = Literal["this process", "alive", "gone", "unknown"]


@dataclass(frozen=True)
class JobRecord:
    """What a pin's metadata says about the backup it was made for."""

    job_id: str
    vault_id: str
    tags: dict[str, str]
    description: str
    hostname: str | None
    pinned: str  # pin.digest of the pin's signature when it was made

    def to_doc(self) -> dict[str, object]:
        return {
            "id": self.job_id,
            "vault": self.vault_id,
            "tags": self.tags,
            "description": self.description,
            "hostname": self.hostname,
            "pinned": self.pinned,
        }

    @classmethod
    def from_doc(cls, doc: object) -> JobRecord | None:
        """None for a document this version did not write (an older pin, a damaged file)."""
        if not isinstance(doc, dict):
            return None
        tags, hostname = doc.get("tags"), doc.get("hostname")
        fields = (doc.get("id"), doc.get("vault"), doc.get("description"), doc.get("pinned"))
        if not all(isinstance(f, str) for f in fields) or not isinstance(tags, dict):
            return None
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in tags.items()):
            return None
        if hostname is not None and not isinstance(hostname, str):
            return None
        job_id, vault_id, description, pinned = fields
        return cls(job_id, vault_id, dict(tags), description, hostname, pinned)  # type: ignore[arg-type]


@dataclass
class Leftover:
    """A pin taken over from a dead process: ``owner_host`` is where that process ran."""

    pin: Pin
    job: JobRecord
    owner_host: str


def pin_metadata(job: JobRecord) -> dict[str, object]:
    """What ``pin.create`` stores beside a backup_async pin."""
    return {JOB_KEY: job.to_doc(), OWNER_KEY: this_process()}


def this_process() -> dict[str, object]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "table": process_table(), "pid": pid, "started": _start_ticks(pid)}


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (the 22nd field of /proc/PID/stat):
    a PID reused by a later process has another. None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def owner_state(owner: object) -> OwnerState:
    """Whether the process an owner record names still runs, as far as this process can tell."""
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return "unknown"
    table, here = owner.get("table"), process_table()
    pid, started = owner.get("pid"), owner.get("started")
    if not isinstance(table, str) or not isinstance(pid, int):
        return "unknown"
    if table != here:
        if table and here and table.split("/")[0] != here.split("/")[0]:
            return "gone"  # another boot of this machine: every process of the last one has ended
        return "unknown"  # another PID namespace (a container sharing the folder)
    if pid == os.getpid():
        return "this process"
    if not pid_alive(pid):
        return "gone"
    now_started = _start_ticks(pid)
    if isinstance(started, int) and now_started is not None and started != now_started:
        return "gone"  # the PID now belongs to a later process
    return "alive"


def take_over(staging: str, vault_id: str) -> list[Leftover]:
    """The pins in ``staging`` made for backups into vault ``vault_id`` whose process is gone,
    oldest first, each now owned by this process. Pins of other vaults, of live processes and
    of this one are left alone."""
    try:
        names = sorted(os.listdir(staging))
    except OSError:
        return []  # no such folder (nothing was ever pinned here), or not one this process may read
    now_ns = time.time_ns()
    taken: list[Leftover] = []
    for name in names:
        made = _PIN_NAME.match(name)
        if made is None:
            continue  # not a pin folder
        root = os.path.join(staging, name)
        age_s = (now_ns - int(made.group(1))) / 1e9
        loaded = pins.read(root)
        if loaded is None:
            if age_s > UNFINISHED_AFTER_S:
                shutil.rmtree(root, ignore_errors=True)
            continue
        pin, doc = loaded
        job, owner = JobRecord.from_doc(doc.get(JOB_KEY)), doc.get(OWNER_KEY)
        if job is None or job.vault_id != vault_id:
            continue
        state = owner_state(owner)
        if state in ("this process", "alive") or (state == "unknown" and age_s < UNCHECKABLE_OWNER_AFTER_S):
            continue
        owner_host = str(owner.get("host", "")) if isinstance(owner, dict) else ""
        if _claim(pin, job):
            taken.append(Leftover(pin, job, owner_host))
    return taken


def _claim(pin: Pin, job: JobRecord) -> bool:
    """Rename the pin's folder, then record this process as its owner. The rename is atomic, so
    of two processes taking over one pin, one does; the metadata moves with the folder, so a
    crash between the two steps leaves the pin to be taken over again. The new name keeps the
    creation time, and so the pin's place in the order."""
    new_root = f"{pin.root.rsplit('-', 1)[0]}-{secrets.token_hex(3)}"
    try:
        os.rename(pin.root, new_root)
    except OSError:
        return False  # another process took it first
    pin.root = new_root
    pin.save_meta(**pin_metadata(job))
    return True
