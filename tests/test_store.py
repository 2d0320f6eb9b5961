"""One conformance suite for every backend: local and memory here; S3 (SeaweedFS, moto), GCS
(fake-gcs-server), Azure (Azurite) and SFTP (OpenSSH) on real servers in tests/backends/."""

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from ckptvault.errors import ObjectExistsError, ObjectNotFoundError, StorageError, UsageError
from ckptvault.store import FsspecStore, LocalStore, ReadAheadStore


class StoreConformance:
    @pytest.fixture
    def store(self):
        raise NotImplementedError

    def test_put_get(self, store):
        store.put("a/b/obj", b"hello")
        assert store.get("a/b/obj") == b"hello"
        assert store.exists("a/b/obj")

    def test_range_get(self, store):
        store.put("r", bytes(range(200)))
        assert store.get_range("r", 10, 5) == bytes(range(10, 15))
        with pytest.raises(StorageError, match="short read"):
            store.get_range("r", 190, 50)

    def test_missing_object(self, store):
        assert not store.exists("nope")
        with pytest.raises(ObjectNotFoundError, match="nope"):
            store.get("nope")
        with pytest.raises(ObjectNotFoundError):
            store.get_range("nope", 0, 1)

    def test_list_with_sizes(self, store):
        store.put("packs/aa/1", b"x" * 3)
        store.put("packs/bb/2", b"y")
        store.put("index/3", b"zz")
        assert [(o.key, o.size) for o in store.list("packs/")] == [("packs/aa/1", 3), ("packs/bb/2", 1)]
        assert store.list("nothing/") == []

    def test_list_says_when_each_object_was_written(self, store):
        # an unreadable lock's age comes from here (repository/locks.py)
        before = datetime.now(timezone.utc) - timedelta(minutes=5)  # servers' clocks and rounding vary
        store.put("locks/1", b"x")
        (info,) = store.list("locks/")
        assert info.modified is not None and before < info.modified < datetime.now(timezone.utc) + timedelta(minutes=5)

    def test_delete(self, store):
        store.put("d", b"1")
        store.delete("d")
        assert not store.exists("d")

    def test_large_object(self, store):
        data = os.urandom(20 * 1024 * 1024 + 7)
        store.put("big", data)
        assert store.get("big") == data

    def test_concurrent_writers(self, store):
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: store.put(f"c/{i}", str(i).encode() * 1000), range(32)))
        assert len(store.list("c/")) == 32
        assert store.get("c/7") == b"7" * 1000

    def test_range_get_inside_a_large_object(self, store):
        data = os.urandom(6 * 1024 * 1024 + 11)
        store.put("packs/ab/big", data)
        for start, length in ((0, 1), (5 * 1024 * 1024 + 3, 1024 * 1024), (len(data) - 7, 7)):
            assert store.get_range("packs/ab/big", start, length) == data[start : start + length]

    def test_empty_object(self, store):
        store.put("empty/e", b"")
        assert store.get("empty/e") == b""
        assert [(o.key, o.size) for o in store.list("empty/")] == [("empty/e", 0)]

    def test_list_prefix_is_a_folder_not_a_substring(self, store):
        store.put("snapshots/a", b"1")
        store.put("snapshotsX/b", b"2")
        assert [o.key for o in store.list("snapshots/")] == ["snapshots/a"]

    def test_delete_of_a_missing_object_is_not_a_failure_of_the_store(self, store):
        with contextlib.suppress(ObjectNotFoundError):  # local disks and SFTP say so; object stores do not
            store.delete("never-there")

    def test_create_if_absent(self, store):
        store.put("config", b"first", if_absent=True)
        with pytest.raises(ObjectExistsError, match="config"):
            store.put("config", b"second", if_absent=True)
        assert store.get("config") == b"first"

    def test_racing_creates_have_exactly_one_winner(self, store):
        if not store.supports_if_absent:
            pytest.skip(f"{store.url} cannot enforce create-if-absent")
        start = threading.Barrier(8)

        def create(i: int) -> bool:
            start.wait()
            try:
                store.put("race", f"writer {i}".encode(), if_absent=True)
                return True
            except ObjectExistsError:
                return False

        with ThreadPoolExecutor(8) as pool:
            won = [i for i, ok in enumerate(pool.map(create, range(8))) if ok]
        assert len(won) == 1, won
        assert store.get("race") == f"writer {won[0]}".encode()

    def test_sequential_range_reads(self, store):
        data = os.urandom(3 * 1024 * 1024 + 5)
        store.put("packs/cd/seq", data)
        pos, size = 0, 100_003
        while pos < len(data):
            n = min(size, len(data) - pos)
            assert store.get_range("packs/cd/seq", pos, n) == data[pos : pos + n]
            pos += n


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path):
        return LocalStore(str(tmp_path / "repo"))

    def test_put_leaves_no_temp_files(self, store, tmp_path):
        store.put("packs/x", b"data")
        assert sorted(os.listdir(tmp_path / "repo" / "packs")) == ["x"]

    def test_listing_leaves_out_what_is_not_an_object(self, store, tmp_path):
        store.put("packs/ab/x", b"data")
        os.symlink(tmp_path / "gone", tmp_path / "repo" / "packs" / "ab" / "dangling")
        (tmp_path / "repo" / "packs" / "ab" / ".tmp-0123").write_bytes(b"half")
        (tmp_path / "repo" / "packs" / "empty").mkdir()
        os.symlink(tmp_path / "repo" / "packs", tmp_path / "repo" / "packs" / "ab" / "loop")  # not walked into
        assert [o.key for o in store.list("packs/")] == ["packs/ab/x"]
        assert [o.key for o in store.list("packs/ab/x")] == ["packs/ab/x"]  # an object's own key
        assert store.list("nothing/") == []

    def test_a_temp_file_renamed_into_place_while_swept_is_no_error(self, store, tmp_path, monkeypatch):
        """prune's sweep of killed writers' temp files ended in an internal error when another process's
        temp file (its lock's, its pack's) was renamed between the sweep's listing and its look at it."""
        store.put("locks/x", b"data")
        walk = os.walk

        def listing_a_renamed_temp(top):
            for dirpath, dirnames, filenames in walk(top):
                yield dirpath, dirnames, [*filenames, ".tmp-renamed-meanwhile"]

        monkeypatch.setattr(os, "walk", listing_a_renamed_temp)
        assert store.remove_stale_temp_files(older_than_s=0) == 0


