"""The embedded broker with real paho clients: retained messages, QoS 1 with persistent sessions, last will."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from server_testkit import Mqtt

from server.broker import EmbeddedBroker


@pytest.fixture(scope="module")
def embedded() -> Iterator[str]:
    with EmbeddedBroker() as b:
        assert b.url.startswith("mqtt://127.0.0.1:")
        yield b.url


def test_retained_message_reaches_a_late_subscriber(embedded: str) -> None:
    pub = Mqtt(embedded, [])
    pub.publish("t/retained", b'{"v": 1}')
    pub.close()
    sub = Mqtt(embedded, ["t/#"])
    assert sub.wait("t/retained") == {"v": 1}
    assert sub.all[0][2]  # flagged retained
    sub.close()


def test_qos1_queued_for_a_persistent_session(embedded: str) -> None:
    dev = Mqtt(embedded, ["q/dev"], client_id="persistent-dev", clean=False)
    dev.close()  # offline, but its session and subscription stay
    pub = Mqtt(embedded, [])
    pub.publish("q/dev", b'{"n": 7}', retain=False)
    pub.close()
    back = Mqtt(embedded, [], client_id="persistent-dev", clean=False)  # no new subscribe
    assert back.wait("q/dev") == {"n": 7}
    back.close()


def test_last_will_when_the_socket_dies(embedded: str) -> None:
    watcher = Mqtt(embedded, ["w/+/status"])
    dev = Mqtt(embedded, [], client_id="will-dev", will=("w/dev/status", b'{"state": "offline"}'))
    dev.publish("w/dev/status", b'{"state": "online"}')
    assert watcher.wait("w/dev/status")["state"] == "online"
    dev.die()
    assert watcher.wait("w/dev/status", lambda m: m["state"] == "offline")["state"] == "offline"
    watcher.close()


def test_stop_and_restart_on_a_new_port() -> None:
    b = EmbeddedBroker()
    url = b.start()
    t0 = time.monotonic()
    b.stop()
    assert time.monotonic() - t0 < 5
    b2 = EmbeddedBroker()
    assert b2.start() != "" and b2.url != ""
    b2.stop()
    assert url
