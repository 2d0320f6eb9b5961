"""One watcher per folder (watch.py): a lock on its state folder and on the watched folder."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from typing import NoReturn

from ..errors import WatchLockedError, spelled
from . import pin as pins
from .names import WATCH_STATE_FOLDER
from .pin import META

PROBE_TRIES, PROBE_WAIT_S = 10, 0.02  # a probe holds its shared lock for microseconds


class WatchLock:
    """One watcher per folder: a second one would pin and ship everything twice. Both the state
    folder's lock file and the watched folder itself are locked: two watchers given different
    ``state_dir``s share only the folder."""

    def __init__(self, path: str, directory: str) -> None:
        self.path = path
        self.directory = directory
        self.fd = self.dir_fd = -1

    def open(self) -> None:
        os.makedirs(self.directory, exist_ok=True)  # what the trainer would make: it is watched from now on
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            os.close(self.dir_fd)
            raise

    def __enter__(self) -> None:
        try:
            _lock_past_probes(self.fd)
        except BlockingIOError:  # the lock file says who holds it, and which folder it watches
            said = os.pread(self.fd, 4096, 0).decode(errors="replace").split("\n")
            holder = said[0].strip() or "another process"
            watched = said[1].strip() if len(said) > 1 else ""
            if watched and watched != self.directory:  # one state folder given to two watches
                self._refuse(
                    f"another ckptvault watch ({holder}) keeps its state in {os.path.dirname(self.path)}, watching "
                    f"{watched}; give this one another {spelled('--state-dir', 'state_dir')}"
                )
            self._refuse(f"another ckptvault watch ({holder}) is already watching {self.directory}; stop it first")
        try:
            fcntl.flock(self.dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its pid is in its own state folder's lock file, not in this one
            self._refuse(
                f"another ckptvault watch (with another {spelled('--state-dir', 'state_dir')}) is already watching "
                f"{self.directory}; stop it first"
            )
        os.ftruncate(self.fd, 0)
        with contextlib.suppress(OSError):  # only names the holder in the messages above: a full disk may refuse it
            os.pwrite(self.fd, f"pid {os.getpid()}\n{self.directory}".encode(), 0)

    def renew(self) -> None:
        """Lock what replaced the watched folder (``rm -rf DIR; mkdir DIR`` by a launcher): the lock held is
        then on a folder no other watcher opens, and a second watcher started on the new one would ship
        every checkpoint again (wt47 F3). Only once the new folder is there: nothing is made while a
        launcher's ``rm -rf`` runs. WatchLockedError when another watcher took it first; a folder that
        cannot be looked at or locked now (EIO, EACCES) is tried again at the next look."""
        try:
            if _is(self.directory, self.dir_fd) or not os.path.isdir(self.directory):
                return
            fresh = WatchLock(self.path, self.directory)
            fresh.open()
        except OSError:
            return
        fresh.__enter__()  # refused: it closed its own descriptors, and this lock keeps the old ones
        self.__exit__()
        self.fd, self.dir_fd = fresh.fd, fresh.dir_fd

    def _refuse(self, message: str) -> NoReturn:
        self.__exit__()
        raise WatchLockedError(message) from None

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)
        os.close(self.dir_fd)


def _lock_past_probes(fd: int) -> None:
    """An exclusive lock on ``fd``, BlockingIOError while another holds one. ``ship-pins`` takes a shared
    lock for a moment to see whether a watcher runs (``pins_of_a_stopped_watcher``): a watcher starting in
    that moment waits it out rather than take it for another watcher."""
    for _ in range(PROBE_TRIES - 1):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(PROBE_WAIT_S)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _is(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (OSError when that cannot be told)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def pins_of_a_stopped_watcher(directory: str, state_dir: str | None = None) -> int:
    """How many pins a watcher of ``directory`` left in its state folder (``state_dir``, the watch's
    ``--state-dir``, else the folder's own ``.ckptvault-watch``), none while one runs there (it ships them
    itself). In a state folder outside ``directory`` only the pins of its checkpoints count: a watch of
    another folder may have shared it, and ships its own."""
    state = state_dir or os.path.join(directory, WATCH_STATE_FOLDER)
    outside = os.path.dirname(os.path.abspath(state)) != os.path.abspath(directory)
    try:
        held = sum(
            _pinned_from(os.path.join(state, "pins", pin), directory if outside else None)
            for pin in os.listdir(os.path.join(state, "pins"))
        )
        fd = os.open(os.path.join(state, "lock"), os.O_RDONLY)
    except OSError:
        return 0
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0
    finally:
        os.close(fd)
    return held


def _pinned_from(root: str, directory: str | None) -> bool:
    """Whether ``root`` is a whole pin (its metadata written), of a checkpoint in ``directory`` if given."""
    if directory is None:
        return os.path.exists(os.path.join(root, META))
    loaded = pins.read(root)
    if loaded is None:
        return False
    try:
        return os.path.samefile(os.path.dirname(loaded[0].source), directory)
    except OSError:  # the folder was deleted and made again, or moved: its path still names it
        return os.path.dirname(loaded[0].source) == os.path.abspath(directory)
