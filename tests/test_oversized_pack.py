"""A listed pack bigger than any pack of the vault can be (bytes added to it, or the object replaced by one of
many GiB: whoever can write to the bucket can) is damage named by check, and is never read whole into memory by
``check --read-data``, ``repair-index --read-data`` or prune: its chunks are read one by one (range reads of
their indexed sizes). Planted here as a sparse file: a real pack grown past the bound, its own bytes in front."""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.repository.format import pack_key
from ckptvault.store.local import LocalStore

MiB = 1 << 20


def _tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def _vault_with_a_grown_pack(tmp_path: Path) -> tuple[Path, Path, Path, Path, str, str]:
    """Snapshot 1 holds a and b (one pack), snapshot 2 only a; the pack is then grown far past any pack's size."""
    url = tmp_path / "vault"
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        d.mkdir()
    data_a, data_b = os.urandom(200_000), os.urandom(300_000)
    (one / "a.bin").write_bytes(data_a)
    (one / "b.bin").write_bytes(data_b)
    (two / "a.bin").write_bytes(data_a)
    with Vault.init(str(url), pack_size=MiB) as vault:
        first = vault.backup(one, tags={"n": "1"})
        second = vault.backup(two, tags={"n": "2"})
    packs = [p for p in (url / "packs").rglob("*") if p.is_file()]
    assert len(packs) == 1  # the second backup stored nothing new
    pack = packs[0]
    with open(pack, "r+b") as f:  # sparse: the pack's own bytes, then a hole up to past the bound
        f.truncate(3 << 30)  # a pack of 1 MiB holds at most ~2 GiB + 1 MiB: one last blob and a header of 1 GiB
    return url, pack, one, two, first.id, second.id


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every read of the local store, (key, bytes); a whole read of an object over 64 MiB fails the test before
    it reads a byte (the code before read the grown pack whole: GiB held in memory)."""
    seen: list[tuple[str, int]] = []
    get, get_range = LocalStore.get, LocalStore.get_range

    def spy_get(self: LocalStore, key: str) -> bytes:
        path = Path(self._path(key))
        size = path.stat().st_size if path.is_file() else 0
        if size > 64 * MiB:
            raise AssertionError(f"{key} ({size} bytes) read whole into memory")
        data = get(self, key)
        seen.append((key, len(data)))
        return data

    def spy_range(self: LocalStore, key: str, start: int, length: int) -> bytes:
        data = get_range(self, key, start, length)
        seen.append((key, len(data)))
        return data

    monkeypatch.setattr(LocalStore, "get", spy_get)
    monkeypatch.setattr(LocalStore, "get_range", spy_range)
    return seen


def test_check_and_repair_index_name_a_grown_pack_and_read_it_chunk_by_chunk(
    tmp_path: Path, reads: list[tuple[str, int]]
) -> None:
    url, pack, one, _two, first, _second = _vault_with_a_grown_pack(tmp_path)
    with Vault.open(str(url)) as vault:
        report = vault.check(read_data=True)
        named = [p for p in report.problems if "more than a pack of this vault can be" in p.detail]
        assert len(named) == 1 and pack.name[:12] in named[0].object
        assert report.damaged_chunks == 0  # its chunks were read, one by one, and verify
        assert report.chunks_read >= 2
        repaired = vault.repair_index(read_data=True)
        assert repaired.rewritten_packs == [pack.name]
        assert repaired.damaged_chunks == []
    assert not pack.exists()  # its chunks copied into a new pack, and it is gone
    assert max(size for _, size in reads) <= 8 * MiB
    with Vault.open(str(url)) as vault:
        assert vault.check(read_data=True).ok
        vault.restore(first, tmp_path / "out")
    assert _tree_hashes(tmp_path / "out") == _tree_hashes(one)


def test_prune_repacks_a_grown_pack_chunk_by_chunk(tmp_path: Path, reads: list[tuple[str, int]]) -> None:
    url, pack, _one, two, first, second = _vault_with_a_grown_pack(tmp_path)
    with Vault.open(str(url)) as vault:
        vault.forget([first], prune=True)  # b's chunks are dead: the pack is repacked
        assert [s.id for s in vault.snapshots()] == [second]
    assert not pack.exists()
    assert max(size for _, size in reads) <= 8 * MiB
    with Vault.open(str(url)) as vault:
        assert vault.check(read_data=True).ok
        vault.restore(second, tmp_path / "out")
    assert _tree_hashes(tmp_path / "out") == _tree_hashes(two)


def _without_root_read_rights() -> None:
    """preexec_fn: the child, root or not, is refused a file of mode 000 (root reads one through CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH: dropped from its bounding set, which exec takes them from)."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2


def test_repair_index_read_data_names_a_grown_pack_it_cannot_read_and_repairs_the_rest(tmp_path: Path) -> None:
    """One storage error while the grown pack was read chunk by chunk aborted the whole repair (exit 20, nothing
    written): another pack's damaged chunk stayed indexed. A pack read whole that cannot be read is named and the
    repair goes on; the grown one now too. Real: the pack's file is mode 000, the CLI runs without root's rights
    to read it anyway, and the other pack has a flipped byte in its chunk."""
    url, pack, _one, _two, _first, _second = _vault_with_a_grown_pack(tmp_path)
    three = tmp_path / "three"
    three.mkdir()
    (three / "c.bin").write_bytes(os.urandom(200_000))
    with Vault.open(str(url)) as vault:
        (chunk,) = vault.files(vault.backup(three))[0].chunks
        loc = vault._repo.index.get(chunk)
    other = url / pack_key(loc.pack_id)
    assert other != pack
    with open(other, "r+b") as f:  # a bit flipped in c.bin's chunk
        at = loc.offset + loc.stored_len // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))
    pack.chmod(0)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ckptvault", "repair-index", "--repo", str(url), "--read-data"],
            capture_output=True,
            env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg-data"), "COLUMNS": "200"},
            stdin=subprocess.DEVNULL,
            preexec_fn=_without_root_read_rights,
            timeout=300,
        )
    finally:
        pack.chmod(0o644)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 20 and "Traceback" not in err, (out, err)
    assert f"1 pack(s) could not be read (e.g. {pack.name[:12]})" in err and "none was dropped" in err, err
    assert "dropped 1 damaged chunk(s)" in out, out  # the rest of the repair was done
    with Vault.open(str(url)) as vault:
        assert vault._repo.index.get(chunk) is None  # dropped: the next backup of c.bin stores it again
        assert vault.backup(three, force_read=True).summary.new_chunks == 1
    assert pack.exists()  # kept, as a pack read whole that cannot be read is: nothing of it dropped
