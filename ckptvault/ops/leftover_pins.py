"""Pins a dead process left behind, taken over by the next ``backup_async`` beside them.

``backup_async`` pins a checkpoint on the caller's thread and releases the pin once its snapshot
is durable. A process that dies first (SIGKILL, the OOM killer, a second Ctrl-C, an exit wait that
ran out) leaves the pin: a checkpoint the trainer's rotation may already have deleted, holding
disk space no one frees. So each pin's metadata records its job (the vault's ID, the tags, the
description, the hostname) and its owner (host, process table, PID and the PID's start time), and
the next ``backup_async`` that pins into the same folder, in this process or a later one, ships
the pins whose owner is gone, oldest first, before its own checkpoint.

An owner in another PID namespace of this machine (a container restarted after the OOM killer, with
the same volume) cannot be looked up by its PID, so the owner holds a POSIX lock on a file in each of
its pins (``Pin.hold_owner_lock``), which the kernel drops when it dies: a lock nobody holds means
the owner is gone. An owner this process cannot check at all (another host sharing the folder, a pin
of a version without the lock, a filesystem without locks) is taken for gone only a day after it got
the pin, and each such pin is named in a warning once; a pin folder without metadata (a crash while
pinning or releasing) is removed after ten minutes.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import os
import shlex
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..errors import SourceError, spelled
from ..localtree import remove_tree
from ..repository.locks import pid_alive, process_table
from ..units import counted
from . import pin as pins
from .names import PIN_FOLDER, WATCH_STATE_FOLDER
from .pin import Pin
from .watch_lock import pins_of_a_stopped_watcher

JOB_KEY = "job"
OWNER_KEY = "owner"
UNCHECKABLE_OWNER_AFTER_S = 24 * 3600.0
UNFINISHED_AFTER_S = 600.0

OwnerState = Literal["this process", "alive", "gone", "unknown"]

# Pins of this process's own jobs that it gave up on, by root -> when (a close interrupted by Ctrl-C): a
# later backup_async in this same process (a notebook's kernel lives on) takes them over too.
_given_up: dict[str, str] = {}


def give_up(pins: list[Pin], when: str) -> None:
    """``when``: what made this process give them up, for the line that says a later call ships them."""
    _given_up.update((p.root, when) for p in pins)


@dataclass(frozen=True)
class JobRecord:
    """What a pin's metadata says about the backup it was made for. ``folders``: the staging
    folder of each of the job's pins, one per source, so that a job is shipped only whole."""

    job_id: str
    vault_id: str
    tags: dict[str, str]
    description: str
    hostname: str | None
    folders: list[str]
    pinned: str  # pin.digest of this pin's signature when it was made
    exclude: list[str] = dataclasses.field(default_factory=list)  # backup_async's exclude patterns

    @classmethod
    def from_doc(cls, doc: object) -> JobRecord | None:
        """From ``dataclasses.asdict`` of one; None for a document this version did not write (an
        older pin, a damaged file)."""
        if not isinstance(doc, dict):
            return None
        strings = (doc.get("job_id"), doc.get("vault_id"), doc.get("description"), doc.get("pinned"))
        hostname = doc.get("hostname")
        if not all(isinstance(f, str) for f in strings) or not (hostname is None or isinstance(hostname, str)):
            return None
        if not _str_dict(doc.get("tags")) or not _str_list(doc.get("folders")):
            return None
        exclude = doc.get("exclude", [])  # absent from records of versions before it
        if not (isinstance(exclude, list) and all(isinstance(p, str) for p in exclude)):
            return None
        return cls(**{f.name: doc[f.name] for f in dataclasses.fields(cls) if f.name != "exclude"}, exclude=exclude)