class TestLocalFsspecStore(StoreConformance):
    """file:// goes through fsspec's local filesystem, with LocalStore's puts and range reads."""

    @pytest.fixture
    def store(self, tmp_path):
        return FsspecStore(f"file://{tmp_path / 'repo'}")


def test_a_plain_path_without_options_needs_no_fsspec(tmp_path):
    """fsspec loads asyncio and ssl: ~0.1 s of every command's start-up, for nothing on a local folder."""
    code = (
        "import sys; from ckptvault import Vault; "
        f"v = Vault.init({str(tmp_path / 'v')!r}); v.backup([{str(tmp_path / 'src')!r}]); "
        f"v.restore('latest', {str(tmp_path / 'out')!r}); v.check(); v.close(); "
        "print(sorted(m for m in ('fsspec', 'asyncio', 'ssl') if m in sys.modules))"
    )
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "w.bin").write_bytes(os.urandom(3 << 20))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert (tmp_path / "out" / "w.bin").read_bytes() == (tmp_path / "src" / "w.bin").read_bytes()


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def store(self):
        return FsspecStore(f"memory://store-test-{uuid.uuid4().hex}")


class RecordingStore:
    """An in-memory store that records every read it answers."""

    def __init__(self, fail_windows: bool = False, silent: bool = False) -> None:
        self.inner = FsspecStore(f"memory://readahead-{uuid.uuid4().hex}")
        self.url = self.inner.url
        self.remote = True
        self.reads: list[tuple[str, int, int]] = []
        self.fail_windows = fail_windows
        self.silent = silent  # windows fail because the storage did not answer

    def put(self, key, data, *, if_absent=False):
        self.inner.put(key, data, if_absent=if_absent)

    def get_range(self, key, start, length):
        self.reads.append(("range", start, length))
        return self.inner.get_range(key, start, length)

    def read_upto(self, key, start, length):
        self.reads.append(("window", start, length))
        if self.silent:
            raise StorageError("GET", key, self.url, "no answer after 5 s", retryable=True) from TimeoutError()
        if self.fail_windows:
            raise StorageError("GET", key, self.url, "short read", retryable=True)
        return self.inner.read_upto(key, start, length)


