"""A pack the storage itself finds damaged. SeaweedFS keeps a CRC with every stored object and answers
each read of one whose bytes no longer match it with an internal error (HTTP 500), after ~15 s: the
object can never be read, yet the server answers, so it is no outage either. check names the pack as
failing and says how to go on; repair-index --drop-failing-packs drops it from the index; the next
backup of the same files stores its chunks again, so every snapshot restores; prune then removes it."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import tree_digest
from ..support import servers
from .conftest import one_line_error

# Each read of the damaged object costs the server ~15 s: one attempt per call, not six.
ONE_ATTEMPT = {"CKPTVAULT_RETRIES": "0"}


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.RunningServer]:
    """A server of its own: its volume files are damaged by hand."""
    try:
        srv = servers.start_seaweedfs(tmp_path_factory.mktemp("seaweed-damage"))
    except servers.ServerUnavailable as exc:
        pytest.skip(f"BACKEND NOT TESTED: s3-seaweedfs (damaged volume): {exc}")
    yield srv
    srv.stop()


def flip_stored_byte(srv: servers.RunningServer, stored: bytes) -> None:
    """Flip one byte inside ``stored`` where the server keeps it on its disk (its volume files)."""
    hits = 0
    for volume in (srv.log.parent / "weed").rglob("*.dat"):
        raw = volume.read_bytes()
        at = raw.find(stored)
        if at >= 0:
            with volume.open("r+b") as f:
                f.seek(at + len(stored) // 2)
                byte = f.read(1)[0]
                f.seek(at + len(stored) // 2)
                f.write(bytes([byte ^ 0xFF]))
            hits += 1
    assert hits == 1, f"the bytes were found in {hits} volume files"


@pytest.mark.slow
def test_a_pack_the_server_finds_damaged_is_dropped_on_request_and_stored_again(seaweed, remote_cli, tmp_path: Path):
    backend = seaweed.backend
    url = backend.new_url()
    src = tmp_path / "ckpt"
    src.mkdir()
    weights = random.Random(7).randbytes(2_000_000)  # incompressible: stored as they are, so found on the disk
    (src / "weights.bin").write_bytes(weights)
    remote_cli(backend, "init", "--repo", url)
    remote_cli(backend, "backup", str(src), "--repo", url, "-t", "n=1")
    flip_stored_byte(seaweed, weights[1_000_000:1_000_064])

    # a restore said only "storage failed ... (after N attempts)": now how to go on too (audit 30b F4)
    out = str(tmp_path / "out-0")
    failed = remote_cli(backend, "restore", "latest", out, "--repo", url, check=False, **ONE_ATTEMPT)
    assert failed.returncode == 20
    error = one_line_error(failed)
    assert error.startswith("error: storage failed: GET packs/"), error
    assert f"ckptvault check --repo {url} names the packs" in error and "repair-index --repo" in error, error
    assert error.endswith("--drop-failing-packs sets their chunks aside (each with the same -o options)"), error

    check = remote_cli(backend, "check", "--read-data", "--repo", url, check=False, **ONE_ATTEMPT)
    assert check.returncode == 20
    error = one_line_error(check)
    assert "1 pack(s) the storage fails on every attempt" in error and "--drop-failing-packs" in error
    assert "fails this object on every attempt" in check.stdout.decode()

    repair = remote_cli(backend, "repair-index", "--drop-failing-packs", "--repo", url, **ONE_ATTEMPT)
    assert "dropped the chunks of 1 pack(s) the storage fails to serve" in repair.stdout.decode()

    again = remote_cli(backend, "backup", str(src), "--repo", url, "-t", "n=2", "--json")
    assert json.loads(again.stdout)["summary"]["new_bytes"] == len(weights)  # all in the dropped pack
    for n in ("1", "2"):
        target = tmp_path / f"out-{n}"
        remote_cli(backend, "restore", "latest", str(target), "--repo", url, "-t", f"n={n}")
        assert tree_digest(target) == tree_digest(src)
    # the damaged pack is indexed without chunks now: nothing reads it, and prune removes it
    remote_cli(backend, "prune", "--keep-latest", "5", "--repo", url)
    after = remote_cli(backend, "check", "--read-data", "--repo", url, **ONE_ATTEMPT)
    assert "no problems found" in after.stdout.decode() and "warning" not in after.stderr.decode()


@pytest.mark.parametrize("backend_name", ["s3-moto", "s3-seaweedfs", "sftp-openssh"])
def test_a_truncated_pack_on_a_server_is_damage_named_and_the_intact_file_restores(
    server, backend_name: str, remote_cli, tmp_path: Path
):
    """S3 answers a range that starts past an object's end with HTTP 416: the restore failed as a storage
    error (exit 20, "InvalidRange") and restored nothing, not even a file none of whose chunks was cut; over
    SFTP each chunk past the end was read six times, minutes a pack (nf48 F1, F2)."""
    import fsspec

    backend = server(backend_name).backend
    url = backend.new_url()
    intact, cut = tmp_path / "intact", tmp_path / "cut"
    for folder, seed in ((intact, 1), (cut, 2)):
        folder.mkdir()
        (folder / f"{folder.name}.bin").write_bytes(random.Random(seed).randbytes(1_500_000))
    remote_cli(backend, "init", "--repo", url)
    remote_cli(backend, "backup", str(intact), "--repo", url)
    fs, root = fsspec.core.url_to_fs(url, **backend.storage_options)
    before = set(fs.find(f"{root}/packs"))
    remote_cli(backend, "backup", str(intact), str(cut), "--repo", url)
    (pack,) = set(fs.find(f"{root}/packs")) - before  # the cut file's chunks, alone
    fs.pipe_file(pack, fs.cat_file(pack)[:100_000])

    out = tmp_path / "out"
    failed = remote_cli(backend, "restore", "latest", str(out), "--repo", url, check=False)
    error = one_line_error(failed)
    assert failed.returncode == 30 and "cut.bin" in error and "run: ckptvault check" in error, error
    assert (out / "intact" / "intact.bin").read_bytes() == (intact / "intact.bin").read_bytes()
    assert "short read" not in failed.stderr.decode()  # the object's size says it: not retried
