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

__all__ = ["PeerLimit", "peer_key"]

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
    unproven: OrderedDict[Any, None] = field(default_factory=OrderedDict)
    evicted: int = 0
    open: dict[str, int] = field(default_factory=dict)
    refused: int = 0  # connections reset at once since the start, for tests and the log
    log_every_s: float = 10.0
    _unlogged: int = 0
    _logged_at: float = -float("inf")

    def admit(self, host: str) -> str | None:
        """The key ``host``'s new connection counts under (to ``release`` with), or None: over the cap."""
        key = peer_key(host, self.v6_prefix)
        n = self.open.get(key, 0)
        if 0 < self.cap <= n and not self.proxy(host):  # asked only at the cap: a proxy's many pay the parse
            self.refused += 1
            self._log(key)
            return None
        self.open[key] = n + 1
        return key

    def hold(self, conn: Any) -> None:
        """``conn`` (a new connection, with ``reset()``) has sent no whole request yet; the oldest such one is
        reset where that makes more than ``unproven_cap``."""
        if self.unproven_cap <= 0:
            return
        while len(self.unproven) >= self.unproven_cap:
            oldest, _ = self.unproven.popitem(last=False)
            self.evicted += 1
            oldest.reset()
        self.unproven[conn] = None

    def prove(self, conn: Any) -> None:
        """``conn`` sent a whole request header (or went away): no longer counted as unproven."""
        self.unproven.pop(conn, None)

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
