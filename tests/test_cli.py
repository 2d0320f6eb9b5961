"""The CLI end to end through real subprocesses, including the README's commands."""

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckptvault.ops.sample import write_sample_checkpoint
from tests.conftest import one_file_vault


def one_line_error(proc) -> str:
    err = proc.stderr.decode()
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


def test_version(cli):
    from ckptvault import __version__

    assert cli("--version").stdout.decode().strip() == f"ckptvault {__version__}"


def test_readme_workflow(cli, tmp_path: Path):
    ckpt = tmp_path / "checkpoints"
    write_sample_checkpoint(str(ckpt), 1200, layer_bytes=1 << 18)
    (ckpt / "model").mkdir()
    (ckpt / "model" / "config.json").write_text('{"hidden": 64}')

    first = cli("backup", str(ckpt), "--tag", "run=x", "--tag", "step=1200", "--description", "after epoch 3")
    err = first.stderr.decode()
    assert "created a new vault at" in err and str(tmp_path / "xdg-data") in err
    line = first.stdout.decode()
    assert line.startswith("snapshot ") and "files" in line and "new" in line and "dedup" in line

    snaps = json.loads(cli("snapshots", "--json").stdout)
    assert len(snaps) == 1
    snap = snaps[0]
    assert snap["tags"] == {"run": "x", "step": "1200"} and snap["description"] == "after epoch 3"
    assert "created a new vault" not in cli("snapshots").stderr.decode()  # only on first use

    table = cli("snapshots", "--tag", "run=x").stdout.decode()
    assert snap["id"][:8] in table and "after epoch 3" in table
    assert json.loads(cli("snapshots", "--json", "--tag", "run=other").stdout) == []

    listing = cli("ls", snap["id"][:8]).stdout.decode()
    assert "model/config.json" in listing and "model.safetensors" in listing
    entries = json.loads(cli("ls", "latest", "--tag", "run=x", "--json").stdout)["entries"]
    sizes = {e["path"]: e["size"] for e in entries}
    assert sizes["model.safetensors"] == (ckpt / "model.safetensors").stat().st_size

    assert cli("cat", snap["id"][:10], "model/config.json").stdout == b'{"hidden": 64}'

    out = cli("restore", snap["id"], str(tmp_path / "restored")).stdout.decode()
    assert "verified" in out
    cli("restore", "latest", "--tag", "run=x", str(tmp_path / "resume"))
    for d in ("restored", "resume"):
        for f in ckpt.rglob("*"):
            if f.is_file():
                assert (tmp_path / d / f.relative_to(ckpt)).read_bytes() == f.read_bytes()

    stats = json.loads(cli("stats", "--json").stdout)
    assert stats["snapshots"] == 1 and stats["logical_bytes"] > 0
    assert stats["per_snapshot"][0]["new_bytes"] > 0
    text = cli("stats").stdout.decode()
    assert "dedup ratio" in text and "stored bytes" in text
    # sc44 #6: the totals came first, and 3,000 rows scrolled them away; -q printed the rows too
    assert text.index(snap["id"][:8]) < text.index("snapshots: 1"), text
    quiet = cli("stats", "-q").stdout.decode()
    assert "dedup ratio" in quiet and snap["id"][:8] not in quiet, quiet


