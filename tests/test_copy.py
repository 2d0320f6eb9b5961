"""Copying snapshots between vaults (``Vault.copy_from``, ``ckptvault copy``): plain to encrypted and
back, what is skipped, what is verified, and what a copy stopped part way leaves."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckptvault import Vault
from ckptvault.blob import Kind
from ckptvault.codec import CompressionSettings
from ckptvault.crypto.keyfile import Keyfile
from ckptvault.errors import (
    CopyIncompleteError,
    CopyNeedsUpgradeError,
    IntegrityError,
    SnapshotNotFoundError,
    UsageError,
)

from .conftest import tree_digest, write_file
from .test_damaged_metadata import recode_chunk

PASS = "copy test passphrase"


@pytest.fixture
def keyfile(tmp_path: Path) -> Keyfile:
    key, _ = Keyfile.create(PASS, scrypt_n=2**10)
    return key.save(tmp_path / "dest.key")


def save_checkpoint(folder: Path, step: int, *, frozen_mb: int = 3, trained_mb: int = 3) -> Path:
    """A fine-tuning save: frozen fp32 weights (the same bytes every step) and trained ones."""
    frozen = np.random.default_rng(0).standard_normal(frozen_mb << 18).astype(np.float32)
    trained = np.random.default_rng(step).standard_normal(trained_mb << 18).astype(np.float32)
    folder.mkdir(parents=True)
    save_file({"frozen": frozen, "trained": trained}, str(folder / "model.safetensors"))
    write_file(folder / "trainer_state.json", json.dumps({"global_step": step}).encode())
    os.symlink("model.safetensors", folder / "latest.safetensors")
    return folder


@pytest.fixture
def source(tmp_path: Path) -> Vault:
    vault = Vault.init(str(tmp_path / "source"), pack_size=2 << 20)
    for step in (100, 200):
        vault.backup(save_checkpoint(tmp_path / f"ckpt-{step}", step), tags={"run": "a", "step": str(step)})
    vault.backup(save_checkpoint(tmp_path / "other-1", 1), tags={"run": "b", "step": "1"})
    yield vault
    vault.close()


def restored(vault: Vault, spec: str, out: Path) -> dict:
    vault.restore(spec, out)
    return tree_digest(out)


def test_copy_into_an_encrypted_vault_keeps_snapshots_and_restores_them(
    tmp_path: Path, source: Vault, keyfile: Keyfile
):
    with Vault.init(str(tmp_path / "dest"), keyfile=keyfile.path, passphrase=PASS) as dest:
        result = dest.copy_from(source)
        assert [s.id for s in result.copied] == [s.id for s in source.snapshots()]
        assert result.already_there == []
        # every chunk was read: the destination's chunk IDs are keyed, the source's are not
        total = sum(s.summary.logical_bytes for s in source.snapshots())
        assert result.read_bytes == total  # each chunk once: the header parsed from the chunk in hand
        # the trained tensors differ per step; the frozen ones are stored once
        assert result.new_bytes < result.read_bytes * 0.8
        for theirs, ours in zip(source.snapshots(), dest.snapshots(), strict=True):
            assert (ours.id, ours.time, ours.tags, ours.paths, ours.hostname) == (
                theirs.id,
                theirs.time,
                theirs.tags,
                theirs.paths,
                theirs.hostname,
            )
            assert ours.tree_id != theirs.tree_id  # a tree of this vault's chunk IDs
        assert dest.latest({"run": "a"}).tags["step"] == "200"
        assert restored(dest, "latest", tmp_path / "d") == restored(source, "latest", tmp_path / "s")
        for snap in source.snapshots():
            assert restored(dest, snap.id, tmp_path / f"d-{snap.id}") == restored(
                source, snap.id, tmp_path / f"s-{snap.id}"
            )
        assert dest.check(read_data=1.0).ok
    # nothing in the destination's packs is readable without the key
    packs = b"".join(p.read_bytes() for p in (tmp_path / "dest").rglob("*") if p.is_file())
    assert b"global_step" not in packs


def test_a_second_copy_copies_only_new_snapshots(tmp_path: Path, source: Vault):
    with Vault.init(str(tmp_path / "dest")) as dest:
        first = dest.copy_from(source, tags={"run": "a"})
        assert len(first.copied) == 2
        source.backup(save_checkpoint(tmp_path / "ckpt-300", 300), tags={"run": "a", "step": "300"})
        second = dest.copy_from(source, tags={"run": "a"})
        assert [s.tags["step"] for s in second.copied] == ["300"]
        assert len(second.already_there) == 2
        # unencrypted both: chunk IDs agree, so what the destination holds is not even read
        frozen_bytes = 3 << 20
        assert second.read_bytes <= second.copied[0].summary.logical_bytes - frozen_bytes + 4096  # + headers
        assert dest.copy_from(source, tags={"run": "a"}).copied == []
        assert restored(dest, "latest", tmp_path / "d") == restored(source, "latest", tmp_path / "s")


def test_a_tag_no_snapshot_carries_is_warned_about_not_read_as_nothing_new(tmp_path: Path, source: Vault):
    """`copy --tag run=zz` said "nothing to copy" and exit 0, which reads as "up to date" (cp47 #2)."""
    with Vault.init(str(tmp_path / "dest")) as dest:
        warnings: list[str] = []
        assert dest.copy_from(source, tags={"run": "c"}, on_warning=warnings.append).copied == []
        assert warnings == [
            f"tags={{'run': 'c'}} selects no snapshot in {source.url} (no snapshot has run=c; run is one of: "
            "a, b); nothing copied"
        ], warnings
        dest.copy_from(source, tags={"run": "a"}, on_warning=warnings.append)
        assert dest.copy_from(source, tags={"run": "a"}, on_warning=warnings.append).already_there
        assert len(warnings) == 1  # nothing new is not nothing selected


def test_copy_from_an_encrypted_vault_and_by_id(tmp_path: Path, keyfile: Keyfile, caplog):
    with Vault.init(str(tmp_path / "enc"), keyfile=keyfile.path, passphrase=PASS) as enc:
        one = enc.backup(save_checkpoint(tmp_path / "c1", 1), tags={"step": "1"})
        enc.backup(save_checkpoint(tmp_path / "c2", 2), tags={"step": "2"})
        with Vault.init(str(tmp_path / "plain")) as plain:
            previewed = []
            assert plain.copy_from(enc, [one.id[:8]], dry_run=True, on_warning=previewed.append).copied == [one]
            assert any("the copies would be stored unencrypted" in w for w in previewed), previewed  # ux43
            # ek44 #3: a mirror job's --repo naming a plain vault decrypted a whole vault into it, exit 0
            with pytest.raises(UsageError, match=r"stored unencrypted there; .* or give decrypt=True to store"):
                plain.copy_from(enc, [one.id[:8]])
            assert plain.snapshots() == []
            result = plain.copy_from(enc, [one.id[:8]], decrypt=True)
            assert "the copies are stored unencrypted" in caplog.text
            assert [s.id for s in result.copied] == [one.id]
            assert [s.id for s in plain.snapshots()] == [one.id]
            assert restored(plain, one.id, tmp_path / "p") == restored(enc, one.id, tmp_path / "e")
            assert plain.copy_from(enc, ["latest"], decrypt=True).copied[0].tags == {"step": "2"}
            assert plain.check(read_data=1.0).ok


def test_dry_run_names_what_would_be_copied_and_writes_nothing(tmp_path: Path, source: Vault):
    with Vault.init(str(tmp_path / "dest")) as dest:
        dest.copy_from(source, ["latest"], tags={"run": "a"})
        before = sorted(p.relative_to(tmp_path / "dest") for p in (tmp_path / "dest").rglob("*"))
        plan = dest.copy_from(source, dry_run=True)
        assert {s.tags["step"] for s in plan.copied} == {"100", "1"}
        assert [s.tags["step"] for s in plan.already_there] == ["200"]
        assert sorted(p.relative_to(tmp_path / "dest") for p in (tmp_path / "dest").rglob("*")) == before


def test_copying_a_vault_into_itself_is_refused(tmp_path: Path, source: Vault):
    with Vault.open(str(tmp_path / "source")) as again, pytest.raises(UsageError, match="same vault"):
        again.copy_from(source)


def test_unknown_snapshot_is_refused_before_anything_is_written(tmp_path: Path, source: Vault):
    with Vault.init(str(tmp_path / "dest")) as dest:
        with pytest.raises(SnapshotNotFoundError):
            dest.copy_from(source, ["latest"], tags={"run": "nope"})
        assert dest.snapshots() == []


def test_damaged_source_chunk_fails_loudly_and_writes_no_snapshot(tmp_path: Path, source: Vault):
    """Flip a byte in every pack of the source: the copy must not store the damage as good data."""
    for pack in (tmp_path / "source" / "packs").rglob("*"):
        if pack.is_file():
            raw = bytearray(pack.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            pack.write_bytes(bytes(raw))
    with Vault.open(str(tmp_path / "source")) as damaged, Vault.init(str(tmp_path / "dest")) as dest:
        with pytest.raises(IntegrityError):
            dest.copy_from(damaged)
        assert dest.snapshots() == []
        assert dest.check().ok


def damage_oldest(vault_dir: Path, source: Vault, what: str) -> str:
    """Damage the oldest snapshot's tree object, snapshot object, or a pack only it uses; its ID."""
    oldest = source.snapshots()[0]
    if what == "tree":
        path = next(p for p in (vault_dir / "trees").rglob("*") if p.name == oldest.tree_id)
        path.write_bytes(b"")
    elif what == "missing tree":  # the snapshot object is still there: not one forgotten meanwhile
        next(p for p in (vault_dir / "trees").rglob("*") if p.name == oldest.tree_id).unlink()
    elif what == "snapshot":
        path = next(p for p in (vault_dir / "snapshots").rglob("*") if p.name == oldest.id)
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))
    else:  # the pack of trained weights that only step 100 holds
        trained = next(e for e in source.files(oldest) if e.path == "model.safetensors").chunks[-1]
        pack = source._repo.index.get(trained).pack_id.hex()
        path = next(p for p in (vault_dir / "packs").rglob("*") if p.name == pack)
        raw = bytearray(path.read_bytes())
        raw[source._repo.index.get(trained).offset + 100] ^= 0xFF
        path.write_bytes(bytes(raw))
    return oldest.id


