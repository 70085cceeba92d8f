"""The HTTP hook an external broker asks about every client (RabbitMQ's rabbitmq_auth_backend_http): the same
rules as the embedded broker (a device its own credentials, its federation's round topic and its own task to
read, its own status to write), answered from the database, a revoked device refused at the next question, and
the hook closed to anyone without its token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr, ValidationError
from server_testkit import FEDPER, Dev, create

from pfl_edge.protocol import mqtt_client_id
from server.launch import BackgroundServer, start_background
from server.settings import Settings

TOKEN = "admin-token-for-the-hook"
HOOK = "hook-token-0123456789abcdef"
SERVER = ("pfl-server", "server-password-for-the-hook")


@pytest.fixture
def srv(tmp_path: Path, broker_url: str) -> Iterator[BackgroundServer]:
    s = start_background(Settings(data_dir=tmp_path / "data", admin_token=TOKEN,  # type: ignore[arg-type]
                                  broker_url=broker_url, broker_hook_token=SecretStr(HOOK),
                                  mqtt_username=SERVER[0], mqtt_password=SecretStr(SERVER[1]), tick_s=0.05))
    try:
        yield s
    finally:
        s.stop()


def _ask(c: httpx.Client, question: str, token: str = HOOK, **form: str) -> str:
    r = c.post(f"/v1/broker/hook/{token}/{question}", data=form)
    return r.text if r.status_code == 200 else str(r.status_code)


def test_the_hook_answers_by_the_embedded_brokers_rules(srv: BackgroundServer) -> None:
    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, TOKEN, "f", FEDPER)
    a, b = Dev(c, "f"), Dev(c, "f")
    pw = a.e["mqtt_password"]
    assert a.e["mqtt_username"] == a.id and len(pw) >= 32 and pw != b.e["mqtt_password"]
    # who: the device with its own password, the server with its own; nobody else
    assert _ask(c, "user", username=a.id, password=pw) == "allow"
    assert _ask(c, "user", username=a.id, password=pw[:-1] + "?") == "deny"
    assert _ask(c, "user", username=a.id, password=b.e["mqtt_password"]) == "deny"
    assert _ask(c, "user", username="nobody", password=pw) == "deny"
    assert _ask(c, "user", username="", password="") == "deny"
    assert _ask(c, "user", username=a.id, password=pw, client_id=mqtt_client_id(a.id)) == "allow"
    assert _ask(c, "user", username=a.id, password=pw, client_id=mqtt_client_id(b.id)) == "deny"  # B's session
    assert _ask(c, "user", username=SERVER[0], password=SERVER[1]) == "allow"
    assert _ask(c, "vhost", username=a.id, vhost="/") == "allow"
    assert _ask(c, "vhost", username=a.id, vhost="other") == "deny"
    # what: its own subscription queues and the MQTT exchange; the topic question decides the topics
    own_q = f"mqtt-subscription-{mqtt_client_id(a.id)}qos1"
    other_q = f"mqtt-subscription-{mqtt_client_id(b.id)}qos1"
    res = {"username": a.id, "vhost": "/"}
    assert _ask(c, "resource", **res, resource="queue", name=own_q, permission="configure") == "allow"
    assert _ask(c, "resource", **res, resource="queue", name=other_q, permission="read") == "deny"
    assert _ask(c, "resource", **res, resource="exchange", name="amq.topic", permission="write") == "allow"
    assert _ask(c, "resource", **res, resource="exchange", name="amq.topic", permission="configure") == "deny"
    assert _ask(c, "resource", **res, resource="exchange", name="amq.direct", permission="write") == "deny"
    assert _ask(c, "resource", username=a.id, vhost="other", resource="queue", name=own_q,
                permission="read") == "deny"
    top = {**res, "resource": "topic", "name": "amq.topic"}
    assert _ask(c, "topic", **top, permission="read", routing_key=f"pfl.f.device.{a.id}.task") == "allow"
    assert _ask(c, "topic", **top, permission="read", routing_key="pfl.f.round") == "allow"
    assert _ask(c, "topic", **top, permission="write", routing_key=f"pfl.f.device.{a.id}.status") == "allow"
    assert _ask(c, "topic", **top, permission="read", routing_key=f"pfl.f.device.{b.id}.task") == "deny"
    assert _ask(c, "topic", **top, permission="write", routing_key=f"pfl.f.device.{b.id}.status") == "deny"
    assert _ask(c, "topic", **top, permission="write", routing_key="pfl.f.round") == "deny"  # a forged round
    assert _ask(c, "topic", **top, permission="read", routing_key="pfl.#") == "deny"
    assert _ask(c, "topic", **top, permission="read", routing_key="pfl.*.round") == "deny"
    assert _ask(c, "topic", **{**top, "name": "amq.direct"}, permission="read", routing_key="pfl.f.round") == "deny"
    assert _ask(c, "topic", username=SERVER[0], vhost="/", resource="topic", name="amq.topic", permission="write",
                routing_key=f"pfl.f.device.{a.id}.task") == "allow"
    # revoked: refused at the broker's next question, whatever it asks
    c.post(f"/v1/federations/f/devices/{a.id}/revoke", headers={"Authorization": f"Bearer {TOKEN}"}
           ).raise_for_status()
    assert _ask(c, "user", username=a.id, password=pw) == "deny"
    assert _ask(c, "vhost", username=a.id, vhost="/") == "deny"
    assert _ask(c, "topic", **top, permission="read", routing_key=f"pfl.f.device.{a.id}.task") == "deny"
    assert _ask(c, "user", username=b.id, password=b.e["mqtt_password"]) == "allow"  # the others are not
    c.close()


def test_the_hook_is_closed_without_its_token_and_bounded(srv: BackgroundServer, tmp_path: Path,
                                                           broker_url: str) -> None:
    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, TOKEN, "f", FEDPER)
    a = Dev(c, "f")
    form = {"username": a.id, "password": a.e["mqtt_password"]}
    assert _ask(c, "user", token=HOOK[:-1] + "x", **form) == "404"
    assert _ask(c, "user", token="", **form) == "404"
    assert _ask(c, "nothing", **form) == "422"
    r = c.post(f"/v1/broker/hook/{HOOK}/user", data={**form, "pad": "x" * 5000})
    assert r.status_code == 413
    # malformed bodies are a refusal, never an error
    for body in (b"\xff\xfe", b"username=" + a.id.encode() + b"&username=x", b"&&&===", b""):
        r = c.post(f"/v1/broker/hook/{HOOK}/user", content=body,
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert (r.status_code, r.text) == (200, "deny"), body
    c.close()
    # a server without a hook token has no hook at all
    other = start_background(Settings(data_dir=tmp_path / "other", admin_token=TOKEN,  # type: ignore[arg-type]
                                      broker_url=broker_url))
    try:
        with httpx.Client(base_url=other.url, timeout=30) as c2:
            assert _ask(c2, "user", **form) == "404"
    finally:
        other.stop()


def test_hook_settings_are_checked() -> None:
    with pytest.raises(ValidationError, match="external broker"):
        Settings(broker_hook_token=SecretStr(HOOK))  # the embedded broker asks nobody
    with pytest.raises(ValidationError, match="at least 16"):
        Settings(broker_url="mqtt://h:1883", broker_hook_token=SecretStr("short"))
    with pytest.raises(ValidationError, match="external broker"):
        Settings(broker_url="mqtt://h:1883", broker_dynsec=True, broker_hook_token=SecretStr(HOOK))


def test_guessing_the_servers_password_through_the_hook_is_throttled(srv: BackgroundServer) -> None:
    """After a burst of wrong passwords for the server's own user name, every answer for that name is deny,
    unchecked (the right password's too: else allow/deny would test guesses for free); devices, whose passwords
    are random, answer as before."""
    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, TOKEN, "f", FEDPER)
    a = Dev(c, "f")
    import inspect

    from server.services.broker_access import BrokerAccess

    burst = inspect.signature(BrokerAccess).parameters["guess_burst"].default  # what the server runs with
    assert _ask(c, "user", username=SERVER[0], password=SERVER[1]) == "allow"
    answers = [_ask(c, "user", username=SERVER[0], password=f"guess-{i}") for i in range(burst + 5)]
    assert answers == ["deny"] * len(answers)
    assert _ask(c, "user", username=SERVER[0], password=SERVER[1]) == "deny"  # locked out, right or not
    assert _ask(c, "user", username=a.id, password=a.e["mqtt_password"]) == "allow"
    assert _ask(c, "vhost", username=SERVER[0], vhost="/") == "allow"  # a link already in is not asked again
    c.close()


def test_the_servers_guess_bucket_refills_and_only_wrong_answers_spend_it() -> None:
    from typing import cast

    from server.services.broker_access import BrokerAccess
    from server.services.store import Store

    now = [0.0]
    acc = BrokerAccess(cast(Store, None), "hook", server_username=SERVER[0], server_password=SERVER[1],
                       guess_rate=0.1, guess_burst=3, clock=lambda: now[0])
    for _ in range(20):  # the right one spends nothing
        assert acc.hook_user(SERVER[0], SERVER[1])
    assert [acc.hook_user(SERVER[0], "wrong") for _ in range(3)] == [False] * 3
    assert not acc.hook_user(SERVER[0], SERVER[1])  # empty: denied unchecked
    now[0] += 9.9
    assert not acc.hook_user(SERVER[0], SERVER[1])
    now[0] += 0.1  # one token back after 1 / guess_rate s
    assert acc.hook_user(SERVER[0], SERVER[1])
    assert not acc.hook_user(SERVER[0], "wrong")  # spends it
    assert not acc.hook_user(SERVER[0], SERVER[1])
    # guesses while locked out spend nothing more: the lockout ends when the bucket says, not later
    for _ in range(50):
        acc.hook_user(SERVER[0], "wrong")
    now[0] += 10.0
    assert acc.hook_user(SERVER[0], SERVER[1])
    assert not BrokerAccess(cast(Store, None), "hook", server_username=SERVER[0]).hook_user(SERVER[0], "")