def test_the_app_names_its_options_however_it_is_run(tmp_path: Path):
    # tests and embedders call the typer app directly, not cli.main: messages still name options
    from ckptvault import Vault

    Vault.init(str(tmp_path / "v")).close()
    script = (
        "from ckptvault.cli.commands import app; "
        f"app(args=['prune', '--keep-latest', '0', '--repo', {str(tmp_path / 'v')!r}])"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--keep-latest must be at least 1" in proc.stderr, proc.stderr


def test_stats_of_a_vault_without_data_shows_no_ratio(cli, tmp_path: Path):
    cli("init", str(tmp_path / "vault"))
    text = cli("stats", "--repo", str(tmp_path / "vault")).stdout.decode()
    assert "dedup ratio: none yet" in text and "0.00x" not in text


def test_stats_of_a_tiny_vault_shows_a_ratio_under_one_in_figures(cli, tmp_path: Path):
    """A few bytes of data against kilobytes of metadata: the ratio is small, and "0.00x" said nothing."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("hello")
    cli("init", str(tmp_path / "vault"))
    cli("backup", str(tmp_path / "src"), "--repo", str(tmp_path / "vault"))
    text = cli("stats", "--repo", str(tmp_path / "vault")).stdout.decode()
    ratio = re.search(r"with compression: (\S+)x", text)
    assert ratio and 0 < float(ratio.group(1)) < 0.1 and "0.00x" not in text, text


@pytest.mark.parametrize(
    ("ratio", "said"),
    [(2.5, "2.50x"), (0.1, "0.10x"), (0.05, "0.050x"), (0.00086, "0.00086x"), (4.8e-05, "0.000048x"), (0.0, "0.00x")],
)
def test_a_stats_ratio_is_said_in_plain_decimals(ratio: float, said: str):
    """One byte of data among 3,000 empty files: "with compression: 4.8e-05x" (``.2g``), not a figure to read."""
    from ckptvault.cli.cmd_stats import _ratio

    assert _ratio(ratio) == said


def test_stats_tells_no_ratio_while_a_snapshot_object_cannot_be_read(cli, tmp_path: Path):
    """Its files left the logical bytes, its chunks stayed in the unique bytes: "dedup ratio: 0.97x",
    dedup making the data bigger (audit 36a F7)."""
    repo, src = str(tmp_path / "vault"), tmp_path / "src"
    src.mkdir()
    cli("init", repo)
    for _ in range(2):
        (src / "w.bin").write_bytes(os.urandom(200_000))
        cli("backup", str(src), "--repo", repo)
    damaged = sorted((tmp_path / "vault" / "snapshots").rglob("*"), key=lambda p: p.stat().st_mtime)[-1]
    raw = bytearray(damaged.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    damaged.write_bytes(bytes(raw))
    text = cli("stats", "--repo", repo).stdout.decode()
    assert "logical bytes: 200.00 KB (the readable snapshots)" in text, text
    assert "dedup ratio: not told while 1 snapshot object(s) cannot be read" in text and "x, with" not in text
    data = json.loads(cli("stats", "--json", "--repo", repo).stdout)
    assert (data["unreadable_snapshots"], data["dedup_ratio"], data["total_ratio"]) == (1, None, None)


def test_stats_times_are_the_snapshots_times(cli, tmp_path: Path):
    """api49 #8: VaultStats.per_snapshot[i].time was a str (seconds only) while Snapshot.time is a datetime;
    `stats --json` prints it as `snapshots --json` prints the snapshot's time, microseconds and all."""
    from datetime import datetime

    from ckptvault import Vault

    repo = one_file_vault(cli, tmp_path)
    with Vault.open(repo) as vault:
        (snap,) = vault.snapshots()
        (row,) = vault.stats().per_snapshot
    assert isinstance(row.time, datetime) and row.time.tzinfo is not None
    assert row.time == snap.time and sorted([row.time, snap.time])  # joins and sorts with Snapshot.time
    listed = json.loads(cli("snapshots", "--json", "--repo", repo).stdout)[0]["time"]
    assert "." in listed, listed  # a backup's time has its microseconds: the formats below must keep them
    assert json.loads(cli("stats", "--json", "--repo", repo).stdout)["per_snapshot"][0]["time"] == listed
    assert snap.time.strftime("%Y-%m-%d %H:%M:%S") in cli("stats", "--repo", repo).stdout.decode()


def test_init_and_explicit_repo(cli, tmp_path: Path):
    repo = str(tmp_path / "vault")
    made = json.loads(cli("init", repo, "--json").stdout)
    assert made["url"] == repo
    again = cli("init", repo, check=False)
    assert again.returncode == 10 and "already exists" in one_line_error(again)

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x" * 1000)
    snap = json.loads(cli("backup", str(tmp_path / "src"), "--repo", repo, "--json", "--quiet").stdout)
    assert snap["summary"]["files"] == 1
    via_env = json.loads(cli("snapshots", "--json", CKPTVAULT_REPO=repo).stdout)
    assert [s["id"] for s in via_env] == [snap["id"]]
    assert not (tmp_path / "xdg-data").exists()  # an explicit repository never touches the default


def test_a_tag_value_with_a_comma_cannot_read_as_two_tags_in_tables(cli, tmp_path: Path):
    repo = str(tmp_path / "vault")
    cli("init", repo)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x" * 1000)
    cli("backup", str(tmp_path / "src"), "--repo", repo, "--tag", "note=lr=3e-4,warmup", "--tag", "run=a", "-q")
    cli("backup", str(tmp_path / "src"), "--repo", repo, "--tag", "run=b", "-q")
    for command in ("snapshots", "stats", "prune --keep-latest 1 --dry-run"):  # prune lists the one to go
        out = cli(*command.split(), "--repo", repo).stdout.decode()
        assert 'note="lr=3e-4,warmup",run=a' in out, out


def test_snapshots_latest_shows_the_snapshot_restore_latest_takes(cli, tmp_path: Path):
    """A resume script that logs "resuming from step N" had to redo latest's rule over snapshots --json:
    the highest step of a run, not the newest upload (step 5 shipped after step 7 here)."""
    repo = str(tmp_path / "vault")
    cli("init", repo)
    for step in (7, 5):
        (tmp_path / "src").mkdir(exist_ok=True)
        (tmp_path / "src" / "f").write_bytes(b"step %d" % step)
        cli("backup", str(tmp_path / "src"), "--repo", repo, "--tag", "run=a", "--tag", f"step={step}", "-q")
    (tmp_path / "src" / "f").write_bytes(b"other run")
    cli("backup", str(tmp_path / "src"), "--repo", repo, "--tag", "run=b", "--tag", "step=1", "-q")
    shown = json.loads(cli("snapshots", "latest", "--tag", "run=a", "--repo", repo, "--json").stdout)
    assert [s["tags"] for s in shown] == [{"run": "a", "step": "7"}]
    cli("restore", "latest", str(tmp_path / "out"), "--tag", "run=a", "--repo", repo, "-q")
    assert (tmp_path / "out" / "f").read_bytes() == b"step 7"
    by_id = json.loads(cli("snapshots", shown[0]["id"][:8], "--repo", repo, "--json").stdout)
    assert [s["id"] for s in by_id] == [shown[0]["id"]]
    table = cli("snapshots", "latest", "--tag", "run=a", "--repo", repo).stdout.decode()
    assert "run=a,step=7" in table and "step=5" not in table
    missing = cli("snapshots", "latest", "--tag", "run=c", "--repo", repo, check=False)
    assert missing.returncode == 18 and "no snapshot matches latest --tag run=c" in one_line_error(missing)


def test_restore_latest_says_when_a_snapshot_without_a_step_made_it_pass_over_a_higher_step(cli, tmp_path: Path):
    """One backup of a run without --tag step=N makes latest go by time: the resume took step 5, backed up
    by hand last, over step 7, silently. It still does (the documented rule), and says so, naming step 7."""
    repo = str(tmp_path / "vault")
    cli("init", repo, "-q")
    (tmp_path / "src").mkdir()
    for step in (5, 7):
        (tmp_path / "src" / "f").write_bytes(b"step %d" % step)
        cli("backup", str(tmp_path / "src"), "--repo", repo, "--tag", "run=a", "--tag", f"step={step}", "-q")
    restored = cli("restore", "latest", str(tmp_path / "out7"), "--tag", "run=a", "--repo", repo, "-q")
    assert restored.stderr == b""
    step7 = json.loads(cli("snapshots", "latest", "--tag", "run=a", "--repo", repo, "--json").stdout)[0]["id"]
    (tmp_path / "src" / "f").write_bytes(b"step 5")
    cli("backup", str(tmp_path / "src"), "--repo", repo, "--tag", "run=a", "-q")
    restored = cli("restore", "latest", str(tmp_path / "out"), "--tag", "run=a", "--repo", repo, "-q")
    assert (tmp_path / "out" / "f").read_bytes() == b"step 5"
    warning = restored.stderr.decode()
    assert warning.count("\n") == 1 and warning.startswith("warning: latest is snapshot ")
    assert f"the highest step is snapshot {step7[:8]} (step=7): give its ID instead of latest" in warning
    shown = cli("snapshots", "latest", "--tag", "run=a", "--repo", repo, "--json")
    assert "1 snapshot of the run has no step tag, so steps were not compared" in shown.stderr.decode()
    forgot = cli("forget", "latest", "--dry-run", "--repo", repo)
    assert f"the highest step is snapshot {step7[:8]} (step=7): forget latest takes the newest by time, not it" in (
        forgot.stderr.decode()
    )


def test_one_of_a_thing_is_said_in_the_singular(cli, tmp_path: Path):
    repo = str(tmp_path / "vault")
    cli("init", repo, "-q")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x" * 1000)
    assert ": 1 file, 1.00 KB" in cli("backup", str(tmp_path / "src"), "--repo", repo).stdout.decode()
    restored = cli("restore", "latest", str(tmp_path / "out"), "--repo", repo).stdout.decode()
    assert ": 1 file, 1.00 KB written" in restored
    checked = cli("check", "--read-data", "--repo", repo).stdout.decode()
    assert "1 snapshot, 1 pack, 1 chunk, read 1 chunk in 1 pack" in checked


def test_tables_show_names_tags_and_paths_as_they_are(cli, tmp_path: Path):
    """Cells are never rich markup (``[/data]`` crashed the listing, ``[red]x`` lost its brackets),
    stay one line, and a long path is never cut with "…" in piped output (`ls > files.txt`)."""
    repo = str(tmp_path / "vault")
    cli("init", repo)
    src = tmp_path / "src"
    src.mkdir()
    (src / "[red]file").write_bytes(b"x" * 1000)
    (src / ("deep-" * 48 + "name.bin")).write_bytes(b"y")
    os.symlink("[/mnt]/x", src / "lnk")
    description = "resumed from [/ckpt/step-100]\nsecond line"
    cli("backup", str(src), "--repo", repo, "--tag", "ds=[/data]", "--description", description, "-q")
    cli("backup", str(src), "--repo", repo, "--tag", "run=b", "-q")
    for command in ("snapshots", "stats", "prune --keep-latest 1 --dry-run"):  # prune lists the one to go
        proc = cli(*command.split(), "--repo", repo)
        assert "ds=[/data]" in proc.stdout.decode(), proc.stdout.decode()
    listing = cli("snapshots", "--repo", repo).stdout.decode()
    assert "resumed from [/ckpt/step-100]\\nsecond line" in listing and len(listing.splitlines()) == 3
    files = cli("ls", "latest", "--repo", repo).stdout.decode()
    for shown in ("[red]file", "lnk -> [/mnt]/x", "deep-" * 48 + "name.bin"):
        assert shown in files, files


def test_quiet_drops_summaries_but_not_what_was_asked_for(cli, tmp_path: Path):
    repo = str(tmp_path / "vault")
    cli("init", repo, "-q")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "weights.bin").write_bytes(b"x" * 1000)
    assert cli("backup", str(tmp_path / "src"), "--repo", repo, "-q").stdout == b""
    assert "weights.bin" in cli("ls", "latest", "--repo", repo, "-q").stdout.decode()
    assert "1.00 KB" in cli("snapshots", "--repo", repo, "-q").stdout.decode()
    assert "logical" in cli("stats", "--repo", repo, "-q").stdout.decode()
    assert cli("restore", "latest", str(tmp_path / "out"), "--repo", repo, "-q").stdout == b""
    # a dry run's plan is what was asked for (docs audit 39 M3: all four printed nothing with -q)
    (tmp_path / "src" / "weights.bin").write_bytes(b"y" * 1000)
    cli("backup", str(tmp_path / "src"), "--repo", repo, "-q")
    planned = cli("prune", "--keep-latest", "1", "--dry-run", "--repo", repo, "-q").stdout.decode()
    assert "outside the newest 1" in planned and "would remove 1 snapshot(s), keep 1" in planned
    planned = cli("forget", "latest", "--dry-run", "--repo", repo, "-q").stdout.decode()
    assert f"would forget 1 snapshot(s), keep 1; their data stays until: ckptvault prune --repo {repo}" in planned
    assert "would index 0 pack(s)" in cli("repair-index", "--dry-run", "--repo", repo, "-q").stdout.decode()
    cli("init", str(tmp_path / "mirror"), "-q")
    copy = cli("copy", "--from-repo", repo, "--repo", str(tmp_path / "mirror"), "--dry-run", "-q")
    assert "would copy 2 snapshot(s)" in copy.stdout.decode()
    assert cli("prune", "--keep-latest", "1", "--repo", repo, "-q").stdout == b""  # done, not planned: a summary


