"""One copy between two vaults as ``Vault.copy_from`` runs it: under the locks the Vault takes, the
snapshots chosen from the source's listing are copied and the destination's index compacted; after
them, what the copy could not take is warned about or raised."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ..errors import CkptVaultError, CopyIncompleteError, CopyNeedsUpgradeError, UsageError, spelled
from ..repository import Repository
from ..snapshot.model import Snapshot
from ..snapshot.selection import tag_options, unmatched_tags
from .compact import compact_or_warn
from .copy import CopyResult, choose_snapshots, mirror_gaps, run_copy
from .progress import Progress


def copy_listed(
    source: Repository,
    dest: Repository,
    listed: list[Snapshot],
    unreadable: Mapping[str, CkptVaultError],
    specs: Sequence[str | Snapshot] | None,
    tags: dict[str, str],
    *,
    urls: tuple[str, str],
    progress: Progress | None,
    before_commit: Callable[[], None] | None,
    dry_run: bool,
    warn: Callable[[str], None],
    decrypt: bool = False,
) -> CopyResult:
    """Copy what ``specs`` and ``tags`` choose of the source's listing (``listed`` and ``unreadable``,
    of one listing). ``urls``: the source's and the destination's, as the warnings name them."""
    source_url, dest_url = urls
    chosen = choose_snapshots(sorted(listed, key=lambda s: s.time), unreadable, specs, tags, source_url)
    if not chosen and tags:  # a mistyped tag would read as "nothing new to copy" (cp47 #2)
        given = spelled(tag_options(tags).strip(), f"tags={tags}")
        why = unmatched_tags(listed, tags, none_readable=bool(unreadable))
        warn(f"{given} selects no snapshot in {source_url}{why}; nothing copied")
    if chosen and source.config.encrypted and not dest.config.encrypted:  # dry_run or decrypt: else refused
        said = "would be" if dry_run else "are"
        needs = "" if decrypt else f" (the copy itself needs {spelled('--decrypt', 'decrypt=True')})"
        warn(f"{source_url} is encrypted and {dest_url} is not: the copies {said} stored unencrypted{needs}; {_keep()}")
    result = run_copy(source, dest, chosen, progress=progress, before_commit=before_commit, dry_run=dry_run)
    for warning in [] if dry_run else compact_or_warn(dest):
        warn(warning)
    return result


def _keep() -> str:
    made = spelled("ckptvault init URL --encrypt --keyfile PATH", "Vault.init(url, keyfile=PATH, passphrase=...)")
    return f"to keep them encrypted, copy into a vault made with: {made}"


def refuse_decrypting(source: Repository, dest: Repository, urls: tuple[str, str]) -> None:
    """A copy out of an encrypted vault into a plain one, unless asked for (``decrypt``), before anything is
    read: a one-line slip (a mirror job's --repo naming a plain vault) would put a whole vault in the clear."""
    if source.config.encrypted and not dest.config.encrypted:
        raise UsageError(
            f"{urls[0]} is encrypted and {urls[1]} is not: the copies would be stored unencrypted there; {_keep()}, "
            f"or give {spelled('--decrypt', 'decrypt=True')} to store them in the clear"
        )


def finish_copy(
    result: CopyResult,
    unreadable: Mapping[str, CkptVaultError],
    dest: Repository,
    *,
    urls: tuple[str, str],
    mirror: bool,
    warn: Callable[[str], None],
) -> CopyResult:
    """``result``, once the snapshots gone meanwhile are warned about; CopyIncompleteError when one could
    not be read, or (``mirror``: all of them were to be copied) the source holds a damaged one the
    destination lacks: a mirror's job must hear of a gap."""
    source_url, dest_url = urls
    for snap in result.gone:
        warn(
            f"snapshot {snap.short_id} was forgotten or retagged in {source_url} while the copy ran, and was "
            "not copied (a retagged one has a new ID: the next copy takes it)"
        )
    if mirror:
        result.failed.update(mirror_gaps(unreadable, dest))
    if result.failed:
        copied, already = len(result.copied), len(result.already_there)
        # not damage where a newer ckptvault wrote every one: an upgrade copies them, no check heals them
        error = CopyNeedsUpgradeError if len(result.newer) == len(result.failed) else CopyIncompleteError
        raise error(source_url, dest_url, result.failed, copied, already, result, newer=result.newer)
    return result
