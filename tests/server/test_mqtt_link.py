"""The server's MQTT client keeps at most ``window`` QoS 1 messages unacknowledged: paho numbers them 1..65,535
and refuses one whose number is still in flight, which lost 34,023 of a 100,000-device final step's tasks."""

from __future__ import annotations

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
        link.start()
        try:
            subscribed = threading.Event()
            link.listen("t/#", heard)
            link.client.on_subscribe = lambda *_a: subscribed.set()
            link.client.subscribe("t/#", qos=1)  # the SUBACK says the subscription is in place
            if not subscribed.wait(10):
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
