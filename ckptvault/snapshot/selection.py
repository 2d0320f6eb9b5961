"""Choosing snapshots: by unique ID prefix, or ``latest`` among those matching tags and hosts.

Tags and hosts select as restic's ``--tag`` and ``--host``: a snapshot must carry every given tag, and
be of one of the given hosts (none given: any host)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from ..errors import SnapshotNotFoundError, UsageError, spelled
from ..units import counted
from .model import WATCH_SIG_TAG, Snapshot, format_tags, shown_tag_part


def filter_by_tags(snapshots: list[Snapshot], tags: dict[str, str] | None) -> list[Snapshot]:
    return [s for s in snapshots if s.matches(tags)]


def filter_by_hosts(snapshots: list[Snapshot], hosts: Sequence[str] | None) -> list[Snapshot]:
    """Those of any of ``hosts`` (None or empty: every snapshot)."""
    return [s for s in snapshots if s.hostname in hosts] if hosts else list(snapshots)


def matching(
    snapshots: list[Snapshot], tags: dict[str, str] | None, hosts: Sequence[str] | None = None
) -> list[Snapshot]:
    """Those carrying every tag of ``tags`` and of one of ``hosts``."""
    return filter_by_hosts(filter_by_tags(snapshots, tags), hosts)


def ordered(snapshots: list[Snapshot]) -> list[Snapshot]:
    """Oldest to newest: by ``step`` tag when every snapshot has a numeric one and all are of one
    run (the same ``run`` tag, or none), else by time.

    A run resumes from its highest step even if an older step was uploaded later
    (async shipping can reorder them); retention counts "newest" both this way and by time. The
    steps of different runs do not compare: the demo's step 200 is not newer than a run's step 150."""
    stepped = by_step(snapshots)
    if stepped is not None and len({s.tags.get("run") for s in snapshots}) <= 1:
        return stepped
    return sorted(snapshots, key=lambda s: (s.time, s.id))  # the ID only breaks exact ties


def by_step(snapshots: list[Snapshot]) -> list[Snapshot] | None:
    """Lowest to highest ``step`` tag (then time), or None when a snapshot has no numeric step."""
    if any(s.step is None for s in snapshots):
        return None
    return sorted(snapshots, key=lambda s: (s.step, s.time, s.id))


def newest(snapshots: list[Snapshot]) -> Snapshot:
    return ordered(snapshots)[-1]


RESUMING = "give its ID instead of latest if that is the save to resume from"


def higher_step_passed_over(snapshots: list[Snapshot], then: str = RESUMING) -> str | None:
    """What to tell a user whose ``latest`` went by time and so passed over a higher step of the same
    run: one snapshot without a step tag makes steps incomparable (a manual backup without ``--tag
    step=N``, a Lightning ``last.ckpt`` of no known step), and a resume would silently go back to an
    older save. None where steps decided, or where the highest step is the one taken anyway. ``then``: what
    to do about it, for the command that took latest."""
    if not snapshots or len({s.tags.get("run") for s in snapshots}) > 1 or by_step(snapshots) is not None:
        return None
    stepped = by_step([s for s in snapshots if s.step is not None])
    taken = newest(snapshots)
    if not stepped or stepped[-1] is taken:
        return None
    highest = stepped[-1]
    stepless = sum(s.step is None for s in snapshots)
    return (
        f"latest is snapshot {taken.id[:8]} by time, not by step: {counted(stepless, 'snapshot')} of the run "
        f"{'has' if stepless == 1 else 'have'} no step tag, so steps were not compared; the highest step is snapshot "
        f"{highest.id[:8]} (step={highest.step}): {then}"
    )


def tag_options(tags: dict[str, str]) -> str:
    return "".join(f" --tag {shlex.quote(f'{k}={v}')}" for k, v in tags.items())


def host_options(hosts: Sequence[str]) -> str:
    return "".join(f" --host {shlex.quote(h)}" for h in hosts)


def selector_options(tags: dict[str, str] | None, hosts: Sequence[str] | None = None) -> str:
    """How the CLI spells the selection: `` --host nodeB --tag run=x`` (each with a leading space)."""
    return host_options(hosts or ()) + tag_options(tags or {})


def _api_selector(tags: dict[str, str] | None, hosts: Sequence[str] | None) -> str:
    return ", ".join([f"hosts={list(hosts or ())}"] * bool(hosts) + [f"tags={tags}"] * bool(tags))


def _describe(tags: dict[str, str] | None, hosts: Sequence[str] | None = None) -> str:
    if not tags and not hosts:
        return ""
    return spelled(selector_options(tags, hosts), f" with {_api_selector(tags, hosts).replace(', ', ' and ')}")


def listing_of(tags: dict[str, str] | None, hosts: Sequence[str] | None = None) -> str:
    """The command (or call) that lists the snapshots a selection takes."""
    return spelled(
        f"ckptvault snapshots{selector_options(tags, hosts)}", f"Vault.snapshots({_api_selector(tags, hosts)})"
    )


NO_SNAPSHOTS_YET = " (the vault has no snapshots yet)"  # why a selection from an empty vault takes none
NONE_READABLE = " (no snapshot of the vault can be read: see the warning above)"  # an empty listing of damage


def _nothing_listed(none_readable: bool) -> str:
    return NONE_READABLE if none_readable else NO_SNAPSHOTS_YET


def tag_keys_in_use(snapshots: list[Snapshot]) -> list[str]:
    """The tag keys a message lists as those in use: without the watch sidecar's internal signature."""
    return sorted({k for s in snapshots for k in s.tags} - {WATCH_SIG_TAG})


