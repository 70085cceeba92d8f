"""Broker tokens: short-lived JWTs that a broker checks alone (RabbitMQ's ``rabbitmq_auth_backend_oauth2``), so
that no CONNECT and no subscription costs a question to the server.

A device's MQTT password, in ``jwt`` mode (``server.services.broker_access``), is a token signed here (ES256,
``kid`` in the header) whose ``aud`` is the broker's resource server id and whose ``scope`` allows exactly what
:func:`server.services.broker_access.device_identity` allows a device (the one definition, which the HTTP hook
answers from too): configure, write and read its own MQTT subscription queues, read its task topic and its
federation's round topic, write its status topic (its will included). RabbitMQ's MQTT plugin turns a topic
into a routing key on ``amq.topic`` ("/" -> "."); a scope reads ``<aud>.<permission>:<vhost>/<name>[/<routing
key>]`` with ``*`` a wildcard (``rabbit_oauth2_scope``); the vhost is percent-encoded (``/`` -> ``%2F``).

Keys: a folder (``broker_token_keys``, default ``<data_dir>/broker-keys``; replicas share one) holds a private
key per ``kid`` (``<kid>.key``, mode 0600) and its public half (``<kid>.pub.pem``, which ``server.rabbitmq``
points RabbitMQ at); ``current`` names the signing one. The first start makes one. Rotation:
:meth:`BrokerTokens.rotate` (``activate=False``) adds a key, every broker node is given its public key
(``rabbitmq_conf`` lists every key of the folder, the old ones too, so that tokens already out stay valid until
they expire), then :meth:`BrokerTokens.activate` makes it the signing one for every process on the folder.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ..broker_wire import Identity

__all__ = ["ALGORITHM", "BrokerTokens", "mqtt_queues", "scopes"]

ALGORITHM = "ES256"  # RabbitMQ 3.10's oauth2 backend (erlang-jose) verifies it; its signature is 86 characters
MQTT_EXCHANGE = "amq.topic"
SERVER_QUEUES = "mqtt-subscription-pfl-server-*"  # the replicas' links: client id pfl-server-<random>


def mqtt_queues(client_id: str) -> tuple[str, str]:
    """The queues RabbitMQ's MQTT plugin keeps a client's subscriptions in (QoS 0 and QoS 1)."""
    return f"mqtt-subscription-{client_id}qos0", f"mqtt-subscription-{client_id}qos1"


def scopes(ident: Identity, audience: str, vhost: str = "/") -> list[str]:
    """The token scopes of ``ident``: its own queues and exactly its topics; an identity without limits (the
    server's own) its links' queues and every ``pfl/...`` topic."""
    v, p = quote(vhost, safe=""), f"{audience}."
    queues = mqtt_queues(ident.client_id) if ident.client_id else (SERVER_QUEUES,)
    out = [f"{p}{perm}:{v}/{q}" for q in queues for perm in ("configure", "write", "read")]
    if ident.read is None or ident.write is None:
        return out + [f"{p}{perm}:{v}/{MQTT_EXCHANGE}/pfl.*" for perm in ("read", "write")]
    key = lambda topic: topic.replace("/", ".")  # noqa: E731  (pfl_edge.protocol's ids hold no ".")
    out += [f"{p}read:{v}/{MQTT_EXCHANGE}/{key(t)}" for t in sorted(ident.read)]
    return out + [f"{p}write:{v}/{MQTT_EXCHANGE}/{key(t)}" for t in sorted(ident.write)]


class BrokerTokens:
    """Signs broker tokens with the folder's current key (made at the first start)."""

    def __init__(self, folder: Path, *, audience: str = "pfl", ttl_s: float = 3600.0, vhost: str = "/",
                 clock: Callable[[], float] = time.time) -> None:
        self.folder, self.audience, self.ttl_s, self.vhost, self.clock = folder, audience, ttl_s, vhost, clock
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not (folder / "current").exists():
            self.rotate()
        self._load()

    def _load(self) -> None:
        current = self.folder / "current"
        self._seen = current.stat().st_mtime_ns
        self.kid = current.read_text().strip()
        self._key = serialization.load_pem_private_key((self.folder / f"{self.kid}.key").read_bytes(), None)

    def activate(self, kid: str) -> None:
        """Sign with ``kid`` from now on (every process on this folder follows at its next token)."""
        if not (self.folder / f"{kid}.key").exists():
            raise ValueError(f"no key {kid!r} in {self.folder}")
        tmp = self.folder / f".current-{kid}"
        tmp.write_text(kid + "\n")
        tmp.replace(self.folder / "current")  # atomic: a replica reading it sees the old kid or the new one
        self._load()

    def rotate(self, *, activate: bool = True) -> str:
        """A new key (its kid returned), its public half listed at once; signing with it from now on, or (not
        ``activate``) only after :meth:`activate`, once every broker node holds its public key."""
        kid = f"pfl-{time.strftime('%Y%m%d', time.gmtime(self.clock()))}-{secrets.token_hex(4)}"
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        fd = os.open(self.folder / f"{kid}.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        (self.folder / f"{kid}.pub.pem").write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        if activate or not (self.folder / "current").exists():
            self.activate(kid)
        return kid

    def public_keys(self) -> dict[str, Path]:
        """Every key's public PEM by kid (what the broker verifies with)."""
        return {p.name.removesuffix(".pub.pem"): p for p in sorted(self.folder.glob("*.pub.pem"))}

    def issue(self, ident: Identity, *, ttl_s: float | None = None) -> tuple[str, float]:
        """A token for ``ident`` and its expiry (unix seconds), signed with the folder's current key."""
        if (self.folder / "current").stat().st_mtime_ns != self._seen:  # another process activated a key
            self._load()
        now = self.clock()
        exp = now + (self.ttl_s if ttl_s is None else ttl_s)
        # aud and scope as lists: RabbitMQ 3.10 refuses a token whose aud is a bare string
        claims: dict[str, Any] = {"sub": ident.username, "aud": [self.audience], "iat": int(now), "exp": int(exp),
                                  "scope": scopes(ident, self.audience, self.vhost)}
        if ident.client_id:
            claims["client_id"] = ident.client_id
        token = jwt.encode(claims, self._key, algorithm=ALGORITHM, headers={"kid": self.kid})  # type: ignore[arg-type]
        return token, float(int(exp))

    def verify(self, token: str) -> dict[str, Any]:
        """The claims of ``token`` if one of the folder's keys signed it and it is in date, as the broker checks
        it (tests and tools; the broker does this itself). Raises ``jwt.InvalidTokenError``."""
        kid = jwt.get_unverified_header(token).get("kid")
        pub = self.public_keys().get(kid) if isinstance(kid, str) else None
        if pub is None:
            raise jwt.InvalidTokenError(f"unknown key id {kid!r}")
        key = serialization.load_pem_public_key(pub.read_bytes())
        return jwt.decode(token, key, algorithms=[ALGORITHM], audience=self.audience)  # type: ignore[arg-type]
