"""In-process HTTP telemetry for ``/metrics``: request latency by route template, request counts by status class,
and bytes received and sent, since this process started (a restart starts them at zero, as Prometheus expects of
a counter; what must survive a restart is read from the database by ``server.routers.prom``).

:class:`HttpTelemetry` is a pure ASGI middleware. Its labels are bounded: the route is the matched route's
*template* (``/v1/blobs/{sha256}``, never the raw path; ``unmatched`` for a path no route holds), the method one
of :data:`METHODS` (else ``other``) and the status its class (``2xx``...). Its cost per request is one clock read
at each end, a wrapper around ``send`` and ``receive`` that adds message sizes, and one locked update of a few
integers.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

__all__ = ["BUCKETS_S", "METHODS", "HttpTelemetry", "RouteStats", "Telemetry", "install", "telemetry_of"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# upper bounds in seconds of the latency histogram's buckets (+Inf is implied): a JSON call takes milliseconds,
# a large blob over a slow link seconds
BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED = "unmatched"


@dataclass
class RouteStats:
    """One (route, method): a latency histogram (``buckets[i]`` counts requests in bucket i alone, not
    cumulatively), requests per status class, and body bytes in and out."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))
    sum_s: float = 0.0
    count: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0


class Telemetry:
    """The counters, keyed by (route template, method); safe to read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[tuple[str, str], RouteStats] = {}
        self.started_at = time.time()

    def observe(self, route: str, method: str, status: int, seconds: float, bytes_in: int, bytes_out: int) -> None:
        code = f"{status // 100}xx" if 100 <= status < 600 else "other"
        i = bisect.bisect_left(BUCKETS_S, seconds)  # first bound >= seconds: Prometheus buckets are "le"
        with self._lock:
            st = self._stats.get((route, method))
            if st is None:
                st = self._stats[(route, method)] = RouteStats()
            st.buckets[i] += 1
            st.sum_s += seconds
            st.count += 1
            st.codes[code] = st.codes.get(code, 0) + 1
            st.bytes_in += bytes_in
            st.bytes_out += bytes_out

    def snapshot(self) -> dict[tuple[str, str], RouteStats]:
        """A consistent copy, sorted by route and method (stable output for scrapers and tests)."""
        with self._lock:
            return {k: RouteStats(list(v.buckets), v.sum_s, v.count, dict(v.codes), v.bytes_in, v.bytes_out)
                    for k, v in sorted(self._stats.items())}


def _route_of(scope: Scope) -> str:
    """The matched route's whole template. FastAPI leaves the route of an included router in ``scope["route"]``
    with its own path only (``/federations/{fed}``, without the ``/v1`` it is included under), so the prefix is
    taken from the request's path: the part before the route's segments. Prefixes are the routers' literal ones,
    so this stays a bounded set."""
    tpl = getattr(scope.get("route"), "path", None)
    if not isinstance(tpl, str):
        return UNMATCHED
    raw = str(scope.get("path", ""))
    n = tpl.count("/")
    if n == 0 or ":path}" in tpl:  # a path converter spans segments: its own template is the best bounded label
        return tpl
    cut = len(raw)
    for _ in range(n):
        cut = raw.rfind("/", 0, cut)
        if cut < 0:
            return tpl
    return raw[:cut] + tpl


class HttpTelemetry:
    """ASGI middleware that records each HTTP request in a :class:`Telemetry` once its response is done."""

    def __init__(self, app: ASGIApp, telemetry: Telemetry) -> None:
        self.app = app
        self.telemetry = telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 0
        n_in = n_out = 0

        async def counting_receive() -> Message:
            nonlocal n_in
            msg = await receive()
            n_in += len(msg.get("body", b""))
            return msg

        async def counting_send(msg: Message) -> None:
            nonlocal status, n_out
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
            elif msg["type"] == "http.response.body":
                n_out += len(msg.get("body", b""))
            await send(msg)

        try:
            await self.app(scope, counting_receive, counting_send)
        except BaseException:
            status = status or 500  # what the server's error handling answers for it
            raise
        finally:
            method = scope.get("method", "")
            self.telemetry.observe(_route_of(scope), method if method in METHODS else "other", status,
                                   time.perf_counter() - t0, n_in, n_out)


def install(app: FastAPI) -> Telemetry:
    """Record every request of ``app`` (outermost middleware: refusals of the input limits count too); the
    counters are ``app.state.telemetry``."""
    tel = Telemetry()
    app.state.telemetry = tel
    app.add_middleware(HttpTelemetry, telemetry=tel)
    return tel


def telemetry_of(app: Any) -> Telemetry:
    tel = getattr(app.state, "telemetry", None)
    return tel if isinstance(tel, Telemetry) else Telemetry()