def _str_dict(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _str_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


@dataclass
class Leftover:
    """A pin taken over from a dead process: ``owner_host`` is where that process ran; ``given_up_here``:
    this process's own, of a job it gave up on, and when (``give_up``); "" for a dead process's."""

    pin: Pin
    job: JobRecord
    owner_host: str
    given_up_here: str = ""


def pin_metadata(job: JobRecord) -> dict[str, object]:
    """What ``pin.create`` stores beside a backup_async pin."""
    return {JOB_KEY: dataclasses.asdict(job), OWNER_KEY: this_process()}


def this_process() -> dict[str, object]:
    pid = os.getpid()
    stat = _proc_stat(pid)
    return {"host": socket.gethostname(), "table": process_table(), "pid": pid, "started": stat and stat[1]}


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """Process ``pid``'s state letter and when it started, in clock ticks after boot (the 3rd and
    22nd fields of /proc/PID/stat: a PID reused by a later process has another start). None where
    there is no such process, or no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        fields = raw[raw.rindex(b")") + 2 :].split()
        return fields[0].decode(), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


@functools.cache
def _boot_time_ns() -> int | None:
    """When this machine booted (``btime`` of /proc/stat)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                if line.startswith("btime "):
                    return int(line.split()[1]) * 10**9
    except (OSError, ValueError):
        pass
    return None


def owner_state(owner: object, pinned_ns: int, root: str) -> OwnerState:
    """Whether the process an owner record names still runs, as far as this process can tell;
    ``pinned_ns``: when the pin at ``root`` got that owner."""
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return "unknown"
    table, here = owner.get("table"), process_table()
    pid, started = owner.get("pid"), owner.get("started")
    if not isinstance(table, str) or not isinstance(pid, int):
        return "unknown"
    if table != here:
        booted = _boot_time_ns()
        if table.split("/")[0] != here.split("/")[0]:
            if booted is not None and pinned_ns < booted:
                return "gone"  # pinned before this machine booted: every process of then has ended
            return "unknown"  # another machine of the same name
        # another PID namespace of this boot: a container sharing the folder, or this one restarted
        held = pins.owner_lock_held(root)
        return "unknown" if held is None else "alive" if held else "gone"
    if pid == os.getpid():
        return "this process"
    if not pid_alive(pid):
        return "gone"
    stat = _proc_stat(pid)
    if stat is not None and (stat[0] == "Z" or (isinstance(started, int) and stat[1] != started)):
        return "gone"  # ended (a zombie its parent has not reaped), or the PID is a later process's
    return "alive"


def take_over(stagings: list[str], vault_id: str, on_warning: Callable[[str], object]) -> list[Leftover]:
    """The pins in the staging folders ``stagings``, and in the other folders their jobs pinned
    into, made for backups into vault ``vault_id`` whose process is gone, oldest first in each
    folder, each now owned by this process. Pins of other vaults, of live processes and of this one
    are left alone. Never raises for the filesystem: a pin that cannot be taken over is named in
    ``on_warning`` and left where it is."""
    folders = _folders_of_jobs(stagings, vault_id)
    held: dict[str, int] = {}
    try:
        # One process at a time looks and claims, holding every folder a job spans (locked in one
        # order, so two processes cannot deadlock): of two processes resuming at once, one gets
        # each job whole, and none sees a pin between its claim and the metadata naming its owner.
        for staging in sorted(folders):
            fd = _lock(staging, on_warning)
            if fd is not None:
                held[staging] = fd
        taken: list[Leftover] = []
        for staging in held:
            try:
                taken += _take_over_locked(staging, vault_id, set(held), on_warning)
            except OSError as exc:
                on_warning(f"cannot look for pins left in {staging}: {exc.strerror or exc}")
        return taken
    finally:
        for fd in held.values():
            os.close(fd)


def _folders_of_jobs(stagings: list[str], vault_id: str) -> list[str]:
    """``stagings`` and every folder that a job pinned there for ``vault_id`` also pinned into
    (read without a lock: only to know which folders to lock)."""
    folders = list(dict.fromkeys(stagings))
    for staging in folders:  # grows as jobs name other folders
        try:
            names = os.listdir(staging)
        except OSError:
            continue
        for name in names:
            loaded = pins.read(os.path.join(staging, name)) if pins.PIN_NAME.match(name) else None
            job = JobRecord.from_doc(loaded[1].get(JOB_KEY)) if loaded else None
            if job is not None and job.vault_id == vault_id:
                folders.extend(f for f in job.folders if f not in folders)
    return folders


def _lock(staging: str, on_warning: Callable[[str], object]) -> int | None:
    """An open descriptor of ``staging`` holding its exclusive flock; None when it is gone."""
    try:
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None  # no such folder (nothing was ever pinned here), or not one this process may read
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_ino == os.stat(staging).st_ino:
            return fd
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            on_warning(f"cannot look for pins left in {staging}: {exc.strerror or exc}")
    os.close(fd)  # removed (its last pin released) while we waited: nothing is left in it
    return None


def _take_over_locked(
    staging: str, vault_id: str, locked: set[str], on_warning: Callable[[str], object]
) -> list[Leftover]:
    now_ns = time.time_ns()
    taken: list[Leftover] = []
    for name in sorted(os.listdir(staging)):
        pinned_ns = pins.pinned_at_ns(name)
        if pinned_ns is None:
            continue  # not a pin folder
        root = os.path.join(staging, name)
        loaded = pins.read(root)
        if loaded is None:
            if now_ns - pinned_ns > UNFINISHED_AFTER_S * 1e9:
                remove_tree(root)
            continue
        pin, doc = loaded
        job, owner = JobRecord.from_doc(doc.get(JOB_KEY)), doc.get(OWNER_KEY)
        if job is None or job.vault_id != vault_id:
            continue
        if not locked.issuperset(f for f in job.folders if os.path.isdir(f)):
            continue  # made after the folders were chosen, in one not locked: left for the next call
        state = owner_state(owner, pinned_ns, root)
        given_up_here = _given_up.get(root, "") if state == "this process" else ""
        if given_up_here:
            state = "gone"
        if state in ("this process", "alive"):
            continue
        if state == "unknown" and now_ns - pinned_ns < UNCHECKABLE_OWNER_AFTER_S * 1e9:
            _say_deferred(pin, job, owner, pinned_ns, on_warning)
            continue
        try:
            _claim(pin, job)
        except OSError as exc:
            on_warning(f"cannot take over the pin {root} left by a process that ended: {exc.strerror or exc}")
            continue
        _given_up.pop(root, None)
        host = str(owner.get("host", "")) if isinstance(owner, dict) else ""
        taken.append(Leftover(pin, job, host, given_up_here))
    return taken


def _say_deferred(pin: Pin, job: JobRecord, owner: object, pinned_ns: int, on_warning: Callable[[str], object]) -> None:
    """Once per pin and process: a pin whose owner cannot be checked waits a day, and the user may
    know better (the owner's machine is gone for good)."""
    if pin.root in _deferred_told:
        return
    _deferred_told.add(pin.root)
    host = (owner.get("host") if isinstance(owner, dict) else None) or "an unknown host"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(pinned_ns / 1e9 + UNCHECKABLE_OWNER_AFTER_S))
    tags = "".join(f" --tag {shlex.quote(f'{k}={v}')}" for k, v in sorted(job.tags.items()))
    on_warning(
        f"{pin.source} is pinned in {pin.root} by a process this one cannot check (on {host}), so it ships "
        f"from {when} if still there; if that process is gone, ship it now with: "
        + spelled(
            f"ckptvault backup --repo <the vault> {shlex.quote(pin.data)}{tags}",
            f"vault.backup({pin.data!r}, tags={dict(sorted(job.tags.items()))!r})",
        )
    )


