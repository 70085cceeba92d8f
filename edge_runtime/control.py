"""The device's control plane: one MQTT connection to its broker, with its own identity and, for ``mqtts://``
brokers, TLS that verifies the broker's certificate (against ``ca_file``, else the system's CAs)."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import queue
import ssl
import sys
import threading
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from pfl_edge.errors import ConfigError
from pfl_edge.protocol import BrokerInfo, Enrolment, mqtt_client_id, round_topic, status_topic, task_topic

if TYPE_CHECKING:
    from .http import Http

__all__ = ["Control"]

log = logging.getLogger("pfl_edge.client")

_TLS = ("mqtts", "ssl")
BROKER_PATH = "/v1/devices/me/broker"


class Control:
    """The MQTT side: a persistent session (clean_session False, client id ``pfl-<device id>``) subscribed at
    QoS 1 to the device's task topic and the federation's round topic; ``online`` on connect, ``offline`` as the
    last will. paho reconnects by itself with back-off (1 s to 30 s) when the broker goes away. A broker it
    cannot reach or that refuses it is logged at WARNING with its URL and the reason at the first failure, and
    again every ``warn_every_s`` while it lasts. After ``rediscover_after_s`` of failures it asks the server
    (``http``) where the broker is now, and follows it there if it moved. Where the broker checks tokens (the
    MQTT password is a JWT, ``jwt`` mode), a refusal asks the server at once for a fresh one, and a fresh one
    is fetched before the current expires, for the next connect."""

    def __init__(self, enr: Enrolment, inbox: queue.Queue[tuple[str, bytes]], *, ca_file: str | None = None,
                 keepalive: int = 30, warn_every_s: float = 60.0, http: Http | None = None,
                 rediscover_after_s: float = 15.0) -> None:
        import paho.mqtt.client as mqtt

        url = urlparse(enr.broker_url)
        if url.scheme not in ("mqtt", "tcp", *_TLS) or not url.hostname:
            raise ConfigError(f"unsupported broker URL {enr.broker_url!r}: use mqtt://host:port or mqtts://host:port")
        self.url = enr.broker_url
        self.fed, self.dev = enr.federation, enr.device_id
        self.inbox = inbox
        self.connected = threading.Event()
        self.last_error: str | None = None
        self._warn_every_s, self._warned_at = warn_every_s, -1e9
        self._http, self._rediscover_after_s, self._keepalive = http, rediscover_after_s, keepalive
        self._failing_since: float | None = None
        self._asking = threading.Lock()
        client_id = enr.mqtt_client_id or mqtt_client_id(enr.device_id)  # absent: a server of an earlier release
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False,
                        protocol=mqtt.MQTTv311)
        if url.scheme in _TLS:
            c.tls_set(ca_certs=ca_file, cert_reqs=ssl.CERT_REQUIRED, tls_version=ssl.PROTOCOL_TLS_CLIENT)
        self._user, self._password = enr.mqtt_username, enr.mqtt_password
        self._refresh_timer: threading.Timer | None = None
        if enr.mqtt_username:
            c.username_pw_set(enr.mqtt_username, enr.mqtt_password)
            self._schedule_refresh(enr.mqtt_password)
        c.will_set(status_topic(self.fed, self.dev), json.dumps({"device_id": self.dev, "state": "offline"}),
                   qos=1, retain=True)
        c.reconnect_delay_set(min_delay=1, max_delay=30)
        c.on_connect = self._on_connect
        c.on_connect_fail = self._on_connect_fail
        c.on_disconnect = self._on_disconnect
        c.on_subscribe = self._on_subscribe
        c.on_message = self._on_message
        self.client = c
        c.connect_async(url.hostname, url.port or (8883 if url.scheme in _TLS else 1883), keepalive=keepalive)
        c.loop_start()

    def _failed(self, reason: str, *, refused: bool = False) -> None:
        """A failure to reach or enter the broker: WARNING at once, then at most every ``warn_every_s``."""
        self.last_error = reason
        now = time.monotonic()
        if now - self._warned_at >= self._warn_every_s:
            self._warned_at = now
            log.warning("cannot use the MQTT broker %s: %s; retrying", self.url, reason)
        if self._failing_since is None:
            self._failing_since = now
        if (self._http is not None and (now - self._failing_since >= self._rediscover_after_s or refused)
                and self._asking.acquire(blocking=False)):
            threading.Thread(target=self._rediscover, name="pfl-broker-address", daemon=True).start()

    def _rediscover(self) -> None:
        """Ask the server where the broker is now; reconnect there if it moved (same scheme)."""
        try:
            if self._http is None:
                return
            try:
                info = BrokerInfo.model_validate(self._http.call("GET", BROKER_PATH).json())
                url = info.broker_url
            except Exception as e:  # the server is away too, or refuses: paho keeps trying the old address
                log.warning("could not ask the server where the MQTT broker is now: %s", e)
                return
            self._fresh_password(info.mqtt_password)
            new, old = urlparse(url), urlparse(self.url)
            if url == self.url or not new.hostname or (new.scheme in _TLS) != (old.scheme in _TLS):
                return
            log.warning("the server says the MQTT broker is now at %s (was %s); connecting there", url, self.url)
            self.url = url
            self.client.connect_async(new.hostname, new.port or (8883 if new.scheme in _TLS else 1883),
                                      keepalive=self._keepalive)
        finally:
            self._failing_since = time.monotonic()
            self._asking.release()

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if getattr(reason, "is_failure", False):
            self._failed(f"it refused the connection ({reason}): are this device's MQTT credentials still valid?",
                         refused=_not_authorised(reason) and token_expiry(self._password) is not None)
            return
        log.info("connected to the broker %s", self.url)
        self.last_error, self._warned_at, self._failing_since = None, -1e9, None
        # subscribe on every connect: a restarted broker may have lost the persistent session
        client.subscribe([(task_topic(self.fed, self.dev), 1), (round_topic(self.fed), 1)])
        client.publish(status_topic(self.fed, self.dev), json.dumps({"device_id": self.dev, "state": "online"}),
                       qos=1, retain=True)

    def _fresh_password(self, password: str | None) -> None:
        """A fresh MQTT password from the server (a token broker's): the next connect uses it."""
        if password and self._user:
            self._password = password
            self.client.username_pw_set(self._user, password)
            self._schedule_refresh(password)

    def _schedule_refresh(self, password: str) -> None:
        """Ask for a fresh token when nine tenths of this one's life are gone (nothing for a plain password)."""
        exp = token_expiry(password)
        if exp is None or self._http is None:
            return
        if self._refresh_timer is not None:
            self._refresh_timer.cancel()
        t = threading.Timer(max(1.0, (exp - time.time()) * 0.9), self._refresh_now)
        t.daemon, t.name = True, "pfl-broker-token"
        self._refresh_timer = t
        t.start()

    def _refresh_now(self) -> None:
        if self._http is None:
            return
        try:
            self._fresh_password(BrokerInfo.model_validate(self._http.call("GET", BROKER_PATH).json()).mqtt_password)
        except Exception as e:  # a refusal at the next connect asks again
            log.warning("could not fetch a fresh MQTT token from the server: %s", e)

    def _on_subscribe(self, client: Any, userdata: Any, mid: Any, codes: Any, props: Any) -> None:
        if any(getattr(c, "is_failure", False) for c in codes):
            self._failed(f"it refused this device's subscriptions ({', '.join(str(c) for c in codes)})")
            return
        self.connected.set()  # connected and subscribed: nothing published from now on is missed
        # and what was published before may never come: a broker that restarted without its retained messages,
        # or another node of a cluster (RabbitMQ keeps retained messages per node). Ring the bell once, so the
        # device asks the server for its task now
        self.inbox.put((round_topic(self.fed), b""))

    def _on_connect_fail(self, client: Any, userdata: Any) -> None:
        err = sys.exc_info()[1]  # paho calls this from inside its ``except OSError``
        self._failed(f"{type(err).__name__}: {err}" if err is not None else "the connection failed")

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if self.connected.is_set():
            log.warning("connection to the MQTT broker %s lost (%s); reconnecting", self.url, reason)
        self.connected.clear()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        self.inbox.put((msg.topic, bytes(msg.payload)))

    def close(self) -> None:
        if self._refresh_timer is not None:
            self._refresh_timer.cancel()
        info = self.client.publish(status_topic(self.fed, self.dev),
                                   json.dumps({"device_id": self.dev, "state": "offline"}), qos=1, retain=True)
        with contextlib.suppress(RuntimeError, ValueError):  # not connected: the will covers it
            info.wait_for_publish(timeout=2.0)
        self.client.disconnect()
        self.client.loop_stop()


def _not_authorised(reason: Any) -> bool:
    """CONNACK 4 or 5 (MQTT 3.1.1): bad credentials or not authorised (an expired token, a revoked device)."""
    return getattr(reason, "value", None) in (4, 5, 134, 135) or "authori" in str(reason).lower()


def token_expiry(password: str) -> float | None:
    """The ``exp`` of a JWT password, read WITHOUT verifying its signature (the device cannot and need not: it
    only plans when to ask for a fresh one; the broker verifies); None for a plain password."""
    parts = password.split(".")
    if len(parts) != 3:
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        exp = payload.get("exp") if isinstance(payload, dict) else None
    except ValueError:
        return None
    return float(exp) if isinstance(exp, int | float) else None
