"""Issue 49, item 3: a device's own key. Threat model: a thief who learned a device's enrolment nonce and the
federation's secret (a copied file, a log), or stole its bearer token, but not its private key. Before, the nonce
and secret took the device's slot (same device id, a fresh token) and a stolen token could be rotated to the end
of its chain. Now a device that enrolled with a key gets its slot back only with a signature by it, with a counter
that must grow (no replay), and signs its own token rotations. Its MQTT client id is derived from its MQTT
password: no other device can guess it."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_testkit import SECRET, app_with_federation, bearer
from sqlalchemy import select

from pfl_edge.device_key import enrol_message, new_key, public_of, rotate_message, sign, verify
from pfl_edge.protocol import EnrolRequest, mqtt_client_id
from server.db import Device
from server.services.broker_access import device_client_id

ADMIN = "admin-token-for-device-key-tests"


@pytest.fixture
def client(tmp_path: Path, broker_url: str) -> Iterator[TestClient]:
    yield from app_with_federation(tmp_path, broker_url, ADMIN)


class Key:
    """A device's key and counter, as edge_runtime.enrol.DeviceKey keeps them."""

    def __init__(self) -> None:
        self.private, self.counter = new_key(), 0
        self.public = public_of(self.private)

    def enrol_body(self, nonce: str, *, counter: int | None = None, fed: str = "f") -> dict[str, Any]:
        if counter is None:
            self.counter += 1
            counter = self.counter
        proof = {"counter": counter, "signature": sign(self.private, enrol_message(fed, nonce, self.public, counter))}
        return {**_plain(nonce, fed), "public_key": self.public, "proof": proof, "protocols": [1, 2]}

    def rotation(self, device_id: str) -> dict[str, Any]:
        self.counter += 1
        return {"proof": {"counter": self.counter,
                          "signature": sign(self.private, rotate_message(device_id, self.counter))}}


def _plain(nonce: str, fed: str = "f") -> dict[str, Any]:
    return {"federation": fed, "enrol_secret": SECRET, "profile": "phone-mid", "nonce": nonce}


def _row(c: TestClient, dev_id: str) -> Device:
    with c.app.state.pfl.coordinator.store.read() as s:  # type: ignore[attr-defined]
        return s.scalar(select(Device).where(Device.id == dev_id))


def test_signatures_verify_only_for_their_key_and_message() -> None:
    """The primitives against each other (and cryptography's own check underneath): a flipped bit in the
    message, the signature or the key fails; malformed hex is False, not an exception."""
    k, other = new_key(), new_key()
    msg = enrol_message("f", "a" * 32, public_of(k), 3)
    sig = sign(k, msg)
    assert verify(public_of(k), msg, sig)
    assert not verify(public_of(other), msg, sig)
    assert not verify(public_of(k), enrol_message("f", "a" * 32, public_of(k), 4), sig)
    assert not verify(public_of(k), msg, sig[:-1] + ("0" if sig[-1] != "0" else "1"))
    assert not verify("zz" * 32, msg, sig) and not verify(public_of(k), msg, "00")
    # the domain tags keep a rotation's signature from passing as an enrolment's
    assert rotate_message("f", 3) != enrol_message("f", "", "", 3)


def test_a_key_needs_its_proof_and_a_nonce() -> None:
    k = Key()
    body = k.enrol_body("b" * 32)
    EnrolRequest.model_validate(body)
    for drop in ("proof", "public_key", "nonce"):
        with pytest.raises(ValueError):
            EnrolRequest.model_validate({x: v for x, v in body.items() if x != drop})


