"""A minimal asyncio MQTT 3.1.1 client for virtual devices (``bench/fleet_load.py``): what a device's session
does on the wire (CONNECT with its own credentials and a will, SUBSCRIBE at QoS 1, PUBACK what arrives at QoS 1,
PINGREQ within the keepalive, a retained status), one coroutine each, so 10,000 sessions fit in one process
(paho runs a thread per client)."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass, field

__all__ = ["MqttError", "MqttSession"]


class MqttError(RuntimeError):
    pass


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("!H", len(b)) + b


def _packet(kind: int, body: bytes) -> bytes:
    n, out = len(body), bytearray([kind])
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out) + body


async def _read_packet(r: asyncio.StreamReader) -> tuple[int, bytes]:
    kind = (await r.readexactly(1))[0]
    n, mult = 0, 1
    for _ in range(4):
        b = (await r.readexactly(1))[0]
        n += (b & 0x7F) * mult
        mult *= 128
        if not b & 0x80:
            break
    return kind, await r.readexactly(n)


@dataclass
class MqttSession:
    """One device's session. ``messages``: (topic, payload) of every PUBLISH received."""

    host: str
    port: int
    client_id: str
    username: str
    password: str
    keepalive: int = 60
    will: tuple[str, bytes] | None = None
    # the address the connection leaves from: one (source, broker) pair has only ~28,000 ephemeral ports, so
    # fleets of more devices spread over 127.0.0.x
    local_host: str | None = None
    messages: asyncio.Queue[tuple[str, bytes]] = field(default_factory=asyncio.Queue)
    _w: asyncio.StreamWriter | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _pid: int = 0
    _acks: dict[int, asyncio.Future[bytes]] = field(default_factory=dict)

    async def connect(self, timeout: float = 30.0) -> None:
        local = None if self.local_host is None else (self.local_host, 0)
        r, w = await asyncio.wait_for(asyncio.open_connection(self.host, self.port, local_addr=local), timeout)
        self._w = w
        flags = 0x80 | 0x40 | 0x02  # username, password, clean session (a virtual device starts afresh)
        payload = _str(self.client_id)
        if self.will is not None:
            flags |= 0x04 | 0x08 | 0x20  # will, QoS 1, retained
            payload += _str(self.will[0]) + _str(self.will[1])
        payload += _str(self.username) + _str(self.password)
        w.write(_packet(0x10, _str("MQTT") + bytes([4, flags]) + struct.pack("!H", self.keepalive) + payload))
        kind, body = await asyncio.wait_for(_read_packet(r), timeout)
        if kind != 0x20 or len(body) != 2 or body[1] != 0:
            w.close()
            raise MqttError(f"{self.client_id}: CONNACK refused (type {kind:#x}, code {body[-1:]!r})")
        self._tasks = [asyncio.create_task(self._reader(r)), asyncio.create_task(self._pinger())]

    def _next_pid(self) -> int:
        self._pid = self._pid % 65535 + 1
        return self._pid

    async def subscribe(self, topics: list[str], timeout: float = 30.0) -> None:
        pid = self._next_pid()
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._acks[pid] = fut
        self._send(0x82, struct.pack("!H", pid) + b"".join(_str(t) + b"\x01" for t in topics))
        codes = await asyncio.wait_for(fut, timeout)
        if any(c == 0x80 for c in codes):
            raise MqttError(f"{self.client_id}: SUBSCRIBE refused for {topics} ({codes!r})")

    async def publish(self, topic: str, payload: bytes, *, retain: bool = False, timeout: float = 30.0) -> None:
        """At QoS 1: returns once the broker acknowledged it."""
        pid = self._next_pid()
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._acks[pid] = fut
        self._send(0x32 | (0x01 if retain else 0), _str(topic) + struct.pack("!H", pid) + payload)
        await asyncio.wait_for(fut, timeout)

    def _send(self, kind: int, body: bytes) -> None:
        if self._w is None or self._w.is_closing():
            raise MqttError(f"{self.client_id}: not connected")
        self._w.write(_packet(kind, body))

    async def _reader(self, r: asyncio.StreamReader) -> None:
        try:
            while True:
                kind, body = await _read_packet(r)
                t = kind & 0xF0
                if t == 0x30:  # PUBLISH
                    (n,) = struct.unpack_from("!H", body)
                    topic, rest = body[2:2 + n].decode(), body[2 + n:]
                    if (kind >> 1) & 3:
                        self._send(0x40, rest[:2])  # PUBACK
                        rest = rest[2:]
                    self.messages.put_nowait((topic, rest))
                elif t in (0x90, 0x40):  # SUBACK, PUBACK
                    (pid,) = struct.unpack_from("!H", body)
                    fut = self._acks.pop(pid, None)
                    if fut is not None and not fut.done():
                        fut.set_result(body[2:])
        except (asyncio.IncompleteReadError, ConnectionError, MqttError):
            pass
        finally:
            for fut in self._acks.values():
                if not fut.done():
                    fut.set_exception(MqttError(f"{self.client_id}: connection lost"))
            self.messages.put_nowait(("", b""))  # wakes a waiter: the session ended

    async def _pinger(self) -> None:
        with contextlib.suppress(MqttError):
            while True:
                await asyncio.sleep(self.keepalive / 2)
                self._send(0xC0, b"")

    async def close(self) -> None:
        with contextlib.suppress(MqttError, ConnectionError):
            self._send(0xE0, b"")
        for t in self._tasks:
            t.cancel()
        if self._w is not None:
            self._w.close()
            with contextlib.suppress(Exception):
                await self._w.wait_closed()
