"""Damaged or too-new metadata objects: real vaults, real bytes changed in the vault folder.

A snapshot object that cannot be decoded is left out of listings with a warning naming it, other
snapshots keep working, ``forget`` removes it by ID and ``prune`` refuses while it exists. An
unreadable lock goes stale by its object's age. What a newer ckptvault wrote (a codec ID, a tree or
snapshot version, a lock version) is refused with exit 17, naming the object.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import fsspec
import pytest

from ckptvault import Vault
from ckptvault.blob import ENVELOPE_VERSION, SEAL_NONE, Kind
from ckptvault.codec import CODEC_DELTA, CODEC_RAW, CompressionSettings, Compressor
from ckptvault.errors import (
    IntegrityError,
    MalformedObjectError,
    SnapshotNotFoundError,
    UnsupportedFormatError,
)
from ckptvault.hashing import checksum
from ckptvault.repository.format import pack_key
from ckptvault.repository.locks import LockManager
from ckptvault.snapshot.manifest import decode_snapshot, decode_tree, encode_snapshot, encode_tree

from .conftest import tree_digest

HOUR_AGO = time.time() - 3600


@pytest.fixture
def two_snapshots(tmp_path: Path, cli: Callable) -> tuple[str, str, str, Path]:
    """A vault made with the CLI holding two snapshots: (repo, first ID, second ID, source folder)."""
    repo = str(tmp_path / "v")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(300_000))
    cli("init", repo)
    cli("backup", "--repo", repo, str(src), "--tag", "step=1")
    (src / "b.txt").write_bytes(b"second save")
    cli("backup", "--repo", repo, str(src), "--tag", "step=2")
    with Vault.open(repo) as vault:
        first, second = vault.snapshots()
    return repo, first.id, second.id, src


def damage(repo: str, snapshot_id: str, how: str) -> None:
    path = Path(repo) / "snapshots" / snapshot_id
    if how == "junk":  # first byte 'j' (106): an envelope version nobody wrote, so damage
        path.write_bytes(b"junk junk junk junk junk junk junk")
    else:
        path.write_bytes(path.read_bytes()[:10])


def reseal(vault: Vault, kind: Kind, object_id: str, folder: str, doc: dict) -> None:
    """Write a validly sealed object with this document (what a newer ckptvault could have written)."""
    oid = bytes.fromhex(object_id)
    (Path(vault.url) / folder / object_id).write_bytes(vault._repo.codec.encode(kind, oid, json.dumps(doc).encode()))


def stderr_lines(proc) -> list[str]:
    return [line for line in proc.stderr.decode().splitlines() if line.strip()]


def error_line(proc) -> str:
    """The one error line; the CLI may have warned first (e.g. about the unreadable snapshot it skipped)."""
    *warnings, error = stderr_lines(proc)
    assert error.startswith("error: ") and all(w.startswith("warning: ") for w in warnings), proc.stderr
    return error


# ---- 1. a snapshot object that cannot be decoded ----------------------------------------------


@pytest.mark.parametrize(("how", "code"), [("junk", 30), ("truncated", 30)])
def test_unreadable_snapshot_is_left_out_with_one_warning_and_others_work(
    two_snapshots, cli: Callable, tmp_path: Path, how: str, code: int
):
    repo, bad, good, src = two_snapshots
    damage(repo, bad, how)

    listed = cli("snapshots", "--repo", repo)
    assert good[:8] in listed.stdout.decode() and bad[:8] not in listed.stdout.decode()
    (warning,) = stderr_lines(listed)  # one line, naming the object and what to do
    assert warning.startswith("warning: snapshot object " + bad[:12])
    assert f"ckptvault check --repo {repo}" in warning and f"ckptvault forget --repo {repo} {bad[:12]}" in warning
    assert "damaged" in warning.split("; left out")[0]  # not only "upgrade": an unknown envelope may be damage

    assert "a.bin" in cli("ls", "--repo", repo, good[:8]).stdout.decode()
    cli("restore", "--repo", repo, good[:8], str(tmp_path / "out"))
    assert tree_digest(tmp_path / "out") == tree_digest(src)
    # the unreadable one may hold the newest save: 'latest' restored the older step, exit 0 (audit 30b F2)
    # and `forget latest` forgot the save before it (review 30 #4)
    commands = [("restore", "--repo", repo, "latest", str(tmp_path / "out2")), ("drill", "--repo", repo)]
    for command in [*commands, ("forget", "--repo", repo, "latest")]:
        latest = cli(*command, check=False)
        assert latest.returncode == code, latest.stderr
        error = error_line(latest)
        assert error.startswith(f"error: 'latest' cannot be told: snapshot object {bad[:12]} is damaged"), error
        assert f"and it may hold the newest save; the newest that can be read is {good[:8]} (step 2)" in error
        assert f"ckptvault forget --repo {repo} {bad[:12]}" in error
    assert not (tmp_path / "out2").exists()
    assert good[:8] in cli("snapshots", "--repo", repo).stdout.decode()

    proc = cli("restore", "--repo", repo, bad[:10], str(tmp_path / "out3"), check=False)
    assert proc.returncode == code
    error = error_line(proc)
    assert error.startswith(f"error: snapshot object {bad[:12]}")
    assert f"ckptvault forget --repo {repo} {bad[:12]}" in error


def test_a_vault_whose_every_snapshot_is_unreadable_is_not_said_to_have_none_yet(
    two_snapshots, cli: Callable, tmp_path: Path
):
    """Every snapshot object damaged: a selection by tag said "the vault has no snapshots yet", and `restore
    latest` without a tag "no snapshot that can be read has those tags" (rv51 L2)."""
    repo, bad, other, _ = two_snapshots
    damage(repo, bad, "truncated")
    damage(repo, other, "junk")
    listing = cli("snapshots", "--repo", repo, "--tag", "step=2", check=False)
    assert listing.returncode == 0
    assert (
        "selects no snapshot (no snapshot of the vault can be read: see the warning above)" in stderr_lines(listing)[-1]
    )
    for by in ((), ("--tag", "step=2"), ("--host", "elsewhere")):  # a tag said "none that can be read has those"
        latest = cli("restore", "--repo", repo, "latest", str(tmp_path / "out"), *by, check=False)
        assert latest.returncode == 30
        assert "hold the newest save; no snapshot can be read; run: ckptvault check" in error_line(latest), by


def test_api_reports_unreadable_snapshots_and_warns_once(two_snapshots):
    repo, bad, good, _ = two_snapshots
    damage(repo, bad, "truncated")
    warnings: list[str] = []
    with Vault.open(repo) as vault:
        vault.on_warning = warnings.append
        assert [s.id for s in vault.snapshots()] == [good]
        assert [s.id for s in vault.snapshots()] == [good]
        assert list(vault.unreadable_snapshots) == [bad]
        assert isinstance(vault.unreadable_snapshots[bad], IntegrityError)
        assert len(warnings) == 1 and bad[:12] in warnings[0]
        with pytest.raises(IntegrityError, match=f"snapshot object {bad[:12]} is damaged"):
            vault.snapshot(bad)
        other = next(c for c in "0123456789abcdef" if c != bad[0])
        with pytest.raises(SnapshotNotFoundError):  # a prefix that names nothing still says so
            vault.snapshot(other + bad[1:])
        with pytest.raises(IntegrityError, match=f"'latest' cannot be told.*newest that can be read is {good[:8]}"):
            vault.latest()
        with pytest.raises(IntegrityError, match=r"'latest' cannot be told.*no snapshot that can be read has those"):
            vault.latest({"no": "such"})  # not "no snapshot has no=such": the unreadable one may have it
        assert len(warnings) == 1


def test_forget_removes_an_unreadable_snapshot_by_id_prefix(two_snapshots, cli: Callable, tmp_path: Path):
    repo, bad, good, src = two_snapshots
    damage(repo, bad, "junk")
    proc = cli("forget", "--repo", repo, bad[:12])
    assert "forgot 1 snapshot(s)" in proc.stdout.decode()
    # its time, tags and size are unknown: said so, not 1970-01-01 and 0 B (docs audit 39 L7)
    (row,) = [line for line in proc.stdout.decode().splitlines() if line.startswith(bad[:8])]
    assert row.split()[1:4] == ["?", "?", "?"] and "1970" not in row, row
    assert not (Path(repo) / "snapshots" / bad).exists()
    listed = cli("snapshots", "--repo", repo)
    assert stderr_lines(listed) == [] and good[:8] in listed.stdout.decode()
    cli("prune", "--repo", repo, "--keep-latest", "1")  # no longer refused; removes the orphaned tree
    assert len(os.listdir(Path(repo) / "trees")) == 1
    cli("restore", "--repo", repo, good[:8], str(tmp_path / "out"))
    assert tree_digest(tmp_path / "out") == tree_digest(src)


def test_an_ambiguous_prefix_lists_the_snapshots_that_cannot_be_read_too(two_snapshots, cli: Callable, tmp_path: Path):
    """A prefix naming an unreadable snapshot object and another said only "(2 match)", where one naming
    readable ones lists each: the unreadable ones are listed by ID, said so, as their time is unknown."""
    repo, bad, good, _ = two_snapshots
    damage(repo, bad, "junk")
    twin_of_bad, twin_of_good = (i[:4] + ("0" if i[4] != "0" else "1") * 60 for i in (bad, good))
    for twin in (twin_of_bad, twin_of_good):
        (Path(repo) / "snapshots" / twin).write_bytes(b"junk junk junk junk junk junk junk")
    with Vault.open(repo) as vault:
        good_time = next(s.time for s in vault.snapshots() if s.id == good)
    proc = cli("restore", "--repo", repo, good[:4], str(tmp_path / "out"), check=False)
    assert proc.returncode == 18 and not (tmp_path / "out").exists(), proc.stderr
    assert error_line(proc) == (
        f"error: snapshot ID prefix {good[:4]} is ambiguous: {good[:12]} ({good_time:%Y-%m-%d %H:%M:%S}), "
        f"{twin_of_good[:12]} (cannot be read); give more digits"
    )
    proc = cli("forget", "--repo", repo, bad[:4], check=False)
    assert proc.returncode == 18, proc.stderr
    both = sorted([bad[:12], twin_of_bad[:12]])
    assert error_line(proc) == (
        f"error: snapshot ID prefix {bad[:4]} is ambiguous: {both[0]} (cannot be read), {both[1]} (cannot be "
        "read); give more digits"
    )
    assert (Path(repo) / "snapshots" / bad).exists()


@pytest.mark.parametrize(("how", "code"), [("junk", 30), ("truncated", 30)])
def test_prune_refuses_while_a_snapshot_is_unreadable(two_snapshots, cli: Callable, how: str, code: int):
    repo, bad, good, _ = two_snapshots
    damage(repo, bad, how)
    before = sorted(str(p.relative_to(repo)) for p in Path(repo).rglob("*") if p.is_file())
    for args in (
        ("prune", "--keep-latest", "1"),
        ("prune", "--keep-latest", "1", "--dry-run"),
        ("forget", "--prune", good[:8]),
    ):
        proc = cli(*args, "--repo", repo, check=False)
        assert proc.returncode == code, proc.stderr
        error = error_line(proc)
        assert error.startswith(f"error: prune refused: snapshot object {bad[:12]}")
        assert f"ckptvault forget --repo {repo} {bad[:12]}" in error and f"ckptvault check --repo {repo}" in error
    after = sorted(str(p.relative_to(repo)) for p in Path(repo).rglob("*") if p.is_file())
    assert after == before  # nothing deleted, not even the snapshot given to forget --prune
    cli("forget", "--prune", "--repo", repo, bad[:12])  # forgetting the unreadable one itself is allowed
    assert [p.name for p in (Path(repo) / "snapshots").iterdir()] == [good]


# ---- 2. unreadable locks -------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"x", b"junk lock bytes"], ids=["one-byte", "junk"])
def test_unreadable_lock_goes_stale_by_its_age_and_plain_unlock_removes_it(
    two_snapshots, cli: Callable, content: bytes
):
    repo, _, _, src = two_snapshots
    lock = Path(repo) / "locks" / ("ab" * 32)
    lock.write_bytes(content)

    proc = cli("backup", "--repo", repo, str(src), check=False)
    assert proc.returncode == 11
    error = error_line(proc)
    assert f"unreadable lock {'ab' * 6}" in error and "ckptvault unlock" in error
    kept = cli("unlock", "--repo", repo)  # not stale yet: listed, kept, and unlock does not fail
    assert "removed 0 lock(s)" in kept.stdout.decode() and lock.exists()

    os.utime(lock, (HOUR_AGO, HOUR_AGO))  # written an hour ago: stale
    cli("backup", "--repo", repo, str(src))  # a stale lock does not block
    removed = cli("unlock", "--repo", repo)
    assert "removed 1 lock(s)" in removed.stdout.decode() and not lock.exists()


def test_an_unreadable_lock_written_in_the_future_blocks_nothing(two_snapshots, cli: Callable):
    """Its age counted from a modification time set to 2099 (anyone who can write to the storage can
    set it): it blocked every command until ``unlock --remove-all``."""
    repo, _, _, src = two_snapshots
    lock = Path(repo) / "locks" / ("ab" * 32)
    lock.write_bytes(b"junk lock bytes")
    future = datetime(2099, 1, 1, tzinfo=timezone.utc).timestamp()
    os.utime(lock, (future, future))
    cli("backup", "--repo", repo, str(src))
    removed = cli("unlock", "--repo", repo)
    assert "removed 1 lock(s)" in removed.stdout.decode() and not lock.exists()


def test_empty_lock_object_blocks_nothing_and_unlock_removes_it(two_snapshots, cli: Callable):
    """A PUT abandoned at its deadline on a hung server can land as an empty object (SeaweedFS): it
    was never a held lock, so it must not block the vault for the 30 minutes of an unreadable one."""
    repo, _, _, src = two_snapshots
    lock = Path(repo) / "locks" / ("ab" * 32)
    lock.write_bytes(b"")

    cli("backup", "--repo", repo, str(src))
    cli("check", "--repo", repo)
    listed = cli("unlock", "--repo", repo)
    assert "removed 1 lock(s)" in listed.stdout.decode() and not lock.exists()


def test_unreadable_lock_age_comes_from_the_object_not_the_listing(vault: Vault):
    lock = Path(vault.url) / "locks" / ("cd" * 32)
    lock.parent.mkdir(exist_ok=True)
    lock.write_bytes(b"\x01")
    (info,) = vault.locks()
    assert info.unreadable and info.time is not None
    later = info.time + timedelta(minutes=31)
    assert not vault._repo.locks.is_stale(info)
    assert LockManager(vault._repo, clock=lambda: later).is_stale(info)
    assert vault.locks()[0].time == info.time  # listing again does not refresh it
    assert vault.unlock() == []
    os.utime(lock, (HOUR_AGO, HOUR_AGO))
    assert [lk.lock_id for lk in vault.unlock()] == [info.lock_id]


def test_lock_of_an_unknown_version_is_refused_naming_it_until_stale(two_snapshots, cli: Callable):
    repo, _, _, src = two_snapshots
    lock_id = "ef" * 32
    doc = {"version": 2, "hostname": "h", "pid": 1, "exclusive": False, "time": datetime.now(timezone.utc).isoformat()}
    with Vault.open(repo) as vault:
        reseal(vault, Kind.LOCK, lock_id, "locks", doc)
        with pytest.raises(UnsupportedFormatError, match=f"lock {lock_id[:12]}.*newer"):
            vault.backup(src)
        assert vault.unlock() == []
    proc = cli("restore", "--repo", repo, "latest", str(Path(repo).parent / "out"), check=False)
    assert proc.returncode == 17 and f"lock {lock_id[:12]}" in proc.stderr.decode()
    os.utime(Path(repo) / "locks" / lock_id, (HOUR_AGO, HOUR_AGO))
    assert "removed 1 lock(s)" in cli("unlock", "--repo", repo).stdout.decode()


# ---- 3. what a newer ckptvault wrote --------------------------------------------------------------


def recode_chunk(vault: Vault, chunk_id: bytes, codec_id: int) -> None:
    """Rewrite a stored chunk blob in place with another codec byte and a valid checksum."""
    repo = vault._repo
    loc = repo.index.get(chunk_id)
    path = Path(vault.url) / pack_key(loc.pack_id)
    data = bytearray(path.read_bytes())
    blob = data[loc.offset : loc.offset + loc.stored_len]
    assert blob[0] == ENVELOPE_VERSION and blob[1] == SEAL_NONE
    inner = bytes([codec_id]) + bytes(blob[3:-16])
    aad = bytes([ENVELOPE_VERSION, SEAL_NONE, Kind.CHUNK]) + chunk_id
    data[loc.offset : loc.offset + loc.stored_len] = bytes(blob[:2]) + inner + checksum(aad, inner, size=16)
    path.write_bytes(bytes(data))


def test_unknown_codec_id_fails_restore_with_17_and_check_reports_it(two_snapshots, cli: Callable, tmp_path: Path):
    repo, _, good, _ = two_snapshots
    with Vault.open(repo) as vault:
        chunk = next(e for e in vault.files(good) if e.path == "a.bin").chunks[0]
        recode_chunk(vault, chunk, 9)
    proc = cli("restore", "--repo", repo, good[:8], str(tmp_path / "out"), check=False)
    assert proc.returncode == 17
    error = error_line(proc)
    assert f"chunk {chunk.hex()[:12]}" in error and "codec ID 9" in error and "newer ckptvault" in error
    assert not (tmp_path / "out" / "a.bin").exists()
    # Not damage either: check --read-data said exit 30, "repair-index --read-data drops it" (it keeps it) and
    # "remove the damaged snapshot(s) with: ckptvault forget ...", which a newer ckptvault restores (fs57)
    check = cli("check", "--read-data", "--repo", repo, check=False)
    out, err = check.stdout.decode(), check.stderr.decode()
    assert check.returncode == 17 and "internal error" not in err and "upgrade ckptvault" in err
    assert f"chunk {chunk.hex()[:12]}" in out and "codec ID 9" in out
    assert "forget" not in out + err and "repair-index" not in out + err and "affects snapshot" not in out
    cli("repair-index", "--read-data", "--repo", repo)
    with Vault.open(repo) as vault:
        assert vault._repo.find(chunk) is not None  # kept for the ckptvault that reads it


def test_codec_ids_unknown_versus_malformed():
    comp = Compressor(CompressionSettings())
    with pytest.raises(UnsupportedFormatError, match=r"codec ID 9 .*newer ckptvault"):
        comp.decompress(9, b"payload", 7)
    head = bytes(32)
    with pytest.raises(UnsupportedFormatError, match="inner codec 7"):
        comp.decompress(CODEC_DELTA, head + bytes([7]) + b"x", 1, lambda _b: b"y")
    with pytest.raises(MalformedObjectError):  # a delta inside a delta is damage, not a newer writer
        comp.decompress(CODEC_DELTA, head + bytes([CODEC_DELTA]) + b"x", 1, lambda _b: b"y")
    assert comp.decompress(CODEC_RAW, b"ok", 2) == b"ok"


def test_tree_of_a_newer_version_is_refused_with_17_naming_it(two_snapshots, cli: Callable):
    repo, bad, good, _ = two_snapshots
    with Vault.open(repo) as vault:
        snap = vault.snapshot(good)
        raw = json.loads(encode_tree(vault.files(snap)))
        reseal(vault, Kind.TREE, snap.tree_id, "trees", {**raw, "version": 2})
    proc = cli("ls", "--repo", repo, good[:8], check=False)
    assert proc.returncode == 17
    error = error_line(proc)
    assert f"tree object {snap.tree_id[:12]}" in error and "newer" in error
    check = cli("check", "--repo", repo, check=False)  # not damage: no advice to forget it
    assert check.returncode == 17 and f"snapshot {good[:12]}" in check.stdout.decode()
    assert "upgrade ckptvault" in check.stderr.decode() and "forget" not in check.stderr.decode()
    assert "a.bin" in cli("ls", "--repo", repo, bad[:8]).stdout.decode()  # the other snapshot is untouched


def test_a_missing_tree_is_damage_exit_30_naming_it_and_the_remedy(two_snapshots, cli: Callable, tmp_path: Path):
    repo, first, second, _ = two_snapshots
    with Vault.open(repo) as vault:
        tree_id = vault.snapshot(second).tree_id
    (Path(repo) / "trees" / tree_id).unlink()
    proc = cli("restore", "--repo", repo, second[:8], str(tmp_path / "out"), check=False)
    error = error_line(proc)
    assert proc.returncode == 30 and f"tree object {tree_id[:12]}" in error and "missing" in error, error
    assert f"ckptvault forget --repo {repo} {second[:8]}" in error
    cli("restore", "--repo", repo, first[:8], str(tmp_path / "first"))  # the other snapshot restores


def test_check_of_a_missing_tree_says_what_to_do_not_to_run_check(two_snapshots, cli: Callable):
    """check's line for a snapshot whose tree object is gone carried the storage error's "run: ckptvault check":
    advice to run the command the user had just run. It names the tree object and its key, and what brings
    it back (a copy of the vault); the summary says to forget the snapshot otherwise."""
    repo, first, second, _ = two_snapshots
    with Vault.open(repo) as vault:
        tree_id = vault.snapshot(second).tree_id
    (Path(repo) / "trees" / tree_id).unlink()
    proc = cli("check", "--repo", repo, check=False)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    line = next(line for line in out.splitlines() if line.startswith(f"snapshot {second[:12]}:"))
    assert proc.returncode == 30, (out, err)
    assert f"tree object {tree_id[:12]} is missing (trees/{tree_id})" in line and "a copy of the vault" in line, line
    assert "ckptvault check" not in out + err, (out, err)
    assert f"ckptvault forget --repo {repo} {second[:8]}" in err and first[:8] not in err, err


@pytest.mark.parametrize(
    "change", [{"pack_size": -5}, {"chunker": {"algorithm": "fastcdc", "min_size": 1, "avg_size": 2, "max_size": 3}}]
)
def test_a_config_with_impossible_values_is_damage_naming_the_config(two_snapshots, cli: Callable, change: dict):
    repo, *_ = two_snapshots
    config = Path(repo) / "config"
    config.write_text(json.dumps({**json.loads(config.read_text()), **change}))
    proc = cli("snapshots", "--repo", repo, check=False)
    error = error_line(proc)
    assert proc.returncode == 30 and f"the config of {repo} is damaged" in error, error


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"id": 5}, "its id 5 is not 32 hex digits"),
        ({"id": "zz"}, "its id 'zz' is not 32 hex digits"),
        ({"version": True}, "its version True is not a whole number"),
        ({"version": "1"}, "its version '1' is not a whole number"),
        ({"created": None}, "its created time is not text"),
        ({"chunker": []}, "chunker, compression and encryption fields must be objects"),  # was an internal error
        ({"pack_size": "big"}, "its pack_size 'big' is not a whole number"),  # was "lacks field '<=' not supported"
        ({"pack_size": True}, "its pack_size True is not a whole number"),
        ({"compression": {"codec": "zstd", "level": 3, "bytegroup": "no"}}, "compression.bytegroup 'no' is not true"),
        ({"encryption": {"mode": "aes-256-gcm", "key_verifier": "x"}}, "has no valid encryption.key_fingerprint"),
    ],
)
def test_a_config_field_of_the_wrong_shape_is_damage_naming_it(two_snapshots, cli: Callable, change, named):
    # id 5 crashed with a traceback in the key check; a lost key_fingerprint read as "wrong keyfile";
    # version true read as format 1 and bytegroup "no" as true
    repo, *_ = two_snapshots
    config = Path(repo) / "config"
    config.write_text(json.dumps({**json.loads(config.read_text()), **change}))
    proc = cli("snapshots", "--repo", repo, check=False)
    error = error_line(proc)
    assert proc.returncode == 30 and f"the config of {repo} is damaged" in error and named in error, error
    # the way on is the config from a copy: `check` fails on the same config (docs audit 39 M1: it was advised)
    assert error.endswith(
        "; put the config back from a copy (ckptvault check --repo " + repo + " --read-data then "
        "tells whether anything else was hit)"
    ), error
    assert "(it says what to do)" not in error


def test_advice_names_the_api_call_from_python_and_the_command_from_the_cli(two_snapshots, cli: Callable):
    """api49 #6: messages raised through the Python API said `run: ckptvault check` and `ckptvault forget ID`
    where the API has vault.check() and vault.forget([...]); the CLI's messages stay as they were."""
    repo, first, _, _ = two_snapshots
    with Vault.open(repo) as vault:
        tree_id = vault.snapshot(first).tree_id
    (Path(repo) / "trees" / tree_id).unlink()
    with Vault.open(repo) as vault, pytest.raises(IntegrityError) as refused:
        vault.prune(keep_latest=2)
    assert str(refused.value).endswith(
        f"is missing; run: vault.check(), then remove the snapshot with: vault.forget([{first[:8]!r}])"
    ), refused.value
    proc = cli("prune", "--keep-latest", "2", "--repo", repo, check=False)
    error = error_line(proc)
    assert proc.returncode == 30 and error.endswith(
        f"is missing; run: ckptvault check --repo {repo}, then remove the snapshot with: "
        f"ckptvault forget --repo {repo} {first[:8]}"
    ), error
    config = Path(repo) / "config"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pack_size": "big"}))
    with pytest.raises(IntegrityError) as damaged:
        Vault.open(repo)
    assert str(damaged.value).endswith(
        "; put the config back from a copy (vault.check(read_data=1.0) then tells whether anything else was hit)"
    ), damaged.value
    said = error_line(cli("stats", "--repo", repo, check=False))
    assert f"put the config back from a copy (ckptvault check --repo {repo} --read-data then" in said, said


