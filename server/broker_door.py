"""Who may hold a connection to the embedded broker before it has logged in (``Door``), counted on the broker's
event loop by ``server.broker_core`` (no lock: that loop alone touches it).

A connection is a stranger's from its accept until CONNACK accepts its CONNECT (a device, the server's own link).
Strangers are bounded per address (``per_address``; an IPv6 peer counts under its ``v6_prefix`` network, as
``server.peers`` counts HTTP peers) and all addresses together (``total``). A session that has logged in is not
counted per address at all, only in ``max_connections``: a fleet behind one NAT holds a session per device, each
authenticated, and as many as it has devices (issue 49: 64 of 100 devices behind one address could log in, the
rest were refused); what bounds them is the enrolment, and each device's one client id.

At a bound a newcomer is not refused: the oldest stranger whose CONNECT is not yet whole, and none of whose bytes
wait unread in the kernel, is reset to make room (a client sends its CONNECT within a round trip of connecting, so
the oldest half-sent one is a stranger holding its place: with a stranger holding an address's cap, the devices
behind that address still log in; but under a burst the loop accepts a batch of connections before it reads from
any, and a CONNECT waiting in the kernel is a client's, not a stranger's). A stranger whose CONNECT is whole is
being answered (its password checked: moments) and is never reset. Where no stranger under a bound can be reset,
the newcomer is refused at its address's bound or ``max_connections``, and let in over ``total`` (the waiting
CONNECTs are read next), as ``server.peers`` does for HTTP.

Loopback is an address like any other: the server's own link connects from it, logs in and so no longer counts
(issue 49: exempt from the cap, half-sent CONNECTs from loopback held 176 MB)."""

from __future__ import annotations

import array
import asyncio
import fcntl
import termios
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from .peers import peer_key

__all__ = ["Door", "Guest", "waiting"]


@dataclass(eq=False)
class Guest:
    """One connection the door let in; ``reset`` closes it at once (the door's eviction)."""

    key: str  # what its address counts under
    transport: asyncio.BaseTransport
    reset: Callable[[], None]
    stranger: bool = True  # not logged in yet (nor reset)
    half: bool = True  # its CONNECT is not whole yet: it may be reset
    held: bool = True  # counted in ``open`` (until it ends, or is reset)


@dataclass
class Door:
    """``per_address``, ``total``, ``max_connections``: 0 is no bound."""

    per_address: int = 256
    total: int = 1024
    max_connections: int = 20_000
    v6_prefix: int = 64
    scan: int = 16  # the most half-sent strangers with bytes waiting passed over for one without (``_silent``)
    open: int = 0  # connections held, strangers or logged in
    evicted: int = 0  # strangers reset to make room
    _half: OrderedDict[Guest, None] = field(default_factory=OrderedDict)  # half-sent, oldest first
    _half_of: dict[str, OrderedDict[Guest, None]] = field(default_factory=dict)  # the same, by address
    _strangers_of: Counter[str] = field(default_factory=Counter)
    _strangers: int = 0

    def admit(self, host: str, transport: asyncio.BaseTransport, reset: Callable[[], None]) -> Guest | str:
        """The new connection from ``host`` on ``transport``, or why it is refused (nobody to reset at a bound)."""
        key = peer_key(host, self.v6_prefix)
        why = (self._room(lambda: self._strangers_of[key], self.per_address, key,
                          "connections not logged in from that address")
               or self._room(lambda: self._strangers, self.total, None, "", refuse=False)
               or self._room(lambda: self.open, self.max_connections, None, "connections open"))
        if why:
            return why
        guest = Guest(key, transport, reset)
        self.open += 1
        self._strangers, self._strangers_of[key] = self._strangers + 1, self._strangers_of[key] + 1
        self._half[guest] = None
        self._half_of.setdefault(key, OrderedDict())[guest] = None
        return guest

    def whole(self, guest: Guest) -> bool:
        """``guest`` sent its whole CONNECT: never reset from now on. False: it was reset before (its CONNECT was
        in its buffer already): it must end without an answer."""
        self._unhalf(guest)
        return guest.held

    def settle(self, guest: Guest) -> None:
        """``guest`` logged in (CONNACK 0): no longer a stranger."""
        self._unhalf(guest)
        if guest.stranger:
            guest.stranger = False
            self._strangers -= 1
            n = self._strangers_of[guest.key] - 1
            if n > 0:
                self._strangers_of[guest.key] = n
            else:
                del self._strangers_of[guest.key]  # an address with nothing open costs no memory

    def leave(self, guest: Guest) -> None:
        """``guest``'s connection ended (a reset one's place was given back when it was reset)."""
        self.settle(guest)
        if guest.held:
            guest.held = False
            self.open -= 1

    def not_logged_in(self, host: str | None = None) -> int:
        """Strangers from ``host``'s address, or from every address."""
        return self._strangers if host is None else self._strangers_of.get(peer_key(host, self.v6_prefix), 0)

    def _room(self, count: Callable[[], int], cap: int, key: str | None, what: str, *, refuse: bool = True) -> str:
        """"" once ``count()`` is under ``cap`` (0: no bound), resetting the oldest silent half-sent strangers (of
        ``key``'s address, or of all) as needed; else why not ("" all the same where not ``refuse``)."""
        while cap and count() >= cap:
            victim = self._silent(self._half if key is None else self._half_of.get(key))
            if victim is None:
                return f"{count()} {what}" if refuse else ""
            self._reset(victim)
        return ""

    def _silent(self, half: OrderedDict[Guest, None] | None) -> Guest | None:
        """The oldest of ``half`` with no byte waiting unread in the kernel, or None; one with bytes waiting goes
        to the back. At most ``scan`` are looked at: an accept costs a few system calls, not one per stranger."""
        if not half:
            return None
        for _ in range(min(self.scan, len(half))):
            guest = next(iter(half))
            if not waiting(guest.transport):
                return guest
            half.move_to_end(guest)
        return None

    def _unhalf(self, guest: Guest) -> None:
        if guest.half:
            guest.half = False
            del self._half[guest]
            mine = self._half_of[guest.key]
            del mine[guest]
            if not mine:
                del self._half_of[guest.key]

    def _reset(self, guest: Guest) -> None:
        self.leave(guest)
        self.evicted += 1
        guest.reset()  # the connection closes now; its handler ends on a later turn of the loop


def waiting(transport: asyncio.BaseTransport) -> bool:
    """Whether bytes of ``transport``'s connection wait in the kernel, not read yet (FIONREAD)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    n = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, n)
    except (OSError, ValueError):  # closed meanwhile: nothing waits
        return False
    return n[0] > 0
