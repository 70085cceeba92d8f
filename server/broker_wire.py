"""MQTT 3.1.1 packets as the embedded broker reads and writes them (``server.broker_core``): the fixed header,
CONNECT, PUBLISH, SUBSCRIBE, UNSUBSCRIBE and the acknowledgements, plus topic filter matching.

Every byte comes from the network: lengths are bounded before anything is read, strings must be UTF-8 without
NUL, and anything malformed raises :class:`WireError` (the broker closes that connection). What the network makes
the broker write to its log is bounded too: names cut short (:func:`shown`) and lines rate-limited
(:class:`LogGate`). And who a client is (:class:`Identity`): the topics it may read and write."""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "ANYONE",
    "CONNACK",
    "CONNECT",
    "DISCONNECT",
    "PINGREQ",
    "PINGRESP",
    "PUBACK",
    "PUBCOMP",
    "PUBLISH",
    "PUBREC",
    "PUBREL",
    "SUBACK",
    "SUBSCRIBE",
    "UNSUBACK",
    "UNSUBSCRIBE",
    "Authenticator",
    "Bucket",
    "Connect",
    "Identity",
    "LogGate",
    "Publish",
    "WireError",
    "connack",
    "matches",
    "parse_connect",
    "parse_publish",
    "parse_subscribe",
    "parse_unsubscribe",
    "peer_host",
    "puback",
    "pubcomp",
    "publish",
    "pubrec",
    "read_packet",
    "shown",
    "suback",
    "unsuback",
    "valid_filter",
    "valid_topic",
]

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 10, 11, 12, 13, 14
PINGRESP_BYTES = bytes([PINGRESP << 4, 0])


class WireError(Exception):
    """A malformed or unsupported packet: the connection is closed."""


async def read_packet(reader: asyncio.StreamReader, max_bytes: int) -> tuple[int, int, bytes]:
    """(packet type, flags, body) of the next packet; ``max_bytes`` bounds the body before it is read: a longer
    one raises as soon as its remaining length is known, so a client that announces a large packet and sends it
    slowly never makes the broker hold more than ``max_bytes`` of it."""
    first = (await reader.readexactly(1))[0]
    length, mult = 0, 1
    for _ in range(4):
        b = (await reader.readexactly(1))[0]
        length += (b & 0x7F) * mult
        if not b & 0x80:
            break
        mult *= 128
    else:
        raise WireError("remaining length longer than 4 bytes")
    if length > max_bytes:
        raise WireError(f"packet of {length} bytes exceeds the broker's limit of {max_bytes}")
    body = await reader.readexactly(length) if length else b""
    return first >> 4, first & 0x0F, body


def shown(value: object, limit: int = 120) -> str:
    """``repr(value)`` for a log line, cut to ``limit`` characters: client ids, user names, topics and filters
    come from the network (before the cut, a SUBSCRIBE of 60,000 refused filters wrote 16.7 times its bytes)."""
    r = repr(value)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r)} characters)"


