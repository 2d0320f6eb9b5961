"""Progress reporting is injected: operations call this protocol and never import rich."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def start(self, total_bytes: int, total_files: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...

    def finish(self) -> None: ...


class NullProgress:
    def start(self, total_bytes: int, total_files: int) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def finish(self) -> None:
        pass
