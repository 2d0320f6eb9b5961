"""Retries with backoff, and a time limit per call, around any Store.

Only failures that may pass are retried: a StorageError marked ``retryable`` (connection
resets, timeouts, short reads, HTTP 5xx and throttling; failures.py decides). Missing objects,
permission errors, a missing bucket and a full disk fail at once. A call that hangs is abandoned
after ``op_timeout`` seconds and retried; the repository only writes immutable objects under fresh
names, so a late duplicate of a PUT is harmless. Async backends (s3fs, gcsfs, adlfs) cancel the
request themselves at the deadline (FsspecStore passes it down), closing its connection; the
thread-based limit here is the backstop, a little later, for every other backend. Local disks get
none (FsspecStore.needs_deadline): a watchdog thread per call is costly there and cannot cancel a
read blocked in the kernel.

A create-if-absent put that is retried after a failure may find its own first attempt stored (the
reply was lost, not the write): it then reads the object back, and identical bytes count as success.

Deadlines follow the size of the call (``call_deadline``): a write to a server that stopped
reading blocks in the socket, where the backends' read timeouts do not look, so a PUT of a 16 MiB
pack is given up after 124 s, not after a fixed 10 minutes; retries are logged as warnings (logger
``ckptvault.store``; one per RETRY_SAID_EVERY_S for all calls), so a stalled transfer is not silent.

A storage that is down or busy as a whole (no answer, 503, 500, throttling, transfers cut mid-body:
``failures.down_or_busy``) is
retried past those attempts for ``retry_for`` seconds from the call's first failure (backoff up to
30 s), as restic rides out an outage: a restore on a fresh machine must not end for a 20-second 503
window and download its multi-GB file again from the start.

Settings come from the environment unless given: CKPTVAULT_RETRIES (attempts after the
first, default 5; set, it is the whole budget), CKPTVAULT_RETRY_FOR (seconds an outage is retried
for, default 120; 0: by attempts only), CKPTVAULT_RETRY_DELAY (first backoff in seconds, default
0.5, doubling up to 30 s), CKPTVAULT_OP_TIMEOUT (seconds per storage call, every call alike;
default: by size).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from ..errors import ObjectExistsError, StorageError
from ..units import format_seconds
from .base import ObjectInfo, Store, TempFiles
from .failures import down_or_busy, object_fault, refused, unknown_host, unreachable
from .options import env_number

T = TypeVar("T")
log = logging.getLogger("ckptvault.store")

# Set when the command was interrupted (Ctrl-C, SIGTERM: the CLI's handlers): a storage call that
# fails is not tried again, so that the calls in flight end with their current attempt (on a dead
# network path each retry waits out a whole deadline: a Ctrl-C took 11 minutes to end).
_interrupted = threading.Event()


def stop_retrying() -> None:
    """From now on, in this process, a failed storage call is not tried again (the command is ending)."""
    _interrupted.set()


# The default deadline of a call that moves a known number of bytes: a base for the round trips,
# plus a second per 256 KiB (a 16 MiB pack: 124 s; four such uploads at once need ~0.5 MB/s). A
# call of unknown size (a whole object's GET, a listing) gets UNSIZED_DEADLINE_S.
BASE_DEADLINE_S = 60.0
SLOWEST_RATE = 256 * 1024
UNSIZED_DEADLINE_S = 600.0


def call_deadline(op_timeout: float | None, nbytes: int | None) -> float:
    """Seconds one storage call may take (0: no limit): ``op_timeout`` for every call where it is
    set (CKPTVAULT_OP_TIMEOUT), else by size (above)."""
    if op_timeout is not None:
        return op_timeout
    if nbytes is None:
        return UNSIZED_DEADLINE_S
    return BASE_DEADLINE_S + nbytes / SLOWEST_RATE


RETRY_FOR_S = 120.0  # how long an outage is retried by default (CKPTVAULT_RETRY_FOR)
# While the storage fails, every call in flight retries (16 reads of a restore): one warning line in this
# many seconds says it for all of them (one 503 window printed 61 lines of ~230 characters)
RETRY_SAID_EVERY_S = 10.0
MAX_FAILING_KEYS = 10_000  # objects remembered as failing with a server error (a few bytes each)


# A call that has not finished this long is said (every SILENCE_SAID_EVERY_S at most for a store): without
# it a frozen server left the user 60-76 s without a word before the first retry (nf48 F5)
SILENCE_SAID_AFTER_S = 30.0
SILENCE_SAID_EVERY_S = 60.0


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 5
    base_delay: float = 0.5
    max_delay: float = 30.0
    op_timeout: float | None = None  # None: by the call's size (call_deadline)
    retry_for: float = 0.0  # seconds a storage down or busy is retried past ``retries`` (never with retries=0)

    @classmethod
    def from_env(cls) -> RetryPolicy:
        timeout = env_number("CKPTVAULT_OP_TIMEOUT", -1)  # unset: by size
        counted = bool(os.environ.get("CKPTVAULT_RETRIES", "").strip())  # a count given is the whole budget
        return cls(
            retries=int(env_number("CKPTVAULT_RETRIES", cls.retries, whole=True)),
            base_delay=env_number("CKPTVAULT_RETRY_DELAY", cls.base_delay),
            op_timeout=None if timeout < 0 else timeout,
            retry_for=env_number("CKPTVAULT_RETRY_FOR", 0.0 if counted else RETRY_FOR_S),
        )

    def delay(self, attempt: int) -> float:
        """Exponential backoff with jitter, so many clients do not retry in step (the exponent bounded: an
        outage retried for long with short delays reaches attempts whose 2**n no float holds)."""
        return min(self.max_delay, self.base_delay * 2 ** min(attempt, 64)) * random.uniform(0.5, 1.0)


NO_ANSWER = "no answer after"
OUTAGE_LOOK_EVERY_S = 10.0  # the longest wait between tries while the storage does not answer at all


def no_answer(seconds: float) -> str:
    """The reason of a call given up at its deadline (here or by the backend's own)."""
    return f"{NO_ANSWER} {format_seconds(seconds)} s"


# Housekeeping whose failure is harmless and said (removing a shared lock at the end of a command) gets
# BRIEF_RETRIES retries of at most BRIEF_DEADLINE_S each (``RetryingStore.briefly``): on a dead link the
# full budget held a finished backup 6 minutes after "snapshot saved" (audit rb44 #3).
BRIEF_DEADLINE_S = 10.0
BRIEF_RETRIES = 1


def call_with_timeout(
    fn: Callable[[], T], timeout: float, op: str, key: str, url: str, on_silence: Callable[[], None] | None = None
) -> T:
    """Run ``fn`` in a daemon thread; give up waiting after ``timeout`` seconds. The thread may
    linger if the call never returns: Python cannot cancel it, but it cannot block exit either.
    ``on_silence`` is called once the call has run SILENCE_SAID_AFTER_S without finishing."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:
            error.append(exc)

    worker = threading.Thread(target=run, name=f"ckptvault-{op}", daemon=True)
    worker.start()
    if on_silence is not None and timeout > SILENCE_SAID_AFTER_S:
        worker.join(SILENCE_SAID_AFTER_S)
        if worker.is_alive():
            on_silence()
        timeout -= SILENCE_SAID_AFTER_S
    worker.join(timeout)
    if worker.is_alive():
        raise StorageError(op, key, url, no_answer(timeout), retryable=True) from TimeoutError()
    if error:
        raise error[0]
    return result[0]


# After a call gave up because the storage did not answer through all its attempts (a timeout, a
# refused or dropped connection; not an error it answered with, which may concern one object only),
# calls made in the next OPEN_S seconds get one attempt each, one at a time (a probe), and those made
# while a probe runs fail at once, instead of each waiting out a budget of its own: a backup's next
# uploads, a restore's queued reads, the lock's release. A probe holds the others back until its own
# deadline (PROBE_PATIENCE_S where calls have none); a probe the storage answers with an error that may
# pass (a 503 while it recovers) goes on with the full retries. Once anything answers, or OPEN_S after
# the last give-up with no probe running, calls get their full retries again.
OPEN_S = 30.0
PROBE_PATIENCE_S = 120.0


@dataclass(frozen=True)
class _GaveUp:
    at: float
    op: str
    key: str
    reason: str


class Breaker:
    """The circuit breaker above, for one store; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gave_up: _GaveUp | None = None
        self._probe = 0  # the running probe's number (0: none)
        self._probe_until = 0.0
        self._probes = 0

    def is_open(self) -> bool:
        gave_up = self._gave_up
        return gave_up is not None and time.monotonic() - gave_up.at < OPEN_S

    def admit(self, op: str, key: str, url: str, *, patience: float) -> int:
        """0 for a call with its full retries, else the number of the probe this call is (one attempt);
        raises a retryable StorageError while another probe runs."""
        with self._lock:
            now = time.monotonic()
            gave_up = self._gave_up
            if gave_up is None:
                return 0
            if self._probe and now < self._probe_until:
                reason = f"not tried, the storage did not answer {gave_up.op} {gave_up.key} ({gave_up.reason})"
                # caused by "no answer", as the give-up was: callers that wait out an outage see it as one
                raise StorageError(op, key, url, reason, retryable=True) from ConnectionError(gave_up.reason)
            if now - gave_up.at >= OPEN_S:
                return 0
            self._probes += 1
            self._probe, self._probe_until = self._probes, now + (patience or PROBE_PATIENCE_S)
            return self._probe

    def settle(self, probe: int, error: BaseException | None) -> None:
        """Record how a call ended (``error`` None for an answer); ``probe`` as ``admit`` gave it."""
        with self._lock:
            if probe and probe == self._probe:
                self._probe = 0
            if isinstance(error, StorageError) and error.retryable and unreachable(error):
                self._gave_up = _GaveUp(time.monotonic(), error.op, error.key, error.reason)
            elif error is None or isinstance(error, StorageError):
                self._gave_up = None  # the storage answered (an interrupt says nothing either way)


# How much later than the backend's own deadline the thread-based one fires, where the backend
# enforces one: long enough for a cancelled request to report itself.
DEADLINE_GRACE_S = 2.0


class RetryingStore:
    def __init__(self, inner: Store, policy: RetryPolicy | None = None) -> None:
        self.inner = inner
        self.policy = policy or RetryPolicy.from_env()
        self.url = inner.url
        self.remote = getattr(inner, "remote", False)
        self.transfers = getattr(inner, "transfers", None)
        self.supports_if_absent = getattr(inner, "supports_if_absent", False)
        self.local_folder: str | None = getattr(inner, "local_folder", None)
        self.odd_path = getattr(inner, "odd_path", None)
        self._grace = DEADLINE_GRACE_S if getattr(inner, "enforces_deadline", False) else 0.0
        self._deadlines = getattr(inner, "needs_deadline", True)
        self._breaker = Breaker()
        self._retry_said = -RETRY_SAID_EVERY_S  # when a retry was last said (time.monotonic)
        self._outage_said = -RETRY_SAID_EVERY_S  # when a retry past the attempts was last said
        self._answered_at = 0.0  # when a call last succeeded (time.monotonic)
        self._failing_keys: set[str] = set()  # objects a server error failed through every attempt
        self._brief = threading.local()  # .on: this thread's calls are housekeeping (briefly())
        self._silence_said = -SILENCE_SAID_EVERY_S  # when a call still running was last said (time.monotonic)

    @property
    def unanswered(self) -> bool:
        """Whether a call gave up lately because the storage did not answer, and nothing answered
        since (a caller may skip best-effort calls, such as removing its shared lock)."""
        return self._breaker.is_open()

    @contextlib.contextmanager
    def briefly(self) -> Iterator[None]:
        """The calls this thread makes inside are housekeeping: BRIEF_RETRIES retries of at most
        BRIEF_DEADLINE_S each, and no outage is waited out; the caller reports a failure and goes on."""
        self._brief.on = True
        try:
            yield
        finally:
            self._brief.on = False

    def _address_hint(self, exc: StorageError) -> str:
        """For connections refused before anything here ever answered: the likelier cause is the address
        (a mistyped port or endpoint_url) than an outage (nf48 F7)."""
        if self._answered_at or not refused(exc):
            return ""
        return (
            " (nothing has accepted a connection there yet: check the address, -o endpoint_url or the URL's "
            "host and port, or that the server runs)"
        )

    def _say_waiting(self, op: str, key: str, deadline: float) -> None:
        """A call still running after SILENCE_SAID_AFTER_S, said for all of this store's (once a minute)."""
        now = time.monotonic()
        if now - self._silence_said < SILENCE_SAID_EVERY_S:
            return
        self._silence_said = now
        log.warning(  # not "no answer": a big upload on a slow link takes this long too
            "waiting for %s: %s %s has not finished in %s s (a slow link, or a server that stopped answering); "
            "each try waits up to %s s (CKPTVAULT_OP_TIMEOUT sets it), then it is retried",
            self.url,
            op,
            key,
            format_seconds(SILENCE_SAID_AFTER_S),
            format_seconds(deadline),
        )

    def _call(self, op: str, key: str, fn: Callable[[], T], nbytes: int | None = None) -> T:
        """``fn`` with retries; ``nbytes``: what the call moves, where known (its deadline)."""
        brief = getattr(self._brief, "on", False)
        deadline = call_deadline(self.policy.op_timeout, nbytes) if self._deadlines else 0
        if brief and self._deadlines:
            deadline = min(deadline, BRIEF_DEADLINE_S) if deadline else BRIEF_DEADLINE_S
        probe = self._breaker.admit(op, key, self.url, patience=deadline + self._grace if deadline else 0)
        retries = 0 if probe else min(self.policy.retries, BRIEF_RETRIES) if brief else self.policy.retries
        attempt = 0
        started = time.monotonic()
        first_failed = 0.0
        while True:
            try:
                if deadline:
                    waiting = functools.partial(self._say_waiting, op, key, deadline)
                    result = call_with_timeout(fn, deadline + self._grace, op, key, self.url, waiting)
                else:
                    result = fn()
            except StorageError as exc:
                if probe and exc.retryable and not unreachable(exc):
                    # the storage answers again (a 503 while it recovers): an ordinary call from now on
                    self._breaker.settle(probe, exc)
                    probe, retries = 0, self.policy.retries
                now = time.monotonic()
                first_failed = first_failed or now
                delay = self.policy.delay(attempt)
                if attempt >= retries and unreachable(exc):
                    # an outage (no answer at all): look again often, so that work resumes soon after the storage
                    # is back (backoffs of up to 30 s left a backup idle 12-25 s after it was, nf48 F9); a storage
                    # that answers busy (503, throttling) keeps the longer backoff it asks for
                    delay = min(delay, OUTAGE_LOOK_EVERY_S)
                window_left = first_failed + self.policy.retry_for - now
                if attempt >= retries and 0 < window_left < delay:
                    # the last try comes at the window's end, not past it: a 100 s outage failed a backup 21 s
                    # after the link was back, with the 120 s default (its next backoff fell past the window)
                    delay = window_left
                outlasting = (
                    attempt >= retries and not brief and self._outlasting(exc, key, retries, first_failed, now + delay)
                )
                # a host name DNS does not know, before anything here ever answered, is a typo in the address, not an
                # outage: it was retried for CKPTVAULT_RETRY_FOR (2 minutes) before it was said
                mistyped = not self._answered_at and unknown_host(exc)
                if mistyped or not exc.retryable or (attempt >= retries and not outlasting) or _interrupted.is_set():
                    self._breaker.settle(probe, exc)
                    if attempt >= retries and object_fault(exc) and len(self._failing_keys) < MAX_FAILING_KEYS:
                        self._failing_keys.add(key)  # its next calls (a restore's other chunks of it) try less
                    if attempt > retries:  # an outage retried for a time: how long, and what sets it
                        waited = format_seconds(now - first_failed)
                        each = (  # attempts that each waited out their deadline: that is set too (nf48 F6)
                            "CKPTVAULT_OP_TIMEOUT how long each attempt waits for an answer, "
                            if exc.reason.startswith(NO_ANSWER)
                            else ""
                        )
                        exc.args = (
                            f"{exc.args[0]} (after {attempt + 1} attempts in {waited} s; {each}CKPTVAULT_RETRY_FOR "
                            f"sets how long an outage is retried){self._address_hint(exc)}",
                        )
                    elif attempt and exc.reason.startswith(NO_ANSWER):  # each attempt waited out its deadline
                        exc.args = (
                            f"{exc.args[0]} (after {attempt + 1} attempts in {format_seconds(now - started)} s; "
                            "CKPTVAULT_OP_TIMEOUT sets how long each attempt waits for an answer)",
                        )
                    elif attempt:
                        exc.args = (f"{exc.args[0]} (after {attempt + 1} attempts)",)
                    raise
                # a retry of this store is said at most once in RETRY_SAID_EVERY_S: a failing storage fails every
                # call in flight alike (21-75 lines of ~300 characters for one 15-25 s window, audit 32a F5); the
                # call that gives up says so in full (and that retries go on for CKPTVAULT_RETRY_FOR is said apart)
                said = self._outage_said if outlasting else self._retry_said
                quiet = now - said < RETRY_SAID_EVERY_S
                if not quiet:
                    self._retry_said = now
                    if outlasting:
                        self._outage_said = now
                if outlasting:
                    (log.debug if quiet else log.warning)(
                        "%s; the storage is %s: retrying in %.1f s (attempt %d; for up to %s s in all, "
                        "CKPTVAULT_RETRY_FOR)",
                        exc,
                        "failing (a server error)" if object_fault(exc) else "down or busy" + self._address_hint(exc),
                        delay,
                        attempt + 2,
                        format_seconds(self.policy.retry_for),
                    )
                else:
                    (log.debug if quiet else log.warning)(
                        "%s; retrying in %.1f s (attempt %d of %d)", exc, delay, attempt + 2, retries + 1
                    )
                failure = exc
            except BaseException as exc:
                self._breaker.settle(probe, exc)
                raise
            else:
                self._breaker.settle(probe, None)
                self._answered_at = time.monotonic()
                return result
            if _interrupted.wait(delay):  # interrupted while waiting to try again: the failure stands
                self._breaker.settle(probe, failure)
                raise failure
            attempt += 1

    def _outlasting(self, exc: StorageError, key: str, retries: int, first_failed: float, next_try: float) -> bool:
        """Whether a call out of attempts goes on: the storage is down or busy, and has been for less than
        ``retry_for`` seconds by the next try. A probe (retries 0) gets one attempt. A server error (500)
        goes on only while it may be the storage's, not the object's: no call was answered since this one
        first failed, and this object did not fail all its attempts with one before (a damaged SeaweedFS
        volume answers so for one object for good, while every other one reads)."""
        if not (retries and next_try - first_failed <= self.policy.retry_for and exc.retryable and down_or_busy(exc)):
            return False
        if object_fault(exc):
            return key not in self._failing_keys and self._answered_at < first_failed
        return True

    def put(self, key: str, data: bytes | bytearray | memoryview, *, if_absent: bool = False) -> None:
        if not if_absent:
            self._call("PUT", key, lambda: self.inner.put(key, data), len(data))
            return
        attempts = 0

        def attempt() -> None:
            nonlocal attempts
            attempts += 1
            self.inner.put(key, data, if_absent=True)

        try:
            self._call("PUT", key, attempt, len(data))
        except ObjectExistsError:
            if attempts < 2 or self.get(key) != bytes(data):
                raise

    def get(self, key: str) -> bytes:
        return self._call("GET", key, lambda: self.inner.get(key))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._call("GET", key, lambda: self.inner.get_range(key, start, length), length)

    def read_upto(self, key: str, start: int, length: int) -> bytes:
        read = self.inner.read_upto  # type: ignore[attr-defined]
        return self._call("GET", key, lambda: read(key, start, length), length)

    def exists(self, key: str) -> bool:
        return self._call("STAT", key, lambda: self.inner.exists(key), 0)

    def list(self, prefix: str) -> list[ObjectInfo]:
        return self._call("LIST", prefix, lambda: self.inner.list(prefix))

    def delete(self, key: str) -> None:
        self._call("DELETE", key, lambda: self.inner.delete(key), 0)

    def remove_stale_temp_files(self, older_than_s: float) -> int:
        return self.inner.remove_stale_temp_files(older_than_s)

    def temp_files(self) -> TempFiles:
        temp_files = getattr(self.inner, "temp_files", None)
        return self._call("LIST", "(temp files)", temp_files) if temp_files is not None else []
