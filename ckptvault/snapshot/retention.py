"""Retention: which snapshots a prune keeps, as a pure function of (snapshots, policy, now).

A snapshot is forgotten only when every given rule says so: with both ``keep_latest`` and
``before`` it must be outside the newest N of its group AND older than the date. Snapshots
not matching ``tags`` are not considered (kept), ``keep_tags`` protect, and the newest
snapshot of every group is always kept, so no policy can empty a group by mistake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from ..errors import UsageError
from .model import Snapshot
from .selection import ordered


@dataclass(frozen=True)
class RetentionPolicy:
    keep_latest: int | None = None
    before: datetime | None = None
    tags: dict[str, str] = field(default_factory=dict)  # only snapshots with all of these are considered
    keep_tags: tuple[str, ...] = ()  # "key" or "key=value": snapshots carrying one are kept
    group_by: str | None = None  # a tag key, or "host"

    def __post_init__(self) -> None:
        if self.keep_latest is None and self.before is None:
            raise UsageError("prune needs a rule: give --keep-latest N and/or --before DATE")
        if self.keep_latest is not None and self.keep_latest < 1:
            raise UsageError("--keep-latest must be at least 1 (to remove given snapshots use: ckptvault forget ID)")
        if self.before is not None and self.before.tzinfo is None:
            raise UsageError("the --before time needs a time zone")


@dataclass(frozen=True)
class Decision:
    snapshot: Snapshot
    keep: bool
    reason: str


@dataclass(frozen=True)
class RetentionPlan:
    decisions: list[Decision]

    @property
    def keep(self) -> list[Snapshot]:
        return [d.snapshot for d in self.decisions if d.keep]

    @property
    def forget(self) -> list[Snapshot]:
        return [d.snapshot for d in self.decisions if not d.keep]


def group_key(snap: Snapshot, group_by: str | None) -> str:
    if group_by is None:
        return ""
    if group_by == "host":
        return snap.hostname
    return snap.tags.get(group_by, "")


def _protected(snap: Snapshot, keep_tags: tuple[str, ...]) -> str | None:
    for spec in keep_tags:
        key, sep, value = spec.partition("=")
        if key in snap.tags and (not sep or snap.tags[key] == value):
            return f"has tag {spec}"
    return None


def plan_retention(snapshots: list[Snapshot], policy: RetentionPolicy) -> RetentionPlan:
    decisions: dict[str, Decision] = {}
    groups: dict[str, list[Snapshot]] = {}
    for snap in snapshots:
        if not snap.matches(policy.tags):
            decisions[snap.id] = Decision(snap, True, "not selected by --tag")
        else:
            groups.setdefault(group_key(snap, policy.group_by), []).append(snap)
    for members in groups.values():
        newest_first = ordered(members)[::-1]
        for rank, snap in enumerate(newest_first):
            decisions[snap.id] = _decide(snap, rank, policy)
    return RetentionPlan([decisions[s.id] for s in snapshots])


def _decide(snap: Snapshot, rank: int, policy: RetentionPolicy) -> Decision:
    if rank == 0:
        return Decision(snap, True, "newest of its group (always kept)")
    protected = _protected(snap, policy.keep_tags)
    if protected:
        return Decision(snap, True, protected)
    if policy.keep_latest is not None and rank < policy.keep_latest:
        return Decision(snap, True, f"within the newest {policy.keep_latest}")
    if policy.before is not None and snap.time >= policy.before:
        return Decision(snap, True, f"not older than {policy.before:%Y-%m-%d %H:%M} UTC")
    outside = f"outside the newest {policy.keep_latest}" if policy.keep_latest is not None else ""
    older = f"older than {policy.before:%Y-%m-%d %H:%M} UTC" if policy.before is not None else ""
    return Decision(snap, False, " and ".join(p for p in (outside, older) if p))
