"""Broker tokens (server.services.broker_tokens): a device's token allows exactly what device_identity allows
(the hook's one definition), it verifies with the folder's public key as RabbitMQ's oauth2 backend would, and
an expired, forged, re-signed or other-audience token does not; the device reads its expiry without a key."""

from __future__ import annotations

import contextlib
import json
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import jwt
import pytest

from edge_runtime.control import _not_authorised, token_expiry
from pfl_edge.protocol import BrokerInfo, Enrolment, mqtt_client_id, round_topic, status_topic, task_topic
from server.broker_wire import Identity
from server.rabbitmq import TokenKeys, rabbitmq_conf
from server.services.broker_access import BrokerAccess, device_identity
from server.services.broker_tokens import BrokerTokens, mqtt_queues, scopes
from server.settings import Settings


def _rk(topic: str) -> str:
    return topic.replace("/", ".")


def test_a_devices_scopes_are_its_queues_and_exactly_its_topics() -> None:
    ident = device_identity("fed-1", "dev-a")
    got = set(scopes(ident, "pfl"))
    queues = mqtt_queues(mqtt_client_id("dev-a"))
    want = {f"pfl.{p}:%2F/{q}" for q in queues for p in ("configure", "write", "read")}
    want |= {f"pfl.read:%2F/amq.topic/{_rk(round_topic('fed-1'))}",
             f"pfl.read:%2F/amq.topic/{_rk(task_topic('fed-1', 'dev-a'))}",
             f"pfl.write:%2F/amq.topic/{_rk(status_topic('fed-1', 'dev-a'))}"}
    assert got == want
    assert not any("dev-b" in s or "fed-2" in s or s.endswith("*") for s in got)
    # the hook answers from the same queue names
    assert all(q.startswith(f"mqtt-subscription-{mqtt_client_id('dev-a')}qos") for q in queues)
    # the server's own: its links' queues and pfl/... topics only
    srv = scopes(Identity("pfl-server"), "pfl")
    assert "pfl.write:%2F/amq.topic/pfl.*" in srv and all("mqtt-subscription-pfl-server-" in s or "amq.topic/pfl."
                                                           in s for s in srv)


def test_a_token_verifies_with_its_key_and_nothing_else_does(tmp_path: Path) -> None:
    tokens = BrokerTokens(tmp_path / "keys", ttl_s=600)
    key_file = tmp_path / "keys" / f"{tokens.kid}.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    token, exp = tokens.issue(device_identity("f", "dev-a"))
    assert jwt.get_unverified_header(token) == {"alg": "ES256", "kid": tokens.kid, "typ": "JWT"}
    claims = tokens.verify(token)
    assert claims["aud"] == ["pfl"] and claims["sub"] == "dev-a" and abs(exp - time.time() - 600) < 5
    assert set(claims["scope"]) == set(scopes(device_identity("f", "dev-a"), "pfl"))
    # expired
    old, _ = tokens.issue(device_identity("f", "dev-a"), ttl_s=-1)
    with pytest.raises(jwt.ExpiredSignatureError):
        tokens.verify(old)
    # another server's key, even under this kid: refused
    other = BrokerTokens(tmp_path / "other")
    forged = jwt.encode({"sub": "dev-a", "aud": ["pfl"], "exp": int(time.time()) + 60, "scope": ["pfl.read:%2F/*"]},
                        other._key, algorithm="ES256", headers={"kid": tokens.kid})  # type: ignore[arg-type]
    with pytest.raises(jwt.InvalidSignatureError):
        tokens.verify(forged)
    # a tampered payload (scopes widened), the signature kept
    h, _, sig = token.split(".")
    body = jwt.utils.base64url_encode(json.dumps({**claims, "scope": ["pfl.read:%2F/*"]}).encode()).decode()
    with pytest.raises(jwt.InvalidSignatureError):
        tokens.verify(f"{h}.{body}.{sig}")
    # another broker's audience
    with pytest.raises(jwt.InvalidAudienceError):
        BrokerTokens(tmp_path / "keys", audience="elsewhere").verify(token)


def test_rotation_signs_with_the_new_key_and_keeps_the_old_one_listed(tmp_path: Path) -> None:
    tokens = BrokerTokens(tmp_path / "keys")
    first, _ = tokens.issue(device_identity("f", "dev-a"))
    old_kid = tokens.kid
    new_kid = tokens.rotate()
    second, _ = tokens.issue(device_identity("f", "dev-a"))
    assert new_kid != old_kid and jwt.get_unverified_header(second)["kid"] == new_kid
    assert set(tokens.public_keys()) == {old_kid, new_kid}
    tokens.verify(first), tokens.verify(second)
    # another replica on the same folder signs with the current key
    replica = BrokerTokens(tmp_path / "keys")
    assert replica.kid == new_kid
    # a key added without signing with it (the brokers first get its public half), then activated: every process
    # on the folder follows at its next token
    staged = tokens.rotate(activate=False)
    assert staged in tokens.public_keys()
    assert jwt.get_unverified_header(tokens.issue(Identity("s"))[0])["kid"] == new_kid
    time.sleep(0.01)
    tokens.activate(staged)
    assert jwt.get_unverified_header(replica.issue(Identity("s"))[0])["kid"] == staged
    conf = rabbitmq_conf(None, tokens=TokenKeys("pfl", tokens.public_keys()))
    assert "auth_backends.1 = rabbit_auth_backend_oauth2" in conf and "auth_http" not in conf
    assert f"auth_oauth2.signing_keys.{old_kid} = " in conf and f"auth_oauth2.signing_keys.{new_kid} = " in conf
    both = rabbitmq_conf("http://h/hook", tokens=TokenKeys("pfl", tokens.public_keys()))
    assert "auth_backends.2 = http" in both


