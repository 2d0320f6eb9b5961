"""Keyfiles in the ways teams keep them: piped in, mounted secrets with newlines, links to a shared
copy, damaged parameters, foreign encodings, folders that cannot be written, two writers at once."""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from ckptvault.crypto import keyfile as keyfile_module
from ckptvault.crypto.keyfile import NONCE_SIZE, WRAP_AAD, KdfParams, Keyfile
from ckptvault.crypto.keys import MasterKey
from ckptvault.errors import KeyfileCorruptError, UsageError, WrongPassphraseError

from .support.tmpfs import mounted_tmpfs
from .test_cli import one_line_error

PASS = "correct horse battery"


@pytest.fixture
def vault(cli, tmp_path: Path) -> tuple[str, str]:
    key, repo = str(tmp_path / "team.key"), str(tmp_path / "vault")
    cli("key", "generate", "-k", key, "--kdf-cost", "14", CKPTVAULT_PASSPHRASE=PASS)
    cli("init", repo, "--encrypt", "-k", key, CKPTVAULT_PASSPHRASE=PASS)
    return key, repo


def test_a_keyfile_piped_in_opens_with_the_passphrase_in_the_environment(cli, vault, tmp_path: Path):
    # the head start on scrypt read the pipe first and left the command nothing: "keyfile is corrupt"
    key, repo = vault
    env = {**os.environ, "CKPTVAULT_PASSPHRASE": PASS, "XDG_DATA_HOME": str(tmp_path / "xdg")}
    proc = subprocess.run(
        ["bash", "-c", f'"{sys.executable}" -m ckptvault snapshots --repo "{repo}" --keyfile <(cat "{key}")'],
        env=env,
        capture_output=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert b"no snapshots" in proc.stdout


def test_a_keyfile_that_is_a_fifo_is_refused_not_waited_on(cli, vault, tmp_path: Path):
    """A --keyfile naming a FIFO (mkfifo) waited in open() for a writer, then for the writer's end: `key info`
    and every command of an encrypted vault hung until killed. It is refused at once as not a regular file
    (exit 14, as a directory is); a pipe given as --keyfile <(...) still opens (the test above)."""
    _, repo = vault
    fifo = tmp_path / "team.fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.key"
    link.symlink_to(fifo)
    env = {**os.environ, "CKPTVAULT_PASSPHRASE": PASS, "XDG_DATA_HOME": str(tmp_path / "xdg")}
    for path in (fifo, link):
        for args in (["key", "info"], ["snapshots", "--repo", repo]):
            proc = subprocess.run(
                [sys.executable, "-m", "ckptvault", *args, "-k", str(path)],
                env=env,
                capture_output=True,
                stdin=subprocess.DEVNULL,
                timeout=60,  # it hung for good
            )
            assert proc.returncode == 14, proc.stderr
            assert f"keyfile {path} is not a regular file (a FIFO" in one_line_error(proc)


def test_a_secret_with_a_trailing_newline_is_the_same_from_a_file_and_the_environment(cli, tmp_path: Path):
    secret = tmp_path / "secret.txt"
    secret.write_text("team-secret\n")  # as a mounted Kubernetes secret holds it
    key = str(tmp_path / "k.key")
    cli("key", "generate", "-k", key, "--kdf-cost", "14", "--passphrase-file", str(secret))
    for value in ("team-secret\n", "team-secret", "team-secret\r\n"):
        cli("init", str(tmp_path / f"v{len(value)}"), "--encrypt", "-k", key, CKPTVAULT_PASSPHRASE=value)


def test_a_keyfile_made_from_a_passphrase_ending_in_a_newline_still_opens():
    # before passphrases lost their trailing newline, one from the environment kept it in the key
    master = MasterKey.generate()
    kdf = KdfParams(n=2**14, salt=secrets.token_bytes(16))
    nonce = secrets.token_bytes(NONCE_SIZE)
    wrapped = nonce + AESGCM(kdf.derive(b"team-secret\n")).encrypt(nonce, master.material, WRAP_AAD)
    legacy = Keyfile(kdf=kdf, wrapped_key=wrapped, fingerprint=master.fingerprint, created="2026-11-01")
    assert legacy.unlock("team-secret\n").material == master.material  # the same environment variable
    assert legacy.unlock("team-secret").material == master.material  # the file that held it


def test_a_passphrase_that_is_not_utf8_works_from_the_environment_and_a_file(cli, tmp_path: Path):
    raw = b"caf\xe9-latin1-secret"  # no traceback, and no byte of it in any message
    key, repo = str(tmp_path / "k.key"), str(tmp_path / "v")
    env = {**os.environb, b"XDG_DATA_HOME": str(tmp_path / "xdg").encode(), b"CKPTVAULT_PASSPHRASE": raw}
    run = [sys.executable, "-m", "ckptvault"]
    made = subprocess.run([*run, "key", "generate", "-k", key, "--kdf-cost", "14"], env=env, capture_output=True)
    assert made.returncode == 0, made.stderr
    (tmp_path / "pw").write_bytes(raw + b"\n")
    cli("init", repo, "--encrypt", "-k", key, "--passphrase-file", str(tmp_path / "pw"))
    wrong = subprocess.run(
        [*run, "snapshots", "--repo", repo, "-k", key],
        env={**env, b"CKPTVAULT_PASSPHRASE": b"caf\xe8-latin1-secret"},
        capture_output=True,
    )
    assert wrong.returncode == 12 and b"\xe8" not in wrong.stderr and "wrong passphrase" in one_line_error(wrong)


def test_a_keyfile_of_a_newer_version_is_refused_as_newer_not_called_corrupt(cli, vault, tmp_path: Path):
    """ "corrupt; use your backup copy of the keyfile" sent a user of an older ckptvault to a copy that is no
    different (fm48 M3): the format's promise is a clear refusal, exit 17."""
    key, repo = vault
    doc = json.loads(Path(key).read_text())
    doc["version"] = 2
    newer = tmp_path / "newer.key"
    newer.write_text(json.dumps(doc))
    proc = cli("snapshots", "--repo", repo, "-k", str(newer), check=False, CKPTVAULT_PASSPHRASE=PASS)
    assert proc.returncode == 17, proc.stderr
    assert one_line_error(proc) == (
        f"error: keyfile {newer} is of version 2, newer than this ckptvault reads (up to 1); "
        "upgrade ckptvault: pip install -U ckptvault"
    )


@pytest.mark.parametrize(
    "field, value",
    [("n", 3), ("n", 0), ("n", -4), ("n", 1e400), ("n", 2**40), ("r", -1), ("p", 0), ("salt", ""), ("n", "16384")],
)
def test_damaged_scrypt_parameters_are_a_corrupt_keyfile(cli, vault, tmp_path: Path, field, value):
    key, repo = vault
    doc = json.loads(Path(key).read_text())
    doc["kdf"][field] = value
    bad = tmp_path / "bad.key"
    bad.write_text(json.dumps(doc))
    proc = cli("snapshots", "--repo", repo, "-k", str(bad), check=False, CKPTVAULT_PASSPHRASE=PASS)
    assert proc.returncode == 15, proc.stderr
    assert "is corrupt" in one_line_error(proc)


def test_passwd_through_a_link_changes_the_shared_keyfile_and_keeps_its_mode(cli, vault, tmp_path: Path):
    key, repo = vault
    shared = tmp_path / "secrets" / "team.key"
    shared.parent.mkdir()
    os.replace(key, shared)
    os.chmod(shared, 0o644)  # readable by the team's group, and (by mistake) by everyone
    os.symlink(shared, key)
    cli("key", "passwd", "-k", key, CKPTVAULT_PASSPHRASE=PASS, CKPTVAULT_NEW_PASSPHRASE="a new passphrase")
    assert os.path.islink(key)
    assert os.stat(shared).st_mode & 0o777 == 0o640, "the group keeps it, others lose it"
    cli("snapshots", "--repo", repo, "-k", str(shared), CKPTVAULT_PASSPHRASE="a new passphrase")
    assert not [p for p in shared.parent.iterdir() if p.name != "team.key"], "a temporary file was left"


_SAVE_AND_HANG_BEFORE_THE_RENAME = """
import sys, time
from ckptvault.crypto import keyfile

def hang(tmp, path, overwrite):  # the new keyfile is written and synced under its temporary name
    print("written", flush=True)
    time.sleep(120)

keyfile._publish = hang
keyfile.Keyfile.create("the passphrase being set", scrypt_n=2**10)[0].save(sys.argv[1], overwrite=True)
"""


def test_a_keyfile_left_by_a_killed_writer_is_removed_by_the_next_one_and_a_live_ones_is_not(cli, tmp_path: Path):
    """A `key passwd` killed between writing the new keyfile and renaming it left `.team.key.tmp-*`: the
    master key under the passphrase being set, which a later rotation away from it never revoked."""
    key, _ = Keyfile.create(PASS, scrypt_n=2**10)
    target = tmp_path / "team.key"
    key.save(target)

    def writer() -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SAVE_AND_HANG_BEFORE_THE_RENAME, str(target)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline() == "written\n"
        return proc

    def temps() -> list[str]:
        return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".team.key.tmp-"))

    killed, live = writer(), writer()
    try:
        killed.kill()
        killed.wait(30)
        assert len(temps()) == 2
        cli("key", "passwd", "-k", str(target), CKPTVAULT_PASSPHRASE=PASS, CKPTVAULT_NEW_PASSPHRASE="a new passphrase")
        assert len(temps()) == 1, "the killed writer's copy stays, or the live writer's went"
    finally:
        live.kill()
        live.wait(30)
    just_made = tmp_path / ".team.key.tmp-0123abcd"
    just_made.touch()  # a writer that has not locked it yet: empty, no key in it
    key.save(target, overwrite=True)
    assert temps() == [just_made.name]
    assert Keyfile.load(target).unlock(PASS).material == key.unlock(PASS).material


