"""The device's own key (issue 49, item 3) as the agent keeps and uses it: made with the nonce before the first
request, private to the state dir, every enrolment attempt and token rotation signed with a counter raised and
saved first. A thief holding a copy of the device's nonce and the federation's secret, but not its key, is refused
the device's slot; the device itself renews as before."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_kit import SECRET, device, serve

from edge_runtime.config import AgentConfig
from edge_runtime.enrol import DeviceKey, enrol, renew
from edge_runtime.http import Http, ServerError
from edge_runtime.state import StateDir
from pfl_edge.device_key import enrol_message, verify
from server.db import Device
from server.launch import BackgroundServer


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[BackgroundServer]:
    yield from serve(tmp_path)


def test_the_key_is_private_to_the_state_dir_and_the_server_keeps_its_public_half(srv: BackgroundServer,
                                                                                   tmp_path: Path) -> None:
    store, http, cfg = device(srv, tmp_path / "dev")
    enr = enrol(store, http, cfg)
    path = store.root / "device-key.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    saved = json.loads(path.read_text())
    key = DeviceKey(store)  # read back: the same key, the counter where the enrolment left it
    assert saved["counter"] == 1
    assert srv.app_state is not None
    with srv.app_state.coordinator.store.read() as s:
        row = s.get(Device, enr.device_id)
        assert row is not None and (row.public_key, row.key_counter) == (key.public, 1)
    http.use_token(store.root / "token.json", enr.token)
    assert http.rotate_if_due()  # signed: the server requires it of a keyed device
    assert json.loads(path.read_text())["counter"] == 2


def test_a_copy_of_the_nonce_without_the_key_cannot_take_the_slot(srv: BackgroundServer, tmp_path: Path) -> None:
    store, http, cfg = device(srv, tmp_path / "dev")
    first = enrol(store, http, cfg)
    thief_root = tmp_path / "thief"
    thief_root.mkdir()
    shutil.copy(store.root / "enrol-nonce.json", thief_root / "enrol-nonce.json")
    t_store, t_http, t_cfg = device(srv, thief_root)
    with pytest.raises(ServerError) as e:
        enrol(t_store, t_http, t_cfg)  # it makes a key of its own: not the one the server keeps
    assert e.value.status == 403 and "signed by it" in str(e.value)
    again = renew(store, http, cfg, first)  # the device itself: its slot, a new chain
    assert (again.device_id, again.index) == (first.device_id, first.index)


def test_each_attempt_is_signed_afresh(tmp_path: Path) -> None:
    """A retried enrolment (a 503, a lost answer) sends a new counter each time: the server takes a counter
    once only, so a retry of the same signed body would be refused."""
    seen: list[dict[str, Any]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(json.loads(req.content))
        if len(seen) == 1:
            return httpx.Response(503, json={"detail": "busy"}, headers={"retry-after": "0"})
        body = seen[-1]
        return httpx.Response(500 if not verify(body["public_key"], enrol_message(
            "f", body["nonce"], body["public_key"], body["proof"]["counter"]), body["proof"]["signature"]) else 418)

    store = StateDir(tmp_path / "dev")
    http = Http("http://device.test", 30)
    http.client = httpx.Client(base_url="http://device.test", transport=httpx.MockTransport(handler))
    cfg = AgentConfig(server="http://device.test", federation="f", enrol_secret=SECRET, profile="phone-mid",
                      state_dir=str(store.root))
    with pytest.raises(ServerError) as e:
        enrol(store, http, cfg)
    assert e.value.status == 418  # the second attempt's signature verified
    assert [b["proof"]["counter"] for b in seen] == [1, 2]
    assert seen[0]["proof"]["signature"] != seen[1]["proof"]["signature"]
    assert json.loads((store.root / "device-key.json").read_text())["counter"] == 2