def test_the_longest_token_fits_the_enrolment_answer(tmp_path: Path) -> None:
    tokens = BrokerTokens(tmp_path / "keys")
    token, _ = tokens.issue(device_identity("f" * 64, "dev-" + "0" * 16))
    limit = Enrolment.model_fields["mqtt_password"].metadata[0].max_length
    assert len(token) < limit == BrokerInfo.model_fields["mqtt_password"].metadata[0].max_length


def test_the_device_reads_the_expiry_without_a_key(tmp_path: Path) -> None:
    token, exp = BrokerTokens(tmp_path / "keys").issue(device_identity("f", "dev-a"))
    assert token_expiry(token) == exp
    assert token_expiry("a-plain-random-password") is None and token_expiry("a.b.c") is None
    assert _not_authorised(SimpleNamespace(value=5)) and not _not_authorised(SimpleNamespace(value=3))


class _Session:
    """The two calls BrokerAccess makes of the database here: get a device, forget its password (revocation)."""

    def __init__(self, devices: dict[str, SimpleNamespace]) -> None:
        self.devices = devices

    def get(self, _model: object, key: str) -> SimpleNamespace | None:
        return self.devices.get(key)

    def execute(self, _stmt: object) -> None:
        for d in self.devices.values():
            d.mqtt_hash = None


class _Store:
    def __init__(self, devices: dict[str, SimpleNamespace]) -> None:
        self.session = _Session(devices)

    @contextlib.contextmanager
    def read(self) -> Iterator[_Session]:
        yield self.session

    write = read


def test_a_revoked_or_unknown_device_gets_no_token(tmp_path: Path) -> None:
    dev = SimpleNamespace(id="dev-a", federation="f", mqtt_hash="x", revoked_at=None, mqtt_client=None)
    access = BrokerAccess(_Store({"dev-a": dev}), "jwt", server_username="pfl-server",  # type: ignore[arg-type]
                          tokens=BrokerTokens(tmp_path / "keys"))
    got = access.device_token("dev-a")
    assert got is not None and access.tokens is not None and access.tokens.verify(got)["sub"] == "dev-a"
    assert access.device_token("dev-zz") is None and access.device_token("pfl-server") is None
    access.remove_device("dev-a")  # what revocation does
    assert access.device_token("dev-a") is None
    dev.mqtt_hash, dev.revoked_at = "x", 1.0
    assert access.device_token("dev-a") is None
    assert access.tokens.verify(access.server_token())["sub"] == "pfl-server"


def test_settings_refuse_tokens_for_the_embedded_broker(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="broker_tokens"):
        Settings(data_dir=tmp_path, broker_tokens=True)
    Settings(data_dir=tmp_path, broker_tokens=True, broker_url="mqtt://127.0.0.1:1883")


def _jwt_shaped(exp: float, tag: str) -> str:
    """A password shaped like a token (the device reads exp from it; the embedded broker here checks it whole)."""
    body = jwt.utils.base64url_encode(json.dumps({"exp": int(exp), "jti": tag}).encode()).decode()
    return f"eyJhbGciOiJFUzI1NiJ9.{body}.c2ln"


class _Server:
    """GET /v1/devices/me/broker as the server answers it in jwt mode: a fresh token each time."""

    def __init__(self, url: str) -> None:
        self.url, self.issued = url, [_jwt_shaped(time.time() + 600, "fresh-1")]

    def call(self, method: str, path: str) -> SimpleNamespace:
        assert (method, path) == ("GET", "/v1/devices/me/broker")
        return SimpleNamespace(json=lambda: {"broker_url": self.url, "mqtt_password": self.issued[-1]})


def test_a_refused_device_fetches_a_fresh_token_and_gets_in() -> None:
    from broker_clients import control

    from server.broker import EmbeddedBroker

    server = _Server("")
    stale = _jwt_shaped(time.time() - 5, "stale")
    with EmbeddedBroker(authenticate=lambda cid, user, pw: device_identity("f", "dev-a")
                        if pw is not None and pw.decode() == server.issued[-1] else None) as b:
        server.url = b.url
        ctl, _ = control(b.url, user="dev-a", password=stale, http=server)
        try:
            assert ctl.connected.wait(15), ctl.last_error
            # before the token expires, a fresh one is fetched for the next connect (expiry here: ~2 s)
            server.issued.append(_jwt_shaped(time.time() + 2.2, "short"))
            b.kick("dev-a")
            assert _wait(lambda: ctl.connected.is_set() and ctl.client._password == server.issued[-1].encode())
            server.issued.append(_jwt_shaped(time.time() + 600, "fresh-2"))  # the timer's fetch gets this one
            assert _wait(lambda: ctl.client._password == server.issued[-1].encode(), 10)
            b.kick("dev-a")
            assert _wait(lambda: ctl.connected.is_set(), 15)
        finally:
            ctl.close()


def _wait(cond: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_a_revoked_device_reaches_the_broker_for_minutes_not_an_hour() -> None:
    """Issue 49: a revoked device's broker token lived up to an hour; the default is now the 10 minutes
    docs/operations.md states (a token is refused by the broker once expired: the RabbitMQ tests, at 15 s)."""
    from server.settings import Settings

    ttl = Settings.model_fields["broker_token_ttl_s"].default
    assert ttl == 600.0
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text(encoding="utf-8")
    assert "The default TTL is **10 minutes**" in " ".join(doc.split())