def test_a_vault_whose_config_is_gone_is_named_damaged_not_missing(two_snapshots, cli: Callable):
    """With its config deleted, the vault was "no vault: that folder holds other files, check the path", and
    the default vault's advice, "created by the first backup", failed at once (docs audit 39 M2)."""
    repo, _, _, src = two_snapshots
    (Path(repo) / "config").unlink()
    said = f"the config of {repo} is missing, but the vault's snapshots or index are there; put the config back"
    for args, env in (
        (["snapshots", "--repo", repo], {}),
        (["backup", str(src), "--repo", repo], {}),
        (["snapshots"], {"CKPTVAULT_REPO": repo}),
        (["backup", str(src)], {"CKPTVAULT_REPO": repo}),
    ):
        proc = cli(*args, check=False, **env)
        assert proc.returncode == 30 and said in error_line(proc), proc.stderr
    assert len(list((Path(repo) / "snapshots").iterdir())) == 2 and not (Path(repo) / "config").exists()


def test_init_over_a_vault_whose_config_is_gone_is_refused_naming_it(two_snapshots, cli: Callable):
    """init said "not empty and holds no vault" (dc47 L1); on a remote store it wrote a new config over the
    old snapshots, whose packs a new key could not read."""
    import uuid

    from ckptvault.errors import MalformedObjectError

    repo, *_ = two_snapshots
    (Path(repo) / "config").unlink()
    said = f"the config of {repo} is missing, but the vault's snapshots or index are there; put the config back"
    for args in (["init", repo], ["init", "--repo", repo]):
        proc = cli(*args, check=False)
        assert proc.returncode == 30 and said in error_line(proc), proc.stderr
        assert f"ckptvault check --repo {repo} --read-data" in error_line(proc)
    assert not (Path(repo) / "config").exists()
    url = f"memory://gone-config-{uuid.uuid4().hex}"
    Vault.init(url).close()
    fs = fsspec.filesystem("memory")
    fs.rm(f"{url}/config")
    fs.pipe(f"{url}/snapshots/{'ab' * 32}", b"a snapshot object")
    with pytest.raises(MalformedObjectError, match=r"config of .* is missing"):
        Vault.init(url)
    assert not fs.exists(f"{url}/config")
    # an empty folder named so among other files is no vault's (rv47 L4)
    other = Path(repo).parent / "thesis"
    (other / "index").mkdir(parents=True)
    (other / "thesis.tex").write_text("not a vault")
    proc = cli("init", str(other), check=False)
    assert proc.returncode == 2 and "is not empty and holds no vault" in error_line(proc), proc.stderr


