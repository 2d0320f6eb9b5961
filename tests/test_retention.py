"""Retention semantics against a small reference model, over random snapshot sets."""

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptvault.errors import UsageError
from ckptvault.snapshot.model import Snapshot, SnapshotSummary
from ckptvault.snapshot.retention import RetentionPolicy, plan_retention

T0 = datetime(2026, 11, 1, tzinfo=timezone.utc)


def make(i: int, minutes: int, tags: dict[str, str], host: str = "h") -> Snapshot:
    return Snapshot(
        id=f"{i:064x}",
        time=T0 + timedelta(minutes=minutes),
        hostname=host,
        paths=["/c"],
        tags=tags,
        description="",
        parent=None,
        tree_id="00" * 32,
        summary=SnapshotSummary(),
    )


def model_forget(snaps: list[Snapshot], p: RetentionPolicy) -> set[str]:
    """The rules as the docs state them, written independently of the implementation."""
    considered = [s for s in snaps if all(s.tags.get(k) == v for k, v in p.tags.items())]
    groups: dict[str, list[Snapshot]] = {}
    for s in considered:
        key = "" if p.group_by is None else (s.hostname if p.group_by == "host" else s.tags.get(p.group_by, ""))
        groups.setdefault(key, []).append(s)
    forget = set()
    for members in groups.values():
        # newest: by time, and also by step among the members that have one (the better of the two ranks)
        by_time = sorted(members, key=lambda s: (s.time, s.id), reverse=True)
        rank_of = {s.id: r for r, s in enumerate(by_time)}
        stepped = [s for s in members if "step" in s.tags and s.tags["step"].isdigit()]
        by_step = sorted(stepped, key=lambda s: (int(s.tags["step"]), s.time, s.id), reverse=True)
        rank_of.update({s.id: min(r, rank_of[s.id]) for r, s in enumerate(by_step)})
        for s in members:
            rank = rank_of[s.id]
            protected = any(
                (k in s.tags and (not v or s.tags[k] == v)) for k, _, v in (t.partition("=") for t in p.keep_tags)
            )
            outside = p.keep_latest is None or rank >= p.keep_latest
            older = p.before is None or s.time < p.before
            if rank > 0 and not protected and outside and older:
                forget.add(s.id)
    # a run that keeps any snapshot keeps what `latest --tag run=R` takes: its highest step when every snapshot
    # of the run has one, else its newest by time
    for run in {s.tags["run"] for s in considered if "run" in s.tags}:
        members = [s for s in considered if s.tags.get("run") == run]
        if all(s.tags.get("step", "").isdigit() for s in members):
            taken = max(members, key=lambda s: (int(s.tags["step"]), s.time, s.id))
        else:
            taken = max(members, key=lambda s: (s.time, s.id))
        if any(s.id not in forget for s in members):
            forget.discard(taken.id)
    return forget


snapshot_sets = st.lists(
    st.tuples(
        st.integers(0, 10_000),  # minutes after T0
        st.sampled_from(["a", "b", "c"]),  # run
        st.one_of(st.none(), st.integers(0, 50)),  # step
        st.booleans(),  # milestone
        st.sampled_from(["h1", "h2"]),
    ),
    max_size=25,
)


@settings(max_examples=300)
@given(
    specs=snapshot_sets,
    keep_latest=st.one_of(st.none(), st.integers(1, 6)),
    before_minutes=st.one_of(st.none(), st.integers(0, 10_000)),
    group_by=st.sampled_from([None, "run", "host"]),
    only_run=st.sampled_from([None, "a"]),
    keep_tags=st.sampled_from([(), ("milestone",), ("run=b",)]),
)
def test_plan_matches_the_model(specs, keep_latest, before_minutes, group_by, only_run, keep_tags):
    if keep_latest is None and before_minutes is None:
        keep_latest = 2
    snaps = []
    for i, (minutes, run, step, milestone, host) in enumerate(specs):
        tags = {"run": run}
        if step is not None:
            tags["step"] = str(step)
        if milestone:
            tags["milestone"] = "yes"
        snaps.append(make(i, minutes, tags, host))
    policy = RetentionPolicy(
        keep_latest=keep_latest,
        before=None if before_minutes is None else T0 + timedelta(minutes=before_minutes),
        tags={"run": only_run} if only_run else {},
        keep_tags=keep_tags,
        group_by=group_by,
    )
    plan = plan_retention(snaps, policy)
    assert {s.id for s in plan.forget} == model_forget(snaps, policy)
    assert len(plan.keep) + len(plan.forget) == len(snaps)
    assert all(d.reason for d in plan.decisions)


def test_both_rules_must_agree():
    snaps = [make(i, minutes=i * 60 * 24, tags={"run": "x"}) for i in range(10)]  # one per day
    before = T0 + timedelta(days=5)
    plan = plan_retention(snaps, RetentionPolicy(keep_latest=2, before=before))
    assert [s.id for s in plan.forget] == [s.id for s in snaps[:5]]  # days 0-4: outside newest 2 AND older
    only_age = plan_retention(snaps, RetentionPolicy(before=before))
    assert len(only_age.forget) == 5
    only_count = plan_retention(snaps, RetentionPolicy(keep_latest=2))
    assert len(only_count.forget) == 8