def test_a_memory_vault_is_refused_by_the_cli_where_it_would_vanish(cli, tmp_path: Path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x")
    for args, env in (
        (["init", "memory://cli-test"], {}),
        (["backup", str(tmp_path / "src"), "--repo", "memory://cli-test"], {}),
        (["snapshots"], {"CKPTVAULT_REPO": "memory://cli-test"}),
    ):
        proc = cli(*args, check=False, **env)
        assert proc.returncode == 2 and "would vanish when this command exits" in one_line_error(proc), args


def test_init_refuses_two_different_repositories(cli, tmp_path: Path):
    proc = cli("init", str(tmp_path / "a"), "--repo", str(tmp_path / "b"), check=False)
    assert proc.returncode == 2 and "two repositories given" in one_line_error(proc)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_init_takes_one_repository_spelled_two_ways(cli, tmp_path: Path):
    cli("init", str(tmp_path / "a"), "--repo", f"file://{tmp_path}/./a")
    assert (tmp_path / "a" / "config").is_file()


def test_init_argument_beats_ckptvault_repo(cli, tmp_path: Path):
    # CKPTVAULT_REPO is a default, like --repo's: the folder typed on the command line is the one
    # created, whatever the variable holds (checked only when it is used)
    for n, env in enumerate((str(tmp_path / "from-env"), "memory://x", " ")):
        cli("init", str(tmp_path / f"typed{n}"), CKPTVAULT_REPO=env)
        assert (tmp_path / f"typed{n}" / "config").is_file()
    assert not (tmp_path / "from-env").exists()


@pytest.mark.parametrize(
    "args, code, fragment",
    [
        (["snapshots", "--repo", "{tmp}/nowhere"], 10, "no vault at"),
        (["snapshots"], 10, "created by the first backup"),
        # a new machine whose CKPTVAULT_REPO was not set: the vault is elsewhere, no backup makes it appear
        (["restore", "latest", "{tmp}/out", "--tag", "run=x"], 10, "name the vault with --repo URL"),
        (["backup", "{tmp}/missing-dir"], 3, "no such file"),
        (["backup", "{tmp}", "--tag", "novalue"], 2, "not key=value"),
        (["backup", "{tmp}", "--tag", "step=1.5e2"], 2, "--tag step=1.5e2 is a number but not a whole one (the step"),
        (["restore", "deadbeef", "{tmp}/out", "--repo", "{tmp}/v"], 18, "no snapshot deadbeef"),
        (["restore", "latest", "{tmp}/out", "--tag", "run=none", "--repo", "{tmp}/v"], 18, "latest --tag run=none"),
        (["restore", "zzzz!", "{tmp}/out", "--repo", "{tmp}/v"], 2, "not a snapshot ID"),
        (["init", "{tmp}/v2", "--compression-level", "99"], 2, "compression level 99 is out of range"),
        # restic's spellings get their equivalent, not click's nearest name (docs audit 39 L11)
        (["prune", "--keep-within", "14d"], 2, "restic's --keep-within AGE is --before AGE here, e.g. --before 14d"),
        (["prune", "--keep-daily", "7"], 2, "ckptvault keeps no calendar buckets: --keep-latest N, --before AGE"),
        # and where the restic habit lives here (cli49 #3): forget takes IDs, restore's target is an argument
        (["forget", "--keep-last", "3"], 2, "(retention rules are prune's here: ckptvault prune --keep-latest N"),
        (["restore", "latest", "--target", "{tmp}/x"], 2, "is the second argument: ckptvault restore SNAPSHOT DIR"),
        (["-r", "{tmp}/v", "snapshots"], 2, "No such option: -r (options go after the command: ckptvault COMMAND"),
        (["--json", "snapshots"], 2, "No such option: --json (options go after the command"),
    ],
)
def test_errors_are_one_line_with_exit_codes(cli, tmp_path: Path, args, code, fragment):
    cli("init", str(tmp_path / "v"))
    proc = cli(*[a.replace("{tmp}", str(tmp_path)) for a in args], check=False)
    assert proc.returncode == code, proc.stderr
    assert fragment in one_line_error(proc)


@pytest.mark.parametrize(
    "env, args, fragment",
    [
        ({"CKPTVAULT_REPO": ""}, ["backup", "{tmp}/src"], "CKPTVAULT_REPO is set but empty"),
        ({"CKPTVAULT_REPO": " "}, ["snapshots"], "CKPTVAULT_REPO is set but empty"),
        ({"CKPTVAULT_REPO": ""}, ["init"], "CKPTVAULT_REPO is set but empty"),
        # a backup set up for encryption must not create an unencrypted default vault
        ({"CKPTVAULT_KEYFILE": "", "CKPTVAULT_PASSPHRASE": "passphrase"}, ["backup", "{tmp}/src"], "CKPTVAULT_KEYFILE"),
        ({}, ["backup", "{tmp}/src", "--keyfile", ""], "--keyfile is empty; give the keyfile's path"),
        ({}, ["init", "{tmp}/v", "--encrypt", "--keyfile", ""], "--keyfile is empty"),
        # each empty option says what it takes and what leaving it out means (docs audit 39 L10)
        (
            {},
            ["backup", "{tmp}/src", "--repo", ""],
            "--repo is empty; give the vault's path or URL, or leave the option out for the default vault",
        ),
        ({}, ["copy", "--from-repo", "", "--repo", "{tmp}/v"], "--from-repo is empty; give the vault's path or URL"),
        ({}, ["drill", "--tmp-dir", ""], "--tmp-dir is empty; give a folder, or leave the option out for the system's"),
        ({}, ["key", "info", "--keyfile", ""], "--keyfile is empty; give the keyfile's path"),
        # a passphrase without a keyfile would leave the vault unencrypted (and create the default one so)
        ({}, ["backup", "{tmp}/src", "--passphrase-file", "{tmp}/src/f"], "--passphrase-file was given without"),
        ({}, ["init", "{tmp}/v", "--passphrase-file", "{tmp}/src/f"], "--passphrase-file was given without"),
    ],
)
def test_a_blank_repository_or_keyfile_is_refused_not_defaulted(cli, tmp_path: Path, env, args, fragment):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x")
    proc = cli(*[a.replace("{tmp}", str(tmp_path)) for a in args], check=False, **env)
    assert proc.returncode == 2 and fragment in one_line_error(proc), proc.stderr
    assert not (tmp_path / "xdg-data").exists() and not (tmp_path / "v").exists()  # no vault was created


def test_init_with_a_missing_keyfile_says_how_to_make_one(cli, tmp_path: Path):
    proc = cli("init", str(tmp_path / "v"), "--encrypt", "--keyfile", str(tmp_path / "team.key"), check=False)
    assert proc.returncode == 14
    assert f"create one with: ckptvault key generate --keyfile {tmp_path / 'team.key'}" in one_line_error(proc)


def test_cat_of_missing_path(cli, tmp_path: Path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x")
    cli("backup", str(tmp_path / "src"))
    proc = cli("cat", "latest", "nope.txt", check=False)
    assert proc.returncode == 19 and "not in snapshot" in one_line_error(proc)


def test_cat_takes_a_path_as_a_shell_writes_it(cli, tmp_path: Path):
    (tmp_path / "src" / "model").mkdir(parents=True)
    (tmp_path / "src" / "model" / "config.json").write_bytes(b"{}")
    cli("backup", str(tmp_path / "src"))
    for spelling in ("model/config.json", "./model/config.json", "/model/config.json", "model//config.json"):
        assert cli("cat", "latest", spelling).stdout == b"{}", spelling


def test_corrupt_restore_exits_30_naming_the_file(cli, tmp_path: Path):
    repo = tmp_path / "vault"
    cli("init", str(repo))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "weights.bin").write_bytes(os.urandom(200_000))
    cli("backup", str(tmp_path / "src"), "--repo", str(repo))
    (pack,) = [p for p in (repo / "packs").rglob("*") if p.is_file()]
    data = bytearray(pack.read_bytes())
    data[1000] ^= 1
    pack.write_bytes(bytes(data))
    proc = cli("restore", "latest", str(tmp_path / "out"), "--repo", str(repo), check=False)
    assert proc.returncode == 30
    assert "weights.bin" in one_line_error(proc)
    assert not (tmp_path / "out" / "weights.bin").exists()


def test_future_repository_version_is_refused(cli, tmp_path: Path):
    repo = tmp_path / "vault"
    cli("init", str(repo))
    config = json.loads((repo / "config").read_text())
    config["version"] = 7
    (repo / "config").write_text(json.dumps(config))
    proc = cli("snapshots", "--repo", str(repo), check=False)
    assert proc.returncode == 17
    assert "newer than this ckptvault supports" in one_line_error(proc)


def test_not_a_repository(cli, tmp_path: Path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config").write_text("hello")
    proc = cli("snapshots", "--repo", str(tmp_path / "junk"), check=False)  # was exit 30, "not valid JSON"
    assert proc.returncode == 10 and "holds another program's file named config" in one_line_error(proc)


def test_demo_command_from_the_readme(cli):
    proc = cli("demo")
    err = proc.stderr.decode()
    assert "byte-identical to the source" in err
    assert "created a new vault" in err
    # its snapshots land in the default vault, where an untagged `restore latest` takes them: how to remove them
    ids = re.search(r"remove them with: ckptvault forget ([0-9a-f]{8}) ([0-9a-f]{8}) --prune", err)
    assert ids, err
    cli("forget", *ids.groups(), "--prune")
    assert "demo" not in cli("snapshots").stdout.decode()


def test_a_demo_whose_temporary_folder_is_full_says_so_and_where(cli, tmp_path: Path):
    """ux57: `TMPDIR=<a full disk> ckptvault demo` was `error: internal error: OSError: [Errno 28] No space left
    on device (traceback saved to ...; please report it)`, exit 1, with its traceback written to that full disk.
    It is exit 21, naming the folder the demo writes its sample checkpoint to, and TMPDIR to pick another."""
    from tests.support.tmpfs import mounted_tmpfs

    repo = str(tmp_path / "v")
    cli("init", repo)
    with mounted_tmpfs(tmp_path / "small-tmp", "2m", "the demo's full temporary folder test") as small:
        proc = cli("demo", "--repo", repo, check=False, TMPDIR=str(small))
        line = one_line_error(proc)
        assert proc.returncode == 21, line
        assert f"no space left writing checkpoint-100/model.safetensors on {small}/ckptvault-demo-" in line, line
        assert "set TMPDIR to a folder with room" in line, line
        assert os.listdir(small) == []  # its partial sample went with its temporary folder
    assert cli("snapshots", "--repo", repo, "--json").stdout.strip() == b"[]"
    # room for the two saves, not for the restore: no "a rerun finishes it", the folder goes with the demo
    with mounted_tmpfs(tmp_path / "tmp-60m", "60m", "the demo's full temporary folder test") as small:
        line = one_line_error(cli("demo", "-q", "--repo", repo, check=False, TMPDIR=str(small)))
        assert "/restored: No space left on device; free space there, or set TMPDIR" in line, line


def test_a_bug_whose_traceback_cannot_be_saved_is_still_one_line(cli, tmp_path: Path):
    """A bug's traceback goes to a file in the temporary folder; where that was nearly full (room for the check
    tempfile makes, not for the traceback), the OSError of saving it escaped the error boundary: two tracebacks on
    the screen, the bug's and the save's. It is one line naming where the bug was raised and why the traceback was
    not saved, exit 1, and no cut traceback is left to take the disk's last bytes."""
    from tests.support.tmpfs import mounted_tmpfs

    repo = str(tmp_path / "v")
    cli("init", repo)
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg-data")}
    bug = [sys.executable, "-m", "tests.support.bugcli", "snapshots", "--repo", repo]
    with mounted_tmpfs(tmp_path / "small-tmp", "1m", "the full temporary folder test of a bug") as small:
        room = os.statvfs(small)
        (small / "fill").write_bytes(b"x" * ((room.f_bavail - 1) * room.f_frsize))  # one page left
        proc = subprocess.run(bug, capture_output=True, env={**env, "TMPDIR": str(small)}, timeout=120)
        line = one_line_error(proc)
        assert proc.returncode == 1 and "internal error: RuntimeError: a planted bug (raised at bugcli.py:" in line
        assert f"its traceback could not be saved in {small}: No space left on device; please report it)" in line
        assert os.listdir(small) == ["fill"]
        # with room, it is saved, as before
        (small / "fill").unlink()
        proc = subprocess.run(bug, capture_output=True, env={**env, "TMPDIR": str(small)}, timeout=120)
        saved = re.search(r"\(traceback saved to (\S+); please report it\)$", one_line_error(proc))
        assert saved and "ValueError: the cause, at length" in Path(saved.group(1)).read_text(), proc.stderr


def test_a_demo_run_in_a_vault_in_use_warns_even_when_quiet(cli, tmp_path: Path):
    """The README's first command writes into the default vault: one that holds a user's own saves gets two
    newer ones, which an untagged `restore latest` takes; -q hid the line that said so (ux43)."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "w.bin").write_bytes(os.urandom(1000))
    cli("backup", str(tmp_path / "mine"), "--tag", "run=mine")
    err = cli("demo", "-q").stderr.decode()
    said = r"^warning: the demo's two saves \(run=demo\) are now newer than the 1 other snapshot in .*; "
    ids = re.search(said + r"remove them with: ckptvault forget ([0-9a-f]{8}) ([0-9a-f]{8}) --prune$", err.strip())
    assert ids, err
    cli("forget", *ids.groups(), "--prune")
    assert [s["tags"]["run"] for s in json.loads(cli("snapshots", "--json").stdout)] == ["mine"]
    # a second demo's advice names the first one's saves too (it named only its own two), and never a run the
    # user named demo (at a higher step than the demo's: restored as the demo's second save, not as latest)
    cli("backup", str(tmp_path / "mine"), "--tag", "run=demo", "--tag", "step=5000", "-d", "my run named demo")
    cli("demo", "-q")
    err = cli("demo").stderr.decode()
    assert "restored the demo's second save (snapshot " in err, err
    said = r"warning: the demo's two saves \(run=demo\) are now newer than the 2 other snapshots in .*; "
    ids = re.search(said + r"remove all 4 demo saves with: ckptvault forget ((?:[0-9a-f]{8} ){4})--prune$", err)
    assert ids, err
    cli("forget", *ids.group(1).split(), "--prune")
    left = json.loads(cli("snapshots", "--json").stdout)
    assert [(s["tags"]["run"], s["description"]) for s in left] == [("mine", ""), ("demo", "my run named demo")]


def test_a_local_url_is_shown_as_one_that_opens_the_vault_again(cli, tmp_path: Path):
    """``local:///x`` was shown as ``local:/x``, which --repo reads as a folder named ``local:`` (audit 31b L1)."""
    url = f"local://{tmp_path}/v"
    created = json.loads(cli("init", url, "--json").stdout)
    assert created["url"] == url
    assert cli("snapshots", "--repo", created["url"]).returncode == 0


def test_a_restore_into_a_special_file_says_what_it_is(cli, tmp_path: Path):
    repo, src = str(tmp_path / "v"), tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x")
    cli("init", repo)
    cli("backup", str(src), "--repo", repo)
    proc = cli("restore", "latest", "/dev/null", "--repo", repo, check=False)
    assert proc.returncode == 22
    assert "restore target /dev/null is a device, FIFO or socket, not a folder;" in one_line_error(proc)


def test_small_rates_are_not_zero():
    """A small checkpoint moved in well under a second at under 1 MB/s read "(0 MB/s)" (audit 31b L5)."""
    from ckptvault.units import format_rate

    assert format_rate(864_260, 1.0) == "864.26 KB/s"
    assert format_rate(412e6, 1.0) == "412 MB/s"
    assert format_rate(10, 0.0) == "0 B/s"


def test_a_size_just_under_a_unit_is_shown_in_the_next_unit(cli, tmp_path: Path):
    """A file of 999,999 bytes was listed as "1000.00 KB" (and restored as "1000.00 KB written"): the unit
    was chosen before the figure was rounded to two decimals. It reads "1.00 MB" now."""
    from ckptvault.units import format_bytes

    src, repo = tmp_path / "src", str(tmp_path / "repo")
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(999_999))
    cli("init", repo)
    cli("backup", str(src), "--repo", repo)
    listing = cli("ls", "latest", "--repo", repo).stdout.decode()
    assert "1.00 MB" in listing and "1000.00" not in listing
    restored = cli("restore", "latest", str(tmp_path / "out"), "--repo", repo).stdout.decode()
    assert "1.00 MB written" in restored
    shown = [format_bytes(n) for n in (999, 999_994, 999_995, 999_999_999)]
    assert shown == ["999 B", "999.99 KB", "1.00 MB", "1.00 GB"]


def test_json_output_of_a_name_that_is_not_utf8_is_strict_json(cli, tmp_path: Path):
    src, repo = tmp_path / "src", str(tmp_path / "repo")
    src.mkdir()
    (src / os.fsdecode(b"weights-\xff.bin")).write_bytes(b"x")
    (src / "weights-\\xff.bin").write_bytes(b"backslash")  # the same "path" in JSON: told apart by path_base64
    cli("init", repo)
    cli("backup", str(src), "--repo", repo)
    out = cli("ls", "latest", "--repo", repo, "--json").stdout.decode()
    assert "\\udc" not in out and "weights-\\\\xff.bin" in out  # no lone surrogate escapes
    entries = [e for e in json.loads(out)["entries"] if e["type"] == "file"]
    assert [e["path"] for e in entries] == ["weights-\\xff.bin"] * 2
    raw = {base64.b64decode(e["path_base64"]) for e in entries if "path_base64" in e}
    assert raw == {b"weights-\xff.bin"}, entries  # only the name that is not UTF-8 has it (audit fs44 #7)


def test_a_name_that_is_not_utf8_is_listed_as_json_lists_it_and_cat_takes_that(cli, tmp_path: Path):
    """The table showed weights-\\udcff.bin and --json weights-\\xff.bin; cat took neither (docs audit 39 L8)."""
    src, repo = tmp_path / "src", str(tmp_path / "repo")
    src.mkdir()
    (src / os.fsdecode(b"weights-\xff.bin")).write_bytes(b"odd name")
    (src / "weights-\\xff.bin").write_bytes(b"backslash")  # a name spelled that way wins over the shown one
    cli("init", repo)
    cli("backup", str(src), "--repo", repo)
    listing = cli("ls", "latest", "--repo", repo).stdout.decode()
    assert listing.count("weights-\\xff.bin") == 2 and "\\udc" not in listing
    assert cli("cat", "latest", "weights-\\xff.bin", "--repo", repo).stdout == b"backslash"
    assert cli("cat", "latest", "weights-\\xFF.bin", "--repo", repo).stdout == b"odd name"
    assert cli("cat", "latest", os.fsdecode(b"weights-\xff.bin"), "--repo", repo).stdout == b"odd name"
    (src / "weights-\\xff.bin").unlink()
    cli("backup", str(src), "--repo", repo)
    assert cli("cat", "latest", "weights-\\xff.bin", "--repo", repo).stdout == b"odd name"


def test_a_byte_and_a_character_that_python_spells_alike_are_listed_apart_and_each_cat_finds_its_own(
    cli, tmp_path: Path
):
    """The byte 0x85 of a name that is not UTF-8 and the character U+0085 (or U+00A0) were both listed as
    \\x85 (\\xa0), and cat of the character's spelling failed (review 40 M2)."""
    src, repo = tmp_path / "src", str(tmp_path / "repo")
    src.mkdir()
    (src / os.fsdecode(b"a\x85.bin")).write_bytes(b"byte")
    (src / "a\u0085.bin").write_bytes(b"next line")
    (src / "model\u00a0v2.bin").write_bytes(b"no-break space")
    cli("init", repo)
    cli("backup", str(src), "--repo", repo)
    listing = cli("ls", "latest", "--repo", repo).stdout.decode()
    assert "a\\x85.bin" in listing and "a\\u0085.bin" in listing and "model\\u00a0v2.bin" in listing, listing
    shown_as = {"a\\x85.bin": b"byte", "a\\u0085.bin": b"next line", "model\\u00a0v2.bin": b"no-break space"}
    for shown, data in shown_as.items():
        assert cli("cat", "latest", shown, "--repo", repo).stdout == data, shown


def test_a_name_with_a_control_character_is_taken_as_ls_shows_it_by_cat_and_restore_include(cli, tmp_path: Path):
    """ls shows a newline in a name as \\n (one line a file); cat and restore --include took neither that
    spelling nor the \\xNN of a byte that is not UTF-8 (--include) (odd46 #3)."""
    src, repo = tmp_path / "src", str(tmp_path / "repo")
    src.mkdir()
    (src / "new\nline.bin").write_bytes(b"newline")
    (src / "tab\tx.bin").write_bytes(b"tab")
    (src / os.fsdecode(b"w\xff.bin")).write_bytes(b"byte")
    (src / "plain.bin").write_bytes(b"plain")
    cli("init", repo)
    cli("backup", str(src), "--repo", repo)
    listing = cli("ls", "latest", "--repo", repo).stdout.decode()
    for shown in ("new\\nline.bin", "tab\\tx.bin", "w\\xff.bin"):
        assert shown in listing, listing
    assert cli("cat", "latest", "new\\nline.bin", "--repo", repo).stdout == b"newline"
    assert cli("cat", "latest", "tab\\x09x.bin", "--repo", repo).stdout == b"tab"
    out = tmp_path / "out"
    cli("restore", "latest", str(out), "--repo", repo, "--include", "new\\n*", "--include", "w\\xff.bin")
    assert sorted(os.listdir(os.fsencode(out))) == [b"new\nline.bin", b"w\xff.bin"]
    # a name spelled with a real backslash is taken as given first, as cat takes it (rv47 L6)
    (src / "new\\nline.bin").write_bytes(b"backslash")
    cli("backup", str(src), "--repo", repo)
    cli("restore", "latest", str(tmp_path / "out2"), "--repo", repo, "--include", "new\\nline.bin")
    assert os.listdir(tmp_path / "out2") == ["new\\nline.bin"]


def test_a_reader_that_goes_away_ends_the_command_quietly_with_141(cli, tmp_path: Path):
    # `ckptvault cat ... | head -c 10`: what SIGPIPE gives other programs, and nothing on stderr
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "weights.bin").write_bytes(os.urandom(4 << 20))
    repo = str(tmp_path / "vault")
    cli("init", repo)
    cli("backup", str(tmp_path / "src"), "--repo", repo)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTVAULT_")}
    env["XDG_DATA_HOME"] = str(tmp_path / "xdg-data")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptvault", "cat", "latest", "weights.bin", "--repo", repo],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert len(proc.stdout.read(10)) == 10
    proc.stdout.close()
    assert proc.wait(timeout=120) == 141
    assert proc.stderr.read() == b""


