"""A Vault kept open for a long time (a serving process, a notebook, ``ckptvault://`` in a training
script) reads what other processes backed up and pruned since it loaded the index: it catches up with
the index objects written since, without calling the vault damaged."""

from __future__ import annotations

import logging
import os

import fsspec

from ckptvault import Vault
from tests.conftest import write_file


def test_a_long_lived_vault_reads_what_others_backed_up_and_pruned_since(tmp_path, vault, repo_url, caplog):
    shared, dropped, newer = os.urandom(1_000_000), os.urandom(1_000_000), os.urandom(1_000_000)
    first = tmp_path / "first"
    write_file(first / "frozen.bin", shared)
    write_file(first / "optimizer.bin", dropped)
    last = tmp_path / "last"
    write_file(last / "frozen.bin", shared)
    write_file(last / "optimizer.bin", newer)

    reader = Vault.open(repo_url)
    with Vault.open(repo_url) as writer:  # another Repository: another process, as far as the index goes
        writer.backup(first, tags={"step": "1"})
        assert b"".join(reader.read_file("latest", "frozen.bin")) == shared  # the reader loads the index

        writer.backup(last, tags={"step": "2"})
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ckptvault"):
            assert b"".join(reader.read_file("latest", "optimizer.bin")) == newer
            assert all(u.stored_bytes > 0 for u in reader.file_usage("latest"))
            assert reader.stats() == writer.stats()
        assert not caplog.records, [r.getMessage() for r in caplog.records]  # no "run repair-index"

        # the prune moves frozen.bin's chunks out of the pack it shared with the forgotten save
        pruned = writer.prune(keep_latest=1, repack_threshold=0.0)
        assert pruned.forgotten and pruned.gc.repack, pruned
        with caplog.at_level(logging.WARNING, logger="ckptvault"):
            assert b"".join(reader.read_file("latest", "frozen.bin")) == shared
            fs = fsspec.filesystem("ckptvault", repo=repo_url, skip_instance_cache=True)
            with fs.open("latest/frozen.bin") as f:
                assert f.read() == shared
        assert not caplog.records, [r.getMessage() for r in caplog.records]
    reader.close()