def test_a_date_given_in_another_zone_is_shown_in_utc():
    snaps = [make(i, minutes=i * 60 * 24, tags={}) for i in range(4)]  # one a day from 2026-11-01 00:00 UTC
    before = datetime(2026, 11, 2, 5, 30, tzinfo=timezone(timedelta(hours=5)))  # 00:30 UTC
    reasons = {d.snapshot.id: d.reason for d in plan_retention(snaps, RetentionPolicy(before=before)).decisions}
    assert reasons[snaps[0].id] == "older than 2026-11-02 00:30 UTC"  # said 05:30 UTC
    assert reasons[snaps[2].id] == "not older than 2026-11-02 00:30 UTC"


def test_newest_of_a_group_survives_any_date():
    snaps = [make(i, i, {"run": "x"}) for i in range(3)]
    plan = plan_retention(snaps, RetentionPolicy(before=T0 + timedelta(days=365)))
    assert [s.id for s in plan.keep] == [snaps[-1].id]


@pytest.mark.parametrize(
    "kwargs", [{"group_by": "run"}, {"keep_tags": ("k",)}, {"keep_latest": 0}, {"before": datetime(2026, 1, 1)}]
)
def test_bad_policies(kwargs):
    with pytest.raises(UsageError):
        RetentionPolicy(**kwargs)


def test_no_rule_keeps_every_snapshot():
    snaps = [make(i, i, {"run": "x"}) for i in range(3)]
    assert plan_retention(snaps, RetentionPolicy()).forget == []


def test_steps_of_another_run_never_push_out_the_snapshots_saved_last():
    # run a: steps 1000-3000 a month ago; run b (or a restart): steps 100-200, saved last
    old = [make(i, i, {"run": "a", "step": str(1000 * (i + 1))}) for i in range(3)]
    new = [make(10 + i, 40_000 + i, {"run": "b", "step": str(100 * (i + 1))}) for i in range(2)]
    plan = plan_retention(old + new, RetentionPolicy(keep_latest=2))
    kept = {d.snapshot.id for d in plan.decisions if d.keep}
    assert {s.id for s in new} <= kept  # newest by time
    assert {old[2].id, old[1].id} <= kept  # the highest steps
    assert old[0].id not in kept


def test_a_backup_without_a_step_saved_last_does_not_push_out_the_highest_step():
    """`restore latest` warned that the stepless save hid step 6 and named it as the one to resume from;
    `prune --keep-latest 1` then removed step 6 without a word (mw48 #2)."""
    steps = [make(i, i, {"run": "b", "step": str(i + 1)}) for i in range(6)]
    manual = make(10, 100, {"run": "b"})
    plan = plan_retention([*steps, manual], RetentionPolicy(keep_latest=1, group_by="run"))
    assert {d.snapshot.id for d in plan.decisions if d.keep} == {steps[-1].id, manual.id}


def test_grouped_by_host_a_run_keeps_what_latest_takes_and_an_emptied_run_is_named():
    """rv50/h5 #1: grouped by host, runs compared across a host: run x's highest step (20, on nodeB where run b saved
    step 200) went while its step 5, saved last, stayed, so `latest --tag run=x` fell back to step 5; and run a
    went whole (nodeA's newest is run x's) without the warning an ungrouped prune gives."""
    from ckptvault.snapshot.retention import retention_warnings

    a1, a2 = make(1, 1, {"run": "a", "step": "1"}, "nodeA"), make(2, 2, {"run": "a", "step": "2"}, "nodeA")
    x10 = make(3, 3, {"run": "x", "step": "10"}, "nodeA")
    b1, b2 = make(4, 4, {"run": "b", "step": "100"}, "nodeB"), make(5, 5, {"run": "b", "step": "200"}, "nodeB")
    x20, x5 = make(6, 6, {"run": "x", "step": "20"}, "nodeB"), make(7, 7, {"run": "x", "step": "5"}, "nodeB")
    policy = RetentionPolicy(keep_latest=1, group_by="host")
    plan = plan_retention([a1, a2, x10, b1, b2, x20, x5], policy)
    kept = {d.snapshot.id: d.reason for d in plan.decisions if d.keep}
    assert set(kept) == {x10.id, b2.id, x5.id, x20.id}, kept  # run a: x10 is nodeA's newest and highest step
    assert kept[x20.id].startswith("what latest takes of run=x"), kept
    said = retention_warnings(plan, policy, dry_run=True)
    assert said == [
        "run=a would have no snapshot left: keep_latest counts the snapshots of each host's runs together; "
        'group_by="run" keeps the newest N of each'
    ], said


def test_an_ungrouped_prune_names_the_hosts_it_leaves_with_nothing():
    """Three nodes shipping to one vault; `prune --keep-latest 1` kept one node's newest and removed every
    other node's snapshots without a word (mw48 #1)."""
    from ckptvault.snapshot.retention import retention_warnings

    snaps = [make(3 * n + i, 3 * n + i, {"job": f"node{n}"}, host=f"node{n}") for n in (1, 2, 3) for i in (0, 1)]
    policy = RetentionPolicy(keep_latest=1)
    said = retention_warnings(plan_retention(snaps, policy), policy, dry_run=True)
    assert said == [
        "host node1, node2 would have no snapshot left: keep_latest counts the snapshots of all 3 hosts together; "
        'group_by="host" keeps the newest N of each'
    ], said
    grouped = RetentionPolicy(keep_latest=1, group_by="host")
    assert retention_warnings(plan_retention(snaps, grouped), grouped, dry_run=True) == []
    # hosts a --tag leaves out are not counted, nor named (rv48 M5)
    scoped = RetentionPolicy(keep_latest=1, tags={"job": "node1"})
    assert retention_warnings(plan_retention(snaps, scoped), scoped, dry_run=True) == []