@pytest.mark.parametrize("args", [["ls", "--help"], ["--help"], []])
def test_help_into_a_closed_pipe_exits_141_too(tmp_path: Path, args: list[str]):
    # `ckptvault ls --help | head -1` under `set -o pipefail`: the help is output like any other
    proc = subprocess.Popen([sys.executable, "-m", "ckptvault", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the help is written
    assert proc.wait(timeout=120) == 141
    assert proc.stderr.read() == b""


def test_a_plain_table_is_laid_out_as_rich_lays_it_out_less_trailing_spaces():
    """Listings are printed without rich's layout (0.5 s for 1,000 snapshots) when they fit; the same
    columns, widths and justification, wide characters included. Too wide for the screen: rich wraps."""
    import io

    from rich.console import Console

    from ckptvault.cli.output import Output

    table = Output.table("id", "tags", "size", "path")
    table.add_row("3b9cc1e5", "run=a,note=学習率", "65.55 KB", "model/权重.bin")
    table.add_row("b6da4e94", "", "1 B", "x")
    table.add_row("795181c6", "run=[red]b", "123.45 MB", "tab\there")
    console = Console(file=io.StringIO(), width=1000, highlight=False, soft_wrap=True)
    console.print(table)
    by_rich = [line.rstrip() for line in console.file.getvalue().splitlines()]
    assert table.aligned(1000) == by_rich, by_rich
    assert table.aligned(len(by_rich[1]) - 1) is None
    # no room to fold tags and paths into (an 80-column terminal, snapshots' eight columns): the lines as they
    # are, for the terminal to wrap; rich dropped columns, or cut IDs and dates in two (cli49 #1)
    assert table.aligned(8 + 9 + 2 * 3 + 12 + 11) == by_rich


def test_snapshots_on_a_narrow_terminal_keep_ids_times_and_numbers_whole(tmp_path: Path):
    """cli49 #1: at 80 columns each row of `snapshots` folded every column, a date apart from its time and
    `step=` from its number; at 60 the ID itself was cut in two and could not be copied."""
    import io

    from rich.console import Console

    from ckptvault.cli.output import Output

    table = Output.table("id", "time (UTC)", "host", "tags", "files", "size", "stored", "description")
    table.add_row("1b033617", "2026-12-06 15:08:31", "vm", "run=x,step=1200", "5", "1.38 MB", "1.15 MB", "")
    watched = (
        "run=y,checkpoint=checkpoint-100,step=100",
        "4",
        "1 B",
        "1 B",
        "ckptvault watch: /tmp/out/checkpoint-100",
    )
    table.add_row("4fe9544c", "2026-12-06 15:08:59", "vm", *watched)
    for width in (120, 80, 60):
        lines = table.aligned(width)  # as Output prints a table: these lines, else rich's layout
        if lines is None:
            console = Console(file=io.StringIO(), width=width)
            console.print(table)
            lines = console.file.getvalue().splitlines()
        for snapshot_id, when in (("1b033617", "2026-12-06 15:08:31"), ("4fe9544c", "2026-12-06 15:08:59")):
            assert any(snapshot_id in line and when in line for line in lines), (width, lines)
        assert any("1.15 MB" in line for line in lines) and "step=100" in "".join(lines), (width, lines)


def test_a_restore_of_only_folders_and_links_says_what_it_restored(cli, tmp_path: Path):
    """odd46 #8: "0 files, 0 B written" read as if nothing happened, for a folder and a link restored."""
    src, repo = tmp_path / "src", str(tmp_path / "v")
    (src / "empty").mkdir(parents=True)
    (src / "w.bin").write_bytes(b"w")
    (src / "latest").symlink_to("w.bin")
    cli("init", repo)
    cli("backup", str(src), "--repo", repo)
    out = cli("restore", "latest", str(tmp_path / "out"), "--include", "empty", "--include", "latest", "--repo", repo)
    assert ": 0 files, 1 folder, 1 link, 0 B written" in out.stdout.decode(), out.stdout.decode()


def test_a_restore_summary_is_one_line_whatever_the_target_is_named(cli, tmp_path: Path):
    """odd46 #7: a target with a newline in its name split the summary in two (warnings escape it)."""
    repo = one_file_vault(cli, tmp_path)
    out = cli("restore", "latest", str(tmp_path / "nl\ntarget"), "--repo", repo).stdout.decode()
    assert out.count("\n") == 1 and "nl\\ntarget: 1 file" in out, out


def test_small_wordings_of_a_first_time_users_review(cli, tmp_path: Path):
    """cli49 #13: a backup that read no file said "0 B/s read" and "dedup+compression 2221.26x"; diff listed an
    added symlink without its target (ls shows `lnk -> model`); ship-pins --timeout -5 named the API's parameter
    and a Python type; key info of a file that is no keyfile asked for "this vault's keyfile"."""
    repo, src = str(tmp_path / "v"), tmp_path / "src"
    (src / "model").mkdir(parents=True)
    (src / "model" / "w.bin").write_bytes(os.urandom(50_000))
    cli("init", repo)
    cli("backup", str(src), "--repo", repo)
    again = cli("backup", str(src), "--repo", repo).stdout.decode()
    assert again.rstrip().endswith(" s (no file read: unchanged since the last snapshot)"), again
    assert "dedup+compression" not in again and "B/s" not in again
    os.symlink("model", src / "lnk")
    cli("backup", str(src), "--repo", repo)
    listed = cli(
        "diff", "--repo", repo, *[s["id"] for s in json.loads(cli("snapshots", "--repo", repo, "--json").stdout)][1:]
    )
    assert "added    lnk -> model\n" in listed.stdout.decode(), listed.stdout
    refused = cli("ship-pins", str(src), "--timeout", "-5", "--repo", repo, check=False)
    assert refused.returncode == 2 and refused.stderr.decode() == (
        "error: --timeout must be a number of seconds (0 or more), or leave it out to wait as long as it takes; "
        "got -5\n"
    )
    (tmp_path / "bad.key").write_text('{"a": 1}')
    info = cli("key", "info", "--keyfile", str(tmp_path / "bad.key"), check=False)
    assert info.returncode == 15 and info.stderr.decode().rstrip().endswith(
        "is not a ckptvault keyfile (the wrong file?); give the path of a ckptvault keyfile"
    ), info.stderr


def _command_paths() -> list[list[str]]:
    """Every command of the app, as typed (``key passwd``)."""
    import typer

    from ckptvault.cli.commands import app

    def walk(command, path: list[str]) -> list[list[str]]:
        if hasattr(command, "commands"):
            return [p for name, sub in command.commands.items() for p in walk(sub, [*path, name])]
        return [path]

    return walk(typer.main.get_command(app), [])


def test_every_option_that_takes_a_value_names_it_in_the_help(cli):
    """h51 #7: per-command options (--include, --exclude's neighbours, --keep-latest, --before...) showed typer's
    `<str>`/`<int>`/`<float>` where the shared ones show URL, PATH, KEY=VALUE: each now names what it takes."""
    paths = _command_paths()
    assert ["restore"] in paths and ["key", "passwd"] in paths and len(paths) > 20
    bare = re.compile(r"<(str|int|float|text|integer|path)>|\s(?-i:INTEGER|FLOAT)\s", re.IGNORECASE)  # typer's
    for path in paths:
        text = cli(*path, "--help", COLUMNS="240").stdout.decode()
        panel, rows = "", []
        for line in text.splitlines():
            if line.startswith("╭─"):
                panel = line
            elif "Options" in panel and line.startswith("│") and line[1:].lstrip().startswith(("-", "*")):
                rows.append(line)
        assert rows, (path, text)
        typed = [row for row in rows if bare.search(row)]
        assert not typed, (path, typed)
    restore = cli("restore", "--help", COLUMNS="240").stdout.decode()
    assert re.search(r"--include\s+-i\s+GLOB\s", restore), restore
    prune = cli("prune", "--help", COLUMNS="240").stdout.decode()
    assert re.search(r"--keep-latest\s+N\s", prune) and re.search(r"--before\s+DATE\|AGE\s", prune), prune