def unmatched_tags(snapshots: list[Snapshot], tags: dict[str, str], *, none_readable: bool = False) -> str:
    """Which given tag no snapshot carries, and what there is instead (a typo's likely fix).
    ``none_readable``: the listing is empty because no snapshot object could be read, not for want of any."""
    if tags and not snapshots:
        return _nothing_listed(none_readable)
    pool, matched = snapshots, dict[str, str]()
    for key, value in tags.items():
        # among the snapshots the tags before this one select: the steps of run=x, not of every run
        values = sorted({s.tags[key] for s in pool if key in s.tags}, key=_tag_value_order)
        if not values and matched and any(key in s.tags for s in snapshots):  # another run's key, not this one's
            return f" (no snapshot with {format_tags(matched)} has a tag {key!r})"
        if not values:
            keys = tag_keys_in_use(snapshots)
            return f" (no snapshot has a tag {key!r}; keys in use: {', '.join(keys) or 'none'})"
        if value not in values:
            # the lowest and the highest (a run's first and latest steps), where there are many
            shown = [*values[:3], "...", *values[-5:]] if len(values) > 8 else values
            known = ", ".join(v if v == "..." else shown_tag_part(v) for v in shown)
            more = f" ({len(values)} in all)" if len(values) > 8 else ""
            among = f" with {format_tags(matched)}" if matched else ""
            return (
                f" (no snapshot{among} has {format_tags({key: value})}; {shown_tag_part(key)} is one of: {known}{more})"
            )
        pool = [s for s in pool if s.tags.get(key) == value]
        matched[key] = value
    return ""


def _tag_value_order(value: str) -> tuple[int, int, str]:
    """Whole numbers (steps) in numeric order, before any other value: 3, 12, 30, not 12, 3, 30."""
    digits = value[1:] if value.startswith("-") else value
    if digits.isascii() and digits.isdigit():
        return (0, int(value), value)
    return (1, 0, value)


def _hosts_listed(snapshots: list[Snapshot]) -> str:
    hosts = sorted({s.hostname for s in snapshots})
    more = f" and {len(hosts) - 8} more" if len(hosts) > 8 else ""
    return ", ".join(shown_tag_part(h) for h in hosts[:8]) + more or "none"


def unmatched(
    snapshots: list[Snapshot],
    tags: dict[str, str] | None,
    hosts: Sequence[str] | None = None,
    *,
    none_readable: bool = False,
) -> str:
    """Why a selection of tags and hosts takes no snapshot: a tag no snapshot carries (``unmatched_tags``),
    a host no snapshot is of, or the hosts the snapshots with those tags are of; with what there is instead."""
    said = unmatched_tags(snapshots, tags or {}, none_readable=none_readable)
    if said or not hosts:
        return said
    if not snapshots:  # not "the hosts are: none"
        return _nothing_listed(none_readable)
    if not filter_by_hosts(snapshots, hosts):
        return f" (no snapshot is of host {_either(hosts)}; the hosts are: {_hosts_listed(snapshots)})"
    tagged = filter_by_tags(snapshots, tags)
    if tags and tagged:
        return (
            f" (no snapshot of host {_either(hosts)} has {format_tags(tags)}; those that have it are of: "
            f"{_hosts_listed(tagged)})"
        )
    return ""


