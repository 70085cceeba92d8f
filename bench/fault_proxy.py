"""A small fault-injecting TCP proxy (asyncio), for networks this kernel cannot fake (no ``netem``).

Each route listens on ``LISTEN_HOST:PORT`` and forwards to ``TARGET_HOST:PORT``. Every chunk is delivered
``--latency-ms`` after it arrived, in each direction (so a request and its answer take twice that more), in
order. A fraction ``--cut`` of connections is cut mid-transfer: at accept time such a connection draws a byte
count (1 B .. 256 KiB, both directions together) and a time (0.2 .. 20 s); whichever comes first, both sides are
reset (RST, no FIN), as a dropped link or a dying middlebox does. ``--stats FILE`` gets the counts as JSON every
two seconds and at exit (SIGTERM or SIGINT).

    python bench/fault_proxy.py --route 10.0.0.1:9000=127.0.0.1:8080 --latency-ms 200 --cut 0.05 --stats s.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import socket
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["Proxy", "RouteStats", "main"]

CHUNK = 64 * 1024
MAX_CUT_BYTES = 256 * 1024


@dataclass
class RouteStats:
    connections: int = 0
    cut: int = 0  # connections reset mid-transfer by the proxy
    reset: int = 0  # connections one end reset (passed on to the other)
    upstream_refused: int = 0  # the target did not answer (server or broker down)
    bytes: int = 0


@dataclass
class Proxy:
    routes: list[tuple[str, int, str, int]]
    latency_s: float = 0.2
    cut: float = 0.05
    seed: int = 0
    stats: dict[str, RouteStats] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    async def serve(self) -> list[asyncio.Server]:
        servers = []
        for lh, lp, th, tp in self.routes:
            name = f"{lh}:{lp}->{th}:{tp}"
            self.stats[name] = RouteStats()

            def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, name: str = name, th: str = th,
                        tp: int = tp) -> asyncio.Task[None]:
                return asyncio.ensure_future(self._connection(name, r, w, th, tp))

            servers.append(await asyncio.start_server(handler, lh, lp, reuse_address=True))
        return servers

    async def _connection(self, name: str, cr: asyncio.StreamReader, cw: asyncio.StreamWriter, th: str,
                          tp: int) -> None:
        st = self.stats[name]
        st.connections += 1
        try:
            ur, uw = await asyncio.wait_for(asyncio.open_connection(th, tp), 10)
        except (TimeoutError, OSError):
            st.upstream_refused += 1
            _reset(cw)
            return
        budget: list[int] | None = None
        cut_at: float | None = None
        if self.rng.random() < self.cut:
            budget = [self.rng.randint(1, MAX_CUT_BYTES)]
            cut_at = time.monotonic() + self.rng.uniform(0.2, 20.0)
        pending = {asyncio.ensure_future(self._pump(cr, uw, st, budget)),
                   asyncio.ensure_future(self._pump(ur, cw, st, budget))}
        eof_by: float | None = None  # once one side closed, the other gets a minute to finish
        while pending:
            ends = [t for t in (cut_at, eof_by) if t is not None]
            timeout = None if not ends else max(0.0, min(ends) - time.monotonic())
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            ends_of = {p.result() for p in done if not p.cancelled() and p.exception() is None}
            cut = (not done and cut_at is not None and time.monotonic() >= cut_at) or "cut" in ends_of
            if cut or "reset" in ends_of:  # a reset by either end is passed on to the other, as a router would
                st.cut += int(cut)
                st.reset += int(not cut)
                for p in pending:
                    p.cancel()
                _reset(cw)
                _reset(uw)
                return
            if not done:
                break  # the other side never finished
            eof_by = eof_by or time.monotonic() + 60.0
        for p in pending:
            p.cancel()
        for w in (cw, uw):
            w.close()

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, st: RouteStats,
                    budget: list[int] | None) -> str:
        """Copy r to w with the latency. How it ended: "eof" (r closed; passed on to w), "reset" (r was reset,
        or w is gone), "cut" (the cut budget ran out): the last two reset the whole connection."""
        q: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=64)

        broken: list[bool] = []

        async def deliver() -> None:
            while True:
                at, data = await q.get()
                if not data:
                    return
                if broken:
                    continue  # the far side is gone: swallow what is queued so the reader never blocks
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                try:
                    w.write(data)
                    await w.drain()
                except OSError:
                    broken.append(True)

        writer = asyncio.ensure_future(deliver())
        try:
            while not broken:
                data = await r.read(CHUNK)
                if budget is not None:
                    budget[0] -= len(data)
                    if budget[0] <= 0:
                        return "cut"
                st.bytes += len(data)
                await q.put((time.monotonic() + self.latency_s, data))
                if not data:
                    await writer
                    if not broken and w.can_write_eof():
                        w.write_eof()
                    return "eof"
            return "reset"
        except (OSError, asyncio.IncompleteReadError):
            return "reset"
        finally:
            if not writer.done():
                writer.cancel()


def _reset(w: asyncio.StreamWriter) -> None:
    """Close with RST: SO_LINGER on, 0 s."""
    sock = w.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    w.transport.abort()


def _parse_route(text: str) -> tuple[str, int, str, int]:
    try:
        left, right = text.split("=")
        lh, lp = left.rsplit(":", 1)
        th, tp = right.rsplit(":", 1)
        return lh, int(lp), th, int(tp)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a route is LISTEN_HOST:PORT=TARGET_HOST:PORT, got {text!r}") from None


async def _run(proxy: Proxy, stats_path: Path | None) -> None:
    servers = await proxy.serve()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def dump() -> None:
        if stats_path is not None:
            tmp = stats_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({k: asdict(v) for k, v in proxy.stats.items()}))
            tmp.replace(stats_path)

    while not stop.is_set():
        dump()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 2.0)
    for s in servers:
        s.close()
    dump()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--route", type=_parse_route, action="append", required=True)
    p.add_argument("--latency-ms", type=float, default=200.0, help="added to each direction (default 200)")
    p.add_argument("--cut", type=float, default=0.05, help="fraction of connections reset mid-transfer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats", type=Path)
    a = p.parse_args(argv)
    asyncio.run(_run(Proxy(a.route, a.latency_ms / 1e3, a.cut, a.seed), a.stats))


if __name__ == "__main__":
    main()
