"""The server's MQTT client: publishes round announcements and per-device tasks (retained, QoS 1) and listens
to the devices' status topics. Small JSON only; weights never travel over MQTT."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from urllib.parse import urlparse

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from pydantic import BaseModel

__all__ = ["STATUS_FILTER", "MqttLink", "parse_broker_url"]

log = logging.getLogger(__name__)

STATUS_FILTER = "pfl/+/device/+/status"


def parse_broker_url(url: str) -> tuple[str, int]:
    u = urlparse(url)
    if u.scheme not in ("mqtt", "tcp") or not u.hostname:
        raise ValueError(f"broker URL must be mqtt://host:port, got {url!r}")
    return u.hostname, u.port or 1883


class MqttLink:
    """One paho client in its own network thread; reconnects by itself. ``on_status(topic, payload)`` is called
    from that thread for every status message."""

    def __init__(self, url: str, on_status: Callable[[str, bytes], None], *, username: str | None = None,
                 password: str | None = None, on_reconnect: Callable[[], None] | None = None) -> None:
        self.host, self.port = parse_broker_url(url)
        self._on_status = on_status
        self._on_reconnect = on_reconnect
        self._ever_connected = False
        self._connected = threading.Event()
        # clean session: the server re-publishes every current task when it (re)starts, so it needs no backlog
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"pfl-server-{uuid.uuid4().hex[:12]}",
                                  clean_session=True)
        if username is not None:
            self.client.username_pw_set(username, password)
        self.client.on_connect = self._connected_cb
        self.client.on_disconnect = self._disconnected_cb
        self.client.on_message = self._message_cb
        self.client.reconnect_delay_set(min_delay=1, max_delay=10)

    def start(self, timeout: float = 10.0) -> None:
        self.client.connect_async(self.host, self.port, keepalive=30)
        self.client.loop_start()
        if not self._connected.wait(timeout):
            # not fatal: paho keeps trying, and QoS 1 messages wait in its queue
            log.warning("MQTT broker %s:%d not reachable yet; retrying in the background", self.host, self.port)

    def stop(self) -> None:
        try:
            self.client.disconnect()
        finally:
            self.client.loop_stop()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def publish(self, topic: str, msg: BaseModel | None, *, retain: bool = True) -> None:
        """QoS 1; ``None`` clears a retained message."""
        payload = b"" if msg is None else msg.model_dump_json().encode()
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):  # NO_CONN: queued, sent on reconnect
            log.warning("MQTT publish to %s failed: %s", topic, mqtt.error_string(info.rc))

    def _connected_cb(self, client: mqtt.Client, _u: object, _f: object, rc: object, _p: object) -> None:
        if getattr(rc, "is_failure", False):
            log.warning("MQTT connection refused: %s", rc)
            return
        client.subscribe(STATUS_FILTER, qos=1)
        self._connected.set()
        if self._ever_connected and self._on_reconnect is not None:
            # a broker that restarted without persistence lost every retained task: publish them again
            self._on_reconnect()
        self._ever_connected = True

    def _disconnected_cb(self, _c: mqtt.Client, _u: object, _f: object, _rc: object, _p: object) -> None:
        self._connected.clear()

    def _message_cb(self, _c: mqtt.Client, _u: object, msg: mqtt.MQTTMessage) -> None:
        try:
            self._on_status(msg.topic, bytes(msg.payload))
        except Exception:  # a bad status message must not kill the network thread
            log.exception("status message on %s", msg.topic)
