"""What one client may cost the embedded broker: its CONNECT is bounded before it is buffered, connections that
have not logged in are bounded per address (loopback too) and in all while a fleet behind one address logs in
whole, a device's messages are bounded in size and rate, the server's own link is never disconnected for reading
slowly, and what the refusals write to the log is bounded whatever the client sends."""

from __future__ import annotations

import contextlib
import inspect
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from server.broker import EmbeddedBroker
from server.broker_door import Door, Guest, waiting
from server.broker_wire import Identity, LogGate
from server.mqtt import STATUS_FILTER, STATUS_MAX_BYTES, MqttLink, parse_broker_url

DEVICE = Identity("dev", read=frozenset({"t"}), write=frozenset({"s"}), client_id="dev")
SERVER = Identity("srv", own=True)
ANY = Identity("any")


FLEET = 100  # devices behind one address (issue 49's count)


def _who(_cid: str, user: str | None, _pw: bytes | None) -> Identity | None:
    if user and user.startswith("fleet-"):  # a fleet's device: its own client id, its topics
        return Identity(user, read=frozenset({"t"}), write=frozenset({"s"}), client_id=user)
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


# ------------------------------------------------------------------------------------ not logged in yet
NAT = "127.0.0.2"  # a fleet's one address (every 127/8 address is this machine's loopback on Linux)
CONNACK_OK = b"\x20\x02\x00\x00"
CAP = inspect.signature(EmbeddedBroker).parameters["max_per_address"].default  # what the server runs with


def _half_sent(addr: tuple[str, int], source: str = "127.0.0.1") -> socket.socket:
    """A stranger's connection that sends the first bytes of a CONNECT and no more, holding its place."""
    s = socket.create_connection(addr, timeout=10, source_address=(source, 0))
    s.sendall(_connect("stranger")[:6])
    return s


def _closed(s: socket.socket) -> bool:
    """Has the broker closed ``s``, now (it writes nothing to a connection without a whole CONNECT)?"""
    timeout = s.gettimeout()
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True
    finally:
        s.settimeout(timeout)


def _answer(s: socket.socket, n: int = 4) -> bytes:
    """The first ``n`` bytes the broker answers on ``s``: fewer where it closes it (its 10 s timeout: kept)."""
    got = b""
    with contextlib.suppress(OSError):
        while len(got) < n and (chunk := s.recv(n - len(got))):
            got += chunk
    return got


def _fleet(addr: tuple[str, int], names: range, source: str = NAT) -> tuple[list[bytes], list[socket.socket]]:
    """Devices ``fleet-<i>`` behind ``source`` open their connections and send their CONNECTs, all before any
    answer is read (a fleet at once); what each was answered (its CONNACK; less where the broker closed it)."""
    socks = [socket.create_connection(addr, timeout=10, source_address=(source, 0)) for _ in names]
    for i, s in zip(names, socks, strict=True):
        with contextlib.suppress(OSError):
            s.sendall(_connect(f"fleet-{i}", f"fleet-{i}"))
    return [_answer(s) for s in socks], socks


def _not_logged_in(b: EmbeddedBroker, host: str | None = None) -> int:
    return b.call(b.core.door.not_logged_in, host)


def _read(b: EmbeddedBroker) -> None:
    """Until the broker has read every half-sent stranger's bytes (one with bytes waiting in the kernel is a
    client the loop has not come to yet: not reset while there is another)."""
    _until(lambda: b.call(lambda: not any(waiting(g.transport) for g in b.core.door._half)), "bytes left unread")


