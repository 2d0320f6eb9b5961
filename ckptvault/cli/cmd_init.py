from __future__ import annotations

from typing import Annotated

import typer

from ..codec import CompressionSettings
from ..vault import Vault
from .app import JsonOpt, QuietOpt, RepoOpt, StorageOpt, app, command
from .output import Output
from .params import parse_storage_options


@app.command("init")
@command
def init_cmd(
    url: Annotated[str | None, typer.Argument(help="Where to create the repository (fsspec URL or path).")] = None,
    repo: RepoOpt = None,
    storage_option: StorageOpt = None,
    compression_level: Annotated[int, typer.Option(help="zstd level for chunks (1 is best for float weights).")] = 1,
    pack_size_mib: Annotated[int, typer.Option(help="Target pack size in MiB.")] = 32,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Create a repository."""
    out = Output(json_mode=json_out, quiet=quiet)
    target = url or repo
    vault = Vault.init(
        target,
        storage_options=parse_storage_options(storage_option),
        compression=CompressionSettings(level=compression_level),
        pack_size=pack_size_mib * 1024 * 1024,
    )
    out.result({"url": vault.url, "id": vault.config.repo_id}, f"created vault {vault.config.repo_id[:8]} at {vault.url}")