def _either(hosts: Sequence[str]) -> str:
    return " or ".join(map(shown_tag_part, hosts))


def is_id_prefix(spec: str) -> bool:
    """Whether ``spec`` can start a snapshot ID (lower or upper case hex digits)."""
    return bool(spec) and all(c in "0123456789abcdef" for c in spec.lower())


def select(
    snapshots: list[Snapshot], spec: str, tags: dict[str, str] | None = None, hosts: Sequence[str] | None = None
) -> Snapshot:
    """The snapshot ``spec`` names (a unique ID prefix, or ``"latest"``) among those carrying ``tags`` and of
    one of ``hosts``."""
    candidates = matching(snapshots, tags, hosts)
    if spec == "latest":
        if not candidates:
            why = unmatched(snapshots, tags, hosts) or (NO_SNAPSHOTS_YET if not snapshots else "")
            raise SnapshotNotFoundError(
                f"no snapshot matches latest{_describe(tags, hosts)}{why}; "
                f"list them with: {spelled('ckptvault snapshots', 'Vault.snapshots()')}"
            )
        return newest(candidates)
    prefix = spec.lower()
    if not is_id_prefix(prefix):
        raise UsageError(f"{spec!r} is not a snapshot ID; give a hex ID prefix or 'latest'")
    found = [s for s in candidates if s.id.startswith(prefix)]
    if not found:
        untagged = [s for s in snapshots if s.id.startswith(prefix)]
        if (tags or hosts) and len(untagged) == 1:  # it exists, not selected: say so, not "no snapshot"
            raise SnapshotNotFoundError(f"snapshot {spec} {_not_selected(untagged[0], tags, hosts)}")
        listing = spelled("ckptvault snapshots", "Vault.snapshots()")
        raise SnapshotNotFoundError(f"no snapshot {spec}{_describe(tags, hosts)}; list them with: {listing}")
    if len(found) > 1:
        raise ambiguous_prefix(spec, found)
    return found[0]


AMBIGUOUS_SHOWN = 5


def ambiguous_prefix(spec: str, found: list[Snapshot], unreadable_ids: Sequence[str] = ()) -> SnapshotNotFoundError:
    """The error for an ID prefix that names several snapshots: each with its time to the second, as
    `ckptvault snapshots` shows them (saves a minute apart are what a prefix mixes up), then the snapshot
    objects that cannot be read, whose time is unknown (their count alone told nothing to choose by)."""
    shown = [f"{s.id[:12]} ({s.time:%Y-%m-%d %H:%M:%S})" for s in found]
    shown += [f"{i[:12]} (cannot be read)" for i in unreadable_ids]
    more = f" and {len(shown) - AMBIGUOUS_SHOWN} more" if len(shown) > AMBIGUOUS_SHOWN else ""
    listed = ", ".join(shown[:AMBIGUOUS_SHOWN])
    return SnapshotNotFoundError(f"snapshot ID prefix {spec} is ambiguous: {listed}{more}; give more digits")


def _not_selected(snap: Snapshot, tags: dict[str, str] | None, hosts: Sequence[str] | None) -> str:
    """What keeps ``snap`` (named by its ID) out of a selection, and what to do: its tags, its host, or both."""
    wrong, options = [], []
    if not snap.matches(tags):
        wrong.append(
            f"does not carry {format_tags(tags or {}, ', ')} (its tags: {format_tags(snap.tags, ', ') or 'none'})"
        )
        options.append(spelled("--tag", "tags"))
    if hosts and snap.hostname not in hosts:
        wrong.append(f"is of host {shown_tag_part(snap.hostname)}, not {_either(hosts)}")
        options.append(spelled("--host", "hosts"))
    return (
        f"{' and '.join(wrong)}; leave out {' and '.join(options)} to take it, or list the "
        f"{'tagged' if tags and not hosts else 'selected'} ones with: {listing_of(tags, hosts)}"
    )