def test_a_stolen_nonce_and_secret_cannot_take_a_keyed_devices_slot(client: TestClient) -> None:
    nonce, key = secrets.token_hex(16), Key()
    first = client.post("/v1/devices", json=key.enrol_body(nonce))
    assert first.status_code == 201, first.text
    dev = first.json()
    assert _row(client, dev["device_id"]).public_key == key.public
    # the thief: the nonce and the secret, no key; then with a key of its own, properly signed
    assert client.post("/v1/devices", json=_plain(nonce)).status_code == 403
    thief = Key()
    r = client.post("/v1/devices", json=thief.enrol_body(nonce))
    assert r.status_code == 403 and "signed by it" in r.json()["detail"]
    # the thief replays the device's own first request, word for word: its counter was used
    replay = key.enrol_body(nonce, counter=1)
    r = client.post("/v1/devices", json=replay)
    assert r.status_code == 403 and "counter above 1" in r.json()["detail"]
    # the device itself, with the next counter: its slot and id back, a fresh token; its old token is dead
    again = client.post("/v1/devices", json=key.enrol_body(nonce))
    assert again.status_code == 201, again.text
    assert (again.json()["device_id"], again.json()["index"]) == (dev["device_id"], dev["index"])
    assert client.get("/v1/federations/f", headers=bearer(dev["token"])).status_code == 401
    assert client.get("/v1/federations/f", headers=bearer(again.json()["token"])).status_code == 200
    assert _row(client, dev["device_id"]).key_counter == 2
    # a forged signature with the device's public key
    body = key.enrol_body(nonce)
    body["proof"]["signature"] = sign(thief.private, enrol_message("f", nonce, key.public, body["proof"]["counter"]))
    assert client.post("/v1/devices", json=body).status_code == 403


def test_a_keyed_device_signs_its_rotations_and_a_stolen_token_cannot_be_rotated(client: TestClient) -> None:
    nonce, key = secrets.token_hex(16), Key()
    dev = client.post("/v1/devices", json=key.enrol_body(nonce)).json()
    h = bearer(dev["token"])
    r = client.post("/v1/devices/me/token", headers=h)  # the thief's rotation: the token, no key
    assert r.status_code == 401 and "proof" in r.json()["detail"]
    thief = Key()
    assert client.post("/v1/devices/me/token", headers=h, json=thief.rotation(dev["device_id"])).status_code == 401
    body = key.rotation(dev["device_id"])
    r = client.post("/v1/devices/me/token", headers=h, json=body)
    assert r.status_code == 200, r.text
    h2 = bearer(r.json()["token"])
    assert client.post("/v1/devices/me/token", headers=h2, json=body).status_code == 401  # replayed counter
    assert client.post("/v1/devices/me/token", headers=h2, json=key.rotation(dev["device_id"])).status_code == 200


def test_a_device_without_a_key_keeps_working_and_its_first_key_binds(client: TestClient) -> None:
    """A device of an earlier release (no key) enrols and re-enrols as before, and rotates without a proof;
    once upgraded, the first key it shows is kept (trust on first key), and from then on a keyless enrolment
    under its nonce is refused."""
    nonce = secrets.token_hex(16)
    dev = client.post("/v1/devices", json=_plain(nonce)).json()
    assert client.post("/v1/devices/me/token", headers=bearer(dev["token"])).status_code == 200
    assert client.post("/v1/devices", json=_plain(nonce)).json()["device_id"] == dev["device_id"]
    key = Key()
    r = client.post("/v1/devices", json=key.enrol_body(nonce))
    assert r.status_code == 201 and r.json()["device_id"] == dev["device_id"]
    assert client.post("/v1/devices", json=_plain(nonce)).status_code == 403


def test_mqtt_client_ids_are_per_device_unguessable_and_stable_for_a_nonce(client: TestClient) -> None:
    nonce, key = secrets.token_hex(16), Key()
    a = client.post("/v1/devices", json=key.enrol_body(nonce)).json()
    b = client.post("/v1/devices", json=Key().enrol_body(secrets.token_hex(16))).json()
    assert a["mqtt_client_id"] != b["mqtt_client_id"]
    for d in (a, b):
        assert d["mqtt_client_id"] != mqtt_client_id(d["device_id"])
        assert d["mqtt_client_id"] == device_client_id(d["mqtt_password"], d["device_id"])
        assert _row(client, d["device_id"]).mqtt_client == d["mqtt_client_id"]
    # the same device enrolling again (its token chain ended) keeps its client id: its broker session lives on
    assert client.post("/v1/devices", json=key.enrol_body(nonce)).json()["mqtt_client_id"] == a["mqtt_client_id"]
    # a device of an earlier release (no key) gets no field it does not know, and keeps the old id
    old = client.post("/v1/devices", json=_plain(secrets.token_hex(16)))
    assert old.status_code == 201 and "mqtt_client_id" not in old.json()
    assert _row(client, old.json()["device_id"]).mqtt_client is None