def peer_host(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


class Bucket:
    """A token bucket: ``burst`` tokens, refilled at ``rate`` a second (one client's publishes)."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate, self.burst, self.clock = rate, float(burst), clock
        self.tokens, self.at = self.burst, clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens, self.at = min(self.burst, self.tokens + (now - self.at) * self.rate), now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class LogGate:
    """At most ``burst`` log lines of a kind per ``every_s`` seconds; the lines held back are counted, and the next
    line of that kind let through says how many. What a flood of clients makes the broker write stays bounded
    whatever they send, and a refusal is still seen. For one thread (the broker's loop; a link's network thread)."""

    def __init__(self, every_s: float = 10.0, burst: int = 5, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.burst, self.clock = every_s, burst, clock
        self._kinds: dict[str, tuple[float, int, int]] = {}  # kind -> (window start, lines let through, held back)

    def __call__(self, logger: logging.Logger, level: int, kind: str, msg: str, *args: object,
                 exc_info: bool = False) -> bool:
        """Log ``msg % args`` unless ``kind`` has had its lines in this window; whether it was logged."""
        now = self.clock()
        start, let, held = self._kinds.get(kind, (now, 0, 0))
        if now - start >= self.every_s:
            start, let = now, 0
        if let >= self.burst:
            self._kinds[kind] = (start, let, held + 1)
            return False
        self._kinds[kind] = (start, let + 1, 0)
        if held:
            msg = f"{msg} (and {held} more like it not logged)"
        logger.log(level, msg, *args, exc_info=exc_info)
        return True


def _header(kind: int, flags: int, length: int) -> bytes:
    out = bytearray([kind << 4 | flags])
    while True:
        b, length = length % 128, length // 128
        out.append(b | (0x80 if length else 0))
        if not length:
            return bytes(out)


class _Reader:
    def __init__(self, body: bytes) -> None:
        self.b, self.i = body, 0

    def u8(self) -> int:
        if self.i >= len(self.b):
            raise WireError("packet truncated")
        self.i += 1
        return self.b[self.i - 1]

    def u16(self) -> int:
        if self.i + 2 > len(self.b):
            raise WireError("packet truncated")
        self.i += 2
        return int(struct.unpack_from(">H", self.b, self.i - 2)[0])

    def raw(self) -> bytes:
        n = self.u16()
        if self.i + n > len(self.b):
            raise WireError("packet truncated")
        self.i += n
        return self.b[self.i - n:self.i]

    def text(self) -> str:
        try:
            s = self.raw().decode("utf-8")
        except UnicodeDecodeError:
            raise WireError("a string is not UTF-8") from None
        if "\x00" in s:
            raise WireError("a string contains NUL")
        return s

    def rest(self) -> bytes:
        out, self.i = self.b[self.i:], len(self.b)
        return out

    @property
    def more(self) -> bool:
        return self.i < len(self.b)


def _text(s: str) -> bytes:
    b = s.encode()
    return struct.pack(">H", len(b)) + b


@dataclass(frozen=True)
class Publish:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    pid: int = 0


@dataclass(frozen=True)
class Connect:
    client_id: str
    clean: bool
    keepalive: int
    username: str | None
    password: bytes | None
    will: Publish | None
    level: int


def parse_connect(body: bytes) -> Connect:
    r = _Reader(body)
    name = r.text()
    level = r.u8()
    if name != "MQTT":
        raise WireError(f"protocol {shown(name)} is not MQTT")
    flags = r.u8()
    if flags & 0x01:
        raise WireError("reserved CONNECT flag set")
    keepalive = r.u16()
    client_id = r.text()
    will = None
    if flags & 0x04:
        will_topic, will_payload = r.text(), r.raw()
        will = Publish(will_topic, will_payload, qos=(flags >> 3) & 0x03, retain=bool(flags & 0x20))
        if will.qos > 2 or not valid_topic(will_topic):
            raise WireError("invalid will")
    username = r.text() if flags & 0x80 else None
    password = r.raw() if flags & 0x40 else None
    return Connect(client_id, bool(flags & 0x02), keepalive, username, password, will, level)


def parse_publish(flags: int, body: bytes) -> Publish:
    qos = (flags >> 1) & 0x03
    r = _Reader(body)
    topic = r.text()
    pid = r.u16() if qos else 0
    if qos == 3 or not valid_topic(topic) or (qos and pid == 0):
        raise WireError("invalid PUBLISH")
    return Publish(topic, r.rest(), qos=qos, retain=bool(flags & 0x01), dup=bool(flags & 0x08), pid=pid)


def parse_subscribe(body: bytes) -> tuple[int, list[tuple[str, int]]]:
    r = _Reader(body)
    pid = r.u16()
    subs = []
    while r.more:
        subs.append((r.text(), r.u8() & 0x03))
    if not subs:
        raise WireError("SUBSCRIBE without a topic filter")
    return pid, subs


def parse_unsubscribe(body: bytes) -> tuple[int, list[str]]:
    r = _Reader(body)
    pid = r.u16()
    filters = []
    while r.more:
        filters.append(r.text())
    return pid, filters


def connack(session_present: bool, rc: int) -> bytes:
    return _header(CONNACK, 0, 2) + bytes([int(session_present), rc])


def publish(p: Publish) -> bytes:
    body = _text(p.topic) + (struct.pack(">H", p.pid) if p.qos else b"") + p.payload
    return _header(PUBLISH, (0x08 if p.dup else 0) | p.qos << 1 | int(p.retain), len(body)) + body


def puback(pid: int) -> bytes:
    return _header(PUBACK, 0, 2) + struct.pack(">H", pid)


def pubrec(pid: int) -> bytes:
    return _header(PUBREC, 0, 2) + struct.pack(">H", pid)


def pubcomp(pid: int) -> bytes:
    return _header(PUBCOMP, 0, 2) + struct.pack(">H", pid)


def suback(pid: int, codes: list[int]) -> bytes:
    return _header(SUBACK, 0, 2 + len(codes)) + struct.pack(">H", pid) + bytes(codes)


def unsuback(pid: int) -> bytes:
    return _header(UNSUBACK, 0, 2) + struct.pack(">H", pid)


def valid_topic(topic: str) -> bool:
    """A topic a message may be published to: not empty, no wildcards."""
    return bool(topic) and "+" not in topic and "#" not in topic and len(topic.encode()) <= 65535


def valid_filter(f: str) -> bool:
    if not f:
        return False
    levels = f.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            return False
        if "+" in level and level != "+":
            return False
    return True


def matches(a_filter: str, topic: str) -> bool:
    """MQTT 3.1.1 section 4.7: does ``topic`` match ``a_filter`` (``$`` topics never match a leading wildcard)."""
    if topic.startswith("$") and a_filter[:1] in ("+", "#"):
        return False
    f, t = a_filter.split("/"), topic.split("/")
    for i, level in enumerate(f):
        if level == "#":
            return True
        if i >= len(t) or (level != "+" and level != t[i]):
            return False
    return len(f) == len(t)


# ------------------------------------------------------------------------ who may use which topics
@dataclass(frozen=True)
class Identity:
    username: str
    read: frozenset[str] | None = None  # exact topics it may subscribe to and receive; None: any
    write: frozenset[str] | None = None  # topics it may publish to (its will included); None: any
    client_id: str | None = None  # the one client id it may connect with; None: any
    # the server's own link: never disconnected for reading slowly (its QoS 0 messages are dropped meanwhile;
    # its QoS 1 ones wait in its queue), so no flood of device messages can cut the server off its broker
    own: bool = False

    def may_read(self, topic: str) -> bool:
        return self.read is None or topic in self.read

    def may_subscribe(self, a_filter: str) -> bool:
        return self.read is None or a_filter in self.read

    def may_write(self, topic: str) -> bool:
        return self.write is None or topic in self.write


ANYONE = Identity("")  # what every client is when the broker has no authenticator (tests only)
Authenticator = Callable[[str, str | None, bytes | None], Identity | None]
