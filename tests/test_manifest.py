from dataclasses import replace
from datetime import datetime, timezone

import pytest

from ckptvault import errors
from ckptvault.errors import (
    MalformedObjectError,
    SnapshotNotFoundError,
    UnsafePathError,
    UnsupportedFormatError,
    UsageError,
)
from ckptvault.snapshot.manifest import decode_snapshot, decode_tree, encode_snapshot, encode_tree
from ckptvault.snapshot.model import FileEntry, Snapshot, SnapshotSummary, format_tags
from ckptvault.snapshot.retention import RetentionPolicy, plan_retention, retention_warnings
from ckptvault.snapshot.selection import higher_step_passed_over, select


def entry(path, type="file", **kw):
    if type == "file":
        kw.setdefault("size", 3)
        kw.setdefault("chunks", [b"\1" * 32])
        kw.setdefault("blake3", "00")
    return FileEntry(path=path, type=type, mode=0o644, mtime_ns=1, **kw)


def test_tree_round_trip():
    tree = [entry("a"), entry("d", "dir"), entry("d/l", "symlink", target="../a"), entry("d/f", inode=5, ctime_ns=7)]
    assert decode_tree(encode_tree(tree)) == tree


@pytest.mark.parametrize("path", ["../evil", "/etc/passwd", "a/../../b", "a//b", "./a", "", "a/\0"])
def test_unsafe_paths_are_refused(path):
    with pytest.raises(UnsafePathError):
        decode_tree(encode_tree([entry(path)]))


def test_duplicates_and_entries_below_symlinks_are_refused():
    with pytest.raises(UnsafePathError, match="twice"):
        decode_tree(encode_tree([entry("a"), entry("a")]))
    with pytest.raises(UnsafePathError, match="below a symlink"):
        decode_tree(encode_tree([entry("l", "symlink", target="/etc"), entry("l/passwd")]))


def test_garbage_tree_is_malformed():
    for raw in (b"not json", b"[]", b'{"version": 1}'):
        with pytest.raises(MalformedObjectError):
            decode_tree(raw)
    with pytest.raises(UnsupportedFormatError, match="newer"):
        decode_tree(b'{"version": 2, "entries": []}')


def snap(i, step=None, t=0, **tags):
    if step is not None:
        tags["step"] = str(step)
    return Snapshot(
        id=f"{i:02x}" * 32,
        time=datetime(2026, 1, 1, 0, 0, t, tzinfo=timezone.utc),
        hostname="h",
        paths=["/x"],
        tags=tags,
        description="",
        parent=None,
        tree_id="00" * 32,
        summary=SnapshotSummary(files=1),
    )


def test_snapshot_round_trip():
    s = snap(1, step=5, run="x")
    assert decode_snapshot(encode_snapshot(s)) == s
    assert b"excludes" not in encode_snapshot(s), "a snapshot without patterns is written as before the field"
    s = replace(s, excludes=["*.tmp", "./logs"])
    assert decode_snapshot(encode_snapshot(s)) == s


@pytest.mark.parametrize("excludes", ['"*.tmp"', "[1]", '[""]', "null"])
def test_excludes_that_are_not_a_list_of_patterns_are_malformed(excludes):
    raw = encode_snapshot(snap(1)).replace(b'"summary"', b'"excludes":' + excludes.encode() + b',"summary"')
    with pytest.raises(MalformedObjectError, match="excludes"):
        decode_snapshot(raw)