class TestReadAhead:
    """Sequential range reads on a remote store become one request per window (store/readahead.py)."""

    DATA = bytes(range(256)) * 40_000  # 10 MB

    def make(self, **kw) -> tuple[RecordingStore, ReadAheadStore]:
        inner = RecordingStore(**kw)
        inner.put("p", self.DATA)
        return inner, ReadAheadStore(inner, window=1_000_000)

    def test_sequential_reads_share_one_window(self):
        inner, store = self.make()
        for i in range(20):  # 20 x 100 kB: the first read, then two windows
            assert store.get_range("p", i * 100_000, 100_000) == self.DATA[i * 100_000 : (i + 1) * 100_000]
        assert [kind for kind, _, _ in inner.reads] == ["range", "window", "window"]

    def test_a_range_read_twice_is_fetched_again(self):
        inner, store = self.make()
        store.get_range("p", 0, 1000)
        store.get_range("p", 1000, 1000)  # opens a window
        before = len(inner.reads)
        assert store.get_range("p", 1000, 1000) == self.DATA[1000:2000]  # e.g. after failed verification
        assert inner.reads[before:] == [("range", 1000, 1000)]

    def test_random_reads_go_straight_through(self):
        inner, store = self.make()
        for start in (5_000_000, 10, 7_000_000, 300):
            assert store.get_range("p", start, 50) == self.DATA[start : start + 50]
        assert all(kind == "range" for kind, _, _ in inner.reads)

    def test_a_failed_window_falls_back_to_exact_reads(self):
        inner, store = self.make(fail_windows=True)
        for i in range(4):
            assert store.get_range("p", i * 1000, 1000) == self.DATA[i * 1000 : (i + 1) * 1000]
        assert ("window", 1000, 1_000_000) in inner.reads

    def test_a_window_the_storage_did_not_answer_is_not_read_again_range_by_range(self):
        inner, store = self.make(silent=True)
        store.get_range("p", 0, 1000)
        with pytest.raises(StorageError, match="no answer"):
            store.get_range("p", 1000, 1000)  # opens a window, which gets no answer
        assert inner.reads == [("range", 0, 1000), ("window", 1000, 1_000_000)]

    def test_reads_past_the_end_of_the_object_keep_their_errors(self):
        _, store = self.make()
        end = len(self.DATA)
        store.get_range("p", end - 3000, 1000)
        store.get_range("p", end - 2000, 1000)
        with pytest.raises(StorageError, match="short read"):
            store.get_range("p", end - 1000, 2000)

    def test_parallel_sequential_readers(self):
        inner, store = self.make()
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: store.get_range("p", i * 50_000, 50_000), range(200)))
        assert b"".join(got) == self.DATA[:10_000_000]
        assert len(inner.reads) < 100


def test_local_disk_calls_run_without_a_watchdog_thread(tmp_path, monkeypatch: pytest.MonkeyPatch):
    from ckptvault.store import open_store, retrying

    calls: list[str] = []
    real = retrying.call_with_timeout
    monkeypatch.setattr(retrying, "call_with_timeout", lambda fn, *a: calls.append(a[1]) or real(fn, *a))
    local = open_store(str(tmp_path / "local"))
    local.put("k", b"x")
    assert local.get("k") == b"x" and calls == []
    memory = open_store(f"memory://deadline-{uuid.uuid4().hex}")  # not a local disk: watched
    memory.put("k", b"x")
    assert memory.get("k") == b"x" and calls == ["PUT", "GET"]


