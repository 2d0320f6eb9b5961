"""One conformance suite, run against every backend this issue supports (local, memory)."""

import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from ckptvault.errors import ObjectNotFoundError, StorageError
from ckptvault.store import FsspecStore


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


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path):
        return FsspecStore(str(tmp_path / "repo"))

    def test_put_leaves_no_temp_files(self, store, tmp_path):
        store.put("packs/x", b"data")
        assert sorted(os.listdir(tmp_path / "repo" / "packs")) == ["x"]


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def store(self):
        return FsspecStore(f"memory://store-test-{uuid.uuid4().hex}")
