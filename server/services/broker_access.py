"""Who may use the MQTT broker and for what: every device its own credentials and topics, the server its own
identity.

A device's MQTT username is its device id and its client id :func:`device_client_id`; its password has 256 bits of
entropy and only its sha256 is kept (``Device.mqtt_hash``). Without a nonce it is random; a device that enrols with
a nonce gets one derived from the nonce, its enrol secret and a per-federation key (:func:`device_password`), so
that its retried enrolment, answered by two replicas at once, tells it, the database and the broker the same
password whatever order their writes land in (a random one per answer left the device holding one password and
Mosquitto or the database another: refused at CONNACK).
It may subscribe to its federation's round topic and its own task topic and publish only its own status (its
last will is there too). Three modes, by the server's settings:

- ``embedded``: the embedded broker asks :meth:`BrokerAccess.authenticate` at every CONNECT (the database's
  hash; a revoked device is refused) and enforces the topics; :meth:`remove_device` closes its connection at once.
- ``dynsec``: an external Mosquitto with its dynamic-security plugin. The server (the configured admin
  credentials, whose role must allow ``$CONTROL/dynamic-security/#`` and publishing ``pfl/#``) creates a client
  and a role per device through the control topic ``$CONTROL/dynamic-security/v1`` and waits for the plugin's
  answer; removal deletes the client, which Mosquitto disconnects at once.
- ``hook``: an external broker that asks the server over HTTP (RabbitMQ's ``rabbitmq_auth_backend_http``;
  EMQX and VerneMQ have the like): at every CONNECT (:meth:`hook_user`) and for every virtual host, queue,
  exchange and topic a client touches (:meth:`hook_vhost`, :meth:`hook_resource`, :meth:`hook_topic`), by the
  same rules as the embedded broker, read from the database. Nothing is provisioned per device; a revoked
  device is refused at the broker's next question. The routes: ``server.routers.broker_hook``. The server's own
  user name is let in with its password alone, never throttled: that password must be 16 characters or more, and
  random (:meth:`_server_login`).
- ``jwt``: an external broker that checks a signed token alone (RabbitMQ's ``rabbitmq_auth_backend_oauth2``):
  a device's MQTT password is a short-lived token (:mod:`.broker_tokens`) whose scopes allow what
  :func:`device_identity` allows; ``GET /v1/devices/me/broker`` hands it a fresh one (:meth:`device_token`),
  never to a revoked device. Nothing is asked at CONNECT; a revoked device's open connection lasts until it
  drops, or publishes or subscribes after its token's expiry (RabbitMQ closes it then, not before).
- ``shared``: an external broker the server does not manage (the old mode): every device is told
  ``device_mqtt_password``, and the broker's own configuration decides what it may do.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, Literal, Protocol

from sqlalchemy import update

from pfl_edge.protocol import mqtt_client_id, round_topic, status_topic, task_topic

from ..broker_wire import Identity, LogGate
from ..db import Device
from ..errors import ApiError
from .broker_tokens import BrokerTokens, mqtt_queues
from .store import Store

__all__ = ["DYNSEC_TOPIC", "BrokerAccess", "BrokerUnavailable", "Mode", "device_client_id", "device_identity",
           "device_password", "mqtt_hash"]

log = logging.getLogger(__name__)

DYNSEC_TOPIC = "$CONTROL/dynamic-security/v1"
Mode = Literal["embedded", "dynsec", "hook", "jwt", "shared"]
# RabbitMQ's MQTT plugin: a session's subscriptions live in the queues broker_tokens.mqtt_queues(client id),
# bound to this exchange with the topic as routing key ("/" -> ".", "+" -> "*")
MQTT_EXCHANGE = "amq.topic"


class BrokerUnavailable(ApiError):
    """The broker could not be told about a device (503: try again)."""

    status = HTTPStatus.SERVICE_UNAVAILABLE


class _Kicker(Protocol):
    def kick(self, username: str) -> int: ...


class _Link(Protocol):
    def publish_raw(self, topic: str, payload: bytes, *, retain: bool = False) -> None: ...
    def listen(self, topic_filter: str, handler: Any) -> None: ...


def mqtt_hash(password: str | bytes) -> str:
    """What the server keeps of a device's MQTT password (random, 32 bytes of entropy: no slow KDF needed)."""
    return hashlib.sha256(password.encode() if isinstance(password, str) else password).hexdigest()