def test_a_short_local_read_is_continued(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """FUSE and network mounts may return fewer bytes than asked; only the end of the object stops a read."""
    from ckptvault.store import local

    store = LocalStore(str(tmp_path / "s"))
    data = os.urandom(100_000)
    store.put("packs/p", data)
    real = os.pread
    monkeypatch.setattr(local.os, "pread", lambda fd, n, at: real(fd, min(n, 7_000), at))
    assert store.get_range("packs/p", 1234, 50_000) == data[1234:51_234]
    with pytest.raises(StorageError, match="short read"):
        store.get_range("packs/p", 90_000, 20_000)


def test_op_timeout_zero_means_no_deadline(monkeypatch: pytest.MonkeyPatch):
    from ckptvault.store import open_store, retrying

    monkeypatch.setenv("CKPTVAULT_OP_TIMEOUT", "0")
    monkeypatch.setattr(retrying, "call_with_timeout", lambda *a: pytest.fail("a deadline was set"))
    store = open_store(f"memory://no-deadline-{uuid.uuid4().hex}")
    store.put("k", b"x")
    assert store.get("k") == b"x"


def test_deadlines_follow_the_size_of_the_call_unless_set(monkeypatch: pytest.MonkeyPatch):
    from ckptvault.store import open_store, retrying

    assert retrying.call_deadline(None, 16 << 20) == 124  # a pack upload
    assert retrying.call_deadline(None, 0) == 60 and retrying.call_deadline(None, None) == 600
    assert retrying.call_deadline(7, 1 << 30) == 7  # CKPTVAULT_OP_TIMEOUT: every call alike
    monkeypatch.delenv("CKPTVAULT_OP_TIMEOUT", raising=False)
    given = []
    monkeypatch.setattr(retrying, "call_with_timeout", lambda fn, timeout, *a: (given.append(timeout), fn())[1])
    store = open_store(f"memory://deadlines-{uuid.uuid4().hex}")
    store.put("k", b"\0" * (1 << 20))
    store.get_range("k", 0, 512 << 10)
    store.get("k")
    assert given == [64, 62, 600]


def test_a_local_put_makes_the_folders_it_creates_durable(tmp_path, monkeypatch):
    from ckptvault.store import local

    synced: list[str] = []
    real = local.fsync_dir
    monkeypatch.setattr(local, "fsync_dir", lambda path: (synced.append(path), real(path)))
    store = LocalStore(str(tmp_path / "repo"))
    store.put("packs/ab/1", b"x")
    root = str(tmp_path / "repo")
    # the new names: repo in tmp, packs in repo, ab in packs; then the object's own name in ab
    assert synced == [str(tmp_path), root, f"{root}/packs", f"{root}/packs/ab"]
    synced.clear()
    store.put("packs/ab/2", b"y")
    assert synced == [f"{root}/packs/ab"]


def test_local_deletes_are_durable_before_any_operation_on_another_kind_of_object(tmp_path, monkeypatch):
    """Prune and forget delete snapshots before their trees and packs, index objects before their packs: on a
    filesystem that does not keep the order of deletes by itself, a power loss could bring back a snapshot
    whose packs are gone (cr48 F2). Deletes of one kind cost no fsync each."""
    from ckptvault.store import local, open_store

    root = tmp_path / "repo"
    store = open_store(str(root))
    for key in ("snapshots/a", "snapshots/b", "trees/t", "index/i", "packs/ab/p", "packs/cd/q"):
        store.put(key, b"x")
    synced: list[str] = []
    real = local.fsync_dir
    monkeypatch.setattr(local, "fsync_dir", lambda path: (synced.append(path), real(path)))
    removed: list[str] = []
    real_remove = os.remove
    monkeypatch.setattr(local.os, "remove", lambda path: (removed.append(path), real_remove(path)))
    store.delete("snapshots/a")
    store.delete("snapshots/b")
    assert synced == []
    store.delete("trees/t")
    assert synced == [f"{root}/snapshots"] and removed[-1] == f"{root}/trees/t"
    store.delete("index/i")
    store.put("packs/ef/r", b"y")  # a repack's new pack: after the index objects' deletes too
    assert synced[1:3] == [f"{root}/trees", f"{root}/index"], synced
    synced.clear()
    store.delete("packs/ab/p")
    store.delete("packs/cd/q")
    assert synced == []
    store.put("locks/l", b"z")
    assert sorted(synced[:2]) == [f"{root}/packs/ab", f"{root}/packs/cd"], synced


def test_a_folder_whose_fsync_failed_stays_pending_and_parallel_deletes_wait_for_the_flush(tmp_path, monkeypatch):
    """An fsync that failed dropped its folder, and the retried delete went ahead unflushed; the other
    threads of a parallel delete ran ahead of a flush in progress (rv48 M1, M2)."""
    import errno
    import time

    from ckptvault.store import local

    root = tmp_path / "repo"
    store = LocalStore(str(root))
    for key in ("index/i", "packs/ab/p", "packs/cd/q"):
        store.put(key, b"x")
    events: list[str] = []
    real = local.fsync_dir
    failures = [OSError(errno.EIO, "Input/output error")]

    def slow_or_failing(path: str) -> None:
        events.append(f"fsync {os.path.basename(path)}")
        if failures:
            raise failures.pop()
        time.sleep(0.2)
        real(path)

    monkeypatch.setattr(local, "fsync_dir", slow_or_failing)
    real_remove = os.remove
    monkeypatch.setattr(
        local.os, "remove", lambda path: (events.append(f"rm {path[len(str(root)) + 1 :]}"), real_remove(path))
    )
    store.delete("index/i")
    with pytest.raises(StorageError, match="Input/output error"):
        store.delete("packs/ab/p")
    assert events == ["rm index/i", "fsync index"]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(store.delete, ["packs/ab/p", "packs/cd/q"]))
    assert events[2] == "fsync index" and sorted(events[3:]) == ["rm packs/ab/p", "rm packs/cd/q"], events


