"""The server's MQTT client keeps at most ``window`` QoS 1 messages unacknowledged: paho numbers them 1..65,535
and refuses one whose number is still in flight, which lost 34,023 of a 100,000-device final step's tasks."""

from __future__ import annotations

import socket
import threading

from server.broker import EmbeddedBroker
from server.mqtt import MqttLink


def test_publishing_waits_for_acknowledgements_beyond_the_window() -> None:
    n, got, done = 300, [], threading.Event()

    def heard(_topic: str, payload: bytes) -> None:
        got.append(int(payload))
        if len(got) == n:
            done.set()

    with EmbeddedBroker() as broker:
        link = MqttLink(broker.url, lambda _t, _p: None, window=4)
        acked: set[int] = set()
        suback = threading.Condition()

        def on_subscribe(_c: object, _u: object, mid: int, *_a: object) -> None:
            with suback:
                acked.add(mid)
                suback.notify_all()

        link.client.on_subscribe = on_subscribe
        link.start(60)
        try:
            link.listen("t/#", heard)
            _, mid = link.client.subscribe("t/#", qos=1)  # its SUBACK (not the status filter's) says it is in place
            with suback:
                if not suback.wait_for(lambda: mid in acked, timeout=60):
                    raise AssertionError("no SUBACK from the broker")
            for i in range(n):
                link.publish_raw(f"t/{i % 7}", str(i).encode())
            if not done.wait(60):
                raise AssertionError(f"{len(got)} of {n} messages arrived")
        finally:
            link.stop()
    if sorted(got) != list(range(n)):
        raise AssertionError("messages lost or repeated")
    if not 1 <= link.most_unacked <= 4:
        raise AssertionError(f"{link.most_unacked} messages were unacknowledged at once (window 4)")


def test_a_broker_that_is_away_does_not_hold_publishing_up() -> None:
    """Nothing listens: every message waits in paho's queue for a reconnect, and publishing goes on at once
    (waiting for acks that cannot come would stall the round worker for ``window_wait_s`` per message)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    link = MqttLink(f"mqtt://127.0.0.1:{port}", lambda _t, _p: None, window=2, window_wait_s=600)
    link.start(0.1)
    try:
        done = threading.Event()

        def publish() -> None:
            for i in range(10):
                link.publish_raw(f"t/{i}", b"x")
            done.set()

        threading.Thread(target=publish, daemon=True).start()
        if not done.wait(120):
            raise AssertionError("publishing waited for acknowledgements from a broker that is away")
    finally:
        link.stop()
    if link.most_unacked != 10:
        raise AssertionError(f"{link.most_unacked} messages queued, 10 expected")