def device_password(key: str, nonce: str, enrol_secret: str) -> str:
    """The MQTT password of the device that enrols with ``nonce``: the same for each of its enrolments. The enrol
    secret is in it so that the database alone (which holds the key and the nonce, and of the secret only a slow
    hash) does not give the password; whoever knows the secret and the nonce can enrol again anyway."""
    msg = b"\0".join((b"pfl-mqtt", nonce.encode(), enrol_secret.encode()))
    return base64.urlsafe_b64encode(hmac.new(bytes.fromhex(key), msg, hashlib.sha256).digest()).rstrip(b"=").decode()


def device_client_id(password: str, device_id: str) -> str:
    """A device's MQTT client id, from its MQTT password (the same for each enrolment of a device with a nonce,
    and so the same on every replica that answers one): no other device can guess it, so none can connect under
    it and have the broker drop the device's session (a takeover; RabbitMQ disconnects the holder even when the
    newcomer is then refused). Device ids are no secret: DisPFL tasks name neighbours."""
    mac = hmac.new(password.encode(), b"pfl-client\0" + device_id.encode(), hashlib.sha256).hexdigest()
    return f"pfl-{mac[:32]}"


def device_identity(fed_id: str, device_id: str, client_id: str | None = None) -> Identity:
    """The one definition of what a device may do on the broker (the embedded broker's rules and Mosquitto's
    role are both built from it); ``client_id``: its ``Device.mqtt_client`` (None: enrolled before it had one)."""
    return Identity(device_id, read=frozenset({round_topic(fed_id), task_topic(fed_id, device_id)}),
                    write=frozenset({status_topic(fed_id, device_id)}),
                    client_id=client_id or mqtt_client_id(device_id))


