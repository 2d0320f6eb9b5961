"""Bad prune and tag values on the command line: refused with one line and exit 2, nothing removed
(a --tag that selects nothing: a warning)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

import ckptvault.vault
from ckptvault import Vault
from ckptvault.errors import UsageError


def one_line_error(proc) -> str:
    err = proc.stderr.decode()
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


def make_snapshots(repo: str, src: Path, tag_sets: list[dict[str, str]]) -> None:
    src.mkdir(exist_ok=True)
    with Vault.init(repo) as vault:
        for i, tags in enumerate(tag_sets):
            (src / "w.bin").write_bytes(b"weights %d" % i)
            vault.backup(src, tags=tags)


@pytest.fixture
def repo(tmp_path: Path) -> str:
    """Four snapshots of one run: tags run=a, step=1..4."""
    url = str(tmp_path / "vault")
    make_snapshots(url, tmp_path / "src", [{"run": "a", "step": str(i)} for i in range(1, 5)])
    return url


def snapshot_ids(cli, repo: str) -> list[str]:
    return sorted(s["id"] for s in json.loads(cli("snapshots", "--json", "--repo", repo).stdout))


def refused_prune(cli, repo: str, *args: str) -> str:
    """Run ``prune`` with bad ``args`` (for real, not a dry run); it must exit 2 and remove nothing."""
    before = snapshot_ids(cli, repo)
    assert len(before) >= 2
    proc = cli("prune", "--repo", repo, "--keep-latest", "1", *args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert snapshot_ids(cli, repo) == before
    return one_line_error(proc)


# ---- 1. --group-by a tag key no snapshot carries ------------------------------------------


@pytest.mark.parametrize("dry_run", [[], ["-n"]], ids=["real", "dry-run"])
def test_group_by_unknown_tag_key_is_refused(cli, repo: str, dry_run: list[str]):
    line = refused_prune(cli, repo, "--group-by", "nosuchtag", *dry_run)
    assert "--group-by tag key 'nosuchtag' is on none of the 4 snapshots (their tag keys: run, step)" in line
    assert "check the spelling" in line


def test_group_by_unknown_tag_key_counts_only_the_selected(cli, repo: str):
    line = refused_prune(cli, repo, "--group-by", "nosuchtag", "--tag", "run=a")
    assert "is on none of the 4 snapshots selected by --tag (their tag keys: run, step)" in line


def test_group_by_empty_key_is_refused(cli, repo: str):
    assert "--group-by is empty" in refused_prune(cli, repo, "--group-by", "")


def test_a_mistyped_tag_selecting_nothing_is_named_with_the_values_in_use(cli, repo: str):
    """Not an error (a cron'd prune of a run that has not saved yet selects nothing too), but not
    silence: "removed 0 snapshot(s)" alone hid the typo."""
    before = snapshot_ids(cli, repo)
    proc = cli("prune", "--repo", repo, "--keep-latest", "1", "--tag", "run=b", "--quiet")
    assert snapshot_ids(cli, repo) == before
    err = proc.stderr.decode()
    assert err.strip() == (
        "warning: --tag run=b selects no snapshot (no snapshot has run=b; run is one of: a); none removed"
    ), err
    matching = cli("prune", "--repo", repo, "--keep-latest", "1", "--tag", "run=a", "-n")
    assert "selects no snapshot" not in matching.stderr.decode()
    # listing: "no snapshots" alone read as "this run was never backed up"
    listed = cli("snapshots", "--repo", repo, "--tag", "run=b")
    assert listed.stdout.decode().strip() == "no snapshots"
    assert listed.stderr.decode().strip() == (
        "warning: --tag run=b selects no snapshot (no snapshot has run=b; run is one of: a)"
    ), listed.stderr
    assert cli("snapshots", "--repo", repo, "--tag", "run=a").stderr == b""
    # a key with spaces around it is refused when stored, not when selecting (older snapshots may carry one)
    assert cli("snapshots", "--repo", repo, "--tag", " run=a").returncode == 0


def test_group_by_unknown_tag_key_is_refused_by_the_api(repo: str):
    with Vault.open(repo) as vault, pytest.raises(UsageError, match="'nosuchtag' is on none of the 4"):
        vault.prune(keep_latest=1, group_by="nosuchtag")
    with Vault.open(repo) as vault:
        assert len(vault.snapshots()) == 4


def test_snapshots_lacking_the_group_key_form_their_own_named_group(cli, tmp_path: Path, monkeypatch):
    repo = str(tmp_path / "vault")
    # run="" is refused now (an unset variable), but vaults written before hold such snapshots
    monkeypatch.setattr(ckptvault.vault, "tags_arg", lambda tags, name="tags", stored=False: dict(tags or {}))
    tag_sets = [{"run": "a"}, {"run": "a"}, {}, {}, {"run": ""}, {"run": ""}]
    make_snapshots(repo, tmp_path / "src", tag_sets)
    proc = cli("prune", "--repo", repo, "--keep-latest", "1", "--group-by", "run", "--json", "-n")
    assert "2 of 6 snapshot(s) have no tag 'run'" in proc.stderr.decode()
    plan = json.loads(proc.stdout)
    groups: dict[str, list[str]] = {}
    for verdict in ("keep", "forget"):
        for d in plan[verdict]:
            groups.setdefault(d["group"], []).append(verdict)
    # the untagged two are not merged with the empty value run="": three groups, each keeps its newest
    assert {g: sorted(v) for g, v in groups.items()} == {
        "run=a": ["forget", "keep"],
        "(no tag run)": ["forget", "keep"],
        "run=": ["forget", "keep"],
    }
    table = cli("prune", "--repo", repo, "--keep-latest", "1", "--group-by", "run", "-n").stdout.decode()
    assert "(no tag run)" in table
    assert len(snapshot_ids(cli, repo)) == 6


# ---- 2. malformed --keep-tag ----------------------------------------------------------------


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("", "--keep-tag: '' has no key; give key or key=value"),
        ("=v", "--keep-tag: '=v' has no key; give key or key=value"),
        (" =v", "--keep-tag: the key ' ' is blank"),
        ("mile\nstone", "--keep-tag: key 'mile\\nstone' contains a control character (U+000A)"),
    ],
    ids=["empty", "empty-key", "blank-key", "newline"],
)
def test_malformed_keep_tag_is_refused(cli, repo: str, value: str, fragment: str):
    assert fragment in refused_prune(cli, repo, "--keep-tag", value)


def test_keep_tag_key_or_key_value_still_protect(cli, repo: str):
    proc = cli("prune", "--repo", repo, "--keep-latest", "1", "--keep-tag", "step=2", "--keep-tag", "nosuch", "--json")
    forgotten = json.loads(proc.stdout)["forget"]
    assert len(forgotten) == 2 and len(snapshot_ids(cli, repo)) == 2
    # one unlike any tag in use (a milestone not tagged yet) is taken, and said to protect nothing
    warning = "--keep-tag nosuch is on no snapshot (tag keys in use: run, step); it protected nothing"
    assert warning in proc.stderr.decode()


@pytest.mark.parametrize("dry_run", [[], ["-n"]], ids=["real", "dry-run"])
@pytest.mark.parametrize(("value", "meant"), [("kep", "keep"), ("keep=bets", "keep=best"), ("Keep", "keep")])
def test_a_keep_tag_one_typo_from_a_tag_in_use_is_refused(cli, repo: str, value: str, meant: str, dry_run: list[str]):
    """A typo in --keep-tag protected nothing, and the snapshot tagged to be kept was removed, silently."""
    oldest = snapshot_ids(cli, repo)[0]
    cli("tag", oldest, "--add", "keep=best", "--repo", repo, "-q")
    line = refused_prune(cli, repo, "--keep-tag", value, *dry_run)
    assert f"--keep-tag {value!r} is on no snapshot; did you mean {meant!r}?" in line, line
    with Vault.open(repo) as vault, pytest.raises(UsageError, match="keep_tags"):
        vault.prune(keep_latest=1, keep_tags=[value], dry_run=True)


@pytest.mark.parametrize("dry_run", [[], ["-n"]], ids=["real", "dry-run"])
def test_a_keep_tag_with_an_empty_value_is_refused_before_anything_goes(cli, repo: str, dry_run: list[str]):
    """`--keep-tag keep=$BEST` with the variable unset protected nothing, and prune removed the snapshot
    tagged keep=best with exit 0, saying so in a warning after the deletion (ux43)."""
    before = snapshot_ids(cli, repo)
    cli("tag", before[0], "--add", "keep=best", "--repo", repo, "-q")
    line = refused_prune(cli, repo, "--keep-tag", "keep=", *dry_run)
    assert "--keep-tag 'keep=' has an empty value (is a variable unset?)" in line, line
    assert "give keep=VALUE, or 'keep' alone for every value" in line
    assert len(snapshot_ids(cli, repo)) == len(before)
    with Vault.open(repo) as vault, pytest.raises(UsageError, match="keep_tags 'keep=' has an empty value"):
        vault.prune(keep_latest=1, keep_tags=["keep="], dry_run=True)


@pytest.mark.parametrize("value", ["step=5", "step=40", "best", "milestone=yes", "keep=better", "keep2"])
def test_a_keep_tag_that_differs_on_purpose_is_taken(cli, repo: str, value: str):
    """Steps, versions and dates differ from those in use by one character on purpose (a prune protecting
    the step a run will reach); so do other words: only one slip in a word of four letters counts as one."""
    oldest = snapshot_ids(cli, repo)[0]
    cli("tag", oldest, "--add", "keep=best", "--add", "beta=1", "--repo", repo, "-q")
    proc = cli("prune", "--repo", repo, "--keep-latest", "1", "--keep-tag", value, "-n")
    assert f"--keep-tag {value} is on no snapshot" in proc.stderr.decode(), proc.stderr


# ---- 3. --before ages too large for a date ----------------------------------------------------


@pytest.mark.parametrize("value", ["1000000d", "99999999999d", "9" * 30 + "w"])
def test_huge_before_age_is_a_usage_error(cli, repo: str, value: str):
    line = refused_prune(cli, repo, "--before", value)
    assert f"--before: '{value}' is too far back" in line
    assert "2026-11-16" in line and "14d" in line  # names the accepted formats


def test_a_before_age_in_m_is_ambiguous_not_minutes(cli, repo: str):
    """restic's --keep-within 6m is 6 months: read as 6 minutes, a prune removed nearly everything."""
    line = refused_prune(cli, repo, "--before", "6m")
    assert line == (
        "error: --before: '6m' is ambiguous (restic reads 'm' as months): write 6min for minutes, or days, "
        "e.g. 180d for 6 months"
    )
    kept = cli("prune", "--repo", repo, "--keep-latest", "1", "--before", "30min", "--dry-run", "--json")
    assert json.loads(kept.stdout)["forget"] == []  # the snapshots are seconds old


def test_a_before_age_may_combine_units_and_names_them_when_one_is_unknown():
    """cli49 #11: --retry-lock took 1h30m where --before refused 1h30min, 2w3d and 90s, and 1y or 3mo got
    only "not a date or a duration"."""
    from datetime import datetime, timedelta, timezone

    from ckptvault.cli.params import parse_before
    from ckptvault.errors import UsageError

    now = datetime(2026, 12, 6, tzinfo=timezone.utc)
    ages = {"1h30min": timedelta(minutes=90), "2w3d": timedelta(days=17), "90s": timedelta(seconds=90)}
    assert {text: now - parse_before(text, now) for text in ages} == ages
    for text in ("1y", "3mo"):
        with pytest.raises(UsageError, match=r"an age is in s, min, h, d or w \(months and years in days"):
            parse_before(text, now)
    with pytest.raises(UsageError, match="ambiguous"):
        parse_before("1h30m", now)  # restic's 1y6m is a year and 6 months: m stays refused inside a sum too


# ---- 4. tag keys and values that break tables and one-line messages ---------------------------

BAD_TAGS = [
    (" =v", "--tag: the key ' ' is blank"),
    ("a\nb=v", "--tag: key 'a\\nb' contains a control character (U+000A)"),
    ("run=a\nb", "--tag: the value of 'run' ('a\\nb') contains a control character (U+000A)"),
    ("run=a\x1b[31m", "contains a control character (U+001B)"),
    ("run=a\tb", "contains a control character (U+0009)"),
    ("x=" + "y" * 100_000, "--tag: the value of 'x' ('yyy"),
    ("k" * 300 + "=v", "is 300 characters long; the limit is 256"),
    (" run=x", "--tag: the key ' run' has spaces around it"),  # stored, no --tag run=x would select it
    ("run=", "--tag run= has an empty value (is a variable unset?); give one, e.g. --tag run=x"),
    ("run= ", "--tag run=  has an empty value"),  # blank: a quoting slip
    ("run=x ", "--tag run=x : the value 'x ' has spaces around it; write it without, e.g. --tag run=x"),
]


@pytest.mark.parametrize(
    "tag, fragment",
    BAD_TAGS,
    ids=[
        "blank",
        "nl-key",
        "nl-value",
        "esc",
        "tab",
        "100kb",
        "long",
        "spaced-key",
        "empty-value",
        "blank-value",
        "spaced-value",  # docs audit 39 L4: stored, then no --tag run=x selected it
    ],
)
def test_bad_tag_is_refused_by_backup(cli, repo: str, tmp_path: Path, tag: str, fragment: str):
    before = snapshot_ids(cli, repo)
    proc = cli("backup", str(tmp_path / "src"), "--repo", repo, "--tag", tag, check=False)
    assert proc.returncode == 2, proc.stderr
    line = one_line_error(proc)
    assert fragment in line and len(line) < 300
    assert snapshot_ids(cli, repo) == before


def test_an_empty_tag_value_is_refused_by_watch_and_tag_before_anything_is_made(cli, tmp_path: Path):
    """``--tag run=$RUN_ID`` with the variable unset was stored as run= without a word."""
    (tmp_path / "ckpts").mkdir()
    proc = cli("watch", str(tmp_path / "ckpts"), "--tag", "run=", "--once", check=False)
    assert proc.returncode == 2 and "--tag run= has an empty value" in one_line_error(proc)
    assert not (tmp_path / "xdg-data").exists(), "the default vault was made for a command that cannot run"


def test_long_tag_value_names_the_limit(cli, repo: str):
    line = refused_prune(cli, repo, "--tag", "x=" + "y" * 100_000)
    assert "is 100000 characters long; the limit is 256" in line


@pytest.mark.parametrize("tag", ["x=" + "y" * 256, "run=ä é", "run=v w", "a b=c=d"])
def test_unusual_but_valid_tags_are_still_accepted(cli, repo: str, tmp_path: Path, tag: str):
    cli("backup", str(tmp_path / "src"), "--repo", repo, "--tag", tag, "--quiet")
    key, _, value = tag.partition("=")
    newest = json.loads(cli("snapshots", "--json", "--repo", repo, "--tag", tag).stdout)
    assert [s["tags"] for s in newest] == [{key: value}]


def test_a_before_date_more_than_a_day_ahead_is_a_mistyped_year_not_a_cutoff(cli, repo: str):
    # it made every snapshot "older", and --before alone then left only the newest of each group
    line = refused_prune(cli, repo, "--before", "2099-01-01")  # exit 2, nothing removed
    assert "--before 2099-01-01T00:00:00+00:00 is more than a day in the future" in line and "14d" in line


@pytest.mark.parametrize(
    "value, said",
    [  # past year 9999 in UTC is the future, as any year 9999 date is (cp47 #5)
        ("9999-12-31T23:59:59-01:00", "is more than a day in the future"),
        ("0001-01-01T00:30+01:00", "is out of range in UTC"),
    ],
)
def test_a_before_time_with_no_utc_equivalent_is_a_usage_error(cli, repo: str, value: str, said: str):
    line = refused_prune(cli, repo, "--before", value)
    assert said in line


def test_the_before_reason_keeps_the_seconds(repo: str):
    with Vault.open(repo) as vault:
        newest = vault.snapshots()[-1].time
        cutoff = (newest + timedelta(seconds=90)).replace(second=30, microsecond=0)  # seconds to show
        result = vault.prune(keep_latest=1, before=cutoff, dry_run=True)
    reasons = [d.reason for d in result.retention.decisions if not d.keep]
    assert reasons and all(f"older than {cutoff:%Y-%m-%d %H:%M:%S} UTC" in r for r in reasons), reasons


def test_a_run_left_with_no_snapshot_by_an_ungrouped_prune_is_named(cli, tmp_path: Path):
    """--keep-latest counts every run together unless --group-by: an earlier run lost all its snapshots
    to a later run's newer ones, without a word."""
    url = str(tmp_path / "vault")
    make_snapshots(url, tmp_path / "src", [{"run": "a"}, {"run": "a"}, {"run": "b"}, {"run": "c"}])
    dry = cli("prune", "--repo", url, "--keep-latest", "2", "--dry-run")
    assert (
        "warning: run=a would have no snapshot left: --keep-latest counts the snapshots of all 3 runs together; "
        "--group-by run keeps the newest N of each"
    ) in dry.stderr.decode(), dry.stderr
    grouped = cli("prune", "--repo", url, "--keep-latest", "2", "--group-by", "run", "--dry-run")
    assert "no snapshot left" not in grouped.stderr.decode()
    dated = cli("prune", "--repo", url, "--before", "0min", "--dry-run").stderr.decode()
    assert (
        "run=a, run=b would have no snapshot left: the one snapshot kept whatever its age is the newest of all 3 "
        "runs together; --group-by run keeps the newest one of each"
    ) in dated, dated
    real = cli("prune", "--repo", url, "--keep-latest", "2")
    assert "warning: run=a has no snapshot left" in real.stderr.decode()
    assert {s["tags"]["run"] for s in json.loads(cli("snapshots", "--json", "--repo", url).stdout)} == {"b", "c"}


@pytest.mark.parametrize("spec", ["3", "ab", "abc", " 1a "])
def test_forget_refuses_an_id_prefix_too_short_to_be_meant(cli, repo: str, spec: str):
    """`forget 3` (three snapshots?) forgot the one snapshot whose ID starts with 3."""
    before = snapshot_ids(cli, repo)
    proc = cli("forget", "--repo", repo, spec, check=False)
    assert proc.returncode == 2
    assert one_line_error(proc) == (
        f"error: {spec!r} is too short an ID prefix to forget a snapshot by: give at least 4 characters of its ID "
        f"(as ckptvault snapshots --repo {repo} shows them)"
    )
    assert snapshot_ids(cli, repo) == before
    cli("forget", "--repo", repo, before[0][:8])  # as `snapshots` shows it


@pytest.mark.parametrize("spec", ["2", "ab"])
def test_tag_refuses_an_id_prefix_too_short_to_be_meant(cli, repo: str, spec: str):
    """`tag 2 --add keep=best` retagged whichever snapshot's ID began with 2: prune --keep-tag then kept it, and
    could remove the one meant (docs audit 39 M4). A retag replaces a snapshot, as forget removes one."""
    before = snapshot_ids(cli, repo)
    proc = cli("tag", spec, "--add", "keep=best", "--repo", repo, check=False)
    assert proc.returncode == 2
    assert f"{spec!r} is too short an ID prefix to retag a snapshot by: give at least 4 characters" in one_line_error(
        proc
    )
    assert snapshot_ids(cli, repo) == before


def test_the_api_gets_the_warnings_the_cli_prints(tmp_path: Path):
    """A prune from a training script (Vault.prune) was told nothing of a run left with no snapshot, or of
    a tag rule that selected or protected nothing: those warnings were made by the CLI alone."""
    url = str(tmp_path / "vault")
    make_snapshots(url, tmp_path / "src", [{"run": "a"}, {"run": "a"}, {"run": "b"}, {"run": "c"}])
    with Vault.open(url) as vault:
        told: list[str] = []
        vault.on_warning = told.append
        result = vault.prune(keep_latest=2, dry_run=True)
        assert (
            result.warnings
            == told
            == [
                "run=a would have no snapshot left: keep_latest counts the snapshots of all 3 runs together; "
                'group_by="run" keeps the newest N of each'
            ]
        )
        result = vault.prune(keep_latest=1, tags={"run": "d"}, keep_tags=["nosuch"], dry_run=True)
        assert result.warnings[:2] == [
            "tags={'run': 'd'} selects no snapshot (no snapshot has run=d; run is one of: a, b, c); none removed",
            "keep_tags entry 'nosuch' is on no snapshot (tag keys in use: run); it protected nothing",
        ], result.warnings
        assert not vault.prune(keep_latest=2, group_by="run", dry_run=True).warnings
