"""The device's control plane: one MQTT connection to its broker."""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
from typing import Any
from urllib.parse import urlparse

from pfl_edge.errors import ConfigError
from pfl_edge.protocol import Enrolment, round_topic, status_topic, task_topic

__all__ = ["Control"]

log = logging.getLogger("pfl_edge.client")


class Control:
    """The MQTT side: a persistent session (clean_session False, client id = device id) subscribed at QoS 1 to
    the device's task topic and the federation's round topic; ``online`` on connect, ``offline`` as the last
    will. paho reconnects by itself with back-off (1 s to 30 s) when the broker goes away."""

    def __init__(self, enr: Enrolment, inbox: queue.Queue[tuple[str, bytes]]) -> None:
        import paho.mqtt.client as mqtt

        url = urlparse(enr.broker_url)
        if url.scheme not in ("mqtt", "tcp", ""):
            raise ConfigError(f"unsupported broker URL {enr.broker_url!r}: use mqtt://host:port")
        self.fed, self.dev = enr.federation, enr.device_id
        self.inbox = inbox
        self.connected = threading.Event()
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"pfl-{enr.device_id}", clean_session=False,
                        protocol=mqtt.MQTTv311)
        if enr.mqtt_username:
            c.username_pw_set(enr.mqtt_username, enr.mqtt_password)
        c.will_set(status_topic(self.fed, self.dev), json.dumps({"device_id": self.dev, "state": "offline"}),
                   qos=1, retain=True)
        c.reconnect_delay_set(min_delay=1, max_delay=30)
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        self.client = c
        c.connect_async(url.hostname or "127.0.0.1", url.port or 1883, keepalive=30)
        c.loop_start()

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if getattr(reason, "is_failure", False):
            log.warning("broker refused the connection: %s", reason)
            return
        log.info("connected to the broker")
        # subscribe on every connect: a restarted broker may have lost the persistent session
        client.subscribe([(task_topic(self.fed, self.dev), 1), (round_topic(self.fed), 1)])
        client.publish(status_topic(self.fed, self.dev), json.dumps({"device_id": self.dev, "state": "online"}),
                       qos=1, retain=True)
        self.connected.set()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        self.connected.clear()
        log.warning("broker connection lost (%s); reconnecting", reason)

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        self.inbox.put((msg.topic, bytes(msg.payload)))

    def close(self) -> None:
        info = self.client.publish(status_topic(self.fed, self.dev),
                                   json.dumps({"device_id": self.dev, "state": "offline"}), qos=1, retain=True)
        with contextlib.suppress(RuntimeError, ValueError):  # not connected: the will covers it
            info.wait_for_publish(timeout=2.0)
        self.client.disconnect()
        self.client.loop_stop()
