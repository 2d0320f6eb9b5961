"""A TCP proxy that injects network faults between a client and a real server (stdlib asyncio).

    proxy = FaultProxy(upstream_port).start()       # listens on 127.0.0.1:proxy.port, in a thread
    proxy.cut_after_bytes = 3 << 20; proxy.max_cuts = 2  # reset a connection once the client sent
                                                     # 3 MiB on it (mid-upload), twice
    proxy.cut_download_after_bytes = 300_000; proxy.max_download_cuts = 3  # ... once the server sent
                                                     # 300 KB on it (mid-download), 3 times
    proxy.stall_downloads = True                     # ... or hold it there instead, sending nothing more
    proxy.stall_downloads_for = 3.5                  # ... for that long, then carry on (a frozen server thawed)
    proxy.reset_next = 2                             # the next 2 connections are reset on accept
    proxy.stall = True                               # accept, read nothing, answer nothing
    proxy.reply = b"HTTP/1.1 403 Forbidden..."      # answer every request with this, then close
    proxy.stop()

Resets are real RSTs (SO_LINGER 0), what a dropped NAT entry or a crashed load balancer sends.
Counters (``connections``, ``cuts``, ``download_cuts``, ``resets``, ``stalled``) let tests assert that a
fault fired.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Callable


def _abort(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        # knobs, read when a connection is accepted
        self.cut_after_bytes: int | None = None  # reset a connection after this many client->server bytes
        self.max_cuts: int | None = None  # ... this many times in all (None: every time)
        self.cut_download_after_bytes: int | None = None  # reset a connection after this many server->client bytes
        self.max_download_cuts: int | None = None  # ... this many times in all (None: every time)
        self.stall_downloads = False  # hold those connections open, silent, instead of resetting them
        self.stall_downloads_for: float | None = None  # ... for this many seconds, then carry on (None: for good)
        self.reset_next = 0  # reset this many new connections at once
        self.stall = False  # accept and never answer
        self.stall_connections: int | None = None  # ... for this many connections (None: all)
        self.reply: bytes | None = None  # answer each request on new connections with these bytes
        self.max_replies: int | None = None  # ... this many times in all (None: every time)
        # what happened
        self.connections = 0
        self.cuts = 0
        self.download_cuts = 0
        self.resets = 0
        self.stalled = 0
        self.replied = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._lock = threading.Lock()

    def start(self) -> FaultProxy:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="faultproxy", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def heal(self) -> None:
        """No more faults for new connections."""
        self.cut_after_bytes = None
        self.max_cuts = None
        self.cut_download_after_bytes = None
        self.max_download_cuts = None
        self.reset_next = 0
        self.stall = False
        self.stall_connections = None
        self.reply = None
        self.max_replies = None

    def drop_all(self) -> None:
        """Reset every open connection (stalled ones included)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: [_abort(w) for w in list(self._writers)])

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            for w in list(self._writers):
                _abort(w)
            handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
            await self._server.wait_closed()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop.close()
        self._loop = None

    def _decide(self) -> tuple[str, int | None, int | None]:
        with self._lock:
            self.connections += 1
            if self.reset_next > 0:
                self.reset_next -= 1
                self.resets += 1
                return "reset", None, None
            if self.stall and (self.stall_connections is None or self.stall_connections > 0):
                if self.stall_connections is not None:
                    self.stall_connections -= 1
                self.stalled += 1
                return "stall", None, None
            if self.reply is not None and (self.max_replies is None or self.replied < self.max_replies):
                self.replied += 1
                return "reply", None, None
            return "pass", self.cut_after_bytes, self.cut_download_after_bytes

    def _take_cut(self) -> bool:
        with self._lock:
            if self.cut_after_bytes is None or (self.max_cuts is not None and self.cuts >= self.max_cuts):
                return False
            self.cuts += 1
            return True

    def _take_download_cut(self) -> bool:
        with self._lock:
            if self.cut_download_after_bytes is None or (
                self.max_download_cuts is not None and self.download_cuts >= self.max_download_cuts
            ):
                return False
            self.download_cuts += 1
            return True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        action, budget, download_budget = self._decide()
        try:
            if action == "reset":
                _abort(writer)
                return
            if action == "reply":
                # a gateway that refuses: read the request head, answer, close (no upstream at all)
                with contextlib.suppress(asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
                    await reader.readuntil(b"\r\n\r\n")
                    writer.write(self.reply or b"")
                    await writer.drain()
                return
            if action == "stall":
                # hold the connection open, read nothing: the client's writes fill the buffers and block
                while not writer.transport.is_closing():
                    await asyncio.sleep(0.2)
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                _abort(writer)
                return
            self._writers.add(up_writer)
            try:
                await asyncio.gather(
                    self._pipe(reader, up_writer, writer, budget, self._take_cut),
                    self._pipe(
                        up_reader,
                        writer,
                        up_writer,
                        download_budget,
                        self._take_download_cut,
                        self.stall_downloads,
                        self.stall_downloads_for,
                    ),
                )
            finally:
                self._writers.discard(up_writer)
                up_writer.transport.abort()
        finally:
            self._writers.discard(writer)
            if not writer.transport.is_closing():
                writer.close()

    async def _pipe(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        src_writer: asyncio.StreamWriter,
        budget: int | None,
        take_cut: Callable[[], bool],
        stall: bool = False,
        stall_for: float | None = None,
    ) -> None:
        """Copy src to dst; with a budget, reset both connections once it is spent (mid-request or
        mid-response), when ``take_cut`` says this one is still to be cut; with ``stall``, send nothing
        more instead and hold both open until the proxy stops."""
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                if budget is not None:
                    if len(data) >= budget and take_cut():
                        dst.write(data[:budget])
                        if stall and stall_for is not None:  # silent for a while, then the rest as it was
                            await dst.drain()
                            await asyncio.sleep(stall_for)
                            dst.write(data[budget:])
                            await dst.drain()
                            budget = None
                            continue
                        while stall and not dst.transport.is_closing():
                            await asyncio.sleep(0.2)
                        _abort(src_writer)
                        _abort(dst)
                        return
                    budget = None if len(data) >= budget else budget - len(data)
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            _abort(dst)
            _abort(src_writer)