@pytest.mark.parametrize(
    "url, options, fragment",
    [
        (
            "s3://bucket/vault",
            {"endpoint_ur": "http://127.0.0.1:9"},
            "s3:// takes no storage option 'endpoint_ur' (did you mean endpoint_url?)",
        ),
        ("s3://bucket/vault?endpont_url=http://127.0.0.1:9", {}, "'endpont_url' (did you mean endpoint_url?)"),
        ("gs://bucket/vault", {"projct": "p"}, "gs:// takes no storage option 'projct' (did you mean project?)"),
        ("az://container/vault", {"account_nme": "a"}, "az:// takes no storage option 'account_nme'"),
        ("sftp://u@127.0.0.1:9/vault", {"key_file": "k"}, "sftp:// takes no storage option 'key_file'"),
        ("memory://vault", {"zz": 1}, "memory:// takes no storage option 'zz'"),
        # botocore refused these with a TypeError inside the first call: a storage failure, exit 20
        (
            "s3://bucket/vault",
            {"client_kwargs.endpoint_urll": "http://127.0.0.1:9"},
            "'client_kwargs.endpoint_urll' (did you mean client_kwargs.endpoint_url?)",
        ),
        (
            "s3://bucket/vault?config_kwargs.read_timout=5",
            {},
            "'config_kwargs.read_timout' (did you mean config_kwargs.read_timeout?)",
        ),
        ("s3://bucket/vault", {"client_kwargs": {"zz": 1}}, "s3:// takes no storage option 'client_kwargs.zz';"),
    ],
)
def test_a_storage_option_the_backend_does_not_take_is_refused(url, options, fragment):
    # s3fs, gcsfs and adlfs pass options they do not name to fsspec, which ignores them: a typo in
    # endpoint_url would open the vault on AWS instead. Refused before any connection is made.
    with pytest.raises(UsageError, match=re.escape(fragment)):
        FsspecStore(url, options)