@pytest.mark.parametrize("what", ["tree", "missing tree", "chunk", "snapshot"])
def test_a_damaged_snapshot_in_the_source_does_not_stop_the_others(tmp_path: Path, source: Vault, what: str, cli):
    """The copy went oldest first and stopped at the first damaged snapshot: a mirror kept nothing
    newer until someone forgot the old one, and the error named no snapshot and sent to `check`,
    which in a copy checks the destination (audit 36a F3). A damaged snapshot object was skipped
    with exit 0, so the mirror's job never heard of the gap."""
    damaged = damage_oldest(tmp_path / "source", source, what)
    intact = [s for s in source.snapshots() if s.id != damaged]
    cli("init", str(tmp_path / "dest"))
    proc = cli("copy", "--from-repo", str(tmp_path / "source"), "--repo", str(tmp_path / "dest"), check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 30, err
    assert err.count("error: ") == 1 and "Traceback" not in err
    assert f"copy incomplete: 1 snapshot(s) could not be read in {tmp_path / 'source'} and were not copied: " in err
    assert f"snapshot {damaged[:8]}: " in err and f"2 other(s) were copied to {tmp_path / 'dest'}; " in err, err
    assert f"run: ckptvault check --read-data --repo {tmp_path / 'source'}" in err
    assert "; run: ckptvault check;" not in err and not err.rstrip().endswith("run: ckptvault check")
    assert proc.stdout.decode().startswith("copied 2 snapshot(s)"), proc.stdout  # what was copied is said too
    with Vault.open(str(tmp_path / "dest")) as dest:
        assert {s.id for s in dest.snapshots()} == {s.id for s in intact}
        assert dest.check(read_data=1.0).ok
        for snap in intact:
            assert restored(dest, snap.id, tmp_path / f"d-{snap.id}") == restored(source, snap.id, tmp_path / snap.id)
    both = ["--from-repo", str(tmp_path / "source"), "--repo", str(tmp_path / "dest")]
    rerun = cli("copy", "--json", *both, check=False)
    assert rerun.returncode == 30 and list(json.loads(rerun.stdout)["failed"]) == [damaged]
    assert "0 other(s) were copied" in rerun.stderr.decode() and "2 were there already" in rerun.stderr.decode()
    if what == "snapshot":  # a copy chosen by tags leaves out what it cannot read, with the listing's warning
        with Vault.open(str(tmp_path / "source")) as fresh, Vault.init(str(tmp_path / "by-tag")) as dest:
            warnings: list[str] = []
            fresh.on_warning = warnings.append
            assert len(dest.copy_from(fresh, tags={"run": "b"}).copied) == 1
            assert any(f"snapshot object {damaged[:12]} is damaged" in w for w in warnings), warnings
            with pytest.raises(IntegrityError, match=f"in {tmp_path / 'source'}: snapshot object {damaged[:12]} is"):
                dest.copy_from(fresh, [damaged[:8]])  # by its ID: its own error, not "no snapshot"


def test_a_mirror_that_holds_a_snapshot_damaged_in_the_source_since_is_complete(tmp_path: Path, source: Vault):
    """A snapshot copied before its object was damaged in the source is there: a copy of all of them
    failed at every run on it (a review of the copy that goes on)."""
    with Vault.init(str(tmp_path / "dest")) as dest:
        dest.copy_from(source)
    damage_oldest(tmp_path / "source", source, "snapshot")
    with Vault.open(str(tmp_path / "source")) as fresh, Vault.open(str(tmp_path / "dest")) as dest:
        result = dest.copy_from(fresh)
    assert (result.copied, len(result.already_there), result.failed) == ([], 2, {})


def test_a_snapshot_object_of_a_newer_ckptvault_is_a_warning_not_damage(tmp_path: Path, source: Vault, cli):
    """It made a copy of all of them exit 30 with "to see what is damaged there and how to heal it",
    where check says "upgrade ckptvault" (a review of the copy that goes on)."""
    newest = source.snapshots()[-1]
    raw = source._repo.load_snapshot(bytes.fromhex(newest.id)).replace(b'"version":1', b'"version":2', 1)
    assert b'"version":2' in raw
    path = next(p for p in (tmp_path / "source" / "snapshots").rglob("*") if p.name == newest.id)
    path.write_bytes(source._repo.codec.encode(Kind.SNAPSHOT, bytes.fromhex(newest.id), raw))
    cli("init", str(tmp_path / "dest"))
    proc = cli("copy", "--from-repo", str(tmp_path / "source"), "--repo", str(tmp_path / "dest"), check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 0 and "a newer ckptvault is needed" in err and "error" not in err, err
    assert proc.stdout.decode().startswith("copied 2 snapshot(s)")


def test_a_chunk_of_a_newer_codec_skips_its_snapshot_copies_the_others_and_says_upgrade(
    tmp_path: Path, source: Vault, cli
):
    """A chunk whose codec ID this ckptvault does not know (written by a newer one, docs/format.md) stopped the
    whole copy at its snapshot with the chunk's error alone (exit 17): the snapshots after it were never tried,
    and neither the message nor --json said which had been copied. It is now left out as a damaged one is, the
    others are copied, and the error names it and says to upgrade, not to check (exit 17, not damage); the API
    raises CopyNeedsUpgradeError (a CopyIncompleteError) with it in ``newer``. No half snapshot and no pack of
    it stays in the destination."""
    s100, s200, s1 = source.snapshots()
    before = {c for e in source.files(s100) for c in e.chunks}
    newer = next(c for e in source.files(s200) for c in e.chunks if c not in before)
    recode_chunk(source, newer, 9)
    source.close()
    cli("init", str(tmp_path / "dest"))
    args = ("copy", "--json", "--from-repo", str(tmp_path / "source"), "--repo", str(tmp_path / "dest"))
    proc = cli(*args, check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 17 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"snapshot {s200.short_id}: chunk {newer.hex()[:12]}" in err and "codec ID 9" in err, err
    assert "2 other(s) were copied" in err and "upgrade ckptvault" in err and "check" not in err, err
    data = json.loads(proc.stdout)
    assert data["copied"] and len(data["copied"]) == 2 and list(data["failed"]) == data["newer"] == [s200.id]
    with Vault.open(str(tmp_path / "source")) as fresh, Vault.open(str(tmp_path / "dest")) as dest:
        assert sorted(s.id for s in dest.snapshots()) == sorted([s100.id, s1.id])
        report = dest.check(read_data=1.0)
        assert report.ok and not report.warnings, (report.problems, report.warnings)
        packs = {p.name for p in (tmp_path / "dest" / "packs").rglob("*") if p.is_file()}
        assert packs == {loc.pack_id.hex() for _, loc in dest._repo.index.items()}  # none of the skipped one's
        with pytest.raises(CopyIncompleteError) as raised:
            dest.copy_from(fresh)
    assert isinstance(raised.value, CopyNeedsUpgradeError) and raised.value.newer == [s200.id]
    assert raised.value.result.already_there and "upgrade ckptvault" in str(raised.value)


def test_after_a_damaged_snapshot_the_next_is_not_copied_against_chunks_gone_from_the_destination(
    tmp_path: Path, source: Vault
):
    """The failed snapshot's writes are aborted, which reloaded the destination's index as its objects
    say, with the chunks of a pack gone from the destination again: the next snapshot deduplicated
    against them, and its copy did not restore (a review of the copy that goes on)."""
    s100, s200, s1 = source.snapshots()
    with Vault.init(str(tmp_path / "dest"), pack_size=2 << 20) as dest:
        dest.copy_from(source, [s1.id])
        frozen = next(e for e in source.files(s1) if e.path == "model.safetensors").chunks[0]
        gone = dest._repo.index.get(frozen).pack_id.hex()
    next(p for p in (tmp_path / "dest" / "packs").rglob("*") if p.name == gone).unlink()
    damage_oldest(tmp_path / "source", source, "chunk")  # s100's own trained weights
    with Vault.open(str(tmp_path / "source")) as fresh, Vault.open(str(tmp_path / "dest")) as dest:
        with pytest.raises(CopyIncompleteError) as incomplete:
            dest.copy_from(fresh)
        assert list(incomplete.value.failed) == [s100.id]
        assert [s.id for s in incomplete.value.result.copied] == [s200.id]
    with Vault.open(str(tmp_path / "dest")) as dest:
        assert restored(dest, s200.id, tmp_path / "d200") == restored(source, s200.id, tmp_path / "s200")


def test_a_copy_that_lost_its_destination_lock_writes_no_snapshot(tmp_path: Path, source: Vault, monkeypatch):
    """As a backup does (test_locks.py): the destination's lock is verified before each snapshot object is
    written, so a copy whose lock a prune took for a dead process's commits nothing it may have deleted."""
    from ckptvault.errors import LockLostError
    from ckptvault.ops import copy as copy_module

    real = copy_module.encode_tree
    with Vault.init(str(tmp_path / "dest")) as dest:

        def prune_meanwhile(entries):  # while the copy runs, someone removes its lock as stale
            dest.unlock(remove_all=True)
            return real(entries)

        monkeypatch.setattr(copy_module, "encode_tree", prune_meanwhile)
        with pytest.raises(LockLostError, match="removed it as stale"):
            dest.copy_from(source)
        monkeypatch.undo()
        assert dest.snapshots() == []


def test_copy_of_a_file_whose_bytes_differ_from_its_hash_is_refused(tmp_path: Path, source: Vault, monkeypatch):
    """Chunks each intact but not the file the tree describes (a tree that names the wrong chunk):
    the whole-file hash catches it, as it does on restore."""
    from ckptvault.ops import copy as copy_module

    real = copy_module.decode_tree

    def swapped(raw: bytes):
        tree = real(raw)
        files = [e for e in tree if e.type == "file" and len(e.chunks) > 1]
        files[0].chunks[0], files[0].chunks[1] = files[0].chunks[1], files[0].chunks[0]
        return tree

    monkeypatch.setattr(copy_module, "decode_tree", swapped)
    with Vault.init(str(tmp_path / "dest")) as dest, pytest.raises(IntegrityError, match="file hash"):
        dest.copy_from(source, ["latest"], tags={"run": "a"})


def test_cli_copy_plain_to_encrypted_then_nothing_left(tmp_path: Path, source: Vault, keyfile: Keyfile, cli):
    dest = str(tmp_path / "dest")
    env = {"CKPTVAULT_KEYFILE": str(keyfile.path), "CKPTVAULT_PASSPHRASE": PASS}
    cli("init", dest, "--encrypt", **env)
    proc = cli("copy", "--from-repo", str(tmp_path / "source"), "--repo", dest, "--tag", "run=a", **env)
    out = proc.stdout.decode() + proc.stderr.decode()
    assert "copied 2 snapshot(s)" in out, out
    proc = cli("copy", "--from-repo", str(tmp_path / "source"), "--repo", dest, "--json", **env)
    summary = json.loads(proc.stdout)
    assert len(summary["copied"]) == 1 and len(summary["already_there"]) == 2
    assert (
        cli("copy", "--from-repo", str(tmp_path / "source"), "--repo", dest, **env)
        .stdout.decode()
        .count("nothing to copy")
        == 1
    )
    cli("restore", "latest", str(tmp_path / "out"), "--repo", dest, "--tag", "run=a", **env)
    assert tree_digest(tmp_path / "out") == restored(source, source.latest({"run": "a"}).id, tmp_path / "s")


def test_cli_copy_errors_are_one_line(tmp_path: Path, source: Vault, cli):
    dest = str(tmp_path / "dest")
    cli("init", dest)
    missing = cli("copy", "--repo", dest, check=False)
    assert missing.returncode == 2 and b"--from-repo" in missing.stderr
    same = cli("copy", "--from-repo", str(tmp_path / "source"), "--repo", str(tmp_path / "source"), check=False)
    assert same.returncode == 2 and b"same vault" in same.stderr and b"Traceback" not in same.stderr
    gone = cli("copy", "--from-repo", str(tmp_path / "nowhere"), "--repo", dest, check=False)
    assert gone.returncode == 10 and len(gone.stderr.strip().splitlines()) == 1
    nowhere = tmp_path / "nowhere"
    assert f"no vault at {nowhere}; check --from-repo: a copy reads a vault that exists" in gone.stderr.decode()
    assert "ckptvault init" not in gone.stderr.decode()  # making an empty source is never what a copy needs
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.slow
def test_a_copy_killed_part_way_leaves_both_vaults_whole_and_the_rerun_finishes(tmp_path: Path, cli):
    """SIGKILL a real copy while it stores chunks: the destination has no half snapshot, check is
    clean, and the next copy completes and restores bit for bit."""
    src = tmp_path / "source"
    with Vault.init(str(src)) as vault:
        for step in range(1, 4):
            vault.backup(save_checkpoint(tmp_path / f"c{step}", step, trained_mb=16), tags={"step": str(step)})
    dest = str(tmp_path / "dest")
    cli("init", dest)
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg"), "CKPTVAULT_LIMIT_UPLOAD": "20MB"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptvault", "copy", "--from-repo", str(src), "--repo", dest, "-q"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list((tmp_path / "dest" / "packs").rglob("*")):
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    with Vault.open(dest) as vault:
        assert len(vault.snapshots()) < 3  # killed part way
    cli("unlock", "--repo", dest)
    cli("check", "--repo", dest)  # what the killed copy stored is no damage
    cli("copy", "--from-repo", str(src), "--repo", dest)
    cli("check", "--read-data", "--repo", dest)
    with Vault.open(str(src)) as a, Vault.open(dest) as b:
        assert [s.id for s in b.snapshots()] == [s.id for s in a.snapshots()]
        for snap in a.snapshots():
            assert restored(b, snap.id, tmp_path / f"b{snap.id}") == restored(a, snap.id, tmp_path / f"a{snap.id}")


def packs_bytes(vault_dir: Path) -> int:
    return sum(p.stat().st_size for p in (vault_dir / "packs").rglob("*") if p.is_file())


@pytest.mark.parametrize("encrypt", [False, True], ids=["same-ids", "keyed-ids"])
def test_a_delta_coded_source_is_copied_as_deltas(tmp_path: Path, keyfile: Keyfile, encrypt: bool):
    """Chunks the source stores as deltas are stored as deltas in a delta-coded destination, against
    its copy of the same keyframe, whether chunk IDs agree (both unencrypted) or not (encrypted):
    the copy is about as small as its source, restores bit for bit and checks clean, and copying it
    on into a vault without delta coding stores whole chunks that restore alike."""
    from .test_delta import DELTA, SMALL, Training

    NO_DELTA = CompressionSettings(delta=False)
    with Vault.init(str(tmp_path / "delta"), chunker=SMALL, compression=DELTA, pack_size=2 << 20) as source:
        training = Training()
        for step in (1, 2, 3):
            training.step()
            training.save(tmp_path / "ckpt")
            source.backup(tmp_path / "ckpt", tags={"run": "d", "step": str(step)})
        source_deltas = sum(s.summary.delta_chunks for s in source.snapshots())
        assert source_deltas > 0
        options = {"keyfile": keyfile.path, "passphrase": PASS} if encrypt else {}
        with (
            Vault.init(str(tmp_path / "copy"), compression=DELTA, pack_size=2 << 20, **options) as dest,
            Vault.init(str(tmp_path / "plain"), compression=NO_DELTA, pack_size=2 << 20) as plain,
        ):
            result = dest.copy_from(source)
            assert len(result.copied) == 3
            assert result.delta_chunks == source_deltas
            # the copy's chunks are coded as the source's: within a few % of its packs (headers, padding)
            assert packs_bytes(tmp_path / "copy") < packs_bytes(tmp_path / "delta") * 1.05
            assert plain.copy_from(dest, decrypt=True).delta_chunks == 0  # (from the encrypted copy too)
            # a copy's summary says nothing of deltas: they depend on what each destination held
            assert [s.summary.delta_chunks for s in plain.snapshots()] == [0, 0, 0]
            assert packs_bytes(tmp_path / "plain") > packs_bytes(tmp_path / "copy") * 1.1
            for snap in source.snapshots():
                want = restored(source, snap.id, tmp_path / f"s-{snap.id}")
                assert restored(dest, snap.id, tmp_path / f"c-{snap.id}") == want
                assert restored(plain, snap.id, tmp_path / f"p-{snap.id}") == want
            assert dest.check(read_data=1.0).ok and plain.check(read_data=1.0).ok
            # a prune of the copy keeps the keyframes its deltas need
            dest.forget([source.snapshots()[0].id], prune=True)
            assert restored(dest, "latest", tmp_path / "after-prune") == restored(source, "latest", tmp_path / "s")
            assert dest.check(read_data=1.0).ok


def test_a_delta_whose_keyframe_was_not_copied_is_stored_whole(tmp_path: Path):
    """Only the latest snapshot copied: the destination lacks the keyframes (they belong to an
    older save), so its chunks are stored whole and restore alike."""
    from .test_delta import DELTA, SMALL, Training

    with Vault.init(str(tmp_path / "delta"), chunker=SMALL, compression=DELTA, pack_size=2 << 20) as source:
        training = Training()
        for step in (1, 2):
            training.step()
            training.save(tmp_path / "ckpt")
            source.backup(tmp_path / "ckpt", tags={"step": str(step)})
        assert source.latest().summary.delta_chunks > 0
        with Vault.init(str(tmp_path / "copy"), compression=DELTA) as dest:
            result = dest.copy_from(source, ["latest"])
            assert len(result.copied) == 1 and result.delta_chunks == 0
            assert restored(dest, "latest", tmp_path / "c") == restored(source, "latest", tmp_path / "s")
            assert dest.check(read_data=1.0).ok


COPY_CHILD = r"""
import json, sys
from ckptvault import Vault
from ckptvault import keep_freed_memory
keep_freed_memory(one_arena=True)  # as the CLI, which runs copies
with Vault.open(sys.argv[1]) as source, Vault.open(sys.argv[2]) as dest:
    dest.copy_from(source)
with open("/proc/self/status") as f:
    print(json.dumps(int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) // 1024))
"""


@pytest.mark.slow
def test_copy_memory_does_not_grow_with_file_size(tmp_path: Path):
    from .support.disk import need_free_disk
    from .test_memory import BOUND_MB, make_sparse_ish

    peaks = {}
    for size in (256 << 20, 1 << 30):
        need_free_disk(tmp_path, size // 2)
        work = tmp_path / str(size)
        (work / "src").mkdir(parents=True)
        make_sparse_ish(work / "src" / "model.bin", size)
        with Vault.init(str(work / "a")) as source:
            source.backup(work / "src")
        Vault.init(str(work / "b")).close()
        proc = subprocess.run(
            [sys.executable, "-c", COPY_CHILD, str(work / "a"), str(work / "b")],
            capture_output=True,
            check=True,
            timeout=600,
        )
        peaks[size] = json.loads(proc.stdout)
        with Vault.open(str(work / "b")) as dest:
            assert dest.latest().summary.logical_bytes == size
        shutil.rmtree(work)
    print(f"copy peak RSS MB by file size: {peaks}")
    assert peaks[1 << 30] < BOUND_MB, peaks
    assert peaks[1 << 30] < peaks[256 << 20] * 1.25 + 16, peaks


def test_cli_encrypted_source_from_its_own_options(tmp_path: Path, keyfile: Keyfile, cli):
    """The source's keyfile and passphrase come from --from-* options or CKPTVAULT_FROM_* variables,
    never from the destination's; a wrong one, or a passphrase file without a keyfile, is one line."""
    src = str(tmp_path / "enc")
    with Vault.init(src, keyfile=keyfile.path, passphrase=PASS) as enc:
        enc.backup(save_checkpoint(tmp_path / "c1", 1), tags={"step": "1"})
    dest = str(tmp_path / "plain")
    cli("init", dest)
    (tmp_path / "pass.txt").write_text(PASS + "\n")
    wrong = cli(
        "copy", "--repo", dest, CKPTVAULT_FROM_REPO=src, CKPTVAULT_FROM_KEYFILE=str(keyfile.path),
        CKPTVAULT_FROM_PASSPHRASE="not it", CKPTVAULT_PASSPHRASE=PASS, check=False,
    )  # fmt: skip
    assert wrong.returncode == 12 and len(wrong.stderr.strip().splitlines()) == 1, wrong.stderr
    alone = cli("copy", "--from-repo", src, "--from-passphrase-file", str(tmp_path / "pass.txt"), "--repo", dest,
                check=False)  # fmt: skip
    assert alone.returncode == 2 and b"--from-keyfile" in alone.stderr, alone.stderr
    both = cli("copy", "--from-repo", src, "--from-keyfile", str(keyfile.path), "--from-passphrase-file", "-",
               "--repo", dest, "--passphrase-file", "-", input=b"x", check=False)  # fmt: skip
    assert both.returncode == 2 and b"standard input holds one passphrase" in both.stderr, both.stderr
    blank = cli("copy", "--repo", dest, CKPTVAULT_FROM_REPO=" ", check=False)
    assert blank.returncode == 2 and b"CKPTVAULT_FROM_REPO" in blank.stderr, blank.stderr
    args = ["copy", "--from-repo", src, "--from-keyfile", str(keyfile.path), "--from-passphrase-file",
            str(tmp_path / "pass.txt"), "--repo", dest]  # fmt: skip
    refused = cli(*args, check=False)
    assert refused.returncode == 2 and b"or give --decrypt to store them in the clear" in refused.stderr
    done = cli(*args, "--decrypt")
    assert b"copied 1 snapshot(s)" in done.stderr + done.stdout
    assert b"warning:" in done.stderr and b"stored unencrypted" in done.stderr, done.stderr
    with Vault.open(dest) as plain:
        assert restored(plain, "latest", tmp_path / "out") == tree_digest(tmp_path / "c1")


def test_cli_copy_between_vaults_of_one_keyfile_takes_its_passphrase_once(tmp_path: Path, keyfile: Keyfile, cli):
    """ek44 #15: with the same keyfile on both sides (or a copy of it) the copy wanted
    CKPTVAULT_FROM_PASSPHRASE as well; the destination's passphrase is the source's."""
    src, dest, again = (str(tmp_path / name) for name in ("enc", "enc2", "enc3"))
    with Vault.init(src, keyfile=keyfile.path, passphrase=PASS) as enc:
        enc.backup(save_checkpoint(tmp_path / "c1", 1), tags={"step": "1"})
    twin = tmp_path / "team-copy.key"
    twin.write_bytes(Path(keyfile.path).read_bytes())
    for vault in (dest, again):
        with Vault.init(vault, keyfile=keyfile.path, passphrase=PASS):
            pass
    done = cli("copy", "--from-repo", src, "--from-keyfile", str(twin), "--repo", dest, "-k", str(keyfile.path),
               CKPTVAULT_PASSPHRASE=PASS, input=b"")  # fmt: skip
    assert b"copied 1 snapshot(s)" in done.stderr + done.stdout, done.stderr
    piped = cli("copy", "--from-repo", src, "--from-keyfile", str(keyfile.path), "--repo", again, "-k",
                str(keyfile.path), "--passphrase-file", "-", input=PASS.encode())  # fmt: skip
    assert b"copied 1 snapshot(s)" in piped.stderr + piped.stdout, piped.stderr
    with Vault.open(again, keyfile=keyfile.path, passphrase=PASS) as copied:
        assert restored(copied, "latest", tmp_path / "out") == tree_digest(tmp_path / "c1")
    other = cli("copy", "--from-repo", src, "--from-keyfile", str(keyfile.path), "--repo", dest, "-k",
                str(keyfile.path), CKPTVAULT_PASSPHRASE=PASS, CKPTVAULT_FROM_PASSPHRASE="no", check=False)  # fmt: skip
    assert other.returncode == 12, other.stderr  # a source passphrase given apart is still the one used


def test_a_snapshot_copied_again_is_the_same_object_so_no_host_cache_goes_stale(
    tmp_path: Path, source: Vault, monkeypatch
):
    """The destination forgets a copied snapshot (its own retention) and the next copy brings it back
    under the same name. Metadata caches keep objects by name as immutable: a host that cached the
    first copy and then prunes must not take the second copy's tree for garbage (it did, when each
    copy wrote its tree under a new random ID: the snapshot could no longer be restored)."""
    from ckptvault.store import local as local_store

    monkeypatch.setattr(local_store.LocalStore, "remote", True)  # the folder stands in for a store: cached

    def host(name: str) -> Vault:
        monkeypatch.setenv("CKPTVAULT_CACHE_DIR", str(tmp_path / f"cache-{name}"))
        return Vault.open(str(tmp_path / "dest"))

    Vault.init(str(tmp_path / "dest")).close()
    first = source.snapshots()[0]
    with host("a") as a:
        copied = a.copy_from(source, [first.id]).copied[0]
        with host("b") as b:
            assert b.files(first.id)  # cached on host b, tree and all
        a.forget([first.id], prune=True)
        again = a.copy_from(source).copied[0]
    assert again == copied  # the same tree ID, the same summary: the same object
    with host("b") as b:
        b.prune()
    with host("c") as c:
        assert restored(c, first.id, tmp_path / "c") == restored(source, first.id, tmp_path / "s")
        assert c.check(read_data=1.0).ok


def test_a_snapshot_forgotten_in_the_source_while_the_copy_runs_is_skipped(tmp_path: Path, source: Vault):
    """A forget (or a retag) in the source takes a shared lock, as the copy does: it may remove a
    listed snapshot before the copy reaches it. That one is named, the others are copied."""
    from ckptvault.ops import copy as copy_module

    first, second, third = source.snapshots()
    real = copy_module._Copier.snapshot

    def forget_second_first(self, snap, before_commit):
        if snap.id == second.id:
            with Vault.open(str(tmp_path / "source")) as other:
                other.forget([second.id])
        return real(self, snap, before_commit)

    warnings: list[str] = []
    with Vault.init(str(tmp_path / "dest")) as dest:
        copy_module._Copier.snapshot = forget_second_first
        try:
            result = dest.copy_from(source, on_warning=warnings.append)
        finally:
            copy_module._Copier.snapshot = real
        assert [s.id for s in result.copied] == [first.id, third.id]
        assert [s.id for s in result.gone] == [second.id]
        assert len(warnings) == 1 and second.short_id in warnings[0] and "forgotten or retagged" in warnings[0]
        assert dest.check().ok


def test_chunks_the_destination_holds_do_not_pile_up_in_the_pipeline(tmp_path: Path):
    """Chunks already stored are queued in their place among those coded; the queue is drained as it
    goes, or a long run of them (a copy of a vault sharing chunk IDs) would grow it without bound."""
    from ckptvault.ops.backup import ChunkPipeline
    from ckptvault.ops.progress import NullProgress
    from ckptvault.snapshot.model import FileEntry

    with Vault.init(str(tmp_path / "v")) as vault:
        pipeline = ChunkPipeline(vault._repo, NullProgress(), 2, None)
        entry = FileEntry("f", "file", 0o644, 0)
        try:
            for i in range(10_000):
                pipeline.add_stored(entry, i.to_bytes(32, "little"), 1 << 20)
                assert len(pipeline.inflight) <= pipeline.window + 1
            pipeline.drain()
        finally:
            pipeline.close()
        assert entry.chunks == [i.to_bytes(32, "little") for i in range(10_000)]


def test_copy_moves_a_format_1_encrypted_vault_to_format_3_under_a_new_key(tmp_path: Path, keyfile: Keyfile):
    """The way docs/security.md gives to the authenticated settings of format 3 for a vault made before
    0.2.0: a new vault with a new keyfile, and the snapshots copied into it."""
    from .fixtures.make_fixtures import KAT_PASSPHRASE

    fixtures = Path(__file__).parent / "fixtures"
    old = tmp_path / "old"
    shutil.copytree(fixtures / "repo-v1-encrypted", old)
    with (
        Vault.open(str(old), keyfile=fixtures / "keyfile-v1.json", passphrase=KAT_PASSPHRASE) as source,
        Vault.init(str(tmp_path / "new"), keyfile=keyfile.path, passphrase=PASS) as dest,
    ):
        assert source.config.version == 1
        result = dest.copy_from(source)
        assert dest.config.version == 3 and dest.config.key_fingerprint != source.config.key_fingerprint
        assert [s.id for s in result.copied] == [s.id for s in source.snapshots()]
        dest.restore_latest(tmp_path / "out", run="fixture")
        assert dest.check(read_data=1.0).ok
    for rel in ("model/weights.bin", "config.json"):
        assert (tmp_path / "out" / rel).read_bytes() == (fixtures / "source" / rel).read_bytes()
    assert os.readlink(tmp_path / "out" / "link") == "config.json"


def test_a_too_short_id_prefix_is_refused(tmp_path: Path, source: Vault):
    with Vault.init(str(tmp_path / "dest")) as dest:
        with pytest.raises(UsageError, match=r"'9' is too short an ID prefix to copy a snapshot by.*source\.snapshots"):
            dest.copy_from(source, ["9"])  # h5 #4: the source's listing, not this vault's
        assert dest.snapshots() == []


def test_a_snapshot_named_twice_is_copied_once(tmp_path: Path, source: Vault):
    first = source.snapshots()[0]
    with Vault.init(str(tmp_path / "dest")) as dest:
        result = dest.copy_from(source, [first.id, first.id[:8]])
        assert [s.id for s in result.copied] == [first.id]
        assert [s.id for s in dest.snapshots()] == [first.id]


def test_an_unknown_source_snapshot_is_named_in_the_source(tmp_path: Path, source: Vault):
    with Vault.init(str(tmp_path / "dest")) as dest, pytest.raises(SnapshotNotFoundError) as caught:
        dest.copy_from(source, ["deadbeef"])
    assert str(tmp_path / "source") in str(caught.value) and "source.snapshots()" in str(caught.value)


def test_a_storage_option_the_destination_does_not_take_is_refused_before_the_source_is_opened(tmp_path: Path, cli):
    """rb44 #6: `copy --from-repo s3://... --repo ./local -o endpoint_url=...` (the option meant for the source)
    tried the source against AWS's own endpoint for 104 s, with the user's keys, before the destination's
    instant "a local folder takes no storage option"."""
    proc = cli(
        "copy", "--from-repo", str(tmp_path / "no-such-source"), "--repo", str(tmp_path / "dest"),
        "-o", "endpoint_url=http://127.0.0.1:9", check=False,
    )  # fmt: skip
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "takes no storage option 'endpoint_url'" in err, err
    assert "no-such-source" not in err
