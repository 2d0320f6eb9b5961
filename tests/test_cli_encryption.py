"""Encryption through the real CLI: key commands, every passphrase source, distinct exit codes."""

import json
import os
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.crypto.keyfile import Keyfile
from ckptvault.errors import UsageError

from .test_cli import one_line_error


def test_encrypted_workflow_and_key_errors(cli, tmp_path: Path):
    env = {"CKPTVAULT_PASSPHRASE": "first passphrase"}
    key = str(tmp_path / "team.key")
    made = cli("key", "generate", "--keyfile", key, "--kdf-cost", "14", **env)
    assert "fingerprint" in made.stdout.decode() and "cannot be recovered" in made.stderr.decode()
    assert "makes a guess of the passphrase 8x cheaper than the default" in made.stderr.decode()  # ek44 #9
    assert os.stat(key).st_mode & 0o777 == 0o600
    dash = cli("key", "generate", "--keyfile", "-", "--kdf-cost", "14", **env, check=False)  # ek44 #17
    assert dash.returncode == 2 and b"give its path" in dash.stderr and not (Path.cwd() / "-").exists()
    info = json.loads(cli("key", "info", "--keyfile", key, "--json").stdout)
    assert info["kdf"] == "scrypt n=2^14 r=8 p=1" and len(info["fingerprint"]) == 32

    repo = str(tmp_path / "vault")
    init = cli("init", repo, "--encrypt", "--keyfile", key, **env)
    assert "encrypted" in init.stdout.decode() and "cannot be recovered" in init.stderr.decode()
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(300_000))
    cli("backup", str(src), "--repo", repo, "--tag", "run=x", **env, CKPTVAULT_KEYFILE=key)

    pwfile = tmp_path / "pw.txt"
    pwfile.write_text("first passphrase\n")
    cli("restore", "latest", str(tmp_path / "out"), "--repo", repo, "-k", key, "--passphrase-file", str(pwfile))
    assert (tmp_path / "out" / "w.bin").read_bytes() == (src / "w.bin").read_bytes()

    short = cli("key", "passwd", "-k", key, **env, CKPTVAULT_NEW_PASSPHRASE="short", check=False)
    assert short.returncode == 2
    assert "the new passphrase (from CKPTVAULT_NEW_PASSPHRASE) is shorter than 8" in short.stderr.decode()
    changed = cli("key", "passwd", "-k", key, **env, CKPTVAULT_NEW_PASSPHRASE="second passphrase")
    assert info["fingerprint"] in changed.stdout.decode()
    # ek44 #4: it read as the fix when someone left the team; an old copy of the keyfile still opens the vault
    assert "copies of the keyfile made before still open its vaults with the old passphrase" in changed.stdout.decode()
    assert (
        cli("cat", "latest", "w.bin", "--repo", repo, "-k", key, CKPTVAULT_PASSPHRASE="second passphrase").stdout
        == (src / "w.bin").read_bytes()
    )

    cli("key", "generate", "-k", str(tmp_path / "other.key"), "--kdf-cost", "14", **env)
    (tmp_path / "corrupt.key").write_text("{not json")
    damaged = json.loads(Path(key).read_text())
    (tmp_path / "damaged.key").write_text(json.dumps({**damaged, "format": "ckptvault-keyfilf"}))
    cases = [
        (["snapshots", "--repo", repo, "-k", key], {"CKPTVAULT_PASSPHRASE": "wrong"}, 12, "wrong passphrase"),
        (["snapshots", "--repo", repo, "-k", str(tmp_path / "other.key")], env, 13, "does not belong"),
        (["snapshots", "--repo", repo, "-k", str(tmp_path / "missing.key")], env, 14, "does not exist"),
        (  # given by the environment: the message names it too
            ["snapshots", "--repo", repo],
            {**env, "CKPTVAULT_KEYFILE": str(tmp_path / "missing.key")},
            14,
            "give the right path with --keyfile (or CKPTVAULT_KEYFILE)",
        ),
        (["snapshots", "--repo", repo], env, 14, "is encrypted; give its keyfile with --keyfile or CKPTVAULT_KEYFILE"),
        (["snapshots", "--repo", repo, "-k", str(tmp_path / "corrupt.key")], env, 15, "is corrupt"),
        (["snapshots", "--repo", repo, "-k", str(tmp_path / "damaged.key")], env, 15, "is corrupt (format 'ckptva"),
        # another JSON file given for the keyfile (the vault's config): not called damage
        (["snapshots", "--repo", repo, "-k", f"{repo}/config"], env, 15, "is not a ckptvault keyfile (the wrong"),
        (["snapshots", "--repo", repo, "-k", key], {}, 16, "CKPTVAULT_PASSPHRASE, pass --passphrase-file"),
        (["init", str(tmp_path / "v2"), "--encrypt"], env, 2, "--encrypt needs --keyfile"),
        (["key", "generate", "-k", key], env, 2, "never overwritten"),
        (["key", "generate", "-k", key], {}, 2, "never overwritten"),  # not "no passphrase" first (dc47 L2)
        (
            ["snapshots", "--repo", repo, "-k", key, "--passphrase-file", f"{tmp_path}/no-pw.txt"],
            {},
            2,
            "no-pw.txt: No such file",
        ),
    ]
    for args, extra, code, fragment in cases:
        proc = cli(*args, check=False, **extra)
        assert proc.returncode == code, (args, proc.stderr)
        assert fragment in one_line_error(proc), args
    # the passphrase itself given by mistake: not written to the terminal (and so to CI logs)
    for secret in ("second passphrase", "base64/with+slash=", "long" * 100):
        mistaken = cli("snapshots", "--repo", repo, "-k", key, "--passphrase-file", secret, check=False)
        assert mistaken.returncode == 2 and secret not in one_line_error(mistaken), secret


