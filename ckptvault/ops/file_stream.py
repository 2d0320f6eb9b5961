"""Reading one snapshot file whole, chunk by chunk (``Vault.read_file``): each chunk is verified
against its ID, and the whole-file hash once the last chunk is read."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator

from ..errors import IntegrityError, UsageError
from ..hashing import new_file_hasher
from ..repository import Repository
from ..snapshot.model import FileEntry


def read_whole(repo: Repository, entry: FileEntry) -> Generator[bytes, None, None]:
    """The file's bytes, chunk by chunk; IntegrityError after the last chunk when the file hash differs."""
    # a shared lock while it is read (from the first next() until the end or close()), as a restore
    # holds one: a prune waits, and one that took a stopped reader's lock for stale is named as such
    with repo.locks.acquire_to_read():
        hasher = new_file_hasher()
        for chunk_id in entry.chunks:
            data = repo.read_chunk(chunk_id)
            hasher.update(data)
            yield data if isinstance(data, bytes) else bytes(data)
        if hasher.hexdigest() != entry.blake3:
            raise IntegrityError(f"{entry.path}: bytes do not match the snapshot's file hash")


class FileChunks(Iterator[bytes]):
    """``read_file``'s iterator. The Vault's ``close()`` ends it (a file read part way holds a shared lock);
    a read after that raises instead of ending as if the file did: ``b"".join(chunks)`` outside the ``with``
    block gave ``b""``, and one started inside it a cut-short file, with no error and no file hash checked."""

    def __init__(self, chunks: Generator[bytes, None, None], path: str) -> None:
        self._chunks = chunks
        self._path = path
        self._ended = False  # the whole file was read (its hash checked), or its reader closed it
        self._cut = False  # the Vault closed first

    def __next__(self) -> bytes:
        if self._cut:
            raise UsageError(
                f"read_file({self._path!r}) was read after its Vault was closed, so the file was not read whole; "
                "read it before close() (inside the with block)"
            )
        try:
            return next(self._chunks)
        except BaseException:  # the end, or its error (said already): not cut short by a close after it
            self._ended = True
            raise

    def close(self) -> None:
        """Stop reading (as a generator's ``close``): the shared lock is released at once."""
        self._ended = True
        self._chunks.close()

    def cut_by_close(self) -> None:
        self._cut = not self._ended
        with contextlib.suppress(ValueError):  # being read on another thread now: its next read raises
            self._chunks.close()