@pytest.mark.parametrize("name", ["client_kwargs", "config_kwargs"])
@pytest.mark.parametrize("value", ["verify", 3, ["a"]])
def test_an_s3_option_of_settings_given_one_value_is_refused(name, value, cli):
    """-o client_kwargs=verify (a value where settings go) escaped as an internal error ("AttributeError: 'str'
    object has no attribute 'get'", a traceback saved), -o config_kwargs=verify as "repository ... is not a
    valid URL: dictionary update sequence element #0 has length 1; 2 is required"."""
    with pytest.raises(UsageError, match=re.escape(f"storage option {name} holds settings, not ")):
        FsspecStore("s3://bucket/vault", {name: value})
    proc = cli("snapshots", "--repo", "s3://bucket/vault", "-o", f"{name}={json.dumps(value)}", check=False)
    line = proc.stderr.decode().strip()
    assert proc.returncode == 2 and f"storage option {name} holds settings" in line, line
    assert f"-o {name}.NAME=VALUE" in line and "internal error" not in line, line


@pytest.mark.parametrize("name", ["endpoint_url", "client_kwargs.endpoint_url"])
def test_an_s3_endpoint_refused_before_connecting_never_shows_a_login(name):
    """rv58: the refusal of an endpoint botocore cannot use quoted it whole: a login in it was printed."""
    with pytest.raises(UsageError, match="is not a URL botocore can use") as refused:
        FsspecStore("s3://bucket/vault", {name: "admin:hunter2@minio:9000"})
    assert "hunter2" not in str(refused.value) and "'***@minio:9000'" in str(refused.value), refused.value


def test_the_options_each_backend_takes_are_accepted(monkeypatch: pytest.MonkeyPatch):
    # the environment's options are not checked: they may be meant for another vault's backend
    monkeypatch.setenv("CKPTVAULT_STORAGE_OPTIONS", "endpoint_url=http://127.0.0.1:9,nonsense=1")
    FsspecStore("memory://vault-env")
    FsspecStore(
        "s3://bucket/vault?anon=false",
        {
            "endpoint_url": "http://127.0.0.1:9",
            "key": "k",
            "secret": "s",
            "config_kwargs.read_timeout": 5,
            "client_kwargs.region_name": "x",
            "client_kwargs.verify": False,
            "config_kwargs.s3.addressing_style": "path",
            "use_listings_cache": False,
            "max_concurrency": 4,
        },
    )
    FsspecStore("gs://bucket/vault", {"project": "p", "token": "anon", "endpoint_url": "http://127.0.0.1:9"})
    FsspecStore("az://container/vault", {"account_name": "a", "connection_string": "x", "anon": True})
    # extras the libraries hand to their SDKs: aiobotocore's profile, DefaultAzureCredential's keywords
    FsspecStore("s3://bucket/vault?profile=prod")
    FsspecStore("az://container/vault", {"managed_identity_client_id": "x", "exclude_environment_credential": True})
    FsspecStore("sftp://u@127.0.0.1:9/vault", {"key_filename": __file__, "look_for_keys": False, "timeout": 3})
    # numbers given as text (-o), whatever the name holds ("connection" alone keeps a value text), and
    # objects given through the API are not refused by the check of numeric options
    FsspecStore("az://container/vault", {"account_name": "a", "connection_timeout": "30"})
    FsspecStore("s3://bucket/vault", {"config_kwargs.connect_timeout": "5", "config_kwargs.retries.max_attempts": "3"})
    FsspecStore("gs://bucket/vault", {"token": "anon", "session_kwargs": {"timeout": object()}})


def test_sftp_key_files_of_every_shape_are_expanded_and_checked_before_connecting(tmp_path, monkeypatch):
    from ckptvault.store.backends import default_options

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "id").write_text("a key")
    key_object = object()  # paramiko takes key objects beside paths: left as they are
    for given, expanded in (
        ("~/id", str(tmp_path / "id")),
        (Path("~/id"), str(tmp_path / "id")),
        (("~/id",), [str(tmp_path / "id")]),
        (["~/id", key_object], [str(tmp_path / "id"), key_object]),
    ):
        assert default_options("sftp", {"key_filename": given})["key_filename"] == expanded
    for missing in ("~/nope", Path("~/nope"), ("~/nope",), [key_object, "~/nope"]):
        with pytest.raises(UsageError, match=f"cannot read {tmp_path / 'nope'}"):
            default_options("sftp", {"key_filename": missing})