def test_a_passphrase_piped_on_standard_input(cli, tmp_path: Path):
    """``--passphrase-file -``: from a secret manager's pipe, never in a file or the environment (it was
    taken for a file named '-')."""
    key = str(tmp_path / "team.key")
    cli("key", "generate", "--keyfile", key, "--kdf-cost", "14", "--passphrase-file", "-", input=b"piped secret\n")
    repo = str(tmp_path / "vault")
    cli("init", repo, "--encrypt", "-k", key, "--passphrase-file", "-", input=b"piped secret\n")
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(1000))
    cli("backup", str(src), "--repo", repo, "-k", key, "--passphrase-file", "-", "-q", input=b"piped secret")
    wrong = cli("snapshots", "--repo", repo, "-k", key, "--passphrase-file", "-", input=b"other secret\n", check=False)
    assert wrong.returncode == 12, wrong.stderr
    empty = cli("snapshots", "--repo", repo, "-k", key, "--passphrase-file", "-", input=b"\n", check=False)
    assert empty.returncode == 2 and "--passphrase-file -: standard input is empty" in one_line_error(empty)
    both = cli(
        "key", "passwd", "-k", key, "--passphrase-file", "-", "--new-passphrase-file", "-", input=b"x", check=False
    )
    assert both.returncode == 2 and "cannot both be '-'" in one_line_error(both)
    cli(
        "key",
        "passwd",
        "-k",
        key,
        "--new-passphrase-file",
        "-",
        input=b"new secret\n",
        CKPTVAULT_PASSPHRASE="piped secret",
    )
    listed = cli("snapshots", "--repo", repo, "-k", key, "--json", CKPTVAULT_PASSPHRASE="new secret")
    assert len(json.loads(listed.stdout)) == 1


