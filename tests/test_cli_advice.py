"""The commands a message suggests name the vault the failing command was given: pasted as printed,
they act on that vault, not on the default one (walk 37 W1: a mirror's snapshots have the primary's IDs,
so a pasted `ckptvault forget ID` forgot the primary's healthy snapshot)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from ckptvault import errors
from ckptvault.cli.output import VaultNaming, name_the_vault_in_advice, with_vault_named
from ckptvault.cli.process import _OneLineHandler
from ckptvault.errors import VaultNotFoundError


def _suggested(stderr: str, command: str) -> list[str]:
    """The argv of the first ``ckptvault COMMAND ...`` the error line suggests, up to its first ')' or end."""
    found = re.search(rf"ckptvault {command}\b[^()]*?(?= \(|$)", stderr.strip().splitlines()[-1])
    assert found, stderr
    return shlex.split(found.group(0))[1:]


def test_a_pasted_suggestion_acts_on_the_vault_that_was_named_not_the_default(cli, tmp_path: Path):
    primary, mirror = tmp_path / "primary", tmp_path / "the mirror"
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(3 << 20))
    default = {"CKPTVAULT_REPO": str(primary)}  # the user's default vault, in the environment
    cli("init", str(primary), "-q", **default)
    cli("backup", str(src), "-q", **default)
    cli("init", str(mirror), "-q", **default)
    cli("copy", "--from-repo", str(primary), "--repo", str(mirror), "-q", **default)
    pack = next((mirror / "packs").glob("*/*"))
    data = bytearray(pack.read_bytes())
    data[100] ^= 0x40
    pack.write_bytes(data)

    restore = cli("restore", "latest", str(tmp_path / "out"), "--repo", str(mirror), check=False, **default)
    assert restore.returncode == 30
    advised_check = cli(*_suggested(restore.stderr.decode(), "check"), check=False, **default)
    assert advised_check.returncode == 30, advised_check.stderr  # it checked the mirror: not "no problems found"

    error = advised_check.stderr.decode()
    assert f"ckptvault repair-index --repo '{mirror}' --read-data" in error
    cli(*_suggested(error, "forget"), **default)
    assert cli("snapshots", "--repo", str(mirror), "--json").stdout.strip() == b"[]"
    assert len(cli("snapshots", "--json", **default).stdout.splitlines()) > 1  # the primary's is still there


def test_suggestions_repeat_the_vault_options_given_and_only_mention_storage_options():
    message = "the pack is damaged; run: ckptvault check --read-data, then ckptvault forget ab12"
    name_the_vault_in_advice(VaultNaming.of("s3://b/my vault", "key file", "-", ["secret=xyz"]))
    try:
        assert with_vault_named(message) == (
            "the pack is damaged; run: ckptvault check --repo 's3://b/my vault' --keyfile 'key file' "
            "--passphrase-file - --read-data, then ckptvault forget --repo 's3://b/my vault' --keyfile 'key file' "
            "--passphrase-file - ab12 (each with the same -o options)"
        )
        assert "xyz" not in with_vault_named(message)
        for unchanged in (
            "run: ckptvault check --read-data --repo SOURCE",  # names its vault itself (copy's source)
            "add --keyfile PATH (ckptvault key generate --keyfile PATH)",
            "ckptvault checks each chunk",  # prose, not a command
            "another ckptvault watch (pid 7) is already watching ./ckpts",  # another process's vault
            "nothing to suggest",
        ):
            assert with_vault_named(unchanged) == unchanged
        # docs audit dc47 M1: pasted, "ckptvault init URL" made a plain vault, or one on AWS, not at the endpoint
        assert with_vault_named("no vault at s3://b/x; create one with: ckptvault init s3://b/x") == (
            "no vault at s3://b/x; create one with: ckptvault init s3://b/x --encrypt --keyfile 'key file' "
            "--passphrase-file - (each with the same -o options)"
        )
        # docs audit doc55: the URL of an init in parentheses took the ')' with it, and the options came after it
        assert with_vault_named("copy into another one (create it with: ckptvault init URL)") == (
            "copy into another one (create it with: ckptvault init URL --encrypt --keyfile 'key file' "
            "--passphrase-file -) (each with the same -o options)"
        )
    finally:
        name_the_vault_in_advice(VaultNaming())
    assert with_vault_named(message) == message  # the default vault: nothing to add
    plain = VaultNaming.of("./v", None, None, None)
    assert plain.named("create one with: ckptvault init ./v") == "create one with: ckptvault init ./v"
    # a URL's password and query string (options that may be secrets) are left out, and said to be
    secret = VaultNaming.of("s3://u:pw@b/v?secret=xyz", None, None, None)
    assert secret.named("run: ckptvault check") == (
        "run: ckptvault check --repo s3://u@b/v (each with the --repo URL as you gave it, credentials and all)"
    )
    malformed = VaultNaming.of("sftp://u:pw@[::1/x?k=v", None, None, None)  # raised ValueError: a traceback
    assert "pw" not in malformed.named("run: ckptvault check") and "k=v" not in malformed.options


def test_the_librarys_warnings_name_the_vault_too(capsys: pytest.CaptureFixture[str]):
    said = "run: ckptvault repair-index"
    record = logging.LogRecord("ckptvault.damage", logging.WARNING, __file__, 1, said, (), None)
    name_the_vault_in_advice(VaultNaming.of("./v", None, None, None))
    try:
        _OneLineHandler().emit(record)
    finally:
        name_the_vault_in_advice(VaultNaming())
    assert capsys.readouterr().err == "warning: run: ckptvault repair-index --repo ./v\n"


def _primary_and_mirror(cli, tmp_path: Path) -> tuple[Path, Path]:
    """A vault holding one snapshot, and an empty one to copy it into."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(100_000))
    cli("init", str(primary), "-q")
    cli("backup", str(src), "--repo", str(primary), "-q")
    cli("init", str(mirror), "-q")
    return primary, mirror


