"""What one client may cost the embedded broker: its CONNECT is bounded before it is buffered, one address holds a
bounded number of connections, a device's messages are bounded in size and rate, the server's own link is never
disconnected for reading slowly, and what the refusals write to the log is bounded whatever the client sends."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from server.broker import EmbeddedBroker
from server.broker_wire import Identity, LogGate
from server.mqtt import STATUS_FILTER, STATUS_MAX_BYTES, MqttLink, parse_broker_url

DEVICE = Identity("dev", read=frozenset({"t"}), write=frozenset({"s"}), client_id="dev")
SERVER = Identity("srv", own=True)
ANY = Identity("any")


def _who(_cid: str, user: str | None, _pw: bytes | None) -> Identity | None:
    return {"dev": DEVICE, "srv": SERVER, "any": ANY}.get(user or "")


# ------------------------------------------------------------------------------------------------ raw MQTT
def _packet(kind: int, body: bytes) -> bytes:
    out, n = bytearray([kind]), len(body)
    while True:
        b, n = n % 128, n // 128
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out) + body


def _text(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack(">H", len(b)) + b


def _connect(client_id: str, user: str | None = None) -> bytes:
    flags = 0x02 | (0xC0 if user else 0)
    body = _text("MQTT") + bytes([4, flags]) + struct.pack(">H", 60) + _text(client_id)
    if user:
        body += _text(user) + _text("pw")
    return _packet(0x10, body)


def _publish(topic: str, payload: bytes, pid: int) -> bytes:  # QoS 1
    return _packet(0x32, _text(topic) + struct.pack(">H", pid) + payload)


class Client:
    """One raw connection that reads whole packets."""

    def __init__(self, addr: tuple[str, int], client_id: str, user: str | None = None, *,
                 source: str | None = None) -> None:
        self.s = socket.create_connection(addr, timeout=10, source_address=(source, 0) if source else None)
        self.buf = b""
        self.s.sendall(_connect(client_id, user))
        kind, body = self.read()
        assert (kind, body) == (0x20, b"\x00\x00"), (kind, body)

    def read(self) -> tuple[int, bytes]:
        while True:
            if len(self.buf) >= 2:
                n, mult, i = 0, 1, 1
                while i < len(self.buf):
                    n += (self.buf[i] & 0x7F) * mult
                    mult *= 128
                    i += 1
                    if not self.buf[i - 1] & 0x80:
                        break
                if len(self.buf) >= i + n and not self.buf[i - 1] & 0x80:
                    kind, body, self.buf = self.buf[0], self.buf[i:i + n], self.buf[i + n:]
                    return kind, body
            chunk = self.s.recv(65536)
            if not chunk:
                raise ConnectionError("closed by the broker")
            self.buf += chunk

    def close(self) -> None:
        self.s.close()


def _closed_at_once(addr: tuple[str, int], data: bytes, source: str | None = None) -> bytes:
    """What the broker answers to ``data`` before it closes the connection; the socket's 10 s timeout fails the
    test if it keeps it open (the brokers here wait 120 s for a CONNECT: closing is not their timeout)."""
    with socket.create_connection(addr, timeout=10, source_address=(source, 0) if source else None) as s:
        s.sendall(data)
        got = b""
        while True:
            try:
                chunk = s.recv(4096)
            except ConnectionResetError:
                return got
            if not chunk:
                return got
            got += chunk


@pytest.fixture
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker(authenticate=_who, max_per_address=3) as b:
        b.core.connect_timeout_s = 120.0
        yield b


def _addr(b: EmbeddedBroker) -> tuple[str, int]:
    return parse_broker_url(b.url)


# ------------------------------------------------------------------------------------------------- CONNECT
def test_a_connect_announcing_more_than_a_few_kb_is_closed_before_its_body(broker: EmbeddedBroker) -> None:
    addr = _addr(broker)
    t0 = time.monotonic()
    assert _closed_at_once(addr, b"\x10\x80\x80\x10") == b""  # 256 KiB announced, nothing of it sent
    assert time.monotonic() - t0 < 10
    assert broker.core.noted["malformed"] >= 1
    # the bound is the CONNECT's: one of 4 KiB is read and answered, one byte more is refused unread
    fits = _connect("x" * (broker.core.max_connect - 12))
    assert len(fits) - 3 == broker.core.max_connect  # the fixed header, then exactly the bound
    assert _closed_at_once(addr, fits) == b"\x20\x02\x00\x05"  # read, then refused: it names no user
    assert _closed_at_once(addr, _connect("x" * (broker.core.max_connect - 11))) == b""


# --------------------------------------------------------------------------------------- per-address cap
def test_one_address_holds_at_most_its_cap_of_connections(broker: EmbeddedBroker) -> None:
    addr = _addr(broker)
    held = [Client(addr, f"c{i}", "any", source="127.0.0.2") for i in range(3)]
    try:
        assert _closed_at_once(addr, _connect("c3", "any"), source="127.0.0.2") == b""  # the fourth: refused
        assert broker.core.noted["accept"] == 1
        other = Client(addr, "d0", "any", source="127.0.0.3")  # another address is not
        local = [Client(addr, f"l{i}", "any") for i in range(5)]  # nor loopback's own, past the cap
        for c in [other, *local]:
            c.close()
        held.pop().close()
        deadline = time.monotonic() + 30  # the broker sees the close on its own loop: until then, refused
        while True:
            try:
                held.append(Client(addr, "c4", "any", source="127.0.0.2"))
                break
            except (ConnectionError, AssertionError, OSError):
                assert time.monotonic() < deadline, "a closed connection's place was never given back"
                time.sleep(0.05)
    finally:
        for c in held:
            c.close()


# ------------------------------------------------------------------------------------ a device's messages
def _marked(srv: Client, pub: Client, pid: int) -> list[bytes]:
    """The payloads ``srv`` got until a marker that ``pub`` (unrestricted) publishes now: everything routed
    before the marker was written before it."""
    pub.s.sendall(_publish("s", b"marker", pid))
    got: list[bytes] = []
    while True:
        kind, body = srv.read()
        if kind >> 4 != 3:
            continue
        n = struct.unpack(">H", body[:2])[0]
        payload = body[2 + n + (2 if kind & 0x06 else 0):]
        if payload == b"marker":
            return got
        got.append(payload)


def test_a_devices_oversize_or_too_frequent_messages_are_dropped(broker: EmbeddedBroker) -> None:
    now = [1000.0]
    broker.core.clock = lambda: now[0]
    addr = _addr(broker)
    srv, pub = Client(addr, "srv", "srv"), Client(addr, "any", "any")
    srv.s.sendall(_packet(0x82, struct.pack(">H", 1) + _text("s") + b"\x01"))
    assert srv.read() == (0x90, b"\x00\x01\x01")
    dev = Client(addr, "dev", "dev")
    try:
        big = b"{" * (STATUS_MAX_BYTES + 1)
        dev.s.sendall(_publish("s", big, 1) + _publish("s", b"x" * STATUS_MAX_BYTES, 2))
        assert [dev.read(), dev.read()] == [(0x40, b"\x00\x01"), (0x40, b"\x00\x02")]  # both acknowledged
        assert _marked(srv, pub, 1) == [b"x" * STATUS_MAX_BYTES]  # the oversize one dropped, spending nothing
        for i in range(12):  # 9 tokens left of the burst of 10: 3 of these are dropped
            dev.s.sendall(_publish("s", b"%d" % i, 10 + i))
            assert dev.read() == (0x40, struct.pack(">H", 10 + i))
        assert _marked(srv, pub, 2) == [b"%d" % i for i in range(9)]
        now[0] += 1.0  # a second later: one more
        dev.s.sendall(_publish("s", b"late", 30) + _publish("s", b"later", 31))
        assert [dev.read()[0], dev.read()[0]] == [0x40, 0x40]
        assert _marked(srv, pub, 3) == [b"late"]
        assert broker.core.noted["oversize"] == 1 and broker.core.noted["rate"] == 4
        # a will over the bound is refused at CONNECT
        will = _text("MQTT") + bytes([4, 0xC6]) + struct.pack(">H", 60) + _text("dev") + _text("s") + \
            _text(b"w" * (STATUS_MAX_BYTES + 1)) + _text("dev") + _text("pw")
        assert _closed_at_once(addr, _packet(0x10, will)) == b"\x20\x02\x00\x05"
    finally:
        for c in (srv, pub, dev):
            c.close()


def test_the_servers_own_link_is_never_disconnected_for_reading_slowly() -> None:
    """A subscriber that stops reading is disconnected once its write buffer passes the bound; the server's own
    link (own=True) is not: the QoS 0 messages it cannot take are lost instead, and it reads on afterwards."""
    with EmbeddedBroker(authenticate=_who) as b:
        b.core.max_buffer = 64 * 1024
        addr = _addr(b)
        srv, other, pub = Client(addr, "srv", "srv"), Client(addr, "other", "any"), Client(addr, "pub", "any")
        try:
            for c in (srv, other):
                c.s.sendall(_packet(0x82, struct.pack(">H", 1) + _text("s") + b"\x00"))  # QoS 0
                assert c.read() == (0x90, b"\x00\x01\x00")
            flood = _packet(0x30, _text("s") + b"z" * 200_000)  # QoS 0, 200 KB each: ~40 MB in all
            for _ in range(200):
                pub.s.sendall(flood)
            pub.s.sendall(_packet(0xC0, b""))
            assert pub.read() == (0xD0, b"")  # PINGRESP: every message before it was routed
            assert b.core.noted["slow"] == 1 and b.core.noted["own-slow"] > 0
            with pytest.raises(ConnectionError):  # a timeout here (OSError) fails the test: it was kept
                while True:
                    other.read()  # what was buffered, then the end
            srv.s.sendall(_packet(0xC0, b""))
            while srv.read()[0] != 0xD0:  # the server's link drains and is answered
                pass
        finally:
            for c in (srv, other, pub):
                c.close()


def test_the_servers_link_drops_an_oversize_status_before_parsing_it() -> None:
    """Whatever the broker lets through (an external one: its own limits), a status over STATUS_MAX_BYTES never
    reaches the status handler; the ones after it do."""
    seen: list[bytes] = []
    got = threading.Event()

    def on_status(_topic: str, payload: bytes) -> None:
        seen.append(payload)
        got.set()

    with EmbeddedBroker() as b:  # no authenticator: every client may publish anything
        link = MqttLink(b.url, on_status)
        link.start()
        try:
            deadline = time.monotonic() + 30
            while not b.call(lambda: STATUS_FILTER in b.core._subs):  # its subscription is in place
                assert time.monotonic() < deadline, "the link never subscribed"
                time.sleep(0.02)
            pub = Client(_addr(b), "pub")
            pub.s.sendall(_publish("pfl/f/device/d/status", b"{" * (256 * 1024 - 64), 1) +
                          _publish("pfl/f/device/d/status", b'{"device_id": "d", "state": "online"}', 2))
            assert got.wait(30), "the status after the oversize one never came"
            assert seen == [b'{"device_id": "d", "state": "online"}'] and link.dropped_statuses == 1
            assert link.connected  # and the link was not cut off
            pub.close()
        finally:
            link.stop()


# ------------------------------------------------------------------------------------------------ logging
LINE_BOUND = 400  # a refusal line: its fixed words, and names cut to 120 characters


def test_a_huge_subscribe_writes_a_bounded_log(broker: EmbeddedBroker, caplog: pytest.LogCaptureFixture) -> None:
    """60,000 refused filters (and one of 2,000 characters) in one SUBSCRIBE, twice: a few lines of bounded
    length, whatever the packet's size (before: 16.7 times its bytes)."""
    addr = _addr(broker)
    filters = ["f" * 2000] + [str(i % 10) for i in range(60_000)]
    body = struct.pack(">H", 7) + b"".join(_text(f) + b"\x01" for f in filters)
    caplog.set_level(logging.INFO, logger="server.broker")
    for _ in range(2):
        dev = Client(addr, "dev", "dev")
        dev.s.sendall(_packet(0x82, body))
        kind, ack = dev.read()
        assert kind == 0x90 and ack == struct.pack(">H", 7) + b"\x80" * len(filters)
        dev.s.sendall(b"\xe0\x00")  # DISCONNECT: the connection's summary line is written as it ends
        with pytest.raises(ConnectionError):
            dev.read()
        dev.close()
    deadline = time.monotonic() + 30
    while broker.core.noted["summary"] < 2:  # written on the broker's loop as each connection ends
        assert time.monotonic() < deadline, "no summary line"
        time.sleep(0.02)
    lines = [r.getMessage() for r in caplog.records if r.name == "server.broker"]
    written = sum(len(s) for s in lines)
    assert broker.core.noted["subscribe"] == 2 * len(filters)
    assert all(len(s) < LINE_BOUND for s in lines), max(lines, key=len)
    assert written < (broker.core.log_gate.burst + 2) * LINE_BOUND, lines  # against 2 x 242 KB of filters
    assert any("f" * 100 in s and "characters)" in s for s in lines)  # the long one cut, and said to be
    assert any("60001" in s for s in lines)  # the summary counts what the gate held back


def test_the_log_gate_lets_a_few_lines_a_window_through_and_counts_the_rest() -> None:
    now = [0.0]
    gate = LogGate(every_s=10, burst=2, clock=lambda: now[0])
    out: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            out.append(record.getMessage())

    log = logging.getLogger("test.loggate")
    log.addHandler(keep := Keep())
    log.propagate = False
    try:
        assert [gate(log, logging.WARNING, "a", "line %d", i) for i in range(5)] == [True, True, False, False, False]
        assert gate(log, logging.WARNING, "b", "other")  # a kind of its own
        now[0] = 10.0
        assert gate(log, logging.WARNING, "a", "line %d", 5)
        assert out == ["line 0", "line 1", "other", "line 5 (and 3 more like it not logged)"]
    finally:
        log.removeHandler(keep)
        log.propagate = True
