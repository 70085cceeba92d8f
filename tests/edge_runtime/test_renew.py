"""A device whose token chain ends enrols again and carries on: the server refuses a rotation past the chain's
absolute lifetime (``device_token_max_lifetime_s``) or a call with an expired token (401); the device then asks
with its secret and the nonce it kept, and gets back the same device and slot with a new chain (before, a device
whose rotation was refused retried every minute and stopped working when its token expired). A revoked device is
refused (403) and stops."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_kit import ADMIN, device, serve

from edge_runtime.enrol import enrol, renew
from edge_runtime.http import Http, ServerError
from server.db import Device
from server.launch import BackgroundServer


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[BackgroundServer]:
    yield from serve(tmp_path)


def _age(srv: BackgroundServer, dev_id: str, *, expired: bool) -> None:
    """Its chain began past the server's lifetime ago (and, ``expired``, its token expired): no waiting."""
    assert srv.app_state is not None
    with srv.app_state.coordinator.store.sessions.begin() as s:
        row = s.get(Device, dev_id)
        row.token_origin = time.time() - 365 * 86400.0
        if expired:
            row.token_expires = time.time() - 1


def test_a_refused_rotation_makes_the_device_enrol_again_as_itself(srv: BackgroundServer, tmp_path: Path) -> None:
    store, http, cfg = device(srv, tmp_path / "dev")
    first = enrol(store, http, cfg)
    http.use_token(store.root / "token.json", first.token)
    assert http.rotate_if_due() and not http.chain_ended  # a fresh enrolment rotates at once: the chain works
    _age(srv, first.device_id, expired=False)
    http._next_try = 0.0  # (due again: its retry clock, not time, decides here)
    http._expires = None
    assert not http.rotate_if_due() and http.chain_ended  # 401: past the chain's lifetime
    again = renew(store, http, cfg, first)
    assert (again.device_id, again.index) == (first.device_id, first.index) and again.token != first.token
    assert not http.chain_ended
    assert http.call("GET", "/v1/devices/me/broker").status_code == 200  # the new chain's token works
    assert enrol(store, http, cfg) == again  # saved: a restart reads it back


def test_an_expired_token_is_renewed_and_a_revoked_device_is_not(srv: BackgroundServer, tmp_path: Path) -> None:
    store, http, cfg = device(srv, tmp_path / "dev")
    first = enrol(store, http, cfg)
    http.use_token(store.root / "token.json", first.token)
    _age(srv, first.device_id, expired=True)
    with pytest.raises(ServerError) as e:
        http.call("GET", "/v1/devices/me/broker")
    assert e.value.status == 401 and "expired" in str(e.value)
    renew(store, http, cfg, first)
    assert http.call("GET", "/v1/devices/me/broker").status_code == 200
    admin = Http(srv.url, 5)
    admin.token = ADMIN
    admin.call("POST", f"/v1/federations/f/devices/{first.device_id}/revoke")
    with pytest.raises(ServerError) as e:
        renew(store, http, cfg, first)
    assert e.value.status == 403 and "revoked" in str(e.value)
