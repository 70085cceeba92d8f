"""The embedded broker against hostile bytes: anything malformed or oversized closes the connection before it
costs memory; topic filters match as MQTT 3.1.1 section 4.7 says."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest

from server.broker import EmbeddedBroker
from server.broker_wire import matches, valid_filter
from server.mqtt import parse_broker_url


@pytest.fixture(scope="module")
def addr() -> Iterator[tuple[str, int]]:
    with EmbeddedBroker() as b:
        yield parse_broker_url(b.url)


def _closed_after(addr: tuple[str, int], data: bytes) -> bytes:
    """What the broker answers to ``data`` before it closes the connection (it must close it within 5 s)."""
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(data)
        got = b""
        while True:
            try:
                chunk = s.recv(4096)  # a socket.timeout here fails the test: the broker kept it open
            except ConnectionResetError:  # closed by a reset (abort): closed all the same
                return got
            if not chunk:
                return got
            got += chunk


def _connect(client_id: str = "c", flags: int = 0x02, level: int = 4) -> bytes:
    cid = client_id.encode()
    body = struct.pack(">H", 4) + b"MQTT" + bytes([level, flags]) + struct.pack(">HH", 30, len(cid)) + cid
    return bytes([0x10, len(body)]) + body


def test_malformed_and_oversized_packets_close_the_connection(addr: tuple[str, int]) -> None:
    assert _closed_after(addr, b"\xc0\x00") == b""  # PINGREQ before CONNECT
    assert _closed_after(addr, b"\x10\xff\xff\xff\xff\x01") == b""  # a remaining length of 5 bytes
    assert _closed_after(addr, b"\x10\xff\xff\xff\x7f") == b""  # 256 MB announced: refused, nothing read
    assert _closed_after(addr, b"\x10\x04\x00\x02MQ") == b""  # truncated CONNECT
    assert _closed_after(addr, _connect(level=3)) == b"\x20\x02\x00\x01"  # MQTT 3.1: CONNACK 1, then closed
    assert _closed_after(addr, _connect("", flags=0)) == b"\x20\x02\x00\x02"  # no id, persistent session


def _packets(sock: socket.socket, n: int) -> list[bytes]:
    """The next ``n`` whole packets read from ``sock`` (short ones: a one-byte remaining length)."""
    buf, out = b"", []
    while len(out) < n:
        while len(buf) < 2 or len(buf) < 2 + buf[1]:
            chunk = sock.recv(4096)
            assert chunk, f"closed after {out}"
            buf += chunk
        out.append(buf[:2 + buf[1]])
        buf = buf[2 + buf[1]:]
    return out


def test_a_qos2_publish_is_routed_once_and_its_handshake_completes(addr: tuple[str, int]) -> None:
    with socket.create_connection(addr, timeout=5) as sub, socket.create_connection(addr, timeout=5) as pub:
        sub.sendall(_connect("sub") + b"\x82\x08\x00\x01\x00\x03a/b\x02")  # SUBSCRIBE a/b at QoS 2
        assert _packets(sub, 2) == [b"\x20\x02\x00\x00", b"\x90\x03\x00\x01\x01"]  # granted QoS 1
        pub.sendall(_connect("pub"))
        assert _packets(pub, 1) == [b"\x20\x02\x00\x00"]
        publish = b"\x00\x03a/b\x00\x07x"  # topic a/b, packet id 7, payload "x"
        pub.sendall(b"\x34\x08" + publish)  # QoS 2
        assert _packets(pub, 1) == [b"\x50\x02\x00\x07"]  # PUBREC
        pub.sendall(b"\x3c\x08" + publish)  # the same again, DUP set, as after a lost PUBREC
        assert _packets(pub, 1) == [b"\x50\x02\x00\x07"]  # acknowledged again, not routed again
        pub.sendall(b"\x62\x02\x00\x07")  # PUBREL
        assert _packets(pub, 1) == [b"\x70\x02\x00\x07"]  # PUBCOMP
        pub.sendall(b"\x30\x05\x00\x03a/b")  # a QoS 0 marker, routed after them
        got = _packets(sub, 2)
        assert got[0][0] == 0x32 and got[0].endswith(b"a/b\x00\x01x")  # once, at QoS 1 with its own id
        assert got[1] == b"\x30\x05\x00\x03a/b"  # and then the marker: no second copy came between
        # after PUBCOMP the id is free: a new message with it is routed
        pub.sendall(b"\x34\x08" + publish[:-1] + b"y")
        assert _packets(pub, 1) == [b"\x50\x02\x00\x07"]
        assert _packets(sub, 1)[0].endswith(b"y")


def test_a_malformed_pubrel_closes_the_connection(addr: tuple[str, int]) -> None:
    assert _closed_after(addr, _connect() + b"\x60\x02\x00\x01") == b"\x20\x02\x00\x00"  # flags must be 2


@pytest.mark.parametrize(("f", "topic", "expected"), [
    ("pfl/a/round", "pfl/a/round", True), ("pfl/a/round", "pfl/b/round", False), ("pfl/+/round", "pfl/b/round", True),
    ("pfl/#", "pfl", True), ("pfl/#", "pfl/a/device/x/task", True), ("pfl/+", "pfl/a/round", False),
    ("#", "$SYS/x", False), ("+/x", "$SYS/x", False), ("pfl/a/round", "pfl/a/round/x", False),
])
def test_topic_filters(f: str, topic: str, expected: bool) -> None:
    assert valid_filter(f) and matches(f, topic) is expected


def test_invalid_filters() -> None:
    assert not any(valid_filter(f) for f in ("", "a/#/b", "a/b#", "a+/b"))


def test_an_authentication_error_answers_server_unavailable() -> None:
    def broken(_cid: str, _user: str | None, _pw: bytes | None) -> None:
        raise OSError("the database is away")

    with EmbeddedBroker(authenticate=broken) as b:
        assert _closed_after(parse_broker_url(b.url), _connect()) == b"\x20\x02\x00\x03"


def test_connections_beyond_the_limit_are_closed_at_once() -> None:
    with EmbeddedBroker() as b:
        b.core.door.max_connections = 1
        addr = parse_broker_url(b.url)
        with socket.create_connection(addr, timeout=5) as first:
            first.sendall(_connect("first"))
            assert first.recv(4) == b"\x20\x02\x00\x00"
            assert _closed_after(addr, _connect("second")) == b""