def test_latest_prefers_step_then_time():
    snaps = [snap(1, step=200, t=1, run="x"), snap(2, step=100, t=5, run="x"), snap(3, t=9, run="y")]
    assert select(snaps, "latest", {"run": "x"}).id == snaps[0].id  # step wins over upload time
    assert select(snaps, "latest").id == snaps[2].id  # not every snapshot has a step: time
    demo = snap(4, step=200, t=2, run="demo")  # the steps of two runs do not compare: time
    assert select([*snaps[:2], demo], "latest").id == snaps[1].id
    untagged = snap(5, step=50, t=9)  # a snapshot without a run tag is not of run x
    assert select([*snaps[:2], untagged], "latest").id == untagged.id
    unmatched = r"tags=\{'run': 'z'\} \(no snapshot has run=z; run is one of: x, y\)"
    with pytest.raises(SnapshotNotFoundError, match=unmatched):
        select(snaps, "latest", {"run": "z"})
    with pytest.raises(SnapshotNotFoundError, match=r"no snapshot has a tag 'rnu'; keys in use: run, step\)"):
        select(snaps, "latest", {"rnu": "x"})
    # the watch sidecar's internal signature is no key a user chose: not listed (it is in --json only)
    watched = [*snaps, snap(6, step=300, t=10, run="x", checkpoint="checkpoint-300", **{"watch-sig": "ab" * 8})]
    with pytest.raises(SnapshotNotFoundError, match=r"keys in use: checkpoint, run, step\)"):
        select(watched, "latest", {"rnu": "x"})
    with pytest.raises(UsageError, match=r"\(their tag keys: checkpoint, run, step\)"):
        plan_retention(watched, RetentionPolicy(keep_latest=1, group_by="rnu"))
    keep_tag = RetentionPolicy(keep_latest=1, keep_tags=("nosuch",))
    warned = retention_warnings(plan_retention(watched, keep_tag), keep_tag, dry_run=True)
    assert any("is on no snapshot (tag keys in use: checkpoint, run, step)" in w for w in warned), warned


def test_a_tag_no_selected_snapshot_carries_is_told_among_the_others_tags():
    """The values listed are those of the snapshots the tags before it select, steps in numeric order; a run
    whose snapshots carry no step at all got no hint (another run's step=21 made every tag "carried")."""
    snaps = [snap(1, run="a", step=3), snap(2, run="a", step=12), snap(3, run="a", step=30), snap(4, run="b", step=21)]
    listed = r"\(no snapshot with run=a has step=21; step is one of: 3, 12, 30\)"
    with pytest.raises(SnapshotNotFoundError, match=listed):
        select(snaps, "latest", {"run": "a", "step": "21"})
    stepless = [snap(5, run="c"), snaps[3]]
    with pytest.raises(SnapshotNotFoundError, match=r"\(no snapshot with run=c has a tag 'step'\)"):
        select(stepless, "latest", {"run": "c", "step": "21"})
    with pytest.raises(SnapshotNotFoundError, match=r"\(no snapshot has a tag 'stp'; keys in use: run, step\)"):
        select(stepless, "latest", {"run": "c", "stp": "21"})


def test_a_run_of_many_steps_lists_its_first_and_latest_steps():
    """A resume asking for a step its run lacks: the latest steps are the ones it likely meant."""
    snaps = [snap(i, run="a", step=100 * i) for i in range(1, 21)]
    listed = r"step is one of: 100, 200, 300, \.\.\., 1600, 1700, 1800, 1900, 2000 \(20 in all\)\)"
    with pytest.raises(SnapshotNotFoundError, match=listed):
        select(snaps, "latest", {"run": "a", "step": "2100"})


