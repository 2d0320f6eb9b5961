from __future__ import annotations

import os
from typing import Annotated

import typer

from ..codec import CompressionSettings
from ..errors import KeyfileNotFoundError, UsageError
from ..location import local_folder
from ..repository.config import DEFAULT_PACK_SIZE, MAX_PACK_SIZE
from ..vault import Vault
from .app import (
    JsonOpt,
    KeyfileOpt,
    PassphraseFileOpt,
    QuietOpt,
    RepoOpt,
    StorageOpt,
    app,
    command,
    passphrase_source,
    refuse_blank_vault_settings,
    refuse_passphrase_without_keyfile,
    require_lasting_url,
    require_nonempty,
)
from .output import Output
from .params import parse_storage_options

LOSS_WARNING = (
    "without this keyfile AND its passphrase the data in the vault cannot be recovered by anyone; "
    "keep copies of both somewhere other than this machine"
)


def _same_place(a: str, b: str) -> bool:
    """Two spellings of one repository (``ckpts`` and ``./ckpts``, a path and its file:// URL)."""
    folder_a, folder_b = local_folder(a), local_folder(b)
    return a == b or (folder_a is not None and folder_a == folder_b)


@app.command("init")
@command
def init_cmd(
    ctx: typer.Context,
    url: Annotated[
        str | None, typer.Argument(metavar="URL", help="Where to create the repository (fsspec URL or path).")
    ] = None,
    repo: RepoOpt = None,
    storage_option: StorageOpt = None,
    encrypt: Annotated[bool, typer.Option("--encrypt", help="Encrypt everything with the --keyfile's key.")] = False,
    keyfile: KeyfileOpt = None,
    passphrase_file: PassphraseFileOpt = None,
    compression_level: Annotated[
        int, typer.Option(metavar="N", help="zstd level for chunks (1 is best for float weights).")
    ] = 1,
    pack_size_mib: Annotated[int, typer.Option(metavar="N", help="Target pack size in MiB.")] = DEFAULT_PACK_SIZE >> 20,
    delta: Annotated[
        bool,
        typer.Option(
            "--delta/--no-delta",
            help="Store changed tensor pieces as deltas against the previous save (repository format 2; "
            "--no-delta keeps an unencrypted vault at format 1, readable by older ckptvault versions). Fixed for "
            "the repository's life.",
        ),
    ] = CompressionSettings().delta,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Create a repository (encrypted with --encrypt --keyfile)."""
    out = Output(json_mode=json_out, quiet=quiet)
    source = ctx.get_parameter_source("repo")
    if url is not None and source is not None and source.name == "ENVIRONMENT":
        repo = None  # the argument typed on the command line beats CKPTVAULT_REPO, as --repo does
    refuse_blank_vault_settings(url or repo, keyfile)
    if encrypt and not keyfile:
        raise UsageError("--encrypt needs --keyfile; create one with: ckptvault key generate --keyfile PATH")
    if keyfile and not encrypt:
        raise UsageError("a keyfile was given (--keyfile or CKPTVAULT_KEYFILE) but not --encrypt; add --encrypt")
    refuse_passphrase_without_keyfile(passphrase_file, keyfile)
    if not 1 <= pack_size_mib <= MAX_PACK_SIZE >> 20:
        raise UsageError(f"--pack-size-mib {pack_size_mib} is out of range; use 1..{MAX_PACK_SIZE >> 20}")
    for option, value in (("the repository URL", url), ("--repo", repo)):
        if value is not None:
            require_nonempty(option, value, "the vault's path or URL", default="the default vault")
            require_lasting_url(value)
    if url is not None and repo is not None and not _same_place(url, repo):
        raise UsageError(f"two repositories given ({url} and --repo {repo}); give the one to create once")
    try:
        vault = Vault.init(
            url or repo,
            storage_options=parse_storage_options(storage_option),
            compression=CompressionSettings(level=compression_level, delta=delta),
            pack_size=pack_size_mib * 1024 * 1024,
            keyfile=keyfile,
            passphrase=passphrase_source(passphrase_file),
        )
    except KeyfileNotFoundError as exc:  # a new vault may take a new key (an existing vault's may not)
        if keyfile is None or os.path.lexists(keyfile):
            raise
        raise KeyfileNotFoundError(f"{exc}, or create one with: ckptvault key generate --keyfile {keyfile}") from None
    config = vault.config
    text = f"created vault {config.repo_id[:8]} at {vault.url} (format {config.version}"
    text += ", delta coding on)" if config.compression.delta else ", delta coding off)"
    if config.encrypted:
        text += f", encrypted (AES-256-GCM) with keyfile {keyfile} (fingerprint {config.key_fingerprint})"
        out.warn(LOSS_WARNING)
    elif os.environ.get("CKPTVAULT_PASSPHRASE"):
        out.warn("CKPTVAULT_PASSPHRASE is set, but this vault is NOT encrypted (no --encrypt --keyfile)")
    out.result(
        {
            "url": vault.url,
            "id": config.repo_id,
            "encryption": config.encryption,
            "format": config.version,
            "delta": config.compression.delta,
        },
        text,
    )