def test_credentials_never_reach_a_message(monkeypatch):
    """An SDK error quoting a token-info URL (gcsfs with a bad token), a presigned URL or the option's
    value itself: the store's error shows none of them."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class LeakyFileSystem(MemoryFileSystem):
        protocol = ("leaky",)

        def __init__(self, *args, token=None, client_kwargs=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.token, self.secret = token, (client_kwargs or {}).get("aws_secret_access_key")

        def cat_file(self, path, start=None, end=None, **kwargs):
            raise ConnectionError(
                f"Max retries exceeded with url: /tokeninfo?access_token={self.token} (bad token {self.token}, "
                f"secret {self.secret}; https://u:pw-in-url@host/x?X-Amz-Signature=abcdef)"
            )

    fsspec.register_implementation("leaky", LeakyFileSystem, clobber=True)
    monkeypatch.setenv("CKPTVAULT_RETRIES", "0")
    store = FsspecStore(
        "leaky://bucket/vault",
        {"token": "ya29.SECRET-TOKEN", "client_kwargs": {"aws_secret_access_key": "SECRET-KEY-42"}},
    )
    with pytest.raises(StorageError) as info:
        store.get("config")
    message = str(info.value)
    assert "ConnectionError" in message and "tokeninfo?access_token=***" in message, message
    for secret in ("SECRET", "pw-in-url", "abcdef"):
        assert secret not in message, message


def test_hiding_credentials_leaves_the_rest_of_a_message_readable():
    from ckptvault.store.failures import hide_credentials
    from ckptvault.store.options import credential_values

    options = {"token": "anon", "key_filename": "~/.ssh/id", "connection_string": "AccountName=a;AccountKey=k1k1"}
    secrets = credential_values({**options, "key": "AKIA7"})
    assert secrets == ("AccountName=a;AccountKey=k1k1", "AKIA7"), "ways to authenticate and paths are no secrets"
    text = "anonymous access to ~/.ssh/id denied; sftp://bob:pa/ss@host/x; ;AccountKey=abc==;EndpointSuffix=net"
    assert hide_credentials(text, secrets) == (
        "anonymous access to ~/.ssh/id denied; sftp://bob:***@host/x; ;AccountKey=***;EndpointSuffix=net"
    )


def test_whole_reads_are_told_one_request_only_where_the_filesystem_takes_it():
    """s3fs before 2026.3 has no ``max_concurrency`` (and makes no HEAD): passing it failed every GET."""
    s3fs = pytest.importorskip("s3fs")  # the [s3] extra; bash .ci/run installs it

    from ckptvault.store.fsspec_store import _sizes_whole_reads

    class OlderS3:
        async def _cat_file(self, path, version_id=None, start=None, end=None): ...

    assert _sizes_whole_reads(s3fs.S3FileSystem.__new__(s3fs.S3FileSystem))
    assert not _sizes_whole_reads(OlderS3())


def test_a_filesystem_with_an_ftp_attribute_of_its_own_is_listed_through_its_ls(tmp_path):
    """Folders of an SFTP vault are listed through paramiko's listdir_attr, found as the filesystem's ``ftp``: fsspec's
    FTP filesystem (ftp://, one of "any other fsspec protocol") names its ftplib connection so too, which has no
    listdir_attr, and every listing of such a vault failed. Only SFTP's is paramiko's."""
    import ftplib

    from ckptvault.store.fsspec_store import FsspecStore

    store = FsspecStore(f"file://{tmp_path}", None)
    store.put("locks/a", b"lock")
    store.fs.ftp = ftplib.FTP()  # as fsspec's FTPFileSystem holds it (never connected here)
    assert [o.key for o in store.list("locks/")] == ["locks/a"]