def test_passwd_keeps_the_keyfiles_scrypt_settings_and_can_raise_its_cost(cli, tmp_path: Path):
    """passwd wrote r=8, p=1 whatever the keyfile had, and a keyfile's cost could never be raised."""
    path = str(tmp_path / "k.key")
    key, master = Keyfile.create("first passphrase", scrypt_n=2**14, scrypt_r=16, scrypt_p=2)
    key.save(path)
    env = {"CKPTVAULT_PASSPHRASE": "first passphrase", "CKPTVAULT_NEW_PASSPHRASE": "second passphrase"}
    kept_weak = cli("key", "passwd", "-k", path, **env)
    assert "2x cheaper than the default" in kept_weak.stderr.decode() and "--kdf-cost 17 raises it" in (
        kept_weak.stderr.decode()
    )
    kept = Keyfile.load(path)
    assert (kept.kdf.n, kept.kdf.r, kept.kdf.p) == (2**14, 16, 2)
    env = {"CKPTVAULT_PASSPHRASE": "second passphrase", "CKPTVAULT_NEW_PASSPHRASE": "third passphrase"}
    cli("key", "passwd", "-k", path, "--kdf-cost", "15", **env)
    raised = Keyfile.load(path)
    assert (raised.kdf.n, raised.kdf.r, raised.kdf.p) == (2**15, 16, 2)
    assert raised.unlock("third passphrase").material == master.material
    env = {"CKPTVAULT_PASSPHRASE": "third passphrase", "CKPTVAULT_NEW_PASSPHRASE": "fourth passphrase"}
    lowered = cli("key", "passwd", "-k", path, "--kdf-cost", "14", **env)
    assert "a guess gets cheaper" in lowered.stderr.decode()


def test_passwd_with_a_kdf_cost_below_the_default_says_so_as_generate_does(cli, tmp_path: Path):
    """`key generate --kdf-cost 15` warns that a guess is cheaper than the default; `key passwd --kdf-cost 15`
    wrote the same weak KDF without a word (it warned only below the keyfile's own cost, and then not
    against the default)."""
    path = str(tmp_path / "k.key")
    env = {"CKPTVAULT_PASSPHRASE": "first passphrase", "CKPTVAULT_NEW_PASSPHRASE": "second passphrase"}
    made = cli("key", "generate", "-k", path, "--kdf-cost", "15", **env)
    assert "4x cheaper than the default" in made.stderr.decode()
    kept = cli("key", "passwd", "-k", path, "--kdf-cost", "15", **env)
    assert "4x cheaper than the default" in kept.stderr.decode(), kept.stderr
    assert "a real key wants --kdf-cost 17 or more" in kept.stderr.decode(), kept.stderr
    env = {"CKPTVAULT_PASSPHRASE": "second passphrase", "CKPTVAULT_NEW_PASSPHRASE": "third passphrase"}
    lowered = cli("key", "passwd", "-k", path, "--kdf-cost", "14", **env)
    assert "a guess gets cheaper" in lowered.stderr.decode() and "8x cheaper than the default" in (
        lowered.stderr.decode()
    )
    env = {"CKPTVAULT_PASSPHRASE": "third passphrase", "CKPTVAULT_NEW_PASSPHRASE": "fourth passphrase"}
    raised = cli("key", "passwd", "-k", path, "--kdf-cost", "17", **env)
    assert "cheaper" not in raised.stderr.decode(), raised.stderr


def test_a_new_passphrase_of_spaces_is_refused(cli, tmp_path: Path):
    proc = cli(
        "key", "generate", "-k", str(tmp_path / "k.key"), "--kdf-cost", "14", CKPTVAULT_PASSPHRASE=" " * 12, check=False
    )
    assert proc.returncode == 2 and "shorter than 8 characters, not counting spaces" in proc.stderr.decode()
    assert not (tmp_path / "k.key").exists()


def test_a_new_keyfile_refuses_a_config_rolled_back_below_format_3(cli, tmp_path: Path):
    """With a key that also has an older vault, the storage could roll a format-3 config back to format 2
    with that vault's ID and verifier (which bind no settings), then set any chunker (a review's
    reproduction). A keyfile made since format 3 never had an older vault: it refuses them."""
    env = {"CKPTVAULT_PASSPHRASE": "first passphrase"}
    key = str(tmp_path / "k.key")
    cli("key", "generate", "-k", key, "--kdf-cost", "14", **env)
    assert json.loads(Path(key).read_text())["min_vault_format"] == 3
    repo = tmp_path / "vault"
    cli("init", str(repo), "--encrypt", "-k", key, **env)
    config = json.loads((repo / "config").read_text())
    other_id = "ab" * 16  # (the other vault's verifier would verify for its ID: not even read)
    tiny = {"algorithm": "fastcdc", "min_size": 64, "avg_size": 256, "max_size": 1024}
    (repo / "config").write_text(json.dumps({**config, "version": 2, "id": other_id, "chunker": tiny}))
    proc = cli("snapshots", "--repo", str(repo), "-k", key, **env, check=False)
    assert proc.returncode == 30 and "rolled back" in one_line_error(proc)
    assert "(it says what to do)" not in one_line_error(proc)  # check repeats this error: no way on
    (repo / "config").write_text(json.dumps({**config, "version": 1}))  # refused by its delta flag first (fm48 L7)
    proc = cli("snapshots", "--repo", str(repo), "-k", key, **env, check=False)
    assert proc.returncode == 30 and "it was altered or rolled back" in one_line_error(proc), proc.stderr
    cli("key", "passwd", "-k", key, **env, CKPTVAULT_NEW_PASSPHRASE="second passphrase")
    assert json.loads(Path(key).read_text())["min_vault_format"] == 3  # kept


