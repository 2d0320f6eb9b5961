"""Corruption by flipping real bytes in stored objects."""

import os
from pathlib import Path

import pytest

from ckptvault import CompressionSettings, Vault
from ckptvault.blob import CHECKSUM_SIZE, Kind
from ckptvault.errors import IntegrityError
from ckptvault.repository.format import pack_key


def packs_of(vault: Vault) -> dict[str, list[str]]:
    """pack key -> files that have a chunk in it."""
    out: dict[str, list[str]] = {}
    repo = vault._repo
    for e in vault.files("latest"):
        for c in e.chunks:
            out.setdefault(pack_key(repo.index.get(c).pack_id), []).append(e.path)
    return out


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_flipped_byte_in_a_pack_fails_that_file_only(vault: Vault, repo_url: str, tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.bin", "b.bin", "c.bin"):
        (src / name).write_bytes(os.urandom(3 << 20))  # 3 MiB each, packs are 2 MiB: several packs
    vault.backup(src)
    by_pack = packs_of(vault)
    # a pack that holds chunks of exactly one file
    victim_pack, victim_files = next((k, set(v)) for k, v in by_pack.items() if len(set(v)) == 1)
    (victim,) = victim_files
    flip(Path(repo_url) / victim_pack, 100)

    with pytest.raises(IntegrityError) as info:
        vault.restore("latest", tmp_path / "out")
    assert victim in str(info.value) and "pack" in str(info.value)
    assert not (tmp_path / "out" / victim).exists()
    assert not [p for p in os.listdir(tmp_path / "out") if "ckptvault-tmp" in p]
    for name in {"a.bin", "b.bin", "c.bin"} - {victim}:
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes()


def test_flipped_byte_in_tree_or_snapshot_is_detected(vault: Vault, repo_url: str, tmp_path: Path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"data")
    snap = vault.backup(tmp_path / "src")
    flip(Path(repo_url) / "trees" / snap.tree_id, 5)
    with pytest.raises(IntegrityError, match="tree object"):
        vault.files(snap)
    flip(Path(repo_url) / "snapshots" / snap.id, 5)
    with pytest.raises(IntegrityError, match="snapshot object"):
        vault.snapshot(snap.id)
    assert vault.snapshots() == [] and snap.id in vault.unreadable_snapshots  # listed without it, and said


def test_missing_pack_names_the_file(vault: Vault, repo_url: str, tmp_path: Path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f.bin").write_bytes(os.urandom(100_000))
    vault.backup(tmp_path / "src")
    (pack,) = packs_of(vault)
    os.unlink(Path(repo_url) / pack)
    with pytest.raises(IntegrityError, match=r"f\.bin.*pack is missing"):
        vault.restore("latest", tmp_path / "out")


def test_a_truncated_pack_fails_its_files_and_the_others_still_restore(cli, tmp_path: Path):
    # a short read of a pack was a storage error (exit 20) that stopped the whole restore
    repo, src = tmp_path / "repo", tmp_path / "src"
    (src).mkdir()
    (src / "keep.txt").write_bytes(b"intact")
    cli("init", str(repo))
    cli("backup", str(src), "--repo", str(repo))
    (src / "big.bin").write_bytes(os.urandom(3_000_000))
    cli("backup", str(src), "--repo", str(repo))
    biggest = max((p for p in (repo / "packs").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    os.truncate(biggest, biggest.stat().st_size // 3)
    proc = cli("restore", "latest", str(tmp_path / "out"), "--repo", str(repo), check=False)
    assert proc.returncode == 30, proc.stderr
    assert proc.stderr.decode().count("\n") == 1 and "big.bin" in proc.stderr.decode(), proc.stderr
    assert "truncated" in proc.stderr.decode() and "Traceback" not in proc.stderr.decode()
    assert (tmp_path / "out" / "keep.txt").read_bytes() == b"intact" and not (tmp_path / "out" / "big.bin").exists()
    assert cli("cat", "latest", "big.bin", "--repo", str(repo), check=False).returncode == 30
    for emptied in (False, True):  # check said also "header is damaged: ... repair-index --read-data copies them"
        if emptied:
            os.truncate(biggest, 0)
        report = cli("check", "--repo", str(repo), check=False).stdout.decode()
        assert "is shorter than the index says" in report and "header is damaged" not in report, report


def test_cat_detects_corruption(vault: Vault, repo_url: str, tmp_path: Path, cli):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f.bin").write_bytes(os.urandom(100_000))
    vault.backup(tmp_path / "src")
    (pack,) = packs_of(vault)
    flip(Path(repo_url) / pack, 50)
    with pytest.raises(IntegrityError):
        b"".join(vault.read_file("latest", "f.bin"))
    # it said only "checksum mismatch", and a plain check finds nothing (audit 36a F4)
    proc = cli("cat", "latest", "f.bin", "--repo", repo_url, check=False)
    assert proc.returncode == 30 and not proc.stdout
    assert proc.stderr.decode().endswith(
        f"is damaged: checksum mismatch; run: ckptvault check --repo {repo_url} --read-data (it says what to do)\n"
    ), proc.stderr
    # check --read-data, which finds it, does not send the user to itself
    report = cli("check", "--read-data", "--repo", repo_url, check=False)
    said = report.stdout.decode() + report.stderr.decode()
    assert report.returncode == 30 and "check --read-data (it says" not in said, said


def test_cat_of_a_damaged_chunk_writes_the_verified_beginning_and_says_so_in_its_help(
    vault: Vault, repo_url: str, tmp_path: Path, cli
):
    """cat streams (as restic's dump): a damaged chunk in the middle of a file stops it with exit 30 after the
    chunks before it were written. Those bytes are the file's, but the output is incomplete; --help said only
    "(verified)", so a script that ignored the exit status took a cut file for the whole."""
    data = os.urandom(1 << 20)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f.bin").write_bytes(data)
    vault.backup(tmp_path / "src")
    repo = vault._repo
    chunks = vault.files("latest")[0].chunks
    assert len(chunks) >= 4
    victim = len(chunks) // 2
    loc = repo.index.get(chunks[victim])
    flip(Path(repo_url) / pack_key(loc.pack_id), loc.offset + loc.stored_len // 2)
    start = sum(repo.index.get(c).raw_len for c in chunks[:victim])  # where the damaged chunk begins in the file
    proc = cli("cat", "latest", "f.bin", "--repo", repo_url, check=False)
    assert proc.returncode == 30 and "is damaged" in proc.stderr.decode(), proc.stderr
    assert 0 < len(proc.stdout) <= start and proc.stdout == data[: len(proc.stdout)]  # correct, and incomplete
    helped = " ".join(cli("cat", "--help", COLUMNS="120").stdout.decode().split())
    assert "exit 30" in helped and "those bytes are correct, but the output is incomplete" in helped, helped


@pytest.mark.parametrize("damage", ["flipped", "zero_chunk_made_nonzero", "chunk_made_zero"])
def test_a_first_copy_wrong_under_a_valid_envelope_is_read_around(tmp_path: Path, caplog, monkeypatch, damage):
    """rs49 #1: a chunk stored twice (two backups that raced) whose first copy holds wrong bytes under a valid
    checksum (memory that went bad in the writer before sealing) failed its file on every restore, while `cat`
    and check read the good copy: the restore's fast path checks envelopes and the file hash only. The file
    is written again from the copies that match their IDs, from an empty file: a zero chunk, left as a hole,
    must not keep the first pass's bytes (rv49 #1: wrong bytes, exit 0), and a chunk the first pass read as
    zeros is fetched again (rv49 #2)."""
    url = str(tmp_path / "vault")
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(2 << 20) + bytes(8 << 20) + os.urandom(2 << 20)
    (src / "w.bin").write_bytes(data)
    Vault.init(url, compression=CompressionSettings(codec="none")).close()  # every chunk raw (codec 0)
    with Vault.open(url) as first, Vault.open(url) as second:
        # the second backup reads the index before the first one stores anything, as when they race
        assert len(second._repo.index) == 0
        monkeypatch.setattr(second._repo, "load_index_as_stored", lambda: None)
        monkeypatch.setattr(second._repo, "reconcile_when_due", lambda: None)
        first.backup(src, tags={"run": "a"})
        second.backup(src, tags={"run": "b"})
    with Vault.open(url) as vault:
        repo = vault._repo
        chunks = vault.files("latest")[0].chunks
        assert all(len(repo.index.locations(c)) == 2 for c in chunks)
        zero = damage == "zero_chunk_made_nonzero"
        chunk_id = next(c for c in chunks if any(repo.read_chunk(c)) != zero)
        loc = repo.index.locations(chunk_id)[0]  # the copy a read tries first
        path = Path(url) / pack_key(loc.pack_id)
        inner = bytearray(path.read_bytes()[loc.offset + 2 : loc.offset + loc.stored_len - CHECKSUM_SIZE])
        if damage == "chunk_made_zero":
            inner[1:] = bytes(len(inner) - 1)
        else:
            inner[len(inner) // 2] ^= 0x80
        sealed = repo.codec.sealer.seal(repo.codec._aad(Kind.CHUNK, chunk_id), [bytes(inner)])
        with open(path, "r+b") as f:
            f.seek(loc.offset + 2)
            f.write(b"".join(bytes(p) for p in sealed))
        for run in ("a", "b"):
            vault.restore_latest(tmp_path / run, run=run)
            assert (tmp_path / run / "w.bin").read_bytes() == data
    assert "reading its copy in pack" in caplog.text
