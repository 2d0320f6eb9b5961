"""What the CLI loads, and when (cli/process.py): a CLI run is short, so its imports count.

scrypt is the longest step before an encrypted command moves data (~0.25 s here); it starts on
another core as soon as the keyfile module is loaded, so that module must not pull in the storage
layer (fsspec and friends took ~45 ms, which every encrypted command then waited for). The rest of
a command's start is loading its own code: each loads only what it runs."""

from __future__ import annotations

import os
import subprocess
import sys


def test_the_keyfile_module_loads_without_the_storage_layer_or_numpy():
    heavy = ("fsspec", "numpy", "ckptvault.store")
    code = f"import sys, ckptvault.crypto.keyfile; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _modules_loaded_by_cli(args: list[str], heavy: tuple[str, ...], env: dict[str, str] | None = None) -> list[str]:
    """Which of ``heavy`` a CLI run loaded, from start to exit (``env``: added to this process's environment)."""
    code = (
        "import atexit, sys\n"
        f"atexit.register(lambda: print(sorted(m for m in {heavy!r} if m in sys.modules)))\n"
        f"sys.argv = ['ckptvault', *{args!r}]\n"
        "from ckptvault.cli import main\n"
        "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    assert done.returncode == 0, done.stderr
    return eval(done.stdout.strip().splitlines()[-1])


def test_a_command_that_moves_no_data_loads_neither_numpy_nor_fsspec(tmp_path):
    """numpy (~0.1 s) and fastcdc are loaded by the first chunk cut and coded, fsspec (~0.1 s with asyncio and
    ssl) only for a URL with a protocol, cryptography for an encrypted vault: listing snapshots, or a backup
    that finds nothing changed, starts without them."""
    repo, src = str(tmp_path / "v"), tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(bytes(range(256)) * 4096)
    # fastcdc loads click (~15 ms; typer has its own); cryptography (~20 ms) is for encrypted vaults
    heavy = ("numpy", "fsspec", "asyncio", "fastcdc", "click", "cryptography")
    assert _modules_loaded_by_cli(["init", repo], heavy) == []
    assert _modules_loaded_by_cli(["backup", str(src), "--repo", repo], heavy) == ["click", "fastcdc", "numpy"]
    assert _modules_loaded_by_cli(["backup", str(src), "--repo", repo], heavy) == []  # nothing changed
    assert _modules_loaded_by_cli(["snapshots", "--repo", repo], heavy) == []


def test_a_command_loads_its_own_module_and_the_operations_it_runs_only(tmp_path):
    """Loading every command and every operation took ~0.1 s more of each run on a slow 2-core VM (a
    quarter of `ckptvault snapshots`): a command loads its own module (cli/process.py) and the Vault
    loads an operation's code when it is called."""
    repo, src, out = str(tmp_path / "v"), tmp_path / "src", str(tmp_path / "out")
    src.mkdir()
    (src / "model.bin").write_bytes(b"weights" * 1000)
    heavy = tuple(
        f"ckptvault.{name}"
        for name in (
            "ops.backup",
            "ops.restore",
            "ops.prune",
            "ops.watch",
            "ops.async_backup",
            "ops.inspect",
            "cli.cmd_backup",
            "cli.cmd_restore",
            "cli.cmd_watch",
        )
    )
    assert _modules_loaded_by_cli(["init", repo], heavy) == []
    assert _modules_loaded_by_cli(["backup", str(src), "--repo", repo], heavy) == [
        "ckptvault.cli.cmd_backup",
        "ckptvault.ops.backup",
    ]
    assert _modules_loaded_by_cli(["snapshots", "--repo", repo], heavy) == []
    assert _modules_loaded_by_cli(["restore", "latest", out, "--repo", repo], heavy) == [
        "ckptvault.cli.cmd_restore",
        "ckptvault.ops.restore",
    ]
    assert (tmp_path / "out" / "model.bin").read_bytes() == b"weights" * 1000
    loaded_for_help = _modules_loaded_by_cli(["--help"], heavy)  # it lists every command
    assert [name for name in loaded_for_help if ".cli." in name] == [name for name in heavy if ".cli." in name]


def test_each_command_name_leads_to_the_module_that_defines_it():
    """A name missing from cli/process.py's map loads every command (slower, as before), and one mapped to the
    wrong module would end its command with "No such command"."""
    from ckptvault.cli.commands import app
    from ckptvault.cli.process import _COMMAND_MODULES

    defined = {
        info.name or info.callback.__name__.replace("_", "-"): info.callback.__module__
        for info in app.registered_commands
    }
    for group in app.registered_groups:
        defined[group.name] = group.typer_instance.registered_commands[0].callback.__module__
    assert {name: f"ckptvault.cli.{module}" for name, module in _COMMAND_MODULES.items()} == defined


def test_an_encrypted_vault_lists_its_snapshots_without_numpy(tmp_path):
    """Its snapshot objects were decrypted into buffers made by numpy, which `snapshots` then loaded (~0.1-0.18 s
    on a slow VM, after scrypt, with the command waiting for it)."""
    repo, src = str(tmp_path / "v"), tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(bytes(range(256)) * 4096)
    env = {"CKPTVAULT_KEYFILE": str(tmp_path / "k.key"), "CKPTVAULT_PASSPHRASE": "startup passphrase"}
    setup = (["key", "generate", "--kdf-cost", "14"], ["init", repo, "--encrypt"], ["backup", str(src), "-r", repo])
    for args in setup:
        command = [sys.executable, "-m", "ckptvault", *args]
        assert subprocess.run(command, capture_output=True, env={**os.environ, **env}).returncode == 0
    assert _modules_loaded_by_cli(["snapshots", "--repo", repo], ("numpy",), env) == []
