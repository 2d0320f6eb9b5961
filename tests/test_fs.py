"""The ckptvault:// fsspec filesystem: random reads equal the original bytes, loaders work through
it, and a read fetches only the chunks it touches."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import fsspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from ckptvault import Vault
from ckptvault.errors import PathNotInSnapshotError, UsageError
from ckptvault.fs import CkptVaultFileSystem
from tests.support.counting_store import count_reads
from tests.support.disk import need_free_disk

MiB = 1024 * 1024


def test_protocol_is_registered_through_the_entry_point() -> None:
    assert fsspec.get_filesystem_class("ckptvault") is CkptVaultFileSystem


def test_random_access_reads_equal_the_original(vault: Vault, tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    data = rng.normal(0, 0.02, 700_000).astype(np.float32).tobytes() + rng.bytes(123_457)  # ~2.9 MB, odd size
    (tmp_path / "src" / "sub").mkdir(parents=True)
    (tmp_path / "src" / "sub" / "blob.bin").write_bytes(data)
    vault.backup(tmp_path / "src")
    fs = CkptVaultFileSystem(vault=vault, cache_chunks=2)  # a tiny cache: reads must refetch correctly
    f = fs.open("latest/sub/blob.bin", "rb")

    @given(offset=st.integers(0, len(data) + 10), length=st.integers(0, 400_000), whence=st.sampled_from([0, 2]))
    def check(offset: int, length: int, whence: int) -> None:
        pos = f.seek(offset if whence == 0 else offset - len(data), whence)
        assert f.read(length) == data[pos : pos + length]
        assert f.tell() == min(pos + length, max(pos, len(data)))

    check()
    f.seek(len(data) - 5)
    assert f.read() == data[-5:] and f.read(10) == b""
    buf = bytearray(1000)
    f.seek(123)
    assert f.readinto(buf) == 1000 and bytes(buf) == data[123:1123]
    f.close()


def test_loaders_read_through_fsspec(vault: Vault, repo_url: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    tensors = {"w": rng.normal(0, 0.02, (300, 400)).astype(np.float32), "b": np.arange(77, dtype=np.int64)}
    arr = rng.normal(0, 1, (50, 60))
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.safetensors").write_bytes(st_save(tensors))
    np.save(src / "emb.npy", arr)
    np.savez(src / "opt.npz", m=arr, v=arr * 2)
    snap = vault.backup(src)
    vault.close()

    with fsspec.open(f"ckptvault://{snap.id[:12]}/model.safetensors", "rb", repo=repo_url) as f:
        loaded = st_load(f.read())
    assert set(loaded) == set(tensors) and all(np.array_equal(loaded[k], tensors[k]) for k in tensors)
    with fsspec.open("ckptvault://latest/emb.npy", "rb", repo=repo_url) as f:
        assert np.array_equal(np.load(f), arr)
    with fsspec.open("ckptvault://latest/opt.npz", "rb", repo=repo_url) as f, np.load(f) as z:
        assert np.array_equal(z["v"], arr * 2)

    fs = fsspec.filesystem("ckptvault", repo=repo_url)
    assert sorted(fs.ls("latest", detail=False)) == ["latest/emb.npy", "latest/model.safetensors", "latest/opt.npz"]
    info = fs.info("ckptvault://latest/emb.npy")
    assert info["type"] == "file" and info["size"] == (src / "emb.npy").stat().st_size
    assert fs.cat("latest/emb.npy") == (src / "emb.npy").read_bytes()
    assert fs.cat_file("latest/emb.npy", start=10, end=20) == (src / "emb.npy").read_bytes()[10:20]
    assert [e["name"] for e in fs.ls("")] == [snap.id]
    assert fs.exists("latest/model.safetensors") and not fs.exists("latest/nope")
    with pytest.raises(FileNotFoundError):
        fs.open("latest/nope.bin")
    with pytest.raises(FileNotFoundError):
        fs.info("ffffffff/emb.npy")
    for not_an_id in ("abc", "step-1", snap.id[:2]):  # rv50 M1: too short or not hex is no such path either
        with pytest.raises(FileNotFoundError):
            fs.info(not_an_id)
        assert not fs.isdir(not_an_id)
    with pytest.raises(PermissionError):
        fs.open("latest/emb.npy", "wb")


def test_vault_open_file_is_seekable_and_names_missing_paths(vault: Vault, tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "a.bin").write_bytes(b"0123456789")
    snap = vault.backup(tmp_path / "s")
    with vault.open_file(snap, "a.bin") as f:
        assert f.seekable() and f.seek(-3, io.SEEK_END) == 7 and f.read() == b"789"
    with pytest.raises(PathNotInSnapshotError, match=r"'b\.bin' is not in snapshot"):
        vault.open_file(snap, "b.bin")
    (tmp_path / "t" / "model").mkdir(parents=True)
    (tmp_path / "t" / "model" / "w.bin").write_bytes(b"w")
    folder = vault.backup(tmp_path / "t")
    for read in (vault.open_file, lambda s, p: b"".join(vault.read_file(s, p))):
        with pytest.raises(PathNotInSnapshotError, match=r"'model' is a folder in snapshot \w+, not a file"):
            read(folder, "model")  # said "'model' is not in snapshot", which ls contradicts


def test_readinto_a_typed_buffer_fills_its_bytes_and_a_float_offset_is_refused(vault: Vault, tmp_path: Path) -> None:
    values = np.arange(16, dtype=np.float32)
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "w.bin").write_bytes(values.tobytes())
    snap = vault.backup(tmp_path / "s")
    with vault.open_file(snap, "w.bin") as f:
        grid = np.zeros((2, 4), dtype=np.float32)  # 8 items, 32 bytes
        assert f.readinto(grid) == 32 and f.tell() == 32
        assert (grid.ravel() == values[:8]).all()
        with pytest.raises(TypeError):
            f.seek(1.5)  # refused here, as by a real file, not at the next read
        assert f.seek(np.int64(4)) == 4


def test_links_to_files_of_the_snapshot_read_as_those_files_and_a_recursive_copy_completes(
    vault: Vault, repo_url: str, tmp_path: Path
) -> None:
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "model.safetensors").write_bytes(b"weights")
    (src / "latest.safetensors").symlink_to("model.safetensors")
    (src / "sub" / "up.safetensors").symlink_to("../latest.safetensors")  # a chain of links
    (src / "elsewhere").symlink_to("/etc/hostname")  # out of the snapshot: left out of listings
    (src / "dangling").symlink_to("gone.bin")
    (src / "folder-link").symlink_to("sub")
    vault.backup(src)
    fs = fsspec.filesystem("ckptvault", repo=repo_url, skip_instance_cache=True)
    listed = sorted(fs.ls("latest", detail=False))
    assert listed == ["latest/latest.safetensors", "latest/model.safetensors", "latest/sub"]
    assert fs.cat("latest/sub/up.safetensors") == b"weights" and fs.info("latest/latest.safetensors")["size"] == 7
    assert fs.info("latest/dangling")["type"] == "other"
    fs.get("latest", str(tmp_path / "copy"), recursive=True)
    copied = sorted(str(p.relative_to(tmp_path / "copy")) for p in (tmp_path / "copy").rglob("*"))
    assert copied == ["latest.safetensors", "model.safetensors", "sub", "sub/up.safetensors"]
    assert (tmp_path / "copy" / "sub" / "up.safetensors").read_bytes() == b"weights"


def test_a_snapshot_forgotten_since_it_was_looked_up_is_file_not_found_until_the_cache_is_invalidated(
    vault: Vault, repo_url: str, tmp_path: Path
) -> None:
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "a.bin").write_bytes(b"first")
    first = vault.backup(tmp_path / "s")
    fs = fsspec.filesystem("ckptvault", repo=repo_url, skip_instance_cache=True)
    assert fs.cat("latest/a.bin") == b"first"
    (tmp_path / "s" / "a.bin").write_bytes(b"second")
    vault.backup(tmp_path / "s")
    assert fs.cat("latest/a.bin") == b"first", "latest is what it was first looked up as"
    vault.forget([first])
    with pytest.raises(FileNotFoundError, match="call invalidate_cache"):
        fs.open("latest/a.bin")
    fs.invalidate_cache()
    assert fs.cat("latest/a.bin") == b"second"


def test_tags_and_hosts_select_the_snapshots_of_the_filesystem_and_other_options_are_refused(
    vault: Vault, two_hosts, repo_url: str
) -> None:
    """h51 #6: `fsspec.open("ckptvault://latest/w.bin", repo=URL, tags={"run": "x"})` ignored the tags, and
    read the newest snapshot of every run: another run's weights. tags= and hosts= narrow the filesystem (restic's
    `mount --tag/--host`): latest is the newest of them, the root lists them, an ID outside them is not there; a
    misspelled option (tag=, host=, run=) is refused rather than ignored."""
    a1, a2, b1, y = (two_hosts[k] for k in ("a1", "a2", "b1", "y"))
    with fsspec.open("ckptvault://latest/w.bin", "rb", repo=repo_url, tags={"run": "x"}) as f:
        assert f.read() == b"a2" * 5000  # run x's highest step, not run y's newer snapshot
    with fsspec.open("ckptvault://latest/w.bin", "rb", repo=repo_url, tags={"run": "x"}, hosts=["nodeB"]) as f:
        assert f.read() == b"b1" * 5000
    fs = fsspec.filesystem("ckptvault", repo=repo_url, hosts=["nodeA"], skip_instance_cache=True)
    assert fs.ls("", detail=False) == [a1.id, a2.id]
    assert fs.cat(f"{a1.id[:8]}/w.bin") == b"a1" * 5000
    with pytest.raises(FileNotFoundError, match="is of host nodeB, not nodeA"):
        fs.cat(f"{y.id[:8]}/w.bin")
    assert not fs.exists(b1.id)
    with pytest.raises(FileNotFoundError, match=r"no snapshot has run=z; run is one of: x, y"):
        CkptVaultFileSystem(vault=vault, tags={"run": "z"}).info("latest")
    for wrong in ({"tag": {"run": "x"}}, {"host": "nodeB"}, {"run": "x"}):
        with pytest.raises(UsageError, match=rf"ckptvault:// takes no option '{next(iter(wrong))}'.*tags=.*hosts="):
            fsspec.open("ckptvault://latest/w.bin", "rb", repo=repo_url, **wrong).open()
    with pytest.raises(UsageError, match="hosts is an empty list"):
        CkptVaultFileSystem(vault=vault, hosts=[])
    with pytest.raises(UsageError, match=r"takes hosts as a list, e.g. hosts=\['nodeB'\]; got str"):
        CkptVaultFileSystem(vault=vault, hosts="nodeB")
    assert CkptVaultFileSystem(vault=vault, use_listings_cache=False).cat("latest/w.bin") == b"yy" * 5000
    # rv51 M1: a selection given to one call went into fsspec's per-call **kwargs and was dropped
    every = CkptVaultFileSystem(vault=vault)
    per_call = "selects snapshots when the filesystem is made, not per call"
    for call in (
        lambda: every.info("latest", tags={"run": "x"}),
        lambda: every.ls("", hosts=["nodeA"]),
        lambda: every.open("latest/w.bin", tags={"run": "x"}),
        lambda: every.cat_file("latest/w.bin", host="nodeA"),
    ):
        with pytest.raises(UsageError, match=per_call):
            call()
    with pytest.raises(UsageError, match=r"takes hosts as a list.*got list_iterator"):  # fsspec pickles it as given
        CkptVaultFileSystem(vault=vault, hosts=iter(["nodeA"]))
    picked = pickle.loads(pickle.dumps(fsspec.filesystem("ckptvault", repo=repo_url, hosts=("nodeA",))))
    assert picked.ls("", detail=False) == [a1.id, a2.id]


def middle_read_fetches(tmp_path: Path, size: int) -> tuple[int, int]:
    """Back up a ``size``-byte file (default chunker), read 1 MiB in its middle; (bytes, chunks) fetched.
    A file over 64 MiB holds random bytes in the first quarter of every 64 MiB (the middle among them)
    and holes between (zeros, stored once): a 1 GiB file costs the disk 256 MiB twice, not 1 GiB."""
    need_free_disk(tmp_path, size // 2 if size > 64 * MiB else 2 * size)
    src = tmp_path / "big"
    src.mkdir()
    rng = np.random.default_rng(11)
    random_per_64_mib = 16 * MiB if size > 64 * MiB else 64 * MiB
    assert size <= 64 * MiB or (size // 2) % (64 * MiB) == 0, "the middle must fall on random bytes"
    with open(src / "weights.bin", "wb") as f:
        f.truncate(size)
        for offset in range(0, size, 64 * MiB):
            f.seek(offset)
            f.write(rng.bytes(min(random_per_64_mib, size - offset)))
    with Vault.init(str(tmp_path / "repo")) as vault:
        vault.backup(src)
        fs = CkptVaultFileSystem(vault=vault)
        reads = count_reads(vault)
        with fs.open("latest/weights.bin") as f:
            f.seek(size // 2)
            data = f.read(MiB)
        with open(src / "weights.bin", "rb") as orig:
            orig.seek(size // 2)
            assert data == orig.read(MiB)
        return sum(n for _, _, n in reads.pack_reads()), len(reads.pack_reads())


MAX_CHUNK = 4 * MiB  # the default chunker's maximum


def test_middle_read_fetches_about_one_mib(tmp_path: Path) -> None:
    fetched, chunks = middle_read_fetches(tmp_path, 48 * MiB)
    assert fetched <= MiB + 2 * MAX_CHUNK and chunks <= 1 + MiB // (256 * 1024) + 1


@pytest.mark.slow
def test_middle_read_of_a_1_gib_file_fetches_about_one_mib(tmp_path: Path) -> None:
    fetched, chunks = middle_read_fetches(tmp_path, 1024 * MiB)
    assert fetched <= MiB + 2 * MAX_CHUNK and chunks <= 1 + MiB // (256 * 1024) + 1
