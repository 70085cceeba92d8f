"""Test-side MQTT clients for the broker tests: a raw paho client that does not reconnect by itself (so a test
sees exactly what the broker did to it), and the device's own Control built from a hand-made enrolment."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from edge_runtime.control import Control
from pfl_edge.protocol import Enrolment
from server.mqtt import parse_broker_url

DIGEST = "0" * 64


class Raw:
    """One connection; ``rc`` its CONNACK code (0 accepted), ``present`` the session-present flag, ``gone`` set
    when the broker closes it; every message lands in ``got`` (topic, payload, retained)."""

    def __init__(self, url: str, client_id: str, *, clean: bool = False, subs: tuple[str, ...] = (),
                 user: str | None = None, password: str | None = None, keepalive: int = 30,
                 will: tuple[str, bytes] | None = None, will_qos: int = 1, tls_ca: str | None = None) -> None:
        host, port = parse_broker_url(url)
        self.rc: int | None = None
        self.present = False
        self.granted: list[int] = []
        self.got: list[tuple[str, bytes, bool]] = []
        self.connected, self.gone, self.subscribed = threading.Event(), threading.Event(), threading.Event()
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean,
                        protocol=mqtt.MQTTv311, reconnect_on_failure=False)
        if user is not None:
            c.username_pw_set(user, password)
        if will is not None:
            c.will_set(will[0], will[1], qos=will_qos, retain=True)
        if url.startswith("mqtts"):
            c.tls_set(ca_certs=tls_ca)
        c.on_connect = self._on_connect
        c.on_disconnect = lambda *_a: self.gone.set()
        c.on_message = lambda _c, _u, m: self.got.append((m.topic, bytes(m.payload), bool(m.retain)))
        c.on_subscribe = self._on_subscribe
        self.subs = subs
        self.c = c
        c.connect_async(host, port, keepalive=keepalive)
        c.loop_start()
        self.connected.wait(10)

    def _on_connect(self, c: mqtt.Client, _u: Any, flags: Any, rc: Any, _p: Any) -> None:
        self.rc = int(rc.value) if hasattr(rc, "value") else int(rc)
        self.present = bool(getattr(flags, "session_present", False))
        if self.rc == 0 and self.subs:
            c.subscribe([(t, 1) for t in self.subs])
        self.connected.set()

    def _on_subscribe(self, _c: Any, _u: Any, _mid: Any, codes: Any, _p: Any) -> None:
        self.granted = [int(getattr(x, "value", x)) for x in codes]
        self.subscribed.set()

    def publish(self, topic: str, payload: dict[str, Any] | bytes, *, retain: bool = True, qos: int = 1) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        info = self.c.publish(topic, data, qos=qos, retain=retain)
        info.wait_for_publish(5)
        if not info.is_published():  # QoS 2: published once the broker's PUBCOMP is in
            raise AssertionError(f"the broker did not acknowledge a QoS {qos} publish to {topic}")

    def topics(self) -> list[str]:
        return [t for t, _, _ in self.got]

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def enrolment(url: str, dev: str = "dev-a", fed: str = "f", user: str = "", password: str = "",
              client_id: str | None = None) -> Enrolment:
    return Enrolment(device_id=dev, token="t", index=0, federation=fed, config={}, density=1.0, kp=0, broker_url=url,
                     mqtt_username=user, mqtt_password=password, round=0, init_digest=DIGEST,
                     mqtt_client_id=client_id)


def control(url: str, dev: str = "dev-a", fed: str = "f", **kw: Any) -> tuple[Control, queue.Queue[tuple[str, bytes]]]:
    """``client_id``: the enrolment's (None: ``pfl-<dev>``, as a server of an earlier release told none)."""
    inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
    user, password, cid = kw.pop("user", ""), kw.pop("password", ""), kw.pop("client_id", None)
    return Control(enrolment(url, dev, fed, user, password, cid), inbox, **kw), inbox


def next_msg(inbox: queue.Queue[tuple[str, bytes]], topic: str, pred: Any = lambda m: True,
             timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no matching message on {topic} within {timeout} s")
        try:
            t, payload = inbox.get(timeout=left)
        except queue.Empty:
            continue
        if t == topic and payload:
            m = json.loads(payload)
            if pred(m):
                return dict(m)


def hook_calls(srv: Any) -> list[tuple[str, str]]:
    """Every question a broker asks the server's hook, as (question, user name), from now on (the routes call
    these on the running server's instance)."""
    access = srv.app_state.coordinator.broker_access
    calls: list[tuple[str, str]] = []

    def counted(name: str, f: Callable[..., bool]) -> Callable[..., bool]:
        def call(*a: Any) -> bool:
            calls.append((name, str(a[0]) if a else ""))
            return f(*a)
        return call

    for name in ("hook_user", "hook_vhost", "hook_resource", "hook_topic"):
        setattr(access, name, counted(name, getattr(access, name)))
    return calls
