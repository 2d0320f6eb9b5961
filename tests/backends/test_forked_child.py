"""A Vault on a remote vault, inherited by a forked child (a DataLoader worker with the fork start method, a
``multiprocessing.Pool`` process, ``os.fork``) while the parent was not writing: the child reads and writes
through connections of its own, refreshes the locks it takes itself, and leaves the parent's connections
working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckptvault import Vault

from ..support import servers
from .conftest import ROOT, make_checkpoint

CHILD_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from datetime import timedelta
    from ckptvault import Vault

    url, options, ckpt, other, out = sys.argv[1], json.loads(sys.argv[2]), *sys.argv[3:6]
    vault = Vault.open(url, storage_options=options)
    first = vault.backup(ckpt, tags={"step": "1"})  # the parent's connections are open, some idle in its pool

    def use(action):
        if action == "snapshots":
            return len(vault.snapshots())
        if action == "backup":
            return vault.backup(other, tags={"step": "2"}).tags["step"]
        if action == "restore":
            return vault.restore(first, os.path.join(out, "restored")).files
        if action == "tag":
            return vault.tag("latest", tags={"step": "2"}, add={"keep": "yes"}).tags["keep"]
        if action == "lock":  # a lock the child takes is refreshed by the child
            vault._repo.locks.refresh_every = timedelta(seconds=0.2)
            reading = vault.read_file(first, "model/weights.bin")
            next(reading)  # read part way: the child holds a shared lock
            before = [(lock.lock_id, lock.pid) for lock in vault.locks()]
            time.sleep(1.5)
            after = [(lock.lock_id, lock.pid) for lock in vault.locks()]
            reading.close()
            return f"{len(before)} {before[0][1] == os.getpid()} {after[0][1] == os.getpid()} {before != after}"

    for action in ("snapshots", "backup", "restore", "tag", "lock"):
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)  # a child that hangs is ended by it
            try:
                said = f"returned {use(action)}"
            except BaseException as exc:
                said = f"{type(exc).__name__}: {exc}"
            os.write(1, f"child {action}: {said}\\n".encode())
            os._exit(0)
        print(f"{action} child ended with status {os.waitpid(pid, 0)[1]}", flush=True)
        steps = sorted(s.tags["step"] for s in vault.snapshots())  # the parent's own calls, after the child's
        print(f"parent after {action}: {vault.backup(ckpt, tags={'step': '1'}).tags['step']} {steps}", flush=True)
    vault.close()
    """
)


@pytest.mark.parametrize(
    "backend_name", ["s3-moto", "gcs-fake-gcs-server", "azure-azurite", "sftp-openssh", "webdav-wsgidav"]
)
def test_a_forked_child_uses_the_vault_it_inherited_through_connections_of_its_own(
    server, backend_name: str, tmp_path: Path
):
    """On S3 every call of the child failed at once, as a storage failure: "RuntimeError: This class is not
    fork-safe" (s3fs's event loop is the parent's); on SFTP each call hung for the whole deadline on the
    parent's session, whose reading thread stayed in the parent, and what the child wrote over it made the
    server drop the parent's session ("Server connection dropped", retried). Local vaults always worked."""
    backend = server(backend_name).backend
    url = backend.new_url()
    Vault.init(url, storage_options=backend.storage_options).close()
    ckpt = make_checkpoint(tmp_path / "ckpt", step=1)
    other = make_checkpoint(tmp_path / "other", step=2)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD_SCRIPT,
            url,
            json.dumps(backend.storage_options),
            str(ckpt),
            str(other),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **servers.CLIENT_ENV, **backend.env},
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr
    said = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if line.startswith("child "))
    assert said == {
        "child snapshots": "returned 1",
        "child backup": "returned 2",
        "child restore": "returned 3",
        "child tag": "returned yes",
        "child lock": "returned 1 True True True",  # its own lock, refreshed (a new object) by its own thread
    }, proc.stdout + proc.stderr
    assert proc.stdout.count("child ended with status 0") == 5, proc.stdout
    # the parent's connections were left alone: no call of the parent's failed or was retried
    assert "retrying" not in proc.stderr and "waiting for" not in proc.stderr, proc.stderr
    assert "parent after lock: 1 ['1', '1', '1', '1', '1', '2']" in proc.stdout, proc.stdout
    with Vault.open(url, storage_options=backend.storage_options) as vault:
        assert vault.check(read_data=True).ok
        assert [s.tags for s in vault.snapshots(tags={"step": "2"})] == [{"step": "2", "keep": "yes"}]


LOCK_HELD_AT_FORK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading, time
    from ckptvault import Vault
    from ckptvault.store import fsspec_store

    url, options, ends = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    vault = Vault.open(url, storage_options=options)
    vault.snapshots()  # a pooled session, idle now
    (session,) = [fs for store in fsspec_store._STORES for idle in store._idle.values() for fs in idle]
    channel = session.ftp.sock  # the SFTP channel: paramiko's transport thread takes its lock for each packet
    held, forked = threading.Event(), threading.Event()

    def transport_thread_at_the_fork():
        with channel.lock:
            held.set()
            forked.wait()

    threading.Thread(target=transport_thread_at_the_fork).start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        os.write(1, f"child: {len(vault.snapshots())} snapshot(s)\\n".encode())
        if ends == "os._exit":  # as multiprocessing's children end
            os._exit(0)
        sys.exit(0)  # through the interpreter's shutdown, which collects what the child inherited
    forked.set()
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child hung", flush=True)
            break
        time.sleep(0.1)
    print(f"parent: {len(vault.snapshots())} snapshot(s)", flush=True)
    vault.close()
    """
)


@pytest.mark.parametrize("ends", ["os._exit", "sys.exit"])
def test_a_child_forked_while_a_session_lock_was_held_does_not_hang(server, tmp_path: Path, ends: str):
    """paramiko's threads take a session's locks (its channel's, its buffers', its channel map's) for each
    packet: a child forked in that instant holds a copy of the lock that no thread of its own will release.
    Closing the inherited sessions through paramiko (the fork hook) waited on it for ever: the child (a
    DataLoader worker forked while a backup_async uploaded) hung before its first line of code. Its copies of
    their sockets are closed without taking any of paramiko's locks."""
    backend = server("sftp-openssh").backend
    url = backend.new_url()
    Vault.init(url, storage_options=backend.storage_options).close()
    proc = subprocess.run(
        [sys.executable, "-c", LOCK_HELD_AT_FORK_SCRIPT, url, json.dumps(backend.storage_options), ends],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **servers.CLIENT_ENV, **backend.env},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["child: 0 snapshot(s)", "parent: 0 snapshot(s)"], proc.stdout + proc.stderr
    assert "retrying" not in proc.stderr, proc.stderr  # the parent's session went on
