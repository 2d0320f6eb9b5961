"""Keyfiles: generate, passwd, info."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from ..crypto.keyfile import (
    DEFAULT_KDF_COST,
    MIN_NEW_PASSPHRASE,
    Keyfile,
    check_kdf_cost,
    keyfile_exists,
    remove_leftover_temps,
    too_short,
)
from ..errors import PassphraseRequiredError, UsageError
from ..vault import Vault
from .app import (
    JsonOpt,
    PassphraseFileOpt,
    QuietOpt,
    app,
    ask_passphrase,
    command,
    passphrase_source,
    require_nonempty,
)
from .cmd_init import LOSS_WARNING
from .output import Output

key_app = typer.Typer(help="Create and manage keyfiles for encrypted vaults.", no_args_is_help=True)
app.add_typer(key_app, name="key")

KeyfilePathOpt = Annotated[
    str, typer.Option("--keyfile", "-k", metavar="PATH", envvar="CKPTVAULT_KEYFILE", help="Path of the keyfile.")
]


KDF_COST_HELP = "scrypt cost as log2(N): 17 takes ~0.3 s and 128 MiB; higher is slower to guess."


def _new_passphrase(passphrase_file: str | None, env: str, option: str) -> str:
    """A new passphrase: from the file or the environment as is, or asked twice on a terminal."""
    from_terminal = passphrase_file == "-" and sys.stdin.isatty()  # asked twice, as without the option
    if (passphrase_file or env in os.environ) and not from_terminal:
        new = passphrase_source(passphrase_file, env=env, option=option)()
    elif sys.stdin.isatty():
        new = ask_passphrase("new passphrase", env=env, option=option)
        if ask_passphrase("repeat the new passphrase", env=env, option=option) != new:
            raise UsageError("the two passphrases differ; nothing was written")
    else:
        raise PassphraseRequiredError(env=env, option=option)
    if too_short(new):
        source = option if passphrase_file else env if env in os.environ else "the prompt"
        raise UsageError(
            f"the new passphrase (from {source}) is shorter than {MIN_NEW_PASSPHRASE} characters, not counting "
            "spaces at its ends; choose a longer one"
        )
    return new


@key_app.command("generate")
@command
def generate_cmd(
    keyfile: KeyfilePathOpt,
    passphrase_file: PassphraseFileOpt = None,
    kdf_cost: Annotated[int, typer.Option(metavar="N", help=KDF_COST_HELP)] = DEFAULT_KDF_COST,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Create a keyfile holding a new random key, protected by a passphrase (asked twice)."""
    out = Output(json_mode=json_out, quiet=quiet)
    require_nonempty("--keyfile", keyfile, "the keyfile's path")
    if keyfile == "-":  # '-' is standard input for a passphrase; a keyfile named so is surely not meant
        raise UsageError("--keyfile -: a keyfile is written to a file (mode 0600), not to the output; give its path")
    check_kdf_cost(kdf_cost, "--kdf-cost")
    if os.path.lexists(os.path.expanduser(keyfile)):  # said before the passphrase is asked for, twice
        remove_leftover_temps(keyfile)  # of a generate killed once the keyfile had its name: this is its rerun
        raise keyfile_exists(os.path.expanduser(keyfile))
    passphrase = _new_passphrase(passphrase_file, "CKPTVAULT_PASSPHRASE", "--passphrase-file")
    key = Vault.generate_keyfile(keyfile, passphrase=passphrase, kdf_cost=kdf_cost)
    _warn_if_weak(out, key, f"fine for tests; a real key wants --kdf-cost {DEFAULT_KDF_COST} or more")
    out.warn(LOSS_WARNING)
    out.result(_describe(key), f"created keyfile {key.path} (fingerprint {key.fingerprint}, mode 0600)")


@key_app.command("passwd")
@command
def passwd_cmd(
    keyfile: KeyfilePathOpt,
    passphrase_file: PassphraseFileOpt = None,
    new_passphrase_file: Annotated[
        str | None,
        typer.Option(
            metavar="PATH",
            help="Read the new passphrase from this file, '-' for standard input (else CKPTVAULT_NEW_PASSPHRASE, "
            "else asked).",
        ),
    ] = None,
    kdf_cost: Annotated[int | None, typer.Option(metavar="N", help=KDF_COST_HELP + " Default: the keyfile's.")] = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Change a keyfile's passphrase. The key, and so the vault's data, stay the same."""
    out = Output(json_mode=json_out, quiet=quiet)
    require_nonempty("--keyfile", keyfile, "the keyfile's path")
    if kdf_cost is not None:
        check_kdf_cost(kdf_cost, "--kdf-cost")
    if passphrase_file == "-" and new_passphrase_file == "-":
        raise UsageError("--passphrase-file and --new-passphrase-file cannot both be '-' (one standard input)")
    key = Keyfile.load(keyfile)
    if kdf_cost is not None and 2**kdf_cost < key.kdf.n:
        out.warn(f"--kdf-cost {kdf_cost} is below the keyfile's {key.kdf.n.bit_length() - 1}: a guess gets cheaper")
    elif kdf_cost is None:
        _warn_if_weak(out, key, f"--kdf-cost {DEFAULT_KDF_COST} raises it")
    key = Vault.change_keyfile_passphrase(
        key,
        passphrase=passphrase_source(passphrase_file, prompt="current passphrase"),
        # asked only once the current one unlocked the key
        new_passphrase=lambda: _new_passphrase(
            new_passphrase_file, "CKPTVAULT_NEW_PASSPHRASE", "--new-passphrase-file"
        ),
        kdf_cost=kdf_cost,
    )
    if kdf_cost is not None:  # a cost given below the default: said as generate says it (not only when lowered)
        _warn_if_weak(out, key, f"fine for tests; a real key wants --kdf-cost {DEFAULT_KDF_COST} or more")
    out.result(
        _describe(key),
        f"changed the passphrase of {key.path} (fingerprint {key.fingerprint} unchanged); copies of the keyfile "
        "made before still open its vaults with the old passphrase: if one left with someone, re-encrypt under a "
        "new key (docs/security.md, Key rotation)",
    )


@key_app.command("info")
@command
def info_cmd(keyfile: KeyfilePathOpt, json_out: JsonOpt = False, quiet: QuietOpt = False) -> None:
    """Show a keyfile's fingerprint, KDF and creation time (no passphrase needed)."""
    out = Output(json_mode=json_out, quiet=quiet)
    require_nonempty("--keyfile", keyfile, "the keyfile's path")
    key = Keyfile.load(keyfile)
    _warn_if_weak(out, key, f"ckptvault key passwd --kdf-cost {DEFAULT_KDF_COST} raises it")
    d = _describe(key)
    out.result(d, "\n".join(f"{k}: {v}" for k, v in d.items()), asked=True)


def _warn_if_weak(out: Output, key: Keyfile, advice: str) -> None:
    """A keyfile whose KDF makes a guess of its passphrase cheaper than the default does (ek44 #9)."""
    if (weaker := key.kdf.weaker_by) > 1:
        out.warn(
            f"keyfile {key.path}: its {_describe(key)['kdf']} makes a guess of the passphrase {weaker:g}x cheaper "
            f"than the default (n=2^{DEFAULT_KDF_COST} r=8 p=1); {advice}"
        )


def _describe(key: Keyfile) -> dict[str, object]:
    kdf = key.kdf
    return {
        "keyfile": key.path,
        "fingerprint": key.fingerprint,
        "kdf": f"scrypt n=2^{kdf.n.bit_length() - 1} r={kdf.r} p={kdf.p}",
        "created": key.created,
    }
