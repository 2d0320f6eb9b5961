import os
import random
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.ops import backup as backup_module

from .support.disk import need_free_disk


def test_same_tree_twice_adds_almost_nothing(vault: Vault, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(backup_module, "RACY_NS", 0)  # files written just before are trusted (not read again)
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.bin").write_bytes(os.urandom(6 << 20))
    (src / "config.json").write_text("{}")
    first = vault.backup(src)
    packs_after_first = vault._repo.list_packs()
    second = vault.backup(src)
    third = vault.backup(src, force_read=True)  # even reading everything again stores nothing new
    assert first.summary.new_bytes == 6 * 2**20 + 2
    assert second.summary.new_bytes == 0 and second.summary.read_bytes == 0
    assert third.summary.new_bytes == 0 and third.summary.read_bytes == first.summary.read_bytes
    # What a backup of unchanged data stores is its tree: one 32-byte ID per chunk (~100 chunks of 64 KiB
    # here, ~4 KB compressed, varying with where the content-defined cuts fall), and no pack at all.
    assert second.summary.stored_bytes < 16 * 1024 and third.summary.stored_bytes < 16 * 1024
    assert vault._repo.list_packs() == packs_after_first


def test_identical_content_in_another_file_and_path_is_stored_once(vault: Vault, tmp_path: Path):
    data = os.urandom(3 << 20)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(data)
    (tmp_path / "a" / "copy.bin").write_bytes(data)
    snap = vault.backup(tmp_path / "a")
    assert snap.summary.new_bytes == len(data)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "y.bin").write_bytes(data)
    assert vault.backup(tmp_path / "b").summary.new_bytes == 0


@pytest.mark.slow
def test_one_changed_tensor_of_500mb_adds_about_50mb(tmp_path: Path):
    """A 500 MB checkpoint of ten 50 MB tensors; one tensor changes between saves."""
    tensor = 50 * 1000 * 1000
    need_free_disk(tmp_path, 22 * tensor)  # the checkpoint and the vault
    url = str(tmp_path / "repo")
    Vault.init(url)  # production chunker and pack sizes
    src = tmp_path / "ckpt"
    src.mkdir()
    with open(src / "model.bin", "wb") as f:
        f.writelines(random.Random(i).randbytes(tensor) for i in range(10))
    with Vault.open(url) as vault:
        vault.backup(src)
        with open(src / "model.bin", "r+b") as f:
            f.seek(4 * tensor)
            f.write(random.Random("changed").randbytes(tensor))
        second = vault.backup(src)
    added = second.summary.new_bytes
    # CDC re-cuts the chunk straddling each edge of the tensor: at most one max-size chunk each side.
    assert tensor <= added <= tensor + 2 * 8 * 2**20, added
    assert second.summary.read_bytes == 10 * tensor
