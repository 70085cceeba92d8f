"""Where the broker is: the embedded broker keeps its address across restarts (or the server refuses to start),
the server never tells devices a loopback address they cannot reach, and a device that cannot reach or enter its
broker says so in its log within seconds."""

from __future__ import annotations

import logging
import queue
import socket
import time
from pathlib import Path

import httpx
import pytest
from broker_clients import control, next_msg
from server_testkit import FEDPER, Dev, create, wait_for

from edge_runtime.control import Control
from edge_runtime.http import Http
from pfl_edge.errors import ConfigError
from pfl_edge.protocol import Enrolment, task_topic
from server.broker import EmbeddedBroker, free_port
from server.broker_core import Identity
from server.broker_setup import start_mqtt
from server.launch import start_background
from server.settings import Settings


def _nobody(_cid: str, _user: str | None, _pw: bytes | None) -> Identity | None:
    return None


def test_no_loopback_broker_address_for_devices_elsewhere(tmp_path: Path) -> None:
    port = free_port()
    s = Settings(data_dir=tmp_path, public_url="http://10.1.2.3:8000", embedded_broker_port=port)
    with pytest.raises(ConfigError, match="PFL_PUBLIC_BROKER_URL"):
        start_mqtt(s, _nobody)
    with socket.socket() as sock:  # refused before anything listened
        assert sock.connect_ex(("127.0.0.1", port)) != 0
    ext = Settings(data_dir=tmp_path, public_url="http://10.1.2.3:8000", broker_url="mqtt://localhost:1883")
    with pytest.raises(ConfigError, match="loopback"):
        start_mqtt(ext, _nobody)


def test_the_embedded_broker_listens_where_devices_reach_the_server(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path, public_url="http://10.1.2.3:8000", embedded_broker_host="0.0.0.0")
    mq = start_mqtt(s, _nobody)
    assert mq.broker is not None
    try:
        assert mq.mode == "embedded"
        assert mq.device_url == f"mqtt://10.1.2.3:{mq.broker.port}" and mq.url == f"mqtt://127.0.0.1:{mq.broker.port}"
        assert mq.server_credentials[0] == "pfl-server" and len(mq.server_credentials[1]) >= 32
    finally:
        mq.broker.stop()


def test_the_broker_keeps_its_port_or_the_server_refuses_to_start(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path)
    first = start_mqtt(s, _nobody)
    assert first.broker is not None
    port = first.broker.port
    first.broker.stop()
    again = start_mqtt(s, _nobody)  # a restart: same address for the devices enrolled before
    assert again.broker is not None and again.broker.port == port and again.device_url == first.device_url
    again.broker.stop()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", port))
    squatter.listen()
    try:
        with pytest.raises(ConfigError, match=f"{port}.*PFL_EMBEDDED_BROKER_PORT"):
            start_mqtt(s, _nobody)
    finally:
        squatter.close()


def _warning(caplog: pytest.LogCaptureFixture, within: float) -> str:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        for r in caplog.records:
            if r.levelno == logging.WARNING and "cannot use the MQTT broker" in r.message:
                return r.message
        time.sleep(0.05)
    raise AssertionError(f"no warning within {within} s: {[r.message for r in caplog.records]}")


def test_a_device_says_when_it_cannot_reach_its_broker(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pfl_edge.client")
    url = f"mqtt://127.0.0.1:{free_port()}"  # nobody listens
    ctl, _ = control(url)
    try:
        msg = _warning(caplog, 3.0)
        assert url in msg and "Connection refused" in msg
    finally:
        ctl.client.loop_stop()


def test_a_device_says_when_its_broker_refuses_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pfl_edge.client")
    with EmbeddedBroker(authenticate=_nobody) as b:
        ctl, _ = control(b.url, user="dev-a", password="stale")
        try:
            msg = _warning(caplog, 3.0)
            assert b.url in msg and "refused" in msg and "credentials" in msg
            assert not ctl.connected.is_set()
        finally:
            ctl.client.loop_stop()


def test_a_device_follows_its_broker_to_a_new_address(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The operator moves the embedded broker (PFL_EMBEDDED_BROKER_PORT) across a server restart: a device that
    cannot reach the old address asks the server where it is now and keeps receiving its tasks there."""
    caplog.set_level(logging.INFO, logger="pfl_edge.client")
    http_port = free_port()
    base = dict(data_dir=tmp_path / "data", admin_token="admin-token-for-moves", tick_s=0.05)
    srv = start_background(Settings(**base), port=http_port)  # type: ignore[arg-type]
    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, "admin-token-for-moves", "f", {**FEDPER, "clients": 1})
    enr = Enrolment.model_validate(Dev(c, "f").e)
    http = Http(srv.url, patience_s=10)
    http.token = enr.token
    inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
    ctl = Control(enr, inbox, http=http, rediscover_after_s=1.0)
    assert next_msg(inbox, task_topic("f", enr.device_id), timeout=15)["round"] == 1
    srv.stop()
    moved = free_port()
    srv = start_background(Settings(**base, embedded_broker_port=moved), port=http_port)  # type: ignore[arg-type]
    try:
        wait_for(lambda: ctl.url.endswith(f":{moved}"), timeout=30, what="the device to follow the broker")
        assert next_msg(inbox, task_topic("f", enr.device_id), timeout=30)["round"] == 1  # re-published there
        assert any("now at" in r.message and str(moved) in r.message for r in caplog.records)
    finally:
        ctl.close()
        srv.stop()
