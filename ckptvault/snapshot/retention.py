"""Retention: which snapshots a prune keeps, as a pure function of (snapshots, policy, now).

A snapshot is forgotten only when every given rule says so: with both ``keep_latest`` and
``before`` it must be outside the newest N of its group AND older than the date. Snapshots
not matching ``tags`` are not considered (kept), ``keep_tags`` protect, and the newest
snapshot of every group is always kept, so no policy can empty a group by mistake. "Newest"
counts by time and, among the snapshots of the group with a numeric ``step`` tag, by step too:
a snapshot among the newest N either way is kept. A run that keeps any snapshot keeps the one ``latest``
takes of it (its highest step), whatever the grouping.

``group_by`` names a tag key (or ``host``). A typo there would put every snapshot into one
group and forget all but one of them, so a key that none of the selected snapshots carries
is refused with a UsageError listing the keys they do carry. When only some carry it, those
lacking it form a group of their own, labelled ``(no tag KEY)``, that is never merged with a
real value (not even the empty one, ``KEY=``); the policy applies to it like to any group
(its newest is kept), and every decision names its group so a dry run shows which is which.

A ``keep_tags`` entry that no snapshot carries protects nothing. When it is one typo away from a
tag that is in use (``kep`` for ``keep``, ``keep=bets`` for ``keep=best``, ``Keep``; not words with
digits, such as ``step=5000`` beside ``step=4000``) it is refused, as the snapshots it was meant to
protect would go; another (``milestone`` before the first milestone is tagged) is taken, and the
CLI says it protects nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

from ..errors import UsageError, spelled
from .model import Snapshot
from .selection import by_step, newest, tag_keys_in_use, tag_options, unmatched_tags


@dataclass(frozen=True)
class RetentionPolicy:
    keep_latest: int | None = None
    before: datetime | None = None
    tags: dict[str, str] = field(default_factory=dict)  # only snapshots with all of these are considered
    keep_tags: tuple[str, ...] = ()  # "key" or "key=value": snapshots carrying one are kept
    group_by: str | None = None  # a tag key, or "host"

    def __post_init__(self) -> None:
        if self.group_by is not None and not self.group_by.strip():
            raise UsageError(f"{spelled('--group-by', 'group_by')} is empty; give a tag key (e.g. 'run') or 'host'")
        for spec in self.keep_tags:
            if not spec.partition("=")[0].strip():
                raise UsageError(
                    f"{spelled('--keep-tag', 'keep_tags')}: {spec!r} has no key; give key or key=value, e.g. milestone"
                )
        if self.keep_latest is None and self.before is None and (self.tags or self.keep_tags or self.group_by):
            given = spelled("--tag, --keep-tag and --group-by", "tags, keep_tags and group_by")
            raise UsageError(
                f"{given} shape a rule, and none was given: add "
                + spelled("--keep-latest N and/or --before DATE", "keep_latest and/or before")
                + " (a prune with no rule at all removes no snapshot, only the data no snapshot needs)"
            )
        if self.keep_latest is not None and self.keep_latest < 1:
            raise UsageError(
                f"{spelled('--keep-latest', 'keep_latest')} must be at least 1 "
                f"(to remove given snapshots use: {spelled('ckptvault forget ID', 'Vault.forget([...])')})"
            )
        if self.before is not None and self.before.tzinfo is None:
            raise UsageError(
                f"the {spelled('--before', 'before')} time needs a time zone, e.g. "
                + spelled("2026-11-16T12:00Z", "datetime(2026, 11, 16, tzinfo=timezone.utc)")
            )
        if self.before is not None:
            try:  # kept in UTC: a time at the very ends of the calendar has no UTC equivalent
                object.__setattr__(self, "before", self.before.astimezone(timezone.utc))
            except OverflowError:
                raise UsageError(
                    f"the {spelled('--before', 'before')} time {self.before.isoformat()} is out of range in UTC"
                ) from None


@dataclass(frozen=True)
class Decision:
    snapshot: Snapshot
    keep: bool
    reason: str
    group: str | None = None  # the group's label, with --group-by: "run=a", "host=h1" or "(no tag run)"


@dataclass(frozen=True)
class RetentionPlan:
    decisions: list[Decision]

    @property
    def keep(self) -> list[Snapshot]:
        return [d.snapshot for d in self.decisions if d.keep]

    @property
    def forget(self) -> list[Snapshot]:
        return [d.snapshot for d in self.decisions if not d.keep]


def group_key(snap: Snapshot, group_by: str | None) -> tuple[bool, str]:
    """``(has the key, value)``: a snapshot lacking the tag never shares a group with a real value."""
    if group_by is None:
        return (True, "")
    if group_by == "host":
        return (True, snap.hostname)
    return (group_by in snap.tags, snap.tags.get(group_by, ""))


def group_label(key: tuple[bool, str], group_by: str | None) -> str | None:
    if group_by is None:
        return None
    present, value = key
    return f"{group_by}={value}" if present else missing_group_label(group_by)


def missing_group_label(group_by: str) -> str:
    return f"(no tag {group_by})"


def _protected(snap: Snapshot, keep_tags: tuple[str, ...]) -> str | None:
    for spec in keep_tags:
        key, sep, value = spec.partition("=")
        if key in snap.tags and (not sep or snap.tags[key] == value):
            return f"has tag {spec}"
    return None


def _check_group_key(selected: list[Snapshot], policy: RetentionPolicy) -> None:
    key = policy.group_by
    if key is None or key == "host" or not selected or any(key in s.tags for s in selected):
        return
    n = len(selected)
    which = f"{n} snapshot{'s' if n != 1 else ''}" + (f" selected by {spelled('--tag', 'tags')}" if policy.tags else "")
    keys = tag_keys_in_use(selected)
    if keys:
        more = f", ... ({len(keys)} in all)" if len(keys) > 8 else ""
        theirs = "their tag keys: " + ", ".join(keys[:8]) + more
    else:
        theirs = "they have no tags"
    raise UsageError(
        f"{spelled('--group-by', 'group_by')} tag key {key!r} is on none of the {which} ({theirs}); "
        "check the spelling, or group by 'host'"
    )


def unused_keep_tags(snapshots: list[Snapshot], keep_tags: tuple[str, ...]) -> list[str]:
    """The ``keep_tags`` entries that no snapshot carries."""
    return [spec for spec in keep_tags if not any(_protected(s, (spec,)) for s in snapshots)]


def _typo_of(given: str, known: set[str]) -> str | None:
    """The word in ``known`` that ``given`` is one slip away from: another case, or one letter added,
    dropped, changed or swapped with its neighbour, in words of four letters or more. Not for words
    with digits: steps, versions and dates differ by one character on purpose (``step=5000``)."""
    if any(c.isdigit() for c in given):
        return None
    for word in sorted(known):
        if len(word) < 4 or any(c.isdigit() for c in word):
            continue
        if word.lower() == given.lower() or _one_edit_apart(given, word):
            return word
    return None


def _one_edit_apart(a: str, b: str) -> bool:
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        swapped = len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]
        return len(diff) == 1 or swapped
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


def _check_keep_tags(snapshots: list[Snapshot], policy: RetentionPolicy) -> None:
    for spec in unused_keep_tags(snapshots, policy.keep_tags):
        key, sep, value = spec.partition("=")
        if sep and not value:  # `--keep-tag milestone=$M` with the variable unset: protecting nothing, say so first
            raise UsageError(
                f"{spelled('--keep-tag', 'keep_tags')} {spec!r} has an empty value (is a variable unset?) and is on "
                f"no snapshot: as given it protects nothing; give {key}=VALUE, or {key!r} alone for every value"
            )
        keys = {k for s in snapshots for k in s.tags}
        if key in keys:
            near = _typo_of(value, {s.tags[key] for s in snapshots if key in s.tags}) if sep else None
            meant = None if near is None else f"{key}={near}"
        else:
            near = _typo_of(key, keys)
            meant = None if near is None else near + spec[len(key) :]
        if meant is not None:
            raise UsageError(
                f"{spelled('--keep-tag', 'keep_tags')} {spec!r} is on no snapshot; did you mean {meant!r}? "
                "Check the spelling: as given it protects nothing, and the snapshots it was meant for could go"
            )


def plan_retention(snapshots: list[Snapshot], policy: RetentionPolicy) -> RetentionPlan:
    """Decide every snapshot. Raises UsageError, before deciding anything, when ``group_by``
    is a tag key that none of the selected snapshots carries (see the module docstring)."""
    if policy.keep_latest is None and policy.before is None:  # garbage collection only, as restic's prune
        return RetentionPlan([Decision(s, True, "no rule given") for s in snapshots])
    decisions: dict[str, Decision] = {}
    groups: dict[tuple[bool, str], list[Snapshot]] = {}
    selected: list[Snapshot] = []
    for snap in snapshots:
        if not snap.matches(policy.tags):
            decisions[snap.id] = Decision(snap, True, f"not selected by {spelled('--tag', 'tags')}")
        else:
            selected.append(snap)
            groups.setdefault(group_key(snap, policy.group_by), []).append(snap)
    _check_group_key(selected, policy)
    _check_keep_tags(snapshots, policy)
    for key, members in groups.items():
        label = group_label(key, policy.group_by)
        # "Newest" by time and, among the members with a step, by step too; a snapshot keeps the
        # better rank. By step alone, the steps of another run or of a restarted one (lower, yet
        # saved last) were pruned first; by time alone, an older step shipped late would push out
        # the highest one, and so would a save without a step tag (a manual backup) saved after it.
        # Unlike ``latest``, the steps of several runs count too: the rank only ever keeps more.
        by_time = sorted(members, key=lambda s: (s.time, s.id), reverse=True)
        rank = {snap.id: r for r, snap in enumerate(by_time)}
        for r, snap in enumerate(reversed(by_step([s for s in members if s.step is not None]) or [])):
            rank[snap.id] = min(r, rank[snap.id])
        for snap in members:
            decisions[snap.id] = replace(_decide(snap, rank[snap.id], policy), group=label)
    _keep_what_latest_takes(selected, decisions)
    return RetentionPlan([decisions[s.id] for s in snapshots])


def _keep_what_latest_takes(selected: list[Snapshot], decisions: dict[str, Decision]) -> None:
    """A run that keeps any snapshot keeps the one ``latest --tag run=R`` takes (its highest step): grouped by
    host, a run's highest step saved on a host where another run saved last went (rank by time and steps
    compared across the host's runs), while a lower step of the run was kept, and the run's resume point fell
    back to that lower step without a word."""
    runs: dict[str, list[Snapshot]] = {}
    for snap in selected:
        if "run" in snap.tags:
            runs.setdefault(snap.tags["run"], []).append(snap)
    for run, members in runs.items():
        taken = newest(members)
        if not decisions[taken.id].keep and any(decisions[s.id].keep for s in members):
            reason = f"what latest takes of run={run}, whose other snapshots are kept (a resume would go back)"
            decisions[taken.id] = replace(decisions[taken.id], keep=True, reason=reason)


def _utc(when: datetime) -> str:
    """``--before 2026-12-01T05:00+05:00`` is 00:00 UTC, and says so (to the second when it has any)."""
    return f"{when:%Y-%m-%d %H:%M}{f':{when:%S}' if when.second or when.microsecond else ''} UTC"


def _decide(snap: Snapshot, rank: int, policy: RetentionPolicy) -> Decision:
    if rank == 0:
        return Decision(snap, True, "newest of its group (always kept)")
    protected = _protected(snap, policy.keep_tags)
    if protected:
        return Decision(snap, True, protected)
    if policy.keep_latest is not None and rank < policy.keep_latest:
        return Decision(snap, True, f"within the newest {policy.keep_latest}")
    if policy.before is not None and snap.time >= policy.before:
        return Decision(snap, True, f"not older than {_utc(policy.before)}")
    outside = f"outside the newest {policy.keep_latest}" if policy.keep_latest is not None else ""
    older = f"older than {_utc(policy.before)}" if policy.before is not None else ""
    return Decision(snap, False, " and ".join(p for p in (outside, older) if p))


def retention_warnings(plan: RetentionPlan, policy: RetentionPolicy, *, dry_run: bool) -> list[str]:
    """What whoever asked for a prune by ``policy`` should be told: a tag rule that selected or protected
    nothing (a typo), snapshots grouped together for want of the group-by tag, and runs left with no
    snapshot because the newest N were counted over every run together."""
    snapshots = [d.snapshot for d in plan.decisions]
    said: list[str] = []
    if policy.tags and snapshots and not any(s.matches(policy.tags) for s in snapshots):
        given = spelled(tag_options(policy.tags).strip(), f"tags={policy.tags}")
        said.append(f"{given} selects no snapshot{unmatched_tags(snapshots, policy.tags)}; none removed")
    for spec in unused_keep_tags(snapshots, policy.keep_tags):
        keys = ", ".join(tag_keys_in_use(snapshots)) or "none"
        given = spelled(f"--keep-tag {spec}", f"keep_tags entry {spec!r}")
        said.append(f"{given} is on no snapshot (tag keys in use: {keys}); it protected nothing")
    group_by = policy.group_by
    if group_by is not None and group_by != "host":
        label = missing_group_label(group_by)
        lacking = sum(d.group == label for d in plan.decisions)
        if lacking:
            grouped = sum(d.group is not None for d in plan.decisions)
            said.append(
                f"{lacking} of {grouped} snapshot(s) have no tag {group_by!r}; "
                f"they are pruned as one group, {label!r}, whose newest is kept"
            )
    has = "would have" if dry_run else "has"
    considered = [s for s in snapshots if s.matches(policy.tags)]

    def say_emptied(key: str, values: set[str], kept: set[str], shown: Callable[[list[str]], str]) -> None:
        if group_by == key or not (emptied := sorted(values - kept)):
            return
        together = f"all {len(values)} {key}s together" if group_by is None else f"each {group_by}'s {key}s together"
        rule = (
            f"{spelled('--keep-latest', 'keep_latest')} counts the snapshots of {together}"
            if policy.keep_latest
            else f"the one snapshot kept whatever its age is the newest of {together}"
        )
        by = spelled(f"--group-by {key}", f'group_by="{key}"')
        each = "N" if policy.keep_latest else "one"
        said.append(f"{shown(emptied)} {has} no snapshot left: {rule}; {by} keeps the newest {each} of each")

    runs = {s.tags["run"] for s in considered if "run" in s.tags}
    say_emptied(
        "run",
        runs,
        {s.tags["run"] for s in plan.keep if "run" in s.tags},
        lambda e: ", ".join(f"run={r}" for r in e),
    )
    # nodes of one job shipping to one vault, told apart by host (restic groups by host by default)
    hosts = {s.hostname for s in considered}
    say_emptied("host", hosts, {s.hostname for s in plan.keep}, lambda e: f"host {', '.join(e)}")
    return said
