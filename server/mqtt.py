"""The server's MQTT client: publishes round announcements and per-device tasks (retained, QoS 1) and listens
to the devices' status topics (and, on Mosquitto with dynamic security, to the plugin's answers). Small JSON
only; weights never travel over MQTT. ``mqtts://`` URLs connect with TLS and verify the broker's certificate."""

from __future__ import annotations

import logging
import ssl
import threading
import uuid
from collections.abc import Callable
from urllib.parse import urlparse

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from pydantic import BaseModel

from .broker_core import MAX_DEVICE_PAYLOAD
from .broker_wire import LogGate

__all__ = ["STATUS_FILTER", "STATUS_MAX_BYTES", "MqttLink", "broker_tls", "parse_broker_url"]

log = logging.getLogger(__name__)

STATUS_FILTER = "pfl/+/device/+/status"
# A status is ~100 bytes of JSON; a longer one is dropped before it is parsed, whatever the broker (an external one
# passes what its own limits allow: Mosquitto's default is 256 MB)
STATUS_MAX_BYTES = MAX_DEVICE_PAYLOAD
# paho numbers QoS 1 messages 1..65,535 and refuses one whose number is still unacknowledged ("Message queue
# full"): a final step told to 100,000 devices at once lost 34,023 tasks so. Publishing waits for acknowledgements
# once this many are outstanding.
WINDOW = 10_000
WINDOW_WAIT_S = 120.0
_TLS_SCHEMES = ("mqtts", "ssl")


def parse_broker_url(url: str) -> tuple[str, int]:
    """(host, port) of ``mqtt://host[:1883]`` or ``mqtts://host[:8883]``."""
    u = urlparse(url)
    if u.scheme not in ("mqtt", "tcp", *_TLS_SCHEMES) or not u.hostname:
        raise ValueError(f"broker URL must be mqtt://host:port or mqtts://host:port, got {url!r}")
    return u.hostname, u.port or (8883 if u.scheme in _TLS_SCHEMES else 1883)


def broker_tls(url: str) -> bool:
    return urlparse(url).scheme in _TLS_SCHEMES


