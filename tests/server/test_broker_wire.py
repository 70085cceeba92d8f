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


def test_qos2_publishes_close_the_connection(addr: tuple[str, int]) -> None:
    publish = b"\x34\x07\x00\x03a/b\x00\x01"  # QoS 2, packet id 1
    assert _closed_after(addr, _connect() + publish) == b"\x20\x02\x00\x00"  # accepted, then closed


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
        b.core.max_connections = 1
        addr = parse_broker_url(b.url)
        with socket.create_connection(addr, timeout=5) as first:
            first.sendall(_connect("first"))
            assert first.recv(4) == b"\x20\x02\x00\x00"
            assert _closed_after(addr, _connect("second")) == b""
