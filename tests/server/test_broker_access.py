"""Broker identity and access rules, on the embedded broker and on a private Mosquitto provisioned through its
dynamic-security plugin: every device its own credentials and topics; strangers, wrong passwords, foreign topics,
forged announcements and revoked devices refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from broker_clients import Raw
from mosquitto_kit import ADMIN, mosquitto
from pydantic import SecretStr
from server_testkit import FEDPER, SECRET, Dev, create, fed_state, wait_for

from pfl_edge.protocol import mqtt_client_id, round_topic, status_topic, task_topic
from server.launch import BackgroundServer, start_background
from server.services.broker_access import device_password
from server.settings import Settings

TOKEN = "admin-token-for-broker-access"


class Fleet:
    """A server with federation ``f`` (round 1 open: three devices enrolled) and an observer that reads all."""

    def __init__(self, srv: BackgroundServer, url: str, observer: tuple[str, str]) -> None:
        self.srv, self.url, self.observer_login = srv, url, observer
        self.c = httpx.Client(base_url=srv.url, timeout=30)
        create(self.c, TOKEN, "f", FEDPER)
        self.devs = [Dev(self.c, "f") for _ in range(3)]
        # round 1 opens and collects in the round worker's own time: the tests start from there
        wait_for(lambda: fed_state(self.c, TOKEN, "f") == (1, "collecting"), timeout=60, what="round 1 collecting")

    def login(self, dev: Dev, **kw: Any) -> Raw:
        return Raw(self.url, dev.client_id, user=dev.e["mqtt_username"], password=dev.e["mqtt_password"],
                   **kw)

    def observer(self) -> Raw:
        o = Raw(self.url, "observer", clean=True, subs=("pfl/#",), user=self.observer_login[0],
                password=self.observer_login[1])
        assert o.rc == 0 and o.subscribed.wait(5)
        return o


@pytest.fixture(params=["embedded", "mosquitto-dynsec"])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fleet]:
    base = dict(data_dir=tmp_path / "data", admin_token=TOKEN, tick_s=0.05)
    if request.param == "embedded":
        srv = start_background(Settings(**base))  # type: ignore[arg-type]
        assert srv.app_state is not None
        access = srv.app_state.coordinator.broker_access
        login = (access.server_username, access._server_password.decode())
        try:
            yield Fleet(srv, srv.broker_url, login)
        finally:
            srv.stop()
        return
    with mosquitto(tmp_path / "mosquitto", dynsec=True) as url:
        srv = start_background(Settings(**base, broker_url=url, broker_dynsec=True,  # type: ignore[arg-type]
                                        mqtt_username=ADMIN[0], mqtt_password=SecretStr(ADMIN[1])))
        try:
            yield Fleet(srv, url, ADMIN)
        finally:
            srv.stop()


def test_each_device_has_its_own_credentials(fleet: Fleet) -> None:
    a, b = fleet.devs[0].e, fleet.devs[1].e
    assert a["mqtt_username"] == a["device_id"] and len(a["mqtt_password"]) >= 32
    assert a["mqtt_password"] != b["mqtt_password"]
    dev = fleet.login(fleet.devs[0], subs=(task_topic("f", a["device_id"]),))
    assert dev.rc == 0 and dev.subscribed.wait(5) and dev.granted == [1]
    wait_for(lambda: task_topic("f", a["device_id"]) in dev.topics(), timeout=10, what="its retained task")
    dev.close()


def test_strangers_and_wrong_passwords_are_refused(fleet: Fleet) -> None:
    a = fleet.devs[0]
    assert Raw(fleet.url, "stranger", clean=True).rc not in (None, 0)
    assert Raw(fleet.url, "stranger", clean=True, user="nobody", password="x" * 40).rc not in (None, 0)
    assert Raw(fleet.url, a.client_id, user=a.id, password=a.e["mqtt_password"][:-1] + "?").rc not in (None, 0)
    # its own password but another device's client id: it could take that device's session over
    other = Raw(fleet.url, fleet.devs[1].client_id, user=a.id, password=a.e["mqtt_password"])
    assert other.rc not in (None, 0)


def test_no_device_can_drop_another_devices_session(fleet: Fleet) -> None:
    """Issue 49: a device connecting with its own credentials under another's client id had the broker drop the
    other's session (RabbitMQ did, though it then refused the newcomer). Client ids are derived from each
    device's MQTT password now: all A knows of B is its device id (DisPFL tasks name neighbours), and under the
    id that gives (``pfl-<device id>``, the old scheme) or a guess A is refused while B's session lives on."""
    a, b = fleet.devs[0], fleet.devs[1]
    assert b.client_id != mqtt_client_id(b.id)
    obs = fleet.observer()
    held = fleet.login(b, subs=(task_topic("f", b.id),))
    assert held.rc == 0 and held.subscribed.wait(10)
    near = b.client_id[:-1] + ("0" if b.client_id[-1] != "0" else "1")  # one character off its real id
    for guess in (mqtt_client_id(b.id), near):
        assert Raw(fleet.url, guess, user=a.id, password=a.e["mqtt_password"]).rc not in (None, 0)
    obs.publish(task_topic("f", b.id), {"ping": 1}, retain=False)
    wait_for(lambda: any(t == task_topic("f", b.id) and not r for t, _, r in held.got), timeout=20,
             what="B, still connected, getting a message")
    assert not held.gone.is_set()
    held.close()
    obs.close()