def test_an_empty_keyfile_temp_of_a_writer_killed_before_writing_is_removed_by_the_next_one(tmp_path: Path):
    """A `key passwd` SIGKILLed right after making its temporary file (tests/support/killcli.py) left an empty
    `.team.key.tmp-*` that every later writer took for a live writer's, not locked yet: it stayed for good.
    Once it is older than a live writer's can be, the next writer removes it; a new one still stays."""
    key, _ = Keyfile.create(PASS, scrypt_n=2**10)
    target = tmp_path / "team.key"
    key.save(target)
    env = {
        **os.environ,
        "XDG_DATA_HOME": str(tmp_path / "xdg"),
        "CKPTVAULT_PASSPHRASE": PASS,
        "CKPTVAULT_NEW_PASSPHRASE": "a new passphrase",
        "KILLCLI_MATCH": "open " + str(tmp_path / ".team.key.tmp-"),
        "KILLCLI_AT": "1",
    }
    run = [sys.executable, "-m", "tests.support.killcli", "key", "passwd", "-k", str(target), "--kdf-cost", "14"]
    killed = subprocess.run(run, env=env, capture_output=True, cwd=Path(__file__).parent.parent, timeout=120)
    assert killed.returncode == -9, killed.stderr
    (left,) = tmp_path.glob(".team.key.tmp-*")
    assert left.stat().st_size == 0 and Keyfile.load(target).unlock(PASS)  # the old keyfile, untouched
    long_ago = time.time() - 3600  # past EMPTY_TEMP_GRACE_S
    os.utime(left, (long_ago, long_ago))
    just_made = tmp_path / ".team.key.tmp-0123abcd"
    just_made.touch()  # a live writer's that has not locked it yet
    rerun = subprocess.run([*run[:1], "-m", "ckptvault", *run[3:]], env=env, capture_output=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(p.name for p in tmp_path.glob(".team.key.tmp-*")) == [just_made.name]
    assert Keyfile.load(target).unlock("a new passphrase")


def test_a_generate_killed_once_the_keyfile_has_its_name_leaves_no_second_name_after_its_rerun(tmp_path: Path):
    """`key generate` SIGKILLed between linking its keyfile into place and removing the temporary name left
    `.team.key.tmp-*`, a second name of the key; the rerun refused the existing name before writing anything,
    so nothing ever removed it (docs/security.md said the next generate does)."""
    target = tmp_path / "team.key"
    env = {
        **os.environ,
        "XDG_DATA_HOME": str(tmp_path / "xdg"),
        "CKPTVAULT_PASSPHRASE": PASS,
        "KILLCLI_MATCH": "unlink " + str(tmp_path / ".team.key.tmp-"),
        "KILLCLI_AT": "1",
    }
    run = [sys.executable, "-m", "tests.support.killcli", "key", "generate", "-k", str(target), "--kdf-cost", "14"]
    killed = subprocess.run(run, env=env, capture_output=True, cwd=Path(__file__).parent.parent, timeout=120)
    assert killed.returncode == -9, killed.stderr
    assert len(list(tmp_path.glob(".team.key.tmp-*"))) == 1 and Keyfile.load(target).unlock(PASS)
    rerun = subprocess.run([*run[:1], "-m", "ckptvault", *run[3:]], env=env, capture_output=True, timeout=120)
    assert rerun.returncode == 2 and b"already exists" in rerun.stderr, rerun.stderr
    assert list(tmp_path.glob(".team.key.tmp-*")) == []
    assert target.stat().st_nlink == 1 and Keyfile.load(target).unlock(PASS)


def test_a_keyfile_that_cannot_be_written_is_a_one_line_error(cli, tmp_path: Path):
    (tmp_path / "afile").write_text("x")
    proc = cli("key", "generate", "-k", str(tmp_path / "afile" / "k.key"), check=False, CKPTVAULT_PASSPHRASE=PASS)
    assert proc.returncode == 2
    assert "cannot write keyfile" in one_line_error(proc)


def test_a_keyfile_in_place_is_not_reported_as_a_failure_when_only_the_folder_sync_fails(tmp_path, monkeypatch):
    def fail(path: str) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(keyfile_module, "fsync_dir", fail)
    key, master = Keyfile.create(PASS, scrypt_n=2**14)
    saved = key.save(tmp_path / "k.key")
    assert Keyfile.load(saved.path).unlock(PASS).material == master.material


def test_a_keyfile_that_appears_while_another_is_written_is_not_overwritten(tmp_path, monkeypatch):
    # two `key generate` at once: the existence check passes for both; the second must not replace the first
    target = tmp_path / "team.key"
    first, _ = Keyfile.create(PASS, scrypt_n=2**14)
    second, _ = Keyfile.create(PASS, scrypt_n=2**14)
    real_exists, real_lexists = os.path.exists, os.path.lexists
    first.save(target)

    def not_yet(real):  # the second writer's check ran before the first writer's keyfile landed
        return lambda path: False if os.fspath(path) == str(target) else real(path)

    monkeypatch.setattr(keyfile_module.os.path, "exists", not_yet(real_exists))
    monkeypatch.setattr(keyfile_module.os.path, "lexists", not_yet(real_lexists))
    with pytest.raises(UsageError, match="already exists"):
        second.save(target)
    monkeypatch.undo()
    assert Keyfile.load(target).fingerprint == first.fingerprint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["team.key"]


def test_an_empty_passphrase_variable_says_so(cli, vault):
    key, repo = vault
    proc = cli("snapshots", "--repo", repo, "-k", key, check=False, CKPTVAULT_PASSPHRASE="")
    assert proc.returncode == 2
    assert "CKPTVAULT_PASSPHRASE is set but empty" in one_line_error(proc)


def test_an_empty_passphrase_file_or_keyfile_path_says_so(cli, vault, tmp_path):
    key, repo = vault
    (tmp_path / "empty").write_text("\n")
    proc = cli("snapshots", "--repo", repo, "-k", key, "--passphrase-file", str(tmp_path / "empty"), check=False)
    assert proc.returncode == 2 and f"--passphrase-file {tmp_path / 'empty'} is empty" in one_line_error(proc)
    for command in ("generate", "passwd", "info"):
        proc = cli("key", command, "--keyfile", "", check=False, CKPTVAULT_PASSPHRASE=PASS)
        assert proc.returncode == 2 and "--keyfile is empty" in one_line_error(proc), command


def test_a_keyfile_is_made_only_with_parameters_it_can_be_loaded_with(tmp_path):
    with pytest.raises(UsageError, match="at most 2"):
        Keyfile.create(PASS, scrypt_n=2**25)


def test_a_filesystem_without_hard_links_still_gets_its_keyfile(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(38, "Function not implemented")  # ENOSYS, as a FUSE filesystem answers

    monkeypatch.setattr(keyfile_module.os, "link", no_links)
    key, master = Keyfile.create(PASS, scrypt_n=2**14)
    saved = key.save(tmp_path / "k.key")
    assert Keyfile.load(saved.path).unlock(PASS).material == master.material
    with pytest.raises(UsageError, match="already exists"):
        key.save(tmp_path / "k.key")


@pytest.mark.parametrize("field", ["wrapped_key", "salt"])
def test_a_damaged_wrapped_key_or_salt_names_a_damaged_keyfile_too(cli, vault, tmp_path: Path, field: str):
    # the unwrap cannot tell them from a wrong passphrase: the message names both, and the remedy
    key, _ = Keyfile.create(PASS, scrypt_n=2**10)
    path = tmp_path / "k.key"
    key.save(path)
    doc = json.loads(path.read_text())
    holder = doc if field in doc else doc["kdf"]
    text = holder[field]
    holder[field] = ("B" if text[0] != "B" else "C") + text[1:]
    path.write_text(json.dumps(doc))
    proc = cli("init", str(tmp_path / "v"), "--encrypt", "--keyfile", str(path), check=False, CKPTVAULT_PASSPHRASE=PASS)
    error = one_line_error(proc)
    assert proc.returncode == 12 and "or the keyfile is damaged" in error and "backup copy" in error, error


def test_a_keyfile_on_a_full_disk_is_exit_21_and_the_old_one_stays(cli, tmp_path: Path):
    with mounted_tmpfs(tmp_path / "mnt", "256k", "the full keyfile disk test") as mount:
        cli(
            "key",
            "generate",
            "--keyfile",
            str(mount / "team.key"),
            "--kdf-cost",
            "14",
            CKPTVAULT_PASSPHRASE="passphrase1",
        )
        before = (mount / "team.key").read_bytes()
        with open(mount / "filler", "wb", buffering=0) as filler, pytest.raises(OSError):
            while True:
                filler.write(b"\0" * 4096)
        passwd = cli("key", "passwd", "--keyfile", str(mount / "team.key"), check=False,
                     CKPTVAULT_PASSPHRASE="passphrase1", CKPTVAULT_NEW_PASSPHRASE="passphrase2")  # fmt: skip
        err = passwd.stderr.decode()
        assert passwd.returncode == 21 and "no space left" in err and "nothing was changed" in err, err
        assert (mount / "team.key").read_bytes() == before


def test_a_keyfile_is_synced_before_it_takes_its_name(tmp_path, monkeypatch):
    """A power loss after the rename must not leave the keyfile's name on a file whose bytes never reached
    the disk: the only copy of the master key."""
    events: list[str] = []
    real_fsync, real_publish = os.fsync, keyfile_module._publish
    monkeypatch.setattr(keyfile_module.os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(keyfile_module, "_publish", lambda *args: (events.append("publish"), real_publish(*args))[1])
    key, master = Keyfile.create(PASS, scrypt_n=2**14)
    key.save(tmp_path / "k.key")
    monkeypatch.undo()
    assert events[:2] == ["fsync", "publish"], events
    assert Keyfile.load(tmp_path / "k.key").unlock(PASS).material == master.material


def test_a_keyfile_whose_fingerprint_does_not_match_its_key_is_damaged(tmp_path):
    key, _ = Keyfile.create(PASS, scrypt_n=2**10)
    doc = json.loads(key.to_json())
    doc["fingerprint"] = "0" * len(doc["fingerprint"])
    with pytest.raises(KeyfileCorruptError, match="fingerprint does not match"):
        Keyfile.from_json(json.dumps(doc).encode()).unlock(PASS)


def test_only_line_ends_are_dropped_from_a_passphrase_not_spaces():
    key, master = Keyfile.create(PASS + " ", scrypt_n=2**10)
    assert key.unlock(PASS + " \n").material == master.material  # a file's newline
    with pytest.raises(WrongPassphraseError):
        key.unlock(PASS)


def test_a_keyfile_is_wrapped_under_the_scrypt_parameters_it_records():
    """Another tool (or a later ckptvault) must unwrap the key from the file alone: a key derived with other
    parameters than the ones written (r=8, p=1 whatever the file says) still opens in this ckptvault, whose
    create and unlock make the same mistake, and nowhere else. The known-answer keyfile has r=8, p=1."""
    key, master = Keyfile.create(PASS, scrypt_n=2**10, scrypt_r=4, scrypt_p=3)
    doc = json.loads(key.to_json())
    kdf, wrapped = doc["kdf"], base64.b64decode(doc["wrapped_key"])
    assert (kdf["n"], kdf["r"], kdf["p"]) == (2**10, 4, 3)
    salt = base64.b64decode(kdf["salt"])
    kek = Scrypt(salt=salt, length=32, n=kdf["n"], r=kdf["r"], p=kdf["p"]).derive(PASS.encode())
    assert AESGCM(kek).decrypt(wrapped[:NONCE_SIZE], wrapped[NONCE_SIZE:], WRAP_AAD) == master.material


def run_in_4_gib(*args: str) -> subprocess.CompletedProcess:
    """The CLI with its address space capped at 4 GiB: a machine smaller than a keyfile's scrypt asks for."""
    import resource

    def capped() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTVAULT_")}
    return subprocess.run(
        [sys.executable, "-m", "ckptvault", *args],
        capture_output=True,
        env={**env, "CKPTVAULT_PASSPHRASE": PASS},
        stdin=subprocess.DEVNULL,
        preexec_fn=capped,
        timeout=300,
    )


def test_a_keyfile_whose_scrypt_needs_more_memory_than_the_machine_gives_is_a_one_line_error(vault, tmp_path: Path):
    """A keyfile made with a high --kdf-cost on a big machine, unlocked on a small one: scrypt's failure to get
    its memory was an internal error with a traceback. The keyfile asks for 16 GiB."""
    key, repo = vault
    doc = json.loads(Path(key).read_text())
    doc["kdf"]["n"] = 2**24
    big = tmp_path / "big.key"
    big.write_text(json.dumps(doc))
    proc = run_in_4_gib("snapshots", "--repo", repo, "-k", str(big))
    assert proc.returncode == 2, proc.stderr
    message = one_line_error(proc)
    assert "scrypt setting (N=2^24, r=8, p=1) needs 16.0 GiB of memory" in message
    assert "ckptvault key passwd --keyfile KEYFILE --kdf-cost 17" in message


def test_a_keyfile_that_needs_more_memory_than_the_machine_gives_is_not_made(tmp_path: Path):
    key = tmp_path / "big.key"
    proc = run_in_4_gib("key", "generate", "-k", str(key), "--kdf-cost", "24")
    assert proc.returncode == 2, proc.stderr
    assert "needs 16.0 GiB of memory to unlock" in one_line_error(proc) and "lower --kdf-cost" in one_line_error(proc)
    assert not key.exists()


@pytest.mark.parametrize("n, r, p", [(2**24, 64, 64), (2**24, 64, 1), (2**24, 8, 2), (2**20, 8, 64), (2**17, 64, 64)])
def test_a_keyfile_asking_scrypt_for_more_than_ckptvault_ever_makes_is_corrupt_not_run(n, r, p):
    """r and p were taken up to 64 each: N=2^24, r=64, p=64 asked 128 GiB and 65,536 times the default work (hours
    per unlock, twice for a wrong passphrase), before the vault's fingerprint was even compared."""
    key, _ = Keyfile.create(PASS, scrypt_n=2**10)
    doc = json.loads(key.to_json())
    doc["kdf"].update(n=n, r=r, p=p)
    with pytest.raises(KeyfileCorruptError, match="out of range"):
        Keyfile.from_json(json.dumps(doc).encode(), "crafted.key")
    with pytest.raises(UsageError, match="out of range"):  # nor made so: refused before scrypt runs
        Keyfile.create(PASS, scrypt_n=n, scrypt_r=r, scrypt_p=p)


@pytest.mark.parametrize("n, r, p", [(2**24, 8, 1), (2**17, 8, 1), (2**14, 16, 4), (2**10, 1, 64)])
def test_every_scrypt_setting_ckptvault_makes_still_loads(n, r, p):
    key, _ = Keyfile.create(PASS, scrypt_n=2**10)
    doc = json.loads(key.to_json())
    doc["kdf"].update(n=n, r=r, p=p)
    assert Keyfile.from_json(json.dumps(doc).encode()).kdf == KdfParams(n=n, r=r, p=p, salt=key.kdf.salt)


@pytest.mark.parametrize(
    ("damage", "code", "said"),
    [
        (lambda f: "g" + f[1:], 15, "is not 32 lowercase hex digits"),  # no longer hex: the field is damaged
        (lambda f: f[:5] + ("0" if f[5] != "0" else "1") + f[6:], 15, "its fingerprint does not match its key"),
        (lambda f: f[:31], 15, "is not 32 lowercase hex digits"),  # a digit cut off
    ],
    ids=["not-hex", "one-digit-changed", "cut"],
)
def test_a_keyfile_whose_fingerprint_field_is_damaged_is_called_corrupt_not_another_vaults(
    cli, vault, tmp_path: Path, damage, code: int, said: str
):
    """A flipped byte in the keyfile's fingerprint read as "keyfile ... does not belong to vault" (exit 13): the
    user went looking for another keyfile, with the right one in hand. A fingerprint that is not 32 hex digits
    is damage; one a digit or few off the vault's is the vault's key with its field damaged (the key says so)."""
    key, repo = vault
    doc = json.loads(Path(key).read_bytes())
    doc["fingerprint"] = damage(doc["fingerprint"])
    damaged = tmp_path / "damaged.key"
    damaged.write_text(json.dumps(doc))
    proc = cli("snapshots", "--repo", repo, "-k", str(damaged), check=False, CKPTVAULT_PASSPHRASE=PASS)
    error = one_line_error(proc)
    assert proc.returncode == code and said in error and "corrupt" in error, error
    assert "does not belong" not in error, error


def test_another_vaults_keyfile_is_still_another_vaults_and_a_damaged_config_fingerprint_is_the_configs(
    cli, vault, tmp_path: Path
):
    key, repo = vault
    other = str(tmp_path / "other.key")
    cli("key", "generate", "-k", other, "--kdf-cost", "14", CKPTVAULT_PASSPHRASE=PASS)
    proc = cli("snapshots", "--repo", repo, "-k", other, check=False, CKPTVAULT_PASSPHRASE=PASS)
    assert proc.returncode == 13 and "does not belong to vault" in one_line_error(proc)
    config = Path(repo) / "config"
    doc = json.loads(config.read_bytes())
    fingerprint = doc["encryption"]["key_fingerprint"]
    doc["encryption"]["key_fingerprint"] = fingerprint[:-1] + ("0" if fingerprint[-1] != "0" else "1")
    config.write_text(json.dumps(doc))
    proc = cli("snapshots", "--repo", repo, "-k", key, check=False, CKPTVAULT_PASSPHRASE=PASS)
    error = one_line_error(proc)
    assert proc.returncode == 30 and f"the config of {repo}" in error and "put the config back" in error, error


@pytest.mark.parametrize(
    "damage",
    [
        lambda f: f[:-1] + "g",  # a flipped bit makes most hex digits a character that is no hex digit
        lambda f: f[:-1] + "A",  # a bit flipped in a letter's case
        lambda f: f[:-1],  # a digit cut off
    ],
    ids=["not-hex", "upper-case", "cut"],
)
def test_a_config_fingerprint_that_is_no_fingerprint_is_the_configs_damage_not_another_vaults_keyfile(
    cli, vault, damage
):
    """The config's fingerprint damaged into something that is no fingerprint (not 32 lowercase hex digits) read
    as "keyfile ... does not belong to vault" (exit 13), sending the user to look for another keyfile: the
    config is what is damaged (exit 30), whichever keyfile is given."""
    key, repo = vault
    config = Path(repo) / "config"
    doc = json.loads(config.read_bytes())
    doc["encryption"]["key_fingerprint"] = damage(doc["encryption"]["key_fingerprint"])
    config.write_text(json.dumps(doc))
    proc = cli("snapshots", "--repo", repo, "-k", key, check=False, CKPTVAULT_PASSPHRASE=PASS)
    error = one_line_error(proc)
    assert proc.returncode == 30 and f"the config of {repo}" in error and "put the config back" in error, error
    assert "does not belong" not in error, error
