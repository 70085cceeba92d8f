"""What one TCP peer, and all peers without a request yet, may hold open on a server (``PeerLimit``), counted on
the server's event loop by its h11 protocol (``server.launch``)."""

from __future__ import annotations

import functools
import ipaddress
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CloseStrangers", "PeerLimit", "peer_key"]

_log = logging.getLogger("server.launch")


@functools.lru_cache(maxsize=65536)
def peer_key(host: str, v6_prefix: int = 64) -> str:
    """What a TCP peer's connections count under: an IPv4 address itself (an IPv4-mapped IPv6 one too), an IPv6
    address its ``v6_prefix`` network, anything else (a Unix socket's name) as it is."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/{v6_prefix}", strict=False))
    return host


@dataclass
class PeerLimit:
    """Open connections per TCP peer address, shared by the protocol instances of one server (each server's
    protocol class has its own: ``uvicorn_config``). Touched only on that server's event loop: no lock. ``cap``:
    the most one address may hold open (0: no limit, counted all the same). The peer is the TCP peer: behind a
    reverse proxy every client is the proxy, so ``proxy`` (the addresses of ``forwarded_allow_ips``) are never
    capped: limiting its clients is the proxy's business. An IPv6 peer counts under its ``v6_prefix`` network (one
    client holds a whole /64: counted per address, it held 64 connections per address of it, issue 49)."""

    cap: int
    proxy: Callable[[str], bool] = lambda _host: False
    v6_prefix: int = 64
    # the most connections without a whole request header yet, all addresses together (0: no bound); one more
    # resets the oldest of them: 70 addresses x 64 silent sockets filled uvicorn's limit_concurrency (503 for every
    # device); a real client sends its request within a round trip, so the oldest silent one is a stranger's
    unproven_cap: int = 0
    unproven: OrderedDict[Any, str] = field(default_factory=OrderedDict)  # connection -> its key, oldest first
    unproven_of: dict[str, OrderedDict[Any, None]] = field(default_factory=dict)  # key -> its connections
    evicted: int = 0
    scan: int = 16  # the most connections with bytes waiting passed over for one that has none (``_silent``)
    open: dict[str, int] = field(default_factory=dict)
    refused: int = 0  # connections reset at once since the start, for tests and the log
    log_every_s: float = 10.0
    _unlogged: int = 0
    _logged_at: float = -float("inf")

    def admit(self, host: str) -> str | None:
        """The key ``host``'s new connection counts under (to ``release`` with), or None: over the cap. At the
        cap, the address's oldest connection without a whole request is reset to make room (a device behind a
        NAT whose stranger holds silent sockets there gets in); an address none of whose connections is silent
        (each has sent a request, or has bytes waiting) is refused."""
        key = peer_key(host, self.v6_prefix)
        n = self.open.get(key, 0)
        if 0 < self.cap <= n and not self.proxy(host):  # asked only at the cap: a proxy's many pay the parse
            victim = self._silent(self.unproven_of.get(key))
            if victim is None:
                self.refused += 1
                self._log(key)
                return None
            self._evict(victim)
        self.open[key] = self.open.get(key, 0) + 1
        return key

    def hold(self, conn: Any, key: str) -> None:
        """``conn`` (a new connection of ``key``, with ``reset()`` and ``unread()``) has sent no whole request yet;
        the oldest such one of all with no byte waiting unread is reset where that makes more than
        ``unproven_cap``."""
        while 0 < self.unproven_cap <= len(self.unproven):
            victim = self._silent(self.unproven)
            if victim is None:  # each has bytes waiting: requests the loop reads next; over the bound till then
                break
            self._evict(victim)
        self.unproven[conn] = key
        self.unproven_of.setdefault(key, OrderedDict())[conn] = None

    def prove(self, conn: Any) -> None:
        """``conn`` sent a whole request header (or went away): no longer counted as unproven."""
        key = self.unproven.pop(conn, None)
        if key is not None:
            mine = self.unproven_of[key]
            mine.pop(conn, None)
            if not mine:
                del self.unproven_of[key]

    def _silent(self, conns: OrderedDict[Any, Any] | None) -> Any:
        """The oldest of ``conns`` (oldest first) with no byte waiting unread, or None. One with bytes waiting
        (``unread()``) goes to the back: under a flood of new connections the loop accepts a whole batch of them
        before it reads from any, and a client's request already in the kernel was reset as the oldest silent
        connection (the 70 addresses' flood, reopened, reset the victim's probes). At most ``scan`` are looked
        at: a batch of connections that each sent a byte costs an accept a few system calls, not one per
        connection held."""
        if not conns:
            return None
        for _ in range(min(self.scan, len(conns))):
            conn = next(iter(conns))
            if not conn.unread():
                return conn
            conns.move_to_end(conn)
        return None

    def _evict(self, conn: Any) -> None:
        self.prove(conn)
        self.evicted += 1
        conn.reset()  # releases its count now: its connection_lost comes on a later turn of the loop

    def release(self, key: str) -> None:
        n = self.open.get(key, 0) - 1
        if n > 0:
            self.open[key] = n
        else:
            self.open.pop(key, None)  # an address with nothing open costs no memory

    def _log(self, host: str) -> None:
        # one line per log_every_s however fast a flood comes (a line per refusal would be the flood's own log)
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= self.log_every_s:
            _log.warning("resetting connections at once from addresses over http_max_connections_per_address "
                         "(%d): %d since the last such line, the last from %s", self.cap, self._unlogged, host)
            self._logged_at, self._unlogged = now, 0


class CloseStrangers:
    """ASGI: a response to a request without an ``Authorization`` header, or answered 401, closes its connection
    (``Connection: close``): a stranger's connection is never kept alive idle between requests, where it would
    count against the server's concurrency as a device's does (issue 49); devices and the admin keep theirs."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        signed = any(k == b"authorization" for k, _ in scope.get("headers", ()))

        async def reply(message: Any) -> None:
            if message["type"] == "http.response.start" and (not signed or message["status"] == 401):
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, reply)