def _until(done: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _close(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


def test_a_fleet_behind_one_address_logs_in_whole_also_while_a_stranger_holds_the_cap() -> None:
    """100 devices behind one address, all at once, are each answered CONNACK 0 and stay (issue 49: 64 of 100
    could, the rest were refused); the cap counts connections that have not logged in, and at the cap a newcomer
    resets the address's oldest half-sent one: a stranger holding the cap there keeps no device out."""
    with EmbeddedBroker(authenticate=_who) as b:  # the default cap
        b.core.connect_timeout_s = 120.0
        addr = _addr(b)
        answers, fleet = _fleet(addr, range(FLEET))
        try:
            assert answers == [CONNACK_OK] * FLEET
            _until(lambda: _not_logged_in(b, NAT) == 0, "logged in, the fleet still counts against its address")
            stranger = [_half_sent(addr, NAT) for _ in range(CAP)]
            _until(lambda: _not_logged_in(b, NAT) == CAP, "the stranger's connections never reached the broker")
            _read(b)
            answers, again = _fleet(addr, range(FLEET, 2 * FLEET))
            fleet += again + stranger
            assert answers == [CONNACK_OK] * FLEET
            assert b.call(lambda: sum(s.conn is not None for s in b.core.sessions.values())) == 2 * FLEET
            _until(lambda: sum(map(_closed, stranger)) == b.core.noted["evicted"] > 0, "the stranger's were not reset")
            assert _not_logged_in(b, NAT) <= CAP
        finally:
            _close(fleet)


def test_a_fleet_larger_than_the_cap_logs_in_in_waves_of_the_cap() -> None:
    """Logged-in sessions do not count at all: 100 devices behind an address capped at 8 log in, 8 at once."""
    with EmbeddedBroker(authenticate=_who, max_per_address=8) as b:
        addr, fleet = _addr(b), []
        try:
            for start in range(0, FLEET, 8):
                answers, wave = _fleet(addr, range(start, min(start + 8, FLEET)))
                fleet += wave
                assert answers == [CONNACK_OK] * len(wave), start
                _until(lambda: _not_logged_in(b, NAT) == 0, "a wave still counts against its address")
            assert b.call(lambda: len(b.core.sessions)) == FLEET
        finally:
            _close(fleet)


def test_half_sent_connects_from_loopback_are_bounded_and_the_servers_link_still_connects() -> None:
    """Loopback is an address like any other (issue 49: its half-sent CONNECTs held 176 MB, exempt from the cap):
    strangers there hold at most the cap, counted by the broker; the server's own link, from loopback too, logs
    in past them, and once in no longer counts."""
    with EmbeddedBroker(authenticate=_who) as b:
        b.core.connect_timeout_s = 120.0
        addr, cap = _addr(b), CAP
        stranger = [_half_sent(addr) for _ in range(cap + 200)]
        try:
            _until(lambda: sum(not _closed(s) for s in stranger) <= cap, "loopback's half-sent CONNECTs unbounded")
            _until(lambda: b.call(lambda: b.core.door.open) <= cap, "the broker holds more than the cap")
            assert _not_logged_in(b, "127.0.0.1") == cap
            _read(b)
            srv = Client(addr, "srv", "srv")  # the server's link, at the cap: a stranger's oldest makes room
            stranger += [_half_sent(addr) for _ in range(cap)]
            _until(lambda: sum(not _closed(s) for s in stranger) <= cap, "the link's place was kept for strangers")
            srv.s.sendall(_packet(0xC0, b""))
            assert srv.read() == (0xD0, b"")  # still in
            _until(lambda: b.call(lambda: b.core.door.open) == cap + 1, "the reset ones are still held")
            srv.close()
        finally:
            _close(stranger)


def test_at_the_cap_the_oldest_half_sent_makes_room_and_connects_being_checked_are_not_reset() -> None:
    """The address's oldest connection without a whole CONNECT is reset for a newcomer; one whose CONNECT is
    whole (its password being checked) never is: with every place of an address so taken, the newcomer is
    refused, as server.peers does for HTTP."""
    release, asked = threading.Event(), threading.Semaphore(0)

    def slow(cid: str, user: str | None, pw: bytes | None) -> Identity | None:
        if user == "slow":
            asked.release()
            release.wait(60)
        return _who(cid, user, pw)

    with EmbeddedBroker(authenticate=slow, max_per_address=3) as b:
        b.core.connect_timeout_s = 120.0
        addr = _addr(b)
        first = [_half_sent(addr, NAT) for _ in range(3)]
        try:
            _until(lambda: _not_logged_in(b, NAT) == 3, "the half-sent ones never reached the broker")
            _read(b)
            fourth = _half_sent(addr, NAT)
            first.append(fourth)
            _until(lambda: _closed(first[0]), "the oldest was not reset")
            assert not any(map(_closed, first[1:])) and b.core.noted["evicted"] == 1
            slow_ones = []
            for _ in range(3):  # each evicts a half-sent one, then sends its whole CONNECT
                _read(b)
                s = socket.create_connection(addr, timeout=10, source_address=(NAT, 0))
                s.sendall(_connect("slow", "slow"))
                slow_ones.append(s)
                assert asked.acquire(timeout=60), "the broker never asked about a whole CONNECT"
            first += slow_ones
            assert all(map(_closed, first[:4])) and b.core.noted["evicted"] == 4
            assert _closed_at_once(addr, _connect("c9", "any"), source=NAT) == b""  # nothing to reset: refused
            assert b.core.noted["accept"] == 1 and not any(map(_closed, slow_ones))
            other = Client(addr, "d0", "any", source="127.0.0.3")  # another address is not
            other.close()
            release.set()
            assert [_answer(s) for s in slow_ones] == [b"\x20\x02\x00\x04"] * 3  # "slow" is nobody
        finally:
            release.set()
            _close(first)


def test_connections_not_logged_in_are_bounded_all_addresses_together() -> None:
    """Half-sent CONNECTs from many addresses: one past the broker's bound resets the oldest of all."""
    with EmbeddedBroker(authenticate=_who, max_unauthenticated=5) as b:
        b.core.connect_timeout_s = 120.0
        addr = _addr(b)
        stranger = []
        try:
            for i in range(12):
                stranger.append(_half_sent(addr, f"127.0.1.{i % 4 + 1}"))
                want = min(i + 1, 5)
                _until(lambda: _not_logged_in(b) == want, "not counted")  # noqa: B023 (called at once)
                _read(b)
            _until(lambda: sum(map(_closed, stranger)) == 7, "the oldest were not reset")
            assert not any(map(_closed, stranger[7:]))
            Client(addr, "any", "any", source="127.0.1.9").close()  # a device still logs in
        finally:
            _close(stranger)


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


def test_a_connect_waiting_unread_in_the_kernel_is_not_taken_for_a_strangers() -> None:
    """Under a burst the loop accepts a batch before it reads from any: a connection whose bytes wait in the
    kernel is a client the loop has not come to, passed over for a silent one; where every one has bytes
    waiting, the newcomer is refused at its address's bound and let in over the bound of all addresses."""

    class Transport:  # what the door asks of a connection: its socket
        def __init__(self, sock: socket.socket) -> None:
            self.sock = sock

        def get_extra_info(self, name: str) -> object:
            return self.sock if name == "socket" else None

    pairs = [socket.socketpair() for _ in range(5)]
    try:
        busy, quiet = [Transport(p[0]) for p in pairs[:3]], [Transport(p[0]) for p in pairs[3:]]
        for p in pairs[:3]:
            p[1].sendall(b"\x10")  # a CONNECT's first byte, unread
        reset: list[int] = []
        door = Door(per_address=2, total=0)
        first = door.admit("10.0.0.1", busy[0], lambda: reset.append(0))  # type: ignore[arg-type]
        door.admit("10.0.0.1", quiet[0], lambda: reset.append(1))  # type: ignore[arg-type]
        door.admit("10.0.0.1", quiet[1], lambda: reset.append(2))  # type: ignore[arg-type]
        assert reset == [1]  # the oldest, first, has bytes waiting: the next oldest went
        door.admit("10.0.0.1", busy[1], lambda: reset.append(3))  # type: ignore[arg-type]
        assert reset == [1, 2]
        assert isinstance(door.admit("10.0.0.1", busy[2], lambda: None), str)  # type: ignore[arg-type]
        assert door.not_logged_in("10.0.0.1") == 2 and isinstance(first, Guest) and first.held
        everywhere = Door(per_address=0, total=1)
        everywhere.admit("10.0.0.2", busy[0], lambda: reset.append(4))  # type: ignore[arg-type]
        assert isinstance(everywhere.admit("10.0.0.3", busy[1], lambda: None), Guest)  # type: ignore[arg-type]
        assert everywhere.not_logged_in() == 2 and reset == [1, 2]  # over the bound: read next
    finally:
        for a, b in pairs:
            a.close()
            b.close()
