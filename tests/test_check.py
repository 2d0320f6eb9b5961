"""check finds damage, names the damaged objects and every snapshot and file they affect."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.chunking import ChunkerParams
from ckptvault.errors import IntegrityError
from ckptvault.repository.format import pack_key

SMALL = ChunkerParams(min_size=16 * 1024, avg_size=64 * 1024, max_size=256 * 1024)


@pytest.fixture
def damaged(tmp_path: Path):
    """Two snapshots; returns (vault, url, {file: pack path}) for a pack holding only b.bin's chunks."""
    url = str(tmp_path / "vault")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(1 << 20))
    vault = Vault.init(url, chunker=SMALL, pack_size=1 << 20)
    vault.backup(src, tags={"n": "1"})
    (src / "b.bin").write_bytes(os.urandom(1 << 20))
    vault.backup(src, tags={"n": "2"})
    repo = vault._repo
    b_entry = next(e for e in vault.files("latest") if e.path == "b.bin")
    pack_id = repo.index.get(b_entry.chunks[0]).pack_id
    return vault, Path(url) / pack_key(pack_id), pack_id.hex()[:12]


def assert_names_b(report, second_id: str) -> None:
    assert not report.ok
    assert list(report.affected) == [second_id]  # the first snapshot has no b.bin: unaffected
    assert report.affected[second_id] == ["b.bin"]


def test_clean_repository(damaged):
    vault, _, _ = damaged
    report = vault.check(read_data=1.0)
    assert report.ok and report.snapshots == 2 and report.chunks_read == report.chunks > 0


def test_deleted_pack(damaged):
    vault, pack, name = damaged
    pack.unlink()
    report = Vault.open(vault.url).check()
    assert any(p.object == f"pack {name}" and "missing" in p.detail for p in report.problems)
    assert_names_b(report, vault.latest().id)


def test_the_report_gives_the_api_the_error_and_remedy_the_cli_raises(damaged):
    """What to do about damage (heal, then forget which snapshots) was worked out by the CLI alone."""
    vault, pack, _ = damaged
    assert vault.check().error(vault.url) is None
    pack.unlink()
    error = Vault.open(vault.url).check().error(vault.url)
    assert isinstance(error, IntegrityError) and error.exit_code == 30
    assert f"vault.forget([{vault.latest().id[:8]!r}])" in str(error) and "vault.repair_index()" in str(error), error


