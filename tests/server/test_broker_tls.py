"""MQTT over TLS: the embedded broker with a certificate, and a private Mosquitto with a TLS listener. The server
and devices verify the broker against the tests' own CA; a device trusting another CA refuses it and says so."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from broker_clients import control, next_msg
from mosquitto_kit import mosquitto
from server_testkit import FEDPER, Dev, create
from tlskit import Pki, make_pki

from pfl_edge.protocol import Enrolment, task_topic
from server.launch import BackgroundServer, start_background
from server.settings import Settings

TOKEN = "admin-token-for-broker-tls"


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


def _enrolled(srv: BackgroundServer) -> Enrolment:
    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, TOKEN, "f", {**FEDPER, "clients": 1})
    return Enrolment.model_validate(Dev(c, "f").e)


@pytest.fixture(params=["embedded", "mosquitto"])
def tls_server(request: pytest.FixtureRequest, tmp_path: Path, pki: Pki) -> Iterator[BackgroundServer]:
    base = dict(data_dir=tmp_path / "data", admin_token=TOKEN, tick_s=0.05, mqtt_ca_file=pki.ca)
    if request.param == "embedded":
        srv = start_background(Settings(**base, broker_tls_cert=pki.cert, broker_tls_key=pki.key))
        try:
            yield srv
        finally:
            srv.stop()
        return
    with mosquitto(tmp_path / "mosquitto", tls=(pki.cert, pki.key)) as url:
        srv = start_background(Settings(**base, broker_url=url))
        try:
            yield srv
        finally:
            srv.stop()


def test_devices_reach_the_broker_over_verified_tls(tls_server: BackgroundServer, pki: Pki,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    enr = _enrolled(tls_server)
    assert enr.broker_url.startswith("mqtts://127.0.0.1:")
    assert tls_server.app_state is not None and tls_server.app_state.link.connected  # the server verified it too
    ctl, inbox = control(enr.broker_url, enr.device_id, "f", user=enr.mqtt_username, password=enr.mqtt_password,
                         client_id=enr.mqtt_client_id, ca_file=str(pki.ca))
    assert ctl.connected.wait(10)
    assert next_msg(inbox, task_topic("f", enr.device_id), timeout=15)["round"] == 1
    ctl.close()
    caplog.set_level(logging.WARNING, logger="pfl_edge.client")
    t0 = time.monotonic()
    wrong, _ = control(enr.broker_url, enr.device_id, "f", user=enr.mqtt_username, password=enr.mqtt_password,
                       client_id=enr.mqtt_client_id, ca_file=str(pki.other_ca))
    while time.monotonic() - t0 < 5 and not any("cannot use the MQTT broker" in r.message for r in caplog.records):
        time.sleep(0.05)
    warned = [r.message for r in caplog.records if "cannot use the MQTT broker" in r.message]
    assert warned and enr.broker_url in warned[0] and "CERTIFICATE_VERIFY_FAILED" in warned[0]
    assert not wrong.connected.is_set()
    wrong.client.loop_stop()