def test_latest_by_time_names_the_higher_step_it_passed_over():
    stepped = [snap(1, step=200, t=1, run="x"), snap(2, step=100, t=5, run="x")]
    assert higher_step_passed_over(stepped) is None  # steps decided
    manual = snap(3, t=9, run="x")  # e.g. a backup without --tag step=N: the run now goes by time
    assert select([*stepped, manual], "latest").id == manual.id
    note = higher_step_passed_over([*stepped, manual])
    assert note == (
        f"latest is snapshot {manual.id[:8]} by time, not by step: 1 snapshot of the run has no step tag, so steps "
        f"were not compared; the highest step is snapshot {stepped[0].id[:8]} (step=200): give its ID instead of "
        "latest if that is the save to resume from"
    )
    # an old stepless snapshot lets a step uploaded late win by time: the note names the higher one
    first = snap(4, t=0, run="x")
    late = snap(5, step=150, t=10, run="x")
    assert select([first, *stepped, late], "latest").id == late.id
    assert "2 snapshots of the run have no step tag" in higher_step_passed_over([first, manual, *stepped, late])
    assert f"is snapshot {stepped[0].id[:8]} (step=200)" in higher_step_passed_over([first, *stepped, late])
    # nothing to say: the highest step is the newest anyway, no step at all, or two runs (steps do not compare)
    assert higher_step_passed_over([first, snap(7, step=100, t=1, run="x"), snap(8, step=200, t=2, run="x")]) is None
    assert higher_step_passed_over([first, manual]) is None
    assert higher_step_passed_over([*stepped, snap(6, t=9, run="y")]) is None
    assert higher_step_passed_over([]) is None


def test_a_step_is_a_number_only_in_ascii_digits():
    assert [snap(i, step=v).step for i, v in enumerate(["1200", "-3", "007"])] == [1200, -3, 7]
    assert [snap(i, step=v).step for i, v in enumerate(["1_000", " 12", "+5", "\u0661\u0662", "", "1e3"])] == [None] * 6
    # a step int() alone would read as 1000 does not win "latest" over a later save: its run is ordered by time
    snaps = [snap(1, step="1_000", t=1, run="x"), snap(2, step="900", t=2, run="x")]
    assert select(snaps, "latest").id == snaps[1].id


def test_tags_holding_commas_or_spaces_read_as_one_tag_in_messages(monkeypatch: pytest.MonkeyPatch):
    snaps = [snap(1, t=1, note="a,b"), snap(2, t=2, note="x"), snap(3, t=3, note=" y")]
    with pytest.raises(SnapshotNotFoundError) as caught:
        select(snaps, "latest", {"note": "a"})
    assert 'note is one of: " y", "a,b", x' in str(caught.value)
    with pytest.raises(SnapshotNotFoundError) as caught:
        select(snaps, snaps[0].id[:8], {"note": "x y"})
    assert 'does not carry note=x y (its tags: note="a,b")' in str(caught.value)
    monkeypatch.setattr(errors, "_command_line", True)  # as the CLI words it: a command line to paste
    with pytest.raises(SnapshotNotFoundError, match=r"ckptvault snapshots --tag 'note=x y'$"):
        select(snaps, snaps[0].id[:8], {"note": "x y"})
    assert format_tags({"note": "a,b", "run": "x"}) == 'note="a,b",run=x'


def test_prefix_selection():
    snaps = [snap(0x11), snap(0x12)]
    assert select(snaps, "1111").id == snaps[0].id
    with pytest.raises(SnapshotNotFoundError, match="ambiguous"):
        select(snaps, "1")
    with pytest.raises(UsageError):
        select(snaps, "xyz")


def test_tree_of_200gb_in_100k_chunks_stays_small():
    """The scale the format promises: 100k chunks (200 GB at 2 MB) in one tree object."""
    import os

    from ckptvault.blob import BlobCodec, ChecksumSealer, Kind
    from ckptvault.codec import CompressionSettings, Compressor

    entries = [
        FileEntry(
            path=f"shard-{i:03d}.safetensors",
            type="file",
            mode=0o644,
            mtime_ns=i,
            size=1000 * 2_000_000,
            blake3="ab" * 32,
            chunks=[os.urandom(32) for _ in range(1000)],
        )
        for i in range(100)
    ]
    raw = encode_tree(entries)
    blob = BlobCodec(Compressor(CompressionSettings()), ChecksumSealer()).encode(Kind.TREE, b"\0" * 32, raw)
    assert len(raw) < 8_000_000 and len(blob) < 5_000_000
    assert decode_tree(raw) == entries