def test_truncated_pack(damaged):
    vault, pack, name = damaged
    data = pack.read_bytes()
    pack.write_bytes(data[: len(data) // 2])
    report = Vault.open(vault.url).check()
    assert any(p.object == f"pack {name}" for p in report.problems)
    assert_names_b(report, vault.latest().id)


def test_flipped_byte_found_only_when_reading_data(damaged):
    vault, pack, name = damaged
    data = bytearray(pack.read_bytes())
    data[100] ^= 0x10
    pack.write_bytes(bytes(data))
    assert vault.check().ok  # structure intact: only --read-data can see it
    report = vault.check(read_data=1.0)
    assert any(p.object.startswith("chunk ") and name in p.detail for p in report.problems)
    assert_names_b(report, vault.latest().id)


def test_damaged_tree_affects_its_whole_snapshot(damaged):
    vault, _, _ = damaged
    snap = vault.latest()
    tree = Path(vault.url) / "trees" / snap.tree_id
    tree.write_bytes(tree.read_bytes()[:-3])
    report = vault.check()
    assert report.affected == {snap.id: ["*"]}


def test_read_data_subset(damaged):
    vault, _, _ = damaged
    report = vault.check(read_data=0.5, seed=1)
    assert report.ok and 0 < report.packs_read < report.packs


def test_cli_check_exit_code_and_listing(cli, damaged):
    vault, pack, name = damaged
    pack.unlink()
    proc = cli("check", "--repo", vault.url, check=False)
    assert proc.returncode == 30
    out = proc.stdout.decode()
    assert f"pack {name}: is missing" in out and f"affects snapshot {vault.latest().short_id}: b.bin" in out
    assert "check found" in proc.stderr.decode()
    # the way out of what is lost, in the vault checked (a mirror has the same IDs: walk 37 W1)
    assert f"ckptvault forget --repo {vault.url} {vault.latest().id[:8]}" in proc.stderr.decode()


def test_many_damaged_snapshots_are_named_above_not_in_one_forget_command(tmp_path: Path, cli):
    """300 missing packs affecting 738 snapshots made one 6.9 KB error line: a forget command of 738 IDs,
    most of the vault's history, to copy unread."""
    repo = str(tmp_path / "repo")
    src = tmp_path / "src"
    src.mkdir()
    (src / "shared.bin").write_bytes(os.urandom(50_000))  # in every snapshot: its pack's loss affects all
    with Vault.init(repo) as vault:
        for step in range(12):
            (src / "own.bin").write_bytes(os.urandom(1000))
            vault.backup(src, tags={"step": str(step)})
    packs = [p for p in Path(repo, "packs").rglob("*") if p.is_file()]
    min(packs, key=lambda p: p.stat().st_mtime_ns).unlink()  # the first backup's: shared.bin's chunk
    proc = cli("check", "--repo", repo, check=False)
    err = proc.stderr.decode().strip()
    assert proc.returncode == 30 and len(err.splitlines()) == 1, err
    assert "affecting 12 snapshot(s)" in err and "remove the damaged snapshots named above" in err, err
    assert f"with ckptvault forget --repo {repo}, after reading" in err and len(err) < 700, err
    assert proc.stdout.decode().count("affects snapshot") == 12
    listed = json.loads(cli("check", "--json", "--repo", repo, check=False).stdout)
    assert len(listed["affected"]) == 12
    # listed oldest first, as `snapshots` lists them (by ID they came in no order a reader could follow)
    oldest_first = [s["id"][:8] for s in json.loads(cli("snapshots", "--json", "--repo", repo).stdout)]
    assert [key[:8] for key in listed["affected"]] == oldest_first
    named = [line.split()[2].rstrip(":") for line in proc.stdout.decode().splitlines() if "affects snapshot" in line]
    assert named == oldest_first


def one_file_backed_up(tmp_path: Path, cli) -> tuple[str, Path]:
    """A vault (path) holding one snapshot of a folder (path) with one 50 KB random file."""
    repo = str(tmp_path / "repo")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(50_000))
    cli("init", repo)
    cli("backup", str(src), "--repo", repo)
    return repo, src


def test_a_pack_cut_short_is_healed_by_a_backup_alone_as_the_check_says(tmp_path: Path, cli):
    """The pack's line said "a backup ... stores them again", the summary "repair-index and a new backup"
    (a repair-index that does nothing for a cut pack): both now say the backup (ux43)."""
    repo, src = one_file_backed_up(tmp_path, cli)
    (pack,) = (p for p in (Path(repo) / "packs").rglob("*") if p.is_file())
    os.truncate(pack, pack.stat().st_size // 2)
    proc = cli("check", "--repo", repo, check=False)
    said, last = proc.stdout.decode(), proc.stderr.decode().strip()
    assert proc.returncode == 30 and "a backup of the files holding them stores them again" in said, said
    assert "still on disk, a new backup of them stores those chunks again" in last and "repair-index" not in last, last
    cli("backup", str(src), "--repo", repo)  # as it says, nothing else
    cli("prune", "--repo", repo)  # the pack's line: salvages its whole chunks and removes it
    assert cli("check", "--repo", repo, "--read-data").stdout.decode().startswith("no problems found")


def test_the_remedy_offers_restoring_the_files_not_named_only_where_there_are_any(tmp_path: Path, cli):
    repo, _ = one_file_backed_up(tmp_path, cli)
    (tree,) = (Path(repo) / "trees").iterdir()
    tree.write_bytes(tree.read_bytes()[:-1] + bytes([tree.read_bytes()[-1] ^ 1]))  # the whole snapshot is lost
    proc = cli("check", "--repo", repo, check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 30 and "remove the damaged snapshot(s) with: ckptvault forget" in err, err
    assert "restore the files not named" not in err


def unprivileged_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a process that file permissions apply to (root's overrides dropped): an object it
    may not read fails as an S3 403, a KMS denial or an archived object does."""
    command = [sys.executable, "-m", "ckptvault", *args]
    if os.geteuid() == 0:
        caps = "-dac_override,-dac_read_search"
        command = ["setpriv", "--bounding-set", caps, "--inh-caps", caps, *command]
    return subprocess.run(command, capture_output=True, text=True)


def test_an_unreadable_pack_is_not_damage_and_names_what_it_holds(damaged):
    """A pack the storage refuses to hand over: check names the snapshot and files that cannot be checked or
    restored until it can be read, exits as a storage failure (20), and never advises forgetting anything;
    repair-index --read-data says it could not verify it instead of reporting success."""
    vault, pack, name = damaged
    pack.chmod(0)
    for args in (("check",), ("check", "--read-data")):
        proc = unprivileged_cli(*args, "--repo", vault.url)
        assert proc.returncode == 20, proc.stderr
        assert f"pack {name}: cannot be read" in proc.stdout and "access denied" in proc.stdout
        assert f"cannot check or restore snapshot {vault.latest().short_id} until it can be read: b.bin" in proc.stdout
        assert "forget" not in proc.stderr and "damaged" not in proc.stderr, proc.stderr
        assert "1 object(s) could not be read" in proc.stderr and "1 snapshot(s) unchecked" in proc.stderr
    proc = unprivileged_cli("repair-index", "--read-data", "--repo", vault.url)
    assert proc.returncode == 20 and f"1 pack(s) could not be read (e.g. {name})" in proc.stderr, proc.stderr
    pack.chmod(0o644)
    assert Vault.open(vault.url).check(read_data=1.0).ok  # nothing was dropped meanwhile


def test_an_unreadable_tree_is_not_reported_as_a_damaged_snapshot(damaged):
    """Forgetting a snapshot whose tree merely could not be read (as check used to advise) deleted a
    healthy snapshot, and the next prune its data."""
    vault, _, _ = damaged
    snap = vault.latest()
    (Path(vault.url) / "trees" / snap.tree_id).chmod(0)
    proc = unprivileged_cli("check", "--repo", vault.url)
    assert proc.returncode == 20, proc.stderr
    assert f"cannot check or restore snapshot {snap.short_id} until it can be read: the whole snapshot" in proc.stdout
    assert "forget" not in proc.stderr and "(2 snapshots," in proc.stderr, proc.stderr


def test_a_damaged_tree_is_named_by_its_snapshot_everywhere_and_stops_only_what_needs_it(tmp_path: Path, cli):
    """Every command but check said only "tree object X is damaged", an ID no other command shows; and a
    status of any path failed outright (exit 30) instead of answering from the other snapshots."""
    repo, a, b = str(tmp_path / "repo"), tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "w.bin").write_bytes(os.urandom(50_000))
    cli("init", repo)
    cli("backup", str(a), "--repo", repo)
    cli("backup", str(b), "--repo", repo)
    newest = json.loads(cli("snapshots", "--json", "--repo", repo).stdout)[1]
    second, tree = newest["id"][:8], Path(repo) / "trees" / newest["tree_id"]
    data = bytearray(tree.read_bytes())
    data[30] ^= 1
    tree.write_bytes(bytes(data))
    for args in (["prune", "--keep-latest", "5"], ["restore", second, str(tmp_path / "out")]):
        proc = cli(*args, "--repo", repo, check=False)
        err = proc.stderr.decode()
        assert proc.returncode == 30 and f"snapshot {second}" in err, err
        assert f"ckptvault forget --repo {repo} {second}" in err, err
    assert cli("status", str(a), "--repo", repo).returncode == 0  # the intact snapshot still answers
    proc = cli("status", str(b), "--repo", repo, check=False)
    assert proc.returncode == 40 and f"the tree of snapshot(s) {second} is damaged" in proc.stdout.decode()


def test_a_missing_pack_is_healed_by_repair_index_without_reading_the_whole_vault(tmp_path: Path, cli):
    repo, src = one_file_backed_up(tmp_path, cli)
    for pack in (Path(repo) / "packs").rglob("*"):
        if pack.is_file():
            pack.unlink()
    last = cli("check", "--repo", repo, check=False).stderr.decode().strip()
    assert f"ckptvault repair-index --repo {repo} and a new backup of them store those chunks again" in last, last
    cli("repair-index", "--repo", repo)  # as it says, and no --read-data
    cli("backup", str(src), "--repo", repo)
    assert cli("check", "--repo", repo, "--read-data").stdout.decode().startswith("no problems found")


def test_check_json_advice_names_the_vault_as_the_text_does(tmp_path: Path, cli):
    """ek44 #17: the JSON detail of a damaged chunk said `ckptvault repair-index --read-data` without
    `--repo`: a script pasting it acted on the default vault."""
    repo, _ = one_file_backed_up(tmp_path, cli)
    (pack,) = [p for p in Path(repo, "packs").rglob("*") if p.is_file()]
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    text = cli("check", "--read-data", "--repo", repo, check=False).stdout.decode()
    listed = json.loads(cli("check", "--read-data", "--json", "--repo", repo, check=False).stdout)
    advice = [p["detail"] for p in listed["problems"] if "ckptvault " in p["detail"]]
    assert advice and all(f"--repo {repo}" in detail for detail in advice), listed["problems"]
    assert all(detail in text for detail in advice), text


def test_check_names_temp_files_a_killed_command_left(tmp_path: Path):
    """audit cr45: a killed prune, copy or backup leaves temp files (whole packs among them) that stay until a
    prune an hour later; check said "no problems found" without a word of them."""
    repo = tmp_path / "repo"
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(50_000))
    with Vault.init(str(repo)) as vault:
        vault.backup(src)
        pack_folder = next(p.parent for p in (repo / "packs").rglob("*") if p.is_file())
        left = pack_folder / ".tmp-0123456789abcdef"
        left.write_bytes(b"x" * 30_000)
        assert not [w for w in vault.check().warnings if "temporary" in w]  # a write in flight, for all it knows
        twenty_minutes_ago = time.time() - 1200
        os.utime(left, (twenty_minutes_ago, twenty_minutes_ago))
        report = vault.check()
        said = [w for w in report.warnings if "temporary" in w]
        assert report.ok and len(said) == 1 and said[0].startswith("1 temporary file(s) (30.00 KB)"), said


def test_every_field_of_the_check_report_is_documented():
    """`check --json` prints CheckReport's fields, and docs/usage.md sends the reader to its docstring for them."""
    import dataclasses

    from ckptvault.ops.check import CheckReport

    doc = CheckReport.__doc__ or ""
    undocumented = [f.name for f in dataclasses.fields(CheckReport) if f"``{f.name}``" not in doc]
    assert not undocumented