_deferred_told: set[str] = set()


def _claim(pin: Pin, job: JobRecord) -> None:
    """Record this process as the pin's owner, under a new name that says when (the day an owner
    that cannot be checked is given runs from then). The metadata is written first: a crash in
    between leaves the pin under its old name, ready to be taken over again. Its owner lock is
    taken before that, so that no other process takes it for one whose owner is gone."""
    pin.hold_owner_lock()
    try:
        pin.save_meta(**pin_metadata(job))
        new_root = os.path.join(os.path.dirname(pin.root), pins.new_pin_name())
        os.rename(pin.root, new_root)
    except BaseException:
        pin.drop_owner_lock()
        raise
    pin.root = new_root


def pins_folder(folder: str, warn: Callable[[str], None]) -> str:
    """The pins folder that ``ship_leftover_pins(folder)`` ships: ``folder`` holds it (the folder the
    checkpoints were saved in), or is it. A folder that is no directory is refused: a mistyped one would
    ship nothing, and the resume pick an older save."""
    if not os.path.isdir(folder):
        # a checkpoint file given (`ship-pins out/last.ckpt`) is there: "no such directory" sent the user looking
        what = "a file, not a folder" if os.path.lexists(folder) else "no such directory"
        raise SourceError(folder or '""', what, "give the folder the checkpoints were saved in")
    folder = os.path.abspath(folder)
    pins_here = folder if os.path.basename(folder) == PIN_FOLDER else os.path.join(folder, PIN_FOLDER)
    beside = os.path.join(os.path.dirname(folder), PIN_FOLDER)
    if not os.path.isdir(pins_here) and os.path.isdir(beside) and _lists_anything(beside):
        # a checkpoint's own folder given (pins lie beside each source): shipping nothing, the resume
        # would pick an older save without a word
        above = os.path.dirname(folder)
        warn(
            f"{folder} holds no {PIN_FOLDER}, but the folder above it does: backup_async pins beside each "
            "source, so a checkpoint folder's pins are there; to ship them: "
            + spelled(f"ckptvault ship-pins {above}", f"ship_leftover_pins({above!r})")
        )
    return pins_here