def test_copy_names_the_source_in_advice_about_it_never_the_destination(cli, tmp_path: Path):
    """copy's --repo is the destination: a damaged snapshot object in the source was said with
    'ckptvault forget --repo DEST ID', which forgets the destination's good copy of it."""
    primary, mirror = _primary_and_mirror(cli, tmp_path)
    cli("copy", "--from-repo", str(primary), "--repo", str(mirror), "-q")
    (snapshot_object,) = (primary / "snapshots").iterdir()
    data = bytearray(snapshot_object.read_bytes())
    data[len(data) // 2] ^= 0x40
    snapshot_object.write_bytes(data)
    again = cli("copy", "--from-repo", str(primary), "--repo", str(mirror), check=False)
    said = again.stderr.decode()
    assert f"ckptvault forget --repo {primary} {snapshot_object.name[:12]}" in said, said
    assert f"--repo {mirror}" not in said, said
    gone = cli("copy", "--from-repo", str(tmp_path / "nowhere"), "--repo", str(mirror), check=False)
    assert f"--repo {mirror}" not in gone.stderr.decode()


def test_copy_names_the_locked_vault_in_its_unlock_advice(cli, tmp_path: Path):
    """A copy into (or out of) a vault a prune holds said 'ckptvault unlock --remove-all removes it now':
    pasted, it removed the default vault's locks, live ones included, and left the locked one as it was."""
    from ckptvault import Vault

    @contextlib.contextmanager
    def held_elsewhere(url: Path) -> Iterator[None]:
        """An exclusive lock of another host's prune (one of this host's names no unlock: it is running)."""
        with Vault.open(str(url)) as holder:
            locks = holder._repo.locks
            info = replace(locks.new_info(exclusive=True), hostname="prune-box", pid_table="other-boot/1")
            locks.put(info)
            try:
                yield
            finally:
                locks.remove(info)

    primary, mirror = _primary_and_mirror(cli, tmp_path)
    twin = tmp_path / "primaryx"  # a URL that begins with the other's: only the locked one may be named
    cli("init", str(twin), "-q")
    with held_elsewhere(twin):
        copy = cli("copy", "--from-repo", str(primary), "--repo", str(twin), "--retry-lock", "0", check=False)
    assert f"ckptvault unlock --repo {twin} --remove-all" in copy.stderr.decode(), copy.stderr
    for locked, other in ((mirror, primary), (primary, mirror)):
        with held_elsewhere(locked):
            copy = cli("copy", "--from-repo", str(primary), "--repo", str(mirror), "--retry-lock", "0", check=False)
        said = copy.stderr.decode()
        assert copy.returncode == 11 and f"vault {locked} is locked" in said, said
        assert f"ckptvault unlock --repo {locked} removes it then" in said, said
        assert f"ckptvault unlock --repo {locked} --remove-all removes it now" in said, said
        assert f"--repo {other}" not in said, said


@pytest.mark.parametrize("url", ["./ckpt.", "s3://b/run)", "s3://b/x,", "/data/my vault", "/data/it's", "./v"])
def test_a_suggested_init_names_any_url_exactly_with_the_vault_options_after_it(monkeypatch, url: str):
    """The URL of a suggested init lost a last ')' or '.' of its own to the options put after it (they went
    where the sentence's punctuation would be), and one with a space was two words."""
    monkeypatch.setattr(errors, "_command_line", True)  # as the CLI words it: a command line to paste
    naming = VaultNaming.of(url, "key file", None, None)
    told = naming.named(str(VaultNotFoundError(url))).partition("create one with: ")[2]
    assert shlex.split(told) == ["ckptvault", "init", url, "--encrypt", "--keyfile", "key file"], told
    if url == "./v":
        assert told.startswith("ckptvault init ./v "), told  # the common case stays unquoted