def _at_a_terminal(args: list[str], env: dict[str, str], typed: list[bytes]) -> tuple[int, str]:
    """Run the CLI with a real terminal (a pty) as its controlling terminal; each of ``typed`` is sent
    once the output so far ends with a prompt (": "). Returns the exit status and what it printed."""
    import pty
    import select
    import sys
    import time

    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its terminal, stdin, stdout and stderr
        os.execve(sys.executable, [sys.executable, "-m", "ckptvault", *args], env)
    printed, seen = b"", b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:  # EIO: the child closed the terminal (exited)
                    break
                if not chunk:
                    break
                seen += chunk
                if typed and seen.rstrip(b" ").endswith(b":"):
                    os.write(fd, typed.pop(0))
                    printed, seen = printed + seen, b""  # the next input waits for the next prompt
    finally:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), (printed + seen).decode(errors="replace")


def test_ctrl_c_at_watchs_passphrase_prompt_cancels_it(tmp_path: Path):
    """ek44 #10: Ctrl-C at watch's prompt said "stopping after the upload in flight" and went on waiting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTVAULT_")}
    key = str(tmp_path / "team.key")
    Keyfile.create("a passphrase!", scrypt_n=2**14)[0].save(key)
    Vault.init(tmp_path / "vault", keyfile=key, passphrase="a passphrase!").close()
    (tmp_path / "out").mkdir()
    args = ["watch", str(tmp_path / "out"), "--tag", "run=w", "--repo", str(tmp_path / "vault"), "-k", key]
    code, printed = _at_a_terminal(args, env, [b"\x03"])
    assert code == 130 and "cancelled" in printed, printed
    assert "upload" not in printed and "watching" not in printed, printed


def test_ctrl_d_at_a_passphrase_prompt_is_no_passphrase_not_a_crash(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTVAULT_")}
    env["XDG_DATA_HOME"] = str(tmp_path / "xdg")
    key = str(tmp_path / "team.key")
    Keyfile.create("a passphrase!", scrypt_n=2**14)[0].save(key)
    Vault.init(tmp_path / "vault", keyfile=key, passphrase="a passphrase!").close()
    for args in (
        ["key", "generate", "--keyfile", str(tmp_path / "new.key")],
        ["key", "passwd", "--keyfile", key],
        ["snapshots", "--repo", str(tmp_path / "vault"), "--keyfile", key],
    ):
        code, printed = _at_a_terminal(args, env, [b"\x04"])
        assert code == 16, (args, printed)
        assert "no passphrase was typed (the prompt got end of input, Ctrl-D)" in printed, printed
        assert "internal error" not in printed and "Traceback" not in printed
    assert not (tmp_path / "new.key").exists()
    code, printed = _at_a_terminal(
        ["key", "generate", "--keyfile", str(tmp_path / "new.key"), "--kdf-cost", "14"],
        env,
        [b"long enough passphrase\n", b"\x04"],  # Ctrl-D at the repeat prompt
    )
    assert code == 16 and "Ctrl-D" in printed and not (tmp_path / "new.key").exists()
    before = Path(key).read_bytes()
    code, printed = _at_a_terminal(["key", "passwd", "--keyfile", key], env, [b"a passphrase!\n", b"\x04"])
    assert code == 16, printed  # Ctrl-D at the new passphrase: its own option and variable are named
    assert "give --new-passphrase-file FILE or CKPTVAULT_NEW_PASSPHRASE" in printed, printed
    assert Path(key).read_bytes() == before


def test_keyfiles_are_made_and_repassphrased_through_the_api_as_the_cli_does(tmp_path: Path):
    """The API had no way to make a keyfile but the internal Keyfile.create, which made a weaker one than
    `key generate` (no config-rollback binding, no passphrase minimum) (api audit 39 M8)."""
    import numpy as np
    import pytest

    from ckptvault import UsageError, WrongPassphraseError

    def asked_too_soon() -> str:
        raise AssertionError("the new passphrase is asked for only once the current one unlocked the key")

    path = tmp_path / "k.key"
    for short in ("seven c", "  abc   "):
        with pytest.raises(UsageError, match="the new passphrase is shorter than 8 characters"):
            Vault.generate_keyfile(path, passphrase=short, kdf_cost=14)
    with pytest.raises(UsageError, match=r"kdf_cost 13 is out of range; use 14\.\.24"):
        Vault.generate_keyfile(path, passphrase="first passphrase", kdf_cost=13)
    assert not path.exists()
    key = Vault.generate_keyfile(path, passphrase="first passphrase", kdf_cost=14)
    assert (key.path, key.kdf.n, key.min_vault_format) == (str(path), 2**14, 3)
    # a Keyfile printed into a log (a debug print, a traceback with locals) does not give out what a guess at the
    # passphrase needs (api49 #10)
    assert key.fingerprint in repr(key) and repr(key.wrapped_key) not in repr(key) and "salt" not in repr(key)
    assert json.loads(path.read_text())["min_vault_format"] == 3 and (path.stat().st_mode & 0o777) == 0o600
    with pytest.raises(UsageError, match="exists"):
        Vault.generate_keyfile(path, passphrase="other passphrase", kdf_cost=14)  # never over a key
    with Vault.init(str(tmp_path / "vault"), keyfile=path, passphrase="first passphrase") as vault:
        (tmp_path / "weights.bin").write_bytes(os.urandom(1000))
        vault.backup(tmp_path / "weights.bin")
    with pytest.raises(WrongPassphraseError):
        Vault.change_keyfile_passphrase(path, passphrase="wrong passphrase", new_passphrase=asked_too_soon)
    with pytest.raises(UsageError, match="shorter than 8"):
        Vault.change_keyfile_passphrase(path, passphrase="first passphrase", new_passphrase="short")
    with pytest.raises(UsageError, match="no new_passphrase given"):
        Vault.change_keyfile_passphrase(path, passphrase="first passphrase", new_passphrase=None)
    with pytest.raises(TypeError):  # keyword-only: swapped positions would show a passphrase as a path
        Vault.change_keyfile_passphrase(path, "first passphrase", "second passphrase")  # type: ignore[misc]
    changed = Vault.change_keyfile_passphrase(
        path, passphrase="first passphrase", new_passphrase=lambda: "second passphrase", kdf_cost=np.int64(15)
    )
    assert (changed.fingerprint, changed.kdf.n) == (key.fingerprint, 2**15)
    with Vault.open(str(tmp_path / "vault"), keyfile=str(path), passphrase="second passphrase") as vault:
        assert len(vault.snapshots()) == 1


def test_a_passphrase_without_a_keyfile_does_not_make_a_plain_vault_in_silence(cli, tmp_path: Path):
    """ek44 #2: CKPTVAULT_PASSPHRASE set and the keyfile's secret missing (a CI job): the first backup created
    the default vault unencrypted, and `init` a plain one, neither saying a word about encryption."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"TOPSECRET" * 1000)
    proc = cli("backup", str(src), check=False, CKPTVAULT_PASSPHRASE="horse battery")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "CKPTVAULT_PASSPHRASE is set but no keyfile was given" in err, err
    assert "would not be encrypted" in err and not (tmp_path / "xdg-data" / "ckptvault").exists()
    made = cli("init", str(tmp_path / "plain"), CKPTVAULT_PASSPHRASE="horse battery")
    assert "this vault is NOT encrypted" in made.stderr.decode(), made.stderr
    cli("init", "--repo", str(tmp_path / "xdg-data" / "ckptvault" / "repo"))  # made plain on purpose: then used
    done = cli("backup", str(src), CKPTVAULT_PASSPHRASE="horse battery")
    assert "snapshot" in done.stdout.decode(), done.stdout


