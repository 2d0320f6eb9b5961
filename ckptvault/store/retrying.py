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

Settings come from the environment unless given: CKPTVAULT_RETRIES (attempts after the
first, default 5), CKPTVAULT_RETRY_DELAY (first backoff in seconds, default 0.5, doubling up
to 30 s), CKPTVAULT_OP_TIMEOUT (seconds per storage call, default 600).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import ObjectExistsError, StorageError, UsageError
from .base import ObjectInfo, Store

T = TypeVar("T")


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not a number") from None
    if value < 0:
        raise UsageError(f"{name}={raw!r} must not be negative")
    return value


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 5
    base_delay: float = 0.5
    max_delay: float = 30.0
    op_timeout: float = 600.0

    @classmethod
    def from_env(cls) -> RetryPolicy:
        return cls(
            retries=int(_env_number("CKPTVAULT_RETRIES", cls.retries)),
            base_delay=_env_number("CKPTVAULT_RETRY_DELAY", cls.base_delay),
            op_timeout=_env_number("CKPTVAULT_OP_TIMEOUT", cls.op_timeout),
        )

    def delay(self, attempt: int) -> float:
        """Exponential backoff with jitter, so many clients do not retry in step."""
        return min(self.max_delay, self.base_delay * 2**attempt) * random.uniform(0.5, 1.0)


def call_with_timeout(fn: Callable[[], T], timeout: float, op: str, key: str, url: str) -> T:
    """Run ``fn`` in a daemon thread; give up waiting after ``timeout`` seconds. The thread may
    linger if the call never returns: Python cannot cancel it, but it cannot block exit either."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:
            error.append(exc)

    worker = threading.Thread(target=run, name=f"ckptvault-{op}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise StorageError(op, key, url, f"no answer after {timeout:g} s", retryable=True)
    if error:
        raise error[0]
    return result[0]


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
        grace = DEADLINE_GRACE_S if getattr(inner, "enforces_deadline", False) else 0.0
        self._wait_s = self.policy.op_timeout + grace if self.policy.op_timeout else self.policy.op_timeout
        self._deadline = getattr(inner, "needs_deadline", True) and self._wait_s > 0  # 0: no deadline

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        attempt = 0
        while True:
            try:
                return call_with_timeout(fn, self._wait_s, op, key, self.url) if self._deadline else fn()
            except StorageError as exc:
                if not exc.retryable or attempt >= self.policy.retries:
                    if attempt:
                        exc.args = (f"{exc.args[0]} (after {attempt + 1} attempts)",)
                    raise
            time.sleep(self.policy.delay(attempt))
            attempt += 1

    def put(self, key: str, data: bytes | bytearray | memoryview, *, if_absent: bool = False) -> None:
        if not if_absent:
            self._call("PUT", key, lambda: self.inner.put(key, data))
            return
        attempts = 0

        def attempt() -> None:
            nonlocal attempts
            attempts += 1
            self.inner.put(key, data, if_absent=True)

        try:
            self._call("PUT", key, attempt)
        except ObjectExistsError:
            if attempts < 2 or self.get(key) != bytes(data):
                raise

    def get(self, key: str) -> bytes:
        return self._call("GET", key, lambda: self.inner.get(key))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._call("GET", key, lambda: self.inner.get_range(key, start, length))

    def read_upto(self, key: str, start: int, length: int) -> bytes:
        return self._call("GET", key, lambda: self.inner.read_upto(key, start, length))  # type: ignore[attr-defined]

    def exists(self, key: str) -> bool:
        return self._call("STAT", key, lambda: self.inner.exists(key))

    def list(self, prefix: str) -> list[ObjectInfo]:
        return self._call("LIST", prefix, lambda: self.inner.list(prefix))

    def delete(self, key: str) -> None:
        self._call("DELETE", key, lambda: self.inner.delete(key))

    def remove_stale_temp_files(self, older_than_s: float) -> int:
        return self.inner.remove_stale_temp_files(older_than_s)