def test_a_device_reads_and_writes_only_its_own_topics(fleet: Fleet) -> None:
    a, b = fleet.devs[0], fleet.devs[1]
    obs = fleet.observer()
    dev = fleet.login(a, subs=(task_topic("f", b.id), "pfl/#", round_topic("f")))
    assert dev.rc == 0 and dev.subscribed.wait(5)
    assert dev.granted[:2] == [0x80, 0x80] and dev.granted[2] in (0, 1)
    forged = {"federation": "f", "round": 2, "state": "finished"}
    dev.publish(status_topic("f", b.id), {"device_id": b.id, "state": "offline"})  # B's status
    dev.publish(round_topic("f"), forged)  # a retained "finished" on the round topic
    dev.publish(status_topic("f", a.id), {"device_id": a.id, "state": "online"})  # its own: allowed
    # both brokers forward one connection's publishes to a subscriber in the order received (MQTT 4.6 asks it
    # per topic; each keeps one queue per session), so once its own status, sent last, is in, a forged message
    # the broker had let through would be in too
    wait_for(lambda: status_topic("f", a.id) in obs.topics(), timeout=10, what="its own status")
    assert status_topic("f", b.id) not in obs.topics()
    assert all(json.loads(p).get("state") != "finished" for t, p, _ in obs.got if t == round_topic("f"))
    assert not any(t == task_topic("f", b.id) for t, _, _ in dev.got)
    late = fleet.login(b, subs=(round_topic("f"),))  # the retained announcement is still the server's
    wait_for(lambda: bool(late.got), timeout=10, what="the retained announcement")
    assert json.loads(late.got[-1][1])["state"] == "collecting"
    for c in (late, dev, obs):
        c.close()


def test_a_removed_device_loses_the_broker_at_once(fleet: Fleet) -> None:
    a = fleet.devs[2]
    dev = fleet.login(a)
    assert dev.rc == 0
    assert fleet.srv.app_state is not None
    fleet.srv.app_state.coordinator.broker_access.remove_device(a.id)
    assert dev.gone.wait(5), "the live connection was not closed"
    assert fleet.login(a).rc not in (None, 0)


def test_enrolling_again_by_nonce_gives_the_same_password_whatever_lands_last(fleet: Fleet) -> None:
    """Two replicas answering one device's retried enrolment at once provision the broker (and write the
    database) in either order; the device keeps the answer it got last. A random password per answer left it
    holding one and the broker another (stop 26, 3 of 1,000 devices refused at CONNACK)."""
    fleet.c.post("/v1/federations", json={"id": "g", "enrol_secret": SECRET, "config": FEDPER},
                 headers={"Authorization": f"Bearer {TOKEN}"}).raise_for_status()
    body = {"federation": "g", "enrol_secret": SECRET, "profile": "phone-mid", "nonce": "ab" * 16}
    first = fleet.c.post("/v1/devices", json=body).json()
    again = fleet.c.post("/v1/devices", json=body).json()
    other = fleet.c.post("/v1/devices", json={**body, "nonce": "cd" * 16}).json()
    assert first["device_id"] == again["device_id"] != other["device_id"]
    assert first["mqtt_password"] == again["mqtt_password"] != other["mqtt_password"]
    assert first["token"] != again["token"]  # the token is still fresh: only the broker's password is derived
    # the first answer's provisioning lands after the second's (the database's write too, through the hash)
    assert fleet.srv.app_state is not None
    access = fleet.srv.app_state.coordinator.broker_access
    access.provision("g", first["device_id"], first["mqtt_password"])
    cid = mqtt_client_id(first["device_id"])  # a device without a key (an earlier release): the old id
    new = Raw(fleet.url, cid, user=first["device_id"], password=again["mqtt_password"])
    assert new.rc == 0
    new.close()
    wrong = Raw(fleet.url, cid, user=first["device_id"], password=other["mqtt_password"])
    assert wrong.rc not in (None, 0)


def test_a_derived_password_depends_on_key_nonce_and_secret() -> None:
    key, other_key = "11" * 32, "22" * 32
    pw = device_password(key, "ab" * 16, "secret")
    assert pw == device_password(key, "ab" * 16, "secret") and len(pw) == 43  # 256 bits, base64url
    assert len({pw, device_password(other_key, "ab" * 16, "secret"), device_password(key, "cd" * 16, "secret"),
                device_password(key, "ab" * 16, "secreT")}) == 4
