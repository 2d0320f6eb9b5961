"""copy: snapshots of another vault into this one (restic's copy: --from-repo is read, --repo written)."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Annotated

import typer

from ..crypto.keyfile import MAX_KEYFILE_BYTES
from ..errors import CkptVaultError, CopyIncompleteError, UsageError, VaultNotFoundError, init_command
from ..location import default_repo_url
from ..ops.copy import CopyResult
from ..store.opening import check_storage_options
from .app import (
    NO_VAULT_ARGS,
    JsonOpt,
    QuietOpt,
    VaultArgs,
    VaultOptionNames,
    app,
    command,
    open_vault,
    passphrase_source,
    refuse_blank_vault_settings,
    vault_options,
)
from .output import Output, VaultNaming, counted, format_bytes, name_the_vault_in_advice
from .params import parse_storage_options, parse_tags

SOURCE_VAULT = VaultOptionNames(
    repo="--from-repo",
    repo_env="CKPTVAULT_FROM_REPO",
    keyfile="--from-keyfile",
    keyfile_env="CKPTVAULT_FROM_KEYFILE",
    passphrase_file="--from-passphrase-file",
    passphrase_env="CKPTVAULT_FROM_PASSPHRASE",
    prompt="passphrase of the source vault's keyfile",
)


# Opening a vault names the options of a command's own vault in its errors (a keyfile missing: "give
# it with --keyfile"); for the source, the user types these instead.
_SOURCE_WORDS = [
    (re.compile(rf"(?<![\w-]){re.escape(ours)}(?![\w-])"), theirs)
    for ours, theirs in (
        ("--keyfile", SOURCE_VAULT.keyfile),
        ("CKPTVAULT_KEYFILE", SOURCE_VAULT.keyfile_env),
        ("--passphrase-file", SOURCE_VAULT.passphrase_file),
        ("CKPTVAULT_PASSPHRASE", SOURCE_VAULT.passphrase_env),
        ("-o", "--from-storage-option"),
    )
]


def _in_source_terms(exc: CkptVaultError) -> CkptVaultError:
    if isinstance(exc, VaultNotFoundError) and str(exc).endswith(init_command(exc.url)):
        exc = VaultNotFoundError(exc.url, "check --from-repo: a copy reads a vault that exists")  # never one to make
    message = str(exc)
    for pattern, theirs in _SOURCE_WORDS:
        message = pattern.sub(theirs, message)
    exc.args = (f"the vault to copy from: {message}",)
    return exc


def _same_keyfile(source: str | None, dest: str | None) -> bool:
    """Whether both vaults' keyfiles are one (the same file, or copies of it): re-encrypting a vault into
    a new one under the same key, or copying between two vaults of one team."""
    if not source or not dest:
        return False
    try:
        first, second = Path(source).expanduser(), Path(dest).expanduser()
        if first.samefile(second):
            return True
        small = max(first.stat().st_size, second.stat().st_size) <= MAX_KEYFILE_BYTES
        return small and first.read_bytes() == second.read_bytes()
    except OSError:  # opening the vault names what is wrong with it
        return False


def _named_for_its_vault(message: str, namings: dict[str, VaultNaming]) -> str:
    """``message`` with the commands it suggests naming the one vault whose URL it names (a lock's
    "vault URL is locked; ... ckptvault unlock --remove-all" would otherwise remove the default vault's
    locks); as it was where it names both or neither."""
    named = [naming for url, naming in namings.items() if re.search(re.escape(url) + r"(?![\w.~/-])", message)]
    return named[0].named(message) if len(named) == 1 else message


@app.command("copy")
@command
@vault_options
def copy_cmd(
    snapshots: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="SNAPSHOT...",
            help="Snapshot IDs (unique prefixes of 4 or more characters) or 'latest' of the source; default: all.",
        ),
    ] = None,
    from_repo: Annotated[
        str | None,
        typer.Option(
            "--from-repo",
            envvar="CKPTVAULT_FROM_REPO",
            metavar="URL",
            help="The vault to copy from (read only). Required.",
        ),
    ] = None,
    from_keyfile: Annotated[
        str | None,
        typer.Option(
            "--from-keyfile",
            envvar="CKPTVAULT_FROM_KEYFILE",
            metavar="PATH",
            help="Keyfile of the source, if encrypted.",
        ),
    ] = None,
    from_passphrase_file: Annotated[
        str | None,
        typer.Option(
            "--from-passphrase-file",
            metavar="PATH",
            help="Read the source keyfile's passphrase from this file, '-' for standard input "
            "(else CKPTVAULT_FROM_PASSPHRASE, else asked).",
        ),
    ] = None,
    from_storage_option: Annotated[
        list[str] | None,
        typer.Option(
            "--from-storage-option",
            metavar="KEY=VALUE",
            help="fsspec storage option key=value for the source (repeatable).",
        ),
    ] = None,
    tag: Annotated[
        list[str] | None,
        typer.Option(
            "--tag", "-t", metavar="KEY=VALUE", help="Copy only snapshots with this tag key=value (repeatable)."
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Only say what would be copied.")] = False,
    decrypt: Annotated[
        bool,
        typer.Option(
            "--decrypt", help="Allow copies out of an encrypted vault into an unencrypted one (stored in the clear)."
        ),
    ] = False,
    vault_args: VaultArgs = NO_VAULT_ARGS,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Copy snapshots of another vault (--from-repo) into this one (--repo): all of them, those with
    --tag, or the given ones. A snapshot keeps its ID and tags, so those already copied are skipped;
    each chunk read is verified, then coded and encrypted by this vault's own settings."""
    out = Output(json_mode=json_out, quiet=quiet)
    # Advice here may be about either vault: --repo (the destination) is not added to all of it, or a
    # pasted forget for a snapshot damaged in the source would forget the destination's good copy.
    # Each vault's own messages (opening it, its warnings, its locks) name it; the rest name none.
    name_the_vault_in_advice(VaultNaming())
    source_naming = VaultNaming.of(from_repo, from_keyfile, from_passphrase_file, from_storage_option)
    tags = parse_tags(tag)
    refuse_blank_vault_settings(from_repo, from_keyfile, SOURCE_VAULT)
    if from_repo is None:
        raise UsageError("give the vault to copy from: --from-repo URL (or CKPTVAULT_FROM_REPO)")
    if from_passphrase_file == "-" and vault_args.passphrase_file == "-":
        raise UsageError(
            "--from-passphrase-file - and --passphrase-file -: standard input holds one passphrase; "
            "give one of them a file (or CKPTVAULT_FROM_PASSPHRASE / CKPTVAULT_PASSPHRASE)"
        )
    if vault_args.storage_option and (vault_args.repo is None or vault_args.repo.strip()):
        # before the source is tried for minutes with a -o meant for it (an empty --repo is said later)
        check_storage_options(vault_args.repo or default_repo_url(), parse_storage_options(vault_args.storage_option))
    shared = None
    asked_apart = from_passphrase_file is not None or SOURCE_VAULT.passphrase_env in os.environ
    if not asked_apart and _same_keyfile(from_keyfile, vault_args.keyfile):  # one passphrase, given once
        shared = functools.cache(passphrase_source(vault_args.passphrase_file))
    try:
        source = open_vault(
            from_repo,
            from_storage_option,
            out,
            from_keyfile,
            from_passphrase_file,
            limit_download=vault_args.limit_download,  # the source is the vault read
            retry_lock=vault_args.retry_lock,
            names=SOURCE_VAULT,
            passphrase=shared,
            keyfile_from_env="from_keyfile" in vault_args.from_environment,
        )
    except CkptVaultError as exc:
        exc = _in_source_terms(exc)
        exc.args = (source_naming.named(str(exc)),)
        raise exc from None
    source.on_warning = lambda message: out.warn(source_naming.named(message))  # its damaged snapshot objects
    dest_naming = VaultNaming.of(
        vault_args.repo, vault_args.keyfile, vault_args.passphrase_file, vault_args.storage_option
    )
    with source:
        try:
            dest = vault_args.open(out, writes=not dry_run, passphrase=shared)
        except CkptVaultError as exc:
            exc.args = (dest_naming.named(str(exc)),)
            raise
        dest.on_warning = lambda message: out.warn(dest_naming.named(message))
        with dest, out.progress("copying") as progress:
            try:
                result = dest.copy_from(
                    source,
                    snapshots or None,
                    tags=tags,
                    dry_run=dry_run,
                    decrypt=decrypt,
                    on_progress=progress,
                    on_warning=out.warn,
                )
                incomplete = None
            except CopyIncompleteError as exc:  # what was copied is said (and given as JSON) before the error
                assert isinstance(exc.result, CopyResult)
                result, incomplete = exc.result, exc
            except CkptVaultError as exc:  # a lock of either vault: its unlock must name it, as the message does
                exc.args = (_named_for_its_vault(str(exc), {source.url: source_naming, dest.url: dest_naming}),)
                raise
    data = {
        "copied": result.copied,
        "already_there": [s.id for s in result.already_there],
        "gone": [s.id for s in result.gone],
        "read_bytes": result.read_bytes,
        "new_bytes": result.new_bytes,
        "delta_chunks": result.delta_chunks,
        "stored_bytes": result.stored_bytes,
        "failed": result.failed,
        "newer": result.newer,
        "dry_run": dry_run,
    }
    there = f"; {len(result.already_there)} already in {dest.url}" if result.already_there else ""
    if not result.copied and incomplete is None:
        out.result(data, f"nothing to copy{there}")
    elif dry_run:
        ids = ", ".join(s.short_id for s in result.copied)
        out.result(data, f"would copy {len(result.copied)} snapshot(s) ({ids}){there}; nothing was written", asked=True)
    else:
        deltas = f" ({counted(result.delta_chunks, 'chunk')} as deltas)" if result.delta_chunks else ""
        out.result(
            data,
            f"copied {len(result.copied)} snapshot(s) to {dest.url}{there}: {format_bytes(result.read_bytes)} read, "
            f"{format_bytes(result.new_bytes)} new, {format_bytes(result.stored_bytes)} stored{deltas}",
        )
    if incomplete is not None:
        raise incomplete