def test_what_is_no_passphrase_or_keyfile_is_refused_without_reading_it_whole(cli, tmp_path: Path, monkeypatch):
    """ek44 #7, #8, #12: `--passphrase-file /dev/zero` (or a checkpoint, by a swapped argument) was read whole: 7 GB
    in 12 s, deaf to SIGTERM; a passphrase file given as the keyfile was "corrupt; use your backup copy"; a byte
    typed at the prompt that the terminal's encoding refuses was an internal error naming it and its place."""
    from ckptvault.cli import app as cli_app

    key = str(tmp_path / "team.key")
    (tmp_path / "pass.txt").write_text("correct horse battery\n")
    zero = cli("key", "generate", "-k", key, "--passphrase-file", "/dev/zero", check=False)
    assert zero.returncode == 2 and "/dev/zero holds more than 64 KiB" in zero.stderr.decode(), zero.stderr
    cli("key", "generate", "-k", key, "--passphrase-file", str(tmp_path / "pass.txt"))
    cli("init", str(tmp_path / "v"), "--encrypt", "-k", key, "--passphrase-file", str(tmp_path / "pass.txt"))
    swapped = cli("snapshots", "--repo", str(tmp_path / "v"), "-k", str(tmp_path / "pass.txt"),
                  "--passphrase-file", key, check=False)  # fmt: skip
    assert swapped.returncode == 15 and "is not a ckptvault keyfile (the wrong file?)" in swapped.stderr.decode()
    # review 44 #5: a keyfile saved by an editor with a byte-order mark, or as UTF-16, still loads (json reads them)
    for encoding in ("utf-8-sig", "utf-16"):
        edited = tmp_path / f"{encoding}.key"
        edited.write_bytes(Path(key).read_text().encode(encoding))
        cli(
            "snapshots",
            "--repo",
            str(tmp_path / "v"),
            "-k",
            str(edited),
            "--passphrase-file",
            str(tmp_path / "pass.txt"),
        )
    big = tmp_path / "model.safetensors"
    big.write_bytes(b"{" + b"\0" * (1 << 20))
    huge = cli("snapshots", "--repo", str(tmp_path / "v"), "-k", str(big), "--passphrase-file", key, check=False)
    assert huge.returncode == 15 and "not a ckptvault keyfile" in huge.stderr.decode(), huge.stderr

    def undecodable(prompt: str) -> str:
        raise UnicodeDecodeError("utf-8", b"caf\xe9", 3, 4, "invalid continuation byte")

    monkeypatch.setattr(cli_app.getpass, "getpass", undecodable)
    with pytest.raises(UsageError) as refused:
        cli_app.ask_passphrase("passphrase")
    assert "not valid in this terminal's encoding" in str(refused.value)
    assert "0xe9" not in str(refused.value) and "position" not in str(refused.value)
    # ek44 #11: Enter alone at the prompt ran scrypt twice, then said "wrong passphrase (or the keyfile is damaged)"
    monkeypatch.setattr(cli_app.getpass, "getpass", lambda prompt: "")
    with pytest.raises(UsageError, match=r"no passphrase was typed \(the line was empty\)"):
        cli_app.ask_passphrase("passphrase")