class MqttLink:
    """One paho client in its own network thread; reconnects by itself. ``on_status(topic, payload)`` is called
    from that thread for every status message. ``tls``: how an ``mqtts://`` broker is verified (None: the
    system's CAs and its host name; ``server.broker_setup`` builds it from the settings)."""

    def __init__(self, url: str, on_status: Callable[[str, bytes], None], *, username: str | None = None,
                 password: str | None = None, on_reconnect: Callable[[], None] | None = None,
                 tls: ssl.SSLContext | None = None, window: int = WINDOW, window_wait_s: float = WINDOW_WAIT_S,
                 renew: Callable[[], tuple[str, float]] | None = None) -> None:
        self.url = url
        self.window, self.window_wait_s = window, window_wait_s
        self._acks = threading.Condition()
        self._unacked = 0  # QoS 1 messages handed to paho and not yet acknowledged by the broker
        self.most_unacked = 0  # the window's high-water mark (tests)
        self._net_thread: int | None = None  # paho's network thread: it must never wait for its own acks
        self.host, self.port = parse_broker_url(url)
        self._on_status = on_status
        self._on_reconnect = on_reconnect
        self._handlers: dict[str, Callable[[str, bytes], None]] = {}
        self._ever_connected = False
        self._connected = threading.Event()
        self.dropped_statuses = 0  # over STATUS_MAX_BYTES
        self._log_gate = LogGate()  # paho's network thread only
        # clean session: the server re-publishes every current task when it (re)starts, so it needs no backlog
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"pfl-server-{uuid.uuid4().hex[:12]}",
                                  clean_session=True)
        if broker_tls(url):
            self.client.tls_set_context(tls if tls is not None else ssl.create_default_context())
        # renew: a broker that checks tokens (server.services.broker_tokens): a fresh password (and its expiry)
        # for every reconnect
        self._username, self._renew, self.password_expires = username, renew, float("inf")
        if renew is not None:
            password, self.password_expires = renew()
        if username is not None:
            self.client.username_pw_set(username, password)
        self.client.on_connect = self._connected_cb
        self.client.on_publish = self._acked_cb
        self.client.on_disconnect = self._disconnected_cb
        self.client.on_message = self._message_cb
        self.client.reconnect_delay_set(min_delay=1, max_delay=10)

    def start(self, timeout: float = 10.0) -> None:
        self.client.connect_async(self.host, self.port, keepalive=30)
        self.client.loop_start()
        if not self._connected.wait(timeout):
            # not fatal: paho keeps trying, and QoS 1 messages wait in its queue
            log.warning("MQTT broker %s not reachable yet; retrying in the background", self.url)

    def stop(self) -> None:
        try:
            self.client.disconnect()
        finally:
            self.client.loop_stop()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def listen(self, topic_filter: str, handler: Callable[[str, bytes], None]) -> None:
        """Also subscribe to ``topic_filter`` (now and after every reconnect); its messages go to ``handler``."""
        self._handlers[topic_filter] = handler
        if self.connected:
            self.client.subscribe(topic_filter, qos=1)

    def publish(self, topic: str, msg: BaseModel | None, *, retain: bool = True) -> None:
        """QoS 1; ``None`` clears a retained message."""
        self.publish_raw(topic, b"" if msg is None else msg.model_dump_json().encode(), retain=retain)

    def publish_raw(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        with self._acks:
            # no wait while the broker is away: paho queues, and the worker publishes every task again on reconnect
            if threading.get_ident() != self._net_thread and not self._acks.wait_for(
                    lambda: self._unacked < self.window or not self.connected, timeout=self.window_wait_s):
                log.warning("MQTT broker %s left %d messages unacknowledged for %.0f s; publishing anyway",
                            self.url, self._unacked, self.window_wait_s)
            self._unacked += 1
            self.most_unacked = max(self.most_unacked, self._unacked)
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):  # NO_CONN: queued, sent on reconnect
            self._acked_cb()
            log.warning("MQTT publish to %s failed: %s", topic, mqtt.error_string(info.rc))

    def _acked_cb(self, *_args: object) -> None:
        with self._acks:
            self._unacked = max(0, self._unacked - 1)
            self._acks.notify_all()

    def _connected_cb(self, client: mqtt.Client, _u: object, _f: object, rc: object, _p: object) -> None:
        if getattr(rc, "is_failure", False):
            log.warning("MQTT broker %s refused the server's connection: %s", self.url, rc)
            self._fresh_password()
            return
        self._net_thread = threading.get_ident()
        client.subscribe([(STATUS_FILTER, 1), *((f, 1) for f in self._handlers)])
        self._connected.set()
        if self._ever_connected and self._on_reconnect is not None:
            # a broker that restarted without persistence lost every retained task: publish them again (the
            # callback only asks the round worker to: this thread must not wait for the acks it reads itself)
            self._on_reconnect()
        self._ever_connected = True

    def _fresh_password(self) -> None:
        if self._renew is not None:
            password, self.password_expires = self._renew()
            self.client.username_pw_set(self._username, password)

    def _disconnected_cb(self, _c: mqtt.Client, _u: object, _f: object, rc: object, _p: object) -> None:
        self._fresh_password()  # paho reconnects with it
        if self._connected.is_set():
            log.warning("MQTT broker %s: connection lost (%s); reconnecting", self.url, rc)
        self._connected.clear()
        with self._acks:
            self._acks.notify_all()  # publishers waiting for acks stop waiting

    def _message_cb(self, _c: mqtt.Client, _u: object, msg: mqtt.MQTTMessage) -> None:
        try:
            for f, handler in list(self._handlers.items()):
                if mqtt.topic_matches_sub(f, msg.topic):
                    handler(msg.topic, bytes(msg.payload))
                    return
            if len(msg.payload) > STATUS_MAX_BYTES:
                self.dropped_statuses += 1
                self._log_gate(log, logging.WARNING, "status", "MQTT status of %d bytes on %s, over %d: dropped",
                               len(msg.payload), msg.topic[:120], STATUS_MAX_BYTES)
                return
            self._on_status(msg.topic, bytes(msg.payload))
        except Exception:  # a bad message must not kill the network thread
            log.exception("MQTT message on %s", msg.topic[:120])
