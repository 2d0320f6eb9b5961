"""Run the ckptvault CLI with a bug planted: ``Vault.snapshots`` raises a RuntimeError, a stand-in for any bug
the CLI's error boundary must keep to one line, caused by an error whose 8 KB message makes the traceback too big
for a nearly full temporary folder: ``python -m tests.support.bugcli snapshots --repo PATH``."""

from __future__ import annotations

import sys

from ckptvault.vault import Vault


def _snapshots(self: Vault, *args: object, **kwargs: object) -> None:
    try:
        raise ValueError("the cause, at length: " + "x" * 8192)
    except ValueError as exc:
        raise RuntimeError("a planted bug") from exc


Vault.snapshots = _snapshots  # type: ignore[method-assign,assignment]

if __name__ == "__main__":
    from ckptvault.cli import main  # as the installed command runs: its logging, signals and exit codes

    sys.argv[0] = "ckptvault"
    main()