def _a_keyfile_and_a_plain_vault(cli, tmp_path: Path) -> tuple[dict[str, str], str, str, Path]:
    """A keyfile (and its passphrase, in env) beside a plain vault holding one snapshot (run=x) of src."""
    env = {"CKPTVAULT_PASSPHRASE": "first passphrase"}
    key = str(tmp_path / "team.key")
    cli("key", "generate", "--keyfile", key, "--kdf-cost", "14", **env)
    repo, src = str(tmp_path / "plain"), tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"w")
    cli("init", repo)
    cli("backup", str(src), "--repo", repo, "--tag", "run=x")
    return env, key, repo, src


def test_a_keyfile_given_for_a_plain_vault_is_not_used_by_readers_and_refuses_writers(cli, tmp_path: Path):
    """cli49 #8: with CKPTVAULT_KEYFILE exported for the main vault, every command on a plain mirror (snapshots,
    restore, ls, check) was refused; a command that only reads warns once and goes on, a writer is refused."""
    env, key, repo, src = _a_keyfile_and_a_plain_vault(cli, tmp_path)
    before = cli("snapshots", "--repo", repo, "--json").stdout
    env["CKPTVAULT_KEYFILE"] = key
    note = (
        f"warning: the vault at {repo} is not encrypted; the keyfile {key} (from CKPTVAULT_KEYFILE) is not used "
        "(to leave it out: env -u CKPTVAULT_KEYFILE ckptvault ...)\n"
    )
    for args in (
        ["snapshots"],
        ["ls", "latest"],
        ["cat", "latest", "w.bin"],
        ["restore", "latest", str(tmp_path / "out")],
        ["check"],
        ["stats"],
        ["forget", "latest", "--dry-run"],
        ["prune", "--keep-latest", "1", "--dry-run"],
    ):
        proc = cli(*args, "--repo", repo, **env, check=False)
        assert proc.returncode == 0 and proc.stderr.decode() == note, (args, proc.stderr)
    assert (tmp_path / "out" / "w.bin").read_bytes() == b"w"
    # rv50 M2: the commands that messages suggest leave out the keyfile that is not used (a writer refuses it)
    dry = cli("forget", "latest", "--dry-run", "--repo", repo, "--keyfile", key, **env).stdout.decode()
    assert f"their data stays until: ckptvault prune --repo {repo}\n" in dry, dry
    for args in (
        ["backup", str(src)],
        ["tag", "latest", "--add", "keep=best"],
        ["forget", "latest"],
        ["prune", "--keep-latest", "1"],
        ["watch", str(src), "--once"],
        ["ship-pins", str(src)],
        ["copy", "--from-repo", repo, "--repo", str(tmp_path / "plain2")],
    ):
        if args[0] == "copy":
            cli("init", str(tmp_path / "plain2"))
        else:
            args += ["--repo", repo]
        proc = cli(*args, **env, check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "is not encrypted but a keyfile was given" in one_line_error(proc), args
        assert "env -u CKPTVAULT_KEYFILE ckptvault ...)" in proc.stderr.decode()  # h5 #5: how, runnable
    assert cli("snapshots", "--repo", repo, "--json").stdout == before


def test_an_unused_keyfile_from_the_environment_is_named_as_such(cli, tmp_path: Path):
    """h51 #1: a reader's warning that the keyfile is not used said nothing of where it came from: one exported in
    CKPTVAULT_KEYFILE (or CKPTVAULT_FROM_KEYFILE, copy's source) is named, with how to leave it out; one given as an
    option is not, even when the variable holds the same path."""
    env, key, repo, _ = _a_keyfile_and_a_plain_vault(cli, tmp_path)
    plain = f"warning: the vault at {repo} is not encrypted; the keyfile {key} is not used\n"
    from_env = cli("snapshots", "--repo", repo, "--json", CKPTVAULT_KEYFILE=key, **env).stderr.decode()
    assert from_env == (
        f"warning: the vault at {repo} is not encrypted; the keyfile {key} (from CKPTVAULT_KEYFILE) is not used "
        "(to leave it out: env -u CKPTVAULT_KEYFILE ckptvault ...)\n"
    ), from_env
    assert cli("snapshots", "--repo", repo, "-k", key, **env).stderr.decode() == plain
    given = cli("ls", "latest", "--repo", repo, "--keyfile", key, CKPTVAULT_KEYFILE=key, **env).stderr.decode()
    assert given == plain, given  # the option was typed: the variable is not what gave it
    mirror = str(tmp_path / "mirror")
    cli("init", mirror)
    copied = cli("copy", "--from-repo", repo, "--repo", mirror, "-q", CKPTVAULT_FROM_KEYFILE=key, **env)
    assert (
        f"the keyfile {key} (from CKPTVAULT_FROM_KEYFILE) is not used "
        "(to leave it out: env -u CKPTVAULT_FROM_KEYFILE ckptvault ...)"
    ) in copied.stderr.decode(), copied.stderr