@pytest.mark.parametrize("how", ["cut", "field"])
def test_init_over_a_vault_whose_config_is_damaged_says_so_not_use_it(two_snapshots, cli: Callable, how: str):
    """init over a damaged config said "a vault already exists ...; use it" (exit 10), and using it then failed
    on the config: docs/reliability.md promises exit 30 and the advice to put the config back from a copy."""
    repo, *_ = two_snapshots
    config = Path(repo) / "config"
    data = config.read_bytes()
    damaged = data[: len(data) // 2] if how == "cut" else json.dumps({**json.loads(data), "version": True}).encode()
    config.write_bytes(damaged)
    proc = cli("init", repo, check=False)
    error = error_line(proc)
    assert proc.returncode == 30 and f"the config of {repo} is damaged" in error, error
    assert "put the config back from a copy" in error and "use it" not in error, error
    assert config.read_bytes() == damaged
    with pytest.raises(MalformedObjectError, match="put the config back from a copy"):
        Vault.init(repo)
    assert cli("init", str(Path(repo).parent / "v2"), check=False).returncode == 0  # a new vault elsewhere
    proc = cli("init", str(Path(repo).parent / "v2"), check=False)  # a whole config: as before
    assert proc.returncode == 10 and "a vault already exists" in error_line(proc), proc.stderr


def test_a_config_that_lacks_a_field_says_to_put_it_back_from_a_copy(two_snapshots, cli: Callable):
    repo, *_ = two_snapshots
    config = Path(repo) / "config"
    doc = json.loads(config.read_text())
    del doc["chunker"]
    config.write_text(json.dumps(doc))
    error = error_line(cli("snapshots", "--repo", repo, check=False))
    assert "lacks field 'chunker'; put the config back from a copy" in error, error


def test_snapshot_of_a_newer_version_or_with_unknown_summary_fields_is_left_out(two_snapshots, cli: Callable):
    repo, first, second, _ = two_snapshots
    with Vault.open(repo) as vault:
        doc = json.loads(encode_snapshot(vault.snapshot(first)))
        reseal(vault, Kind.SNAPSHOT, first, "snapshots", {**doc, "version": 2})
        doc = json.loads(encode_snapshot(vault.snapshot(second)))
        doc["summary"]["new_counter"] = 1
        reseal(vault, Kind.SNAPSHOT, second, "snapshots", doc)
        assert vault.snapshots() == []
        assert all(isinstance(e, UnsupportedFormatError) for e in vault.unreadable_snapshots.values())
    proc = cli("snapshots", "--repo", repo)
    text = proc.stderr.decode()
    assert f"snapshot object {first[:12]}" in text and "version 2 is newer" in text
    assert f"snapshot object {second[:12]}" in text and "new_counter" in text
    assert cli("prune", "--repo", repo, "--keep-latest", "1", check=False).returncode == 17
    with pytest.raises(MalformedObjectError):  # an invalid version is still damage
        decode_snapshot(json.dumps({**doc, "version": 0}).encode())
    with pytest.raises(UnsupportedFormatError):
        decode_tree(b'{"version": 3, "entries": []}')


def test_an_index_object_of_a_newer_ckptvault_is_not_called_damage(two_snapshots, cli: Callable):
    repo, *_ = two_snapshots
    index_dir = Path(repo) / "index"
    index_id = sorted(os.listdir(index_dir))[0]
    blob = (index_dir / index_id).read_bytes()
    inner = bytes([9]) + blob[3:-16]  # a codec this ckptvault does not know, validly sealed
    aad = bytes([ENVELOPE_VERSION, SEAL_NONE, Kind.INDEX]) + bytes.fromhex(index_id)
    (index_dir / index_id).write_bytes(blob[:2] + inner + checksum(aad, inner, size=16))
    check = cli("check", "--repo", repo, check=False)
    out, err = check.stdout.decode(), check.stderr.decode()
    assert check.returncode != 0 and f"index {index_id[:12]}" in out and "codec ID 9" in out
    assert "upgrade ckptvault" in err and "repair-index" not in out + err
    repair = cli("repair-index", "--repo", repo, check=False)
    assert repair.returncode == 17 and os.path.exists(index_dir / index_id)  # nothing removed


@pytest.mark.parametrize(
    ("version", "named"),
    [
        (None, "lacks field 'version'"),  # was "its version None is not a whole number"
        (0, "its version 0 is no repository format (they are 1 to 3)"),  # was "format 0 ... is not supported" (17)
        (-2, "its version -2 is no repository format"),
    ],
)
def test_a_config_without_a_version_or_below_1_is_damage_with_the_way_on(two_snapshots, cli: Callable, version, named):
    """A config that lost its version said "its version None is not a whole number" (None is no value the file
    holds); version 0, which no ckptvault writes, "repository format 0 ... is not supported" (exit 17, no next
    step). Both are the config altered: named so, with the way on (a copy of the config)."""
    repo, *_ = two_snapshots
    config = Path(repo) / "config"
    doc = json.loads(config.read_text())
    if version is None:
        del doc["version"]
    else:
        doc["version"] = version
    config.write_text(json.dumps(doc))
    proc = cli("snapshots", "--repo", repo, check=False)
    error = error_line(proc)
    assert proc.returncode == 30 and f"the config of {repo}" in error and named in error, error
    assert "None" not in error and "put the config back from a copy" in error, error


@pytest.mark.parametrize("keep", [5, 6, 13, 20])
def test_a_config_cut_short_in_a_vault_with_no_snapshot_is_damage_not_another_program_s(tmp_path: Path, cli, keep: int):
    """A new vault's config cut short (`{"form`: a full disk, a copy stopped half way) was "another program's
    file named config" (exit 10), as nothing beside it tells a vault; every config opens with its format."""
    repo = tmp_path / "v"
    cli("init", str(repo))
    config = repo / "config"
    cut = config.read_bytes()[:keep]
    config.write_bytes(cut)
    for args in (("snapshots", "--repo", str(repo)), ("init", str(repo))):
        proc = cli(*args, check=False)
        assert proc.returncode == 30, proc.stderr
        assert error_line(proc).startswith(
            f"error: the config of {repo} is damaged: it is cut short, its {keep} bytes only the opening of a "
            "config; put the config back from a copy"
        ), proc.stderr
    assert config.read_bytes() == cut
    config.write_bytes(b'{"name": "my-dataset", "spl')  # another program's JSON, cut short: still not ours
    proc = cli("snapshots", "--repo", str(repo), check=False)
    assert proc.returncode == 10 and "holds another program's file named config" in error_line(proc), proc.stderr


@pytest.mark.parametrize("how", ["cut", "empty"])
def test_a_damaged_config_is_called_damaged_where_the_vault_is_there(two_snapshots, tmp_path: Path, cli, how: str):
    """A vault's config cut short or emptied was reported as "is this a ckptvault repository?"."""
    repo = two_snapshots[0]
    config = Path(repo) / "config"
    data = config.read_bytes()
    config.write_bytes(data[: len(data) // 2] if how == "cut" else b"")
    proc = cli("snapshots", "--repo", repo, check=False)
    assert proc.returncode == 30, proc.stderr
    assert "is damaged: it is not valid JSON" in proc.stderr.decode() and "put the config back from a copy" in (
        proc.stderr.decode()
    )
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "config").write_text("[section]\nkey = value\n")  # some other program's folder
    proc = cli("snapshots", "--repo", str(stray), check=False)  # was exit 30, "is this a ckptvault repository?"
    assert proc.returncode == 10 and f"{stray} holds another program's file named config" in proc.stderr.decode()
