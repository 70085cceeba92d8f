"""The HTTP hook an external broker asks about every client (RabbitMQ's rabbitmq_auth_backend_http): the same
rules as the embedded broker (a device its own credentials, its federation's round topic and its own task to
read, its own status to write), answered from the database, a revoked device refused at the next question, and
the hook closed to anyone without its token."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr, ValidationError
from server_testkit import FEDPER, Dev, create

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
    assert _ask(c, "user", username=a.id, password=pw, client_id=a.client_id) == "allow"
    assert _ask(c, "user", username=a.id, password=pw, client_id=b.client_id) == "deny"  # B's session
    assert _ask(c, "user", username=SERVER[0], password=SERVER[1]) == "allow"
    assert _ask(c, "vhost", username=a.id, vhost="/") == "allow"
    assert _ask(c, "vhost", username=a.id, vhost="other") == "deny"
    # what: its own subscription queues and the MQTT exchange; the topic question decides the topics
    own_q = f"mqtt-subscription-{a.client_id}qos1"
    other_q = f"mqtt-subscription-{b.client_id}qos1"
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


def test_a_flood_of_wrong_guesses_through_the_hook_never_keeps_the_servers_link_out(srv: BackgroundServer) -> None:
    """Issue 49: a bucket of wrong answers for the server's user name, once empty, denied the right password too:
    whoever could ask the hook (its token, or any MQTT client of the broker, which asks the hook for it) kept the
    servers' links from logging in. Now the right password is let in at once whatever came before and beside it,
    and each wrong one is denied; guessing is hopeless by the password's length instead (next test)."""
    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, TOKEN, "f", FEDPER)
    a = Dev(c, "f")
    right = {"username": SERVER[0], "password": SERVER[1]}
    with ThreadPoolExecutor(8) as pool:
        flood = pool.map(lambda i: _ask(c, "user", username=SERVER[0], password=f"guess-{i}"), range(400))
        during = [_ask(c, "user", **right) for _ in range(5)]  # beside the flood
        assert set(flood) == {"deny"}
    assert during == ["allow"] * 5
    assert _ask(c, "user", **right) == "allow"  # and after it
    assert _ask(c, "user", username=a.id, password=a.e["mqtt_password"]) == "allow"
    assert _ask(c, "user", username=SERVER[0], password=SERVER[1] + "x") == "deny"
    assert _ask(c, "user", username=SERVER[0], password=SERVER[1][:-1]) == "deny"
    assert _ask(c, "user", username=SERVER[0], password="") == "deny"
    c.close()


def test_the_servers_password_is_too_long_to_guess_at_the_hooks_speed(srv: BackgroundServer) -> None:
    """The bound: a server MQTT password the hook checks is 16 characters or more (the server refuses to start
    with less). Drawn at random as the docs say (``openssl rand -hex 32``: 256 bits), or even as the least a
    random spelling gives (16 hex characters: 64 bits), it takes 2.9 x 10^5 years on average at a million
    guesses a second, far more than the hook answers (measured here): no throttle is needed, so none locks the
    servers out."""
    with pytest.raises(ValidationError, match="at least 16"):
        Settings(broker_url="mqtt://h:1883", broker_hook_token=SecretStr(HOOK), mqtt_username="pfl-server",
                 mqtt_password=SecretStr("x" * 15))
    Settings(broker_url="mqtt://h:1883", broker_hook_token=SecretStr(HOOK), mqtt_username="pfl-server",
             mqtt_password=SecretStr("x" * 16))
    Settings(broker_url="mqtt://h:1883", broker_dynsec=True, mqtt_username="a", mqtt_password=SecretStr("short"))
    c = httpx.Client(base_url=srv.url, timeout=30)
    n, t0 = 400, time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(lambda i: _ask(c, "user", username=SERVER[0], password=f"{i:016x}"), range(n))) == {"deny"}
    rate = n / (time.perf_counter() - t0)
    c.close()
    bound = 1e6  # guesses a second
    years = 2 ** (4 * 16 - 1) / bound / (365.25 * 86400)  # half the space of 16 hex characters, on average
    print(f"the hook answered {rate:.0f} guesses a second; at {bound:.0e}, 16 random hex characters take "
          f"{years:.1e} years")
    assert rate < bound / 100 and years > 2.5e5


def test_the_servers_login_checks_every_password_and_denies_only_wrong_ones() -> None:
    from typing import cast

    from server.services.broker_access import BrokerAccess
    from server.services.store import Store

    acc = BrokerAccess(cast(Store, None), "hook", server_username=SERVER[0], server_password=SERVER[1])
    assert [acc.hook_user(SERVER[0], "wrong") for _ in range(1000)] == [False] * 1000
    assert acc.hook_user(SERVER[0], SERVER[1])  # never locked out
    assert not acc.hook_user(SERVER[0], SERVER[1][:-1]) and not acc.hook_user(SERVER[0], SERVER[1] + "\0")
    assert not BrokerAccess(cast(Store, None), "hook", server_username=SERVER[0]).hook_user(SERVER[0], "")