class BrokerAccess:
    def __init__(self, store: Store, mode: Mode, *, server_username: str = "", server_password: str = "",
                 broker: _Kicker | None = None, link: _Link | None = None, shared_password: str = "",
                 timeout_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 tokens: BrokerTokens | None = None) -> None:
        if mode == "embedded" and broker is None:
            raise ValueError("embedded broker access needs the broker")
        if mode == "dynsec" and link is None:
            raise ValueError("dynamic-security access needs the server's MQTT link")
        if mode == "jwt" and tokens is None:
            raise ValueError("token access needs the signing keys")
        self.tokens = tokens
        self.store, self.mode = store, mode
        self.server_username, self._server_password = server_username, server_password.encode()
        self.broker, self.link = broker, link
        self.shared_password, self.timeout_s = shared_password, timeout_s
        self._pending: dict[str, tuple[dict[str, dict[str, Any]], int, threading.Event]] = {}
        self._lock = threading.Lock()
        self._guess_log = LogGate(clock=clock)  # wrong passwords for the server's user name: a few lines per 10 s
        if link is not None and mode == "dynsec":
            link.listen(DYNSEC_TOPIC + "/response", self._on_response)

    # ------------------------------------------------------------------------------------------- devices
    def fresh_password(self, derive: tuple[str, str, str] | None = None) -> tuple[str, str | None]:
        """A device's MQTT password for an enrolment and what the server keeps of it (``Device.mqtt_hash``, set
        in the enrolment's transaction): :func:`device_password` of ``derive`` (key, nonce, enrol secret), else
        random; in ``shared`` mode the shared password, of which nothing is kept."""
        if self.mode == "shared":
            return self.shared_password, None
        password = secrets.token_urlsafe(32) if derive is None else device_password(*derive)
        return password, mqtt_hash(password)

    def provision(self, fed_id: str, device_id: str, password: str, client_id: str | None = None) -> None:
        """Tell a broker that keeps its own accounts (``dynsec``) about a device that has just enrolled with
        ``password`` and ``client_id`` (replacing any earlier ones) and its federation's topics; the embedded
        broker and the HTTP hook read the database instead."""
        if self.mode != "dynsec":
            return
        ident = device_identity(fed_id, device_id, client_id)
        role = f"pfl-{device_id}"
        acls = [{"acltype": kind, "topic": t, "allow": True}
                for t in sorted(ident.read or ()) for kind in ("subscribePattern", "publishClientReceive")]
        acls += [{"acltype": "publishClientSend", "topic": t, "allow": True} for t in sorted(ident.write or ())]
        self._dynsec([{"command": "deleteClient", "username": device_id},
                      {"command": "deleteRole", "rolename": role},
                      {"command": "createRole", "rolename": role, "acls": acls},
                      {"command": "createClient", "username": device_id, "password": password,
                       "clientid": ident.client_id, "roles": [{"rolename": role}]}],
                     tolerate={"deleteClient", "deleteRole"})

    def remove_device(self, device_id: str) -> None:
        """The device loses MQTT now: its password is forgotten and its live connection closed."""
        with self.store.write() as s:
            s.execute(update(Device).where(Device.id == device_id).values(mqtt_hash=None))
        if self.mode == "embedded" and self.broker is not None:
            self.broker.kick(device_id)
        elif self.mode == "dynsec":
            self._dynsec([{"command": "deleteClient", "username": device_id},
                          {"command": "deleteRole", "rolename": f"pfl-{device_id}"}],
                         tolerate={"deleteRole"})
        log.info("device %s removed from the broker", device_id)

    # ---------------------------------------------------------------------------------- embedded broker
    def authenticate(self, client_id: str, username: str | None, password: bytes | None) -> Identity | None:
        """The embedded broker's question at every CONNECT: who is this, and what may it do (None: refused)."""
        if not username or password is None:
            return None
        if self.server_username and username == self.server_username:
            return Identity(username, own=True) if hmac.compare_digest(password, self._server_password) else None
        with self.store.read() as s:
            dev = s.get(Device, username)
            if dev is None or dev.revoked_at is not None or not dev.mqtt_hash:
                return None
            if not hmac.compare_digest(mqtt_hash(password), dev.mqtt_hash):
                return None
            return device_identity(dev.federation, dev.id, dev.mqtt_client)

    # ------------------------------------------------------------------------------------- broker tokens
    def device_token(self, device_id: str) -> str | None:
        """``jwt`` mode: a fresh MQTT password (a signed token) for a device that still has broker access
        (enrolled, not revoked); None in other modes or for a device without access."""
        ident = self.identity(device_id) if self.tokens is not None else None
        if self.tokens is None or ident is None or ident.read is None:
            return None
        return self.tokens.issue(ident)[0]

    def server_token(self) -> str:
        """``jwt`` mode: the server's own MQTT password (its links' queues, every ``pfl/...`` topic)."""
        if self.tokens is None:
            raise ValueError("no broker tokens in this mode")
        return self.tokens.issue(Identity(self.server_username or "pfl-server"))[0]

    # ------------------------------------------------------------------------------------ the HTTP hook
    def identity(self, username: str) -> Identity | None:
        """What ``username`` may do now (None: nobody we know, or revoked): the hook's authorisation questions
        come without a password, after :meth:`hook_user` let the client in."""
        if self.server_username and username == self.server_username:
            return Identity(username)
        with self.store.read() as s:
            dev = s.get(Device, username)
            if dev is None or dev.revoked_at is not None or not dev.mqtt_hash:
                return None
            return device_identity(dev.federation, dev.id, dev.mqtt_client)

    def hook_user(self, username: str, password: str, client_id: str | None = None) -> bool:
        """A CONNECT: the password is the user's, and the client id (where the broker tells it) its own. For the
        server's own user name, see :meth:`_server_login`."""
        if self.server_username and username == self.server_username:
            return self._server_login(password)
        ident = self.authenticate("", username, password.encode())
        if ident is None:
            return False
        return client_id is None or ident.client_id is None or client_id == ident.client_id

    def _server_login(self, password: str) -> bool:
        """The hook's ``user`` question for the server's own name: the right password is let in, every time; a
        wrong one is denied and logged (through a gate: 5 lines per 10 s, the rest counted). Compared as sha256
        digests in constant time: the time tells neither the password's length nor where a guess goes wrong.

        Never throttled, on purpose (issue 49). A bucket of wrong answers that, once empty, denied every answer
        for this name, the right password's too, let whoever can ask the hook keep the servers' links out as long
        as it liked: the hook token's holder, and any client of the broker (RabbitMQ asks the hook about whatever
        name a CONNECT gives). A throttle that let the right password through would tell a guesser at full speed
        when it guessed right; a delay per answer slows only a guesser that waits for each (guesses, and the
        broker's CONNECTs, run in parallel) and holds the server's threads meanwhile. What bounds guessing is the
        password itself: the server refuses to start the hook with one under 16 characters (``server.settings``),
        and the docs draw it at random (``openssl rand -hex 32``: 256 bits). Even 16 random hex characters (64
        bits) take 2.9 x 10^5 years on average at a million guesses a second, thousands of times what the hook
        answers (~200-350 a second on the 2-core machine, per replica: BENCHMARKS.md, "Issue 49")."""
        if hmac.compare_digest(hashlib.sha256(password.encode()).digest(),
                               hashlib.sha256(self._server_password).digest()) and self._server_password:
            return True
        self._guess_log(log, logging.WARNING, "wrong", "broker hook: a wrong password for the server's MQTT user")
        return False

    def hook_vhost(self, username: str, vhost: str, vhost_allowed: str = "/") -> bool:
        return vhost == vhost_allowed and self.identity(username) is not None

    def hook_resource(self, username: str, resource: str, name: str, permission: str) -> bool:
        """A queue or exchange: a device may use its own subscription queues and publish to, and read from, the
        MQTT exchange (the topic question then decides which topics); the server anything."""
        ident = self.identity(username)
        if ident is None:
            return False
        if ident.read is None and ident.write is None:
            return True
        if resource == "exchange":
            return name == MQTT_EXCHANGE and permission in ("read", "write")
        if resource == "queue":
            return name in mqtt_queues(ident.client_id or "") and permission in ("configure", "read", "write")
        return False

    def hook_topic(self, username: str, name: str, permission: str, routing_key: str) -> bool:
        """A topic on the MQTT exchange: ``write`` to publish (its status, its will), ``read`` to subscribe
        (its federation's round topic, its own task)."""
        ident = self.identity(username)
        if ident is None or name != MQTT_EXCHANGE:
            return False
        topic = routing_key.replace(".", "/")  # pfl_edge.protocol's ids hold no "." (nor "/", "+", "#")
        if permission == "write":
            return ident.may_write(topic)
        if permission == "read":
            return ident.may_subscribe(topic)
        return False

    # --------------------------------------------------------------------------------- dynamic security
    def _dynsec(self, commands: list[dict[str, Any]], *, tolerate: set[str]) -> None:
        """Send ``commands`` to Mosquitto's dynamic-security plugin and wait for its answers; an error that is
        not one of the ``tolerate``d commands' (deleting what is not there) raises :class:`BrokerUnavailable`."""
        if self.link is None:
            raise BrokerUnavailable("the server has no link to the broker")
        corr = uuid.uuid4().hex
        for i, c in enumerate(commands):
            c["correlationData"] = f"{corr}-{i}"
        got: dict[str, dict[str, Any]] = {}
        done = threading.Event()
        with self._lock:
            self._pending[corr] = (got, len(commands), done)
        try:
            self.link.publish_raw(DYNSEC_TOPIC, json.dumps({"commands": commands}).encode())
            if not done.wait(self.timeout_s):
                raise BrokerUnavailable(f"the broker's dynamic-security plugin did not answer within "
                                        f"{self.timeout_s:g} s; try again")
        finally:
            with self._lock:
                self._pending.pop(corr, None)
        errors = [f"{r.get('command')}: {r['error']}" for r in got.values()
                  if r.get("error") and r.get("command") not in tolerate]
        if errors:
            raise BrokerUnavailable(f"the broker refused to provision the device: {'; '.join(errors)}")

    def _on_response(self, _topic: str, payload: bytes) -> None:
        try:
            responses = json.loads(payload).get("responses", [])
        except (ValueError, AttributeError):
            return
        for r in responses if isinstance(responses, list) else []:
            cd = r.get("correlationData") if isinstance(r, dict) else None
            if not isinstance(cd, str) or "-" not in cd:
                continue
            with self._lock:
                pending = self._pending.get(cd.split("-", 1)[0])
                if pending is None:
                    continue
                got, n, done = pending
                got[cd] = r
                if len(got) >= n:
                    done.set()