def left_for_other_vaults(staging: str, vault_id: str) -> dict[str, int]:
    """How many checkpoints processes that ended left pinned in ``staging`` for each vault other than
    ``vault_id`` (by vault ID): a ship into this vault leaves them, and must say so, since a restart that
    named the wrong vault would otherwise hear "nothing left pinned" and resume from an older save."""
    jobs: dict[str, set[str]] = {}
    try:
        names = sorted(os.listdir(staging))
    except OSError:
        return {}  # no pins folder: nothing was pinned here
    for name in names:
        pinned_ns = pins.pinned_at_ns(name)
        loaded = pins.read(os.path.join(staging, name)) if pinned_ns is not None else None
        job = JobRecord.from_doc(loaded[1].get(JOB_KEY)) if loaded else None
        if pinned_ns is None or loaded is None or job is None or job.vault_id == vault_id:
            continue
        if owner_state(loaded[1].get(OWNER_KEY), pinned_ns, os.path.join(staging, name)) in ("alive", "this process"):
            continue  # a live process's own pins: it ships them
        jobs.setdefault(job.vault_id, set()).add(job.job_id)
    return {vault: len(ids) for vault, ids in jobs.items()}


def say_other_vaults(staging: str, folder: str, vault_id: str, warn: Callable[[str], None]) -> None:
    """Name the pins ``left_for_other_vaults`` finds in ``staging`` (the pins folder of ``folder``)."""
    for other, count in left_for_other_vaults(staging, vault_id).items():
        warn(
            f"{staging} holds {count} checkpoint(s) left pinned for another vault (ID {other[:8]}), which are "
            "not shipped into this one; to ship them, "
            + spelled(
                f"run ckptvault ship-pins {shlex.quote(folder)} --repo <that vault>",
                f"call ship_leftover_pins({folder!r}) on a Vault of that vault",
            )
        )


def watch_state_folder(state_dir: str | None) -> str | None:
    """The watch's ``--state-dir`` that ``ship_leftover_pins`` is to look in too. A missing one is refused:
    a mistyped one would find nothing, and the resume go on from an older save."""
    if state_dir is None:
        return None
    if not os.path.isdir(state_dir):
        what = "a file, not a folder" if os.path.lexists(state_dir) else "no such directory"
        option = spelled("--state-dir", "state_dir")
        raise SourceError(state_dir or '""', what, f"give the {option} the watch sidecar was started with")
    return state_dir


def watch_pins_left(folder: str, state_dir: str | None) -> list[tuple[str, int, str]]:
    """The pins a dead watch sidecar of ``folder`` left, in the folder's own state folder and in ``state_dir``
    (its ``--state-dir``): (that state folder, how many, the call that ships them). They are not
    backup_async's, and only a watch ships them (with its records of what shipped)."""
    if os.path.basename(os.path.abspath(folder)) == PIN_FOLDER:
        # the pins folder itself given (as ship_leftover_pins takes it): the watch's folder is the one above it,
        # and a watch's pins kept in --state-dir were otherwise passed over in silence (rv61)
        folder = os.path.dirname(os.path.abspath(folder))
    own = os.path.join(folder, WATCH_STATE_FOLDER)
    places: list[tuple[str, str | None]] = [(own, None)]
    if state_dir is not None and not _same_folder(state_dir, own):
        places.append((state_dir, state_dir))
    left = []
    for where, given in places:
        if held := pins_of_a_stopped_watcher(folder, given):
            option = f" --state-dir {shlex.quote(given)}" if given else ""
            keyword = f", state_dir={given!r}" if given else ""
            command = spelled(
                f"ckptvault watch {shlex.quote(folder)} --once{option}", f"vault.watch({folder!r}, once=True{keyword})"
            )
            left.append((where, held, command))
    return left


def say_watch_pins(folder: str, state_dir: str | None, warn: Callable[[str], None]) -> None:
    """Name the pins ``watch_pins_left`` finds: a restart's ``ship-pins`` then ``restore latest`` otherwise
    took "nothing left pinned" for all shipped while a dead watcher's pin held the newest save (wt47 F6,
    sp60)."""
    for where, held, command in watch_pins_left(folder, state_dir):
        warn(f"{where} holds {counted(held, 'checkpoint')} a watch sidecar pinned; ship them with: {command}")


def _same_folder(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def _lists_anything(folder: str) -> bool:
    try:
        return bool(os.listdir(folder))
    except OSError:  # one that cannot be listed is no advice to give
        return False
