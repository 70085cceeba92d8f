"""The round trip of an emulated link, where this kernel's shapers cannot add one: ``netem`` is not built in, and
the qdiscs that are (``tbf``, ``htb``, ``pfifo``, ``clsact``) only rate, queue or classify. A TCP relay on the
bridge's address forwards each connection of a device to the server on loopback and holds every chunk it reads
for the device's one-way delay before it writes it on, in order, each direction: every request and answer, MQTT
message and acknowledgement, pays the class's round trip, as on its real link. What it does not do is in
docs/emulation.md (TCP's own handshake and window growth over the delay). Runs its own event loop in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pfl_edge.errors import PflEdgeError

__all__ = ["DelayRelay", "Route"]

CHUNK = 64 * 1024
QUEUED = 256  # chunks in flight per direction before the relay stops reading (TCP's flow control resumes)


@dataclass(frozen=True)
class Route:
    listen_host: str
    listen_port: int
    target_host: str
    target_port: int


@dataclass
class _Stats:
    connections: int = 0
    bytes: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})


class DelayRelay:
    """Forwards each route's connections, delaying both directions by ``delay_for(peer address)`` seconds (0 for
    a peer it does not know)."""

    def __init__(self, routes: list[Route], delay_for: Callable[[str], float]) -> None:
        self.routes, self.delay_for = routes, delay_for
        self.stats = _Stats()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-relay", daemon=True)
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=30)
        except OSError as e:
            self.close()
            raise PflEdgeError(f"the delay relay cannot listen: {e}") from e

    async def _listen(self) -> None:
        for r in self.routes:
            def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, r: Route = r) -> None:
                task = asyncio.ensure_future(self._connection(reader, writer, r))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self._servers.append(await asyncio.start_server(handler, r.listen_host, r.listen_port, backlog=1024))

    async def _connection(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter, r: Route) -> None:
        peer = down_w.get_extra_info("peername")
        delay = self.delay_for(peer[0] if peer else "")
        self.stats.connections += 1
        try:
            up_r, up_w = await asyncio.open_connection(r.target_host, r.target_port)
        except OSError:
            down_w.close()
            return
        pumps = [asyncio.ensure_future(self._pump(down_r, up_w, delay, "up")),
                 asyncio.ensure_future(self._pump(up_r, down_w, delay, "down"))]
        try:  # both ways to their ends, or the first error (a reset) ends both
            await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for p in pumps:
                p.cancel()
            for w in (up_w, down_w):
                w.close()
            for p in pumps:
                if p.done() and not p.cancelled():
                    p.exception()  # retrieved: a reset is how a connection may end

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float,
                    way: str) -> None:
        """Read as it comes, write each chunk ``delay`` after it was read, in order; end (EOF) the same way."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUED)

        async def send() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        with contextlib.suppress(OSError):
                            writer.write_eof()
                    return
                writer.write(data)
                self.stats.bytes[way] += len(data)
                await writer.drain()

        sender = asyncio.ensure_future(send())
        try:
            while True:
                data = await reader.read(CHUNK)
                await queue.put((loop.time() + delay, data))
                if not data:
                    break
            await sender
        finally:
            sender.cancel()

    def close(self) -> None:
        """Stop listening and drop every connection; the thread ends."""
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            for s in self._servers:
                s.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.sleep(0)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
