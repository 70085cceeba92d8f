"""Issue 50, item 1: a versioned protocol. A device says at enrolment which versions it speaks; the server answers
in the highest both speak, or refuses with 426 naming both sides' versions, keeping nothing. A device of an earlier
release (it names none: version 1) gets no field version 1 did not have; what a device of version 2 is sent, it
reads tolerantly (a field added later is ignored), while what a device sends stays strict."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_testkit import SECRET, Dev, app_with_federation, fed_state, snapshot, wait_for
from sqlalchemy import select

from pfl_edge.protocol import PROTOCOL_VERSIONS, Enrolment, Task, UpdateRequest, negotiate
from server.db import Device

ADMIN = "admin-token-for-version-tests"


@pytest.fixture
def client(tmp_path: Path, broker_url: str) -> Iterator[TestClient]:
    yield from app_with_federation(tmp_path, broker_url, ADMIN)


def _body(**kw: Any) -> dict[str, Any]:
    return {"federation": "f", "enrol_secret": SECRET, "profile": "phone-mid", **kw}


def _row(c: TestClient, dev_id: str) -> Device:
    with c.app.state.pfl.coordinator.store.read() as s:  # type: ignore[attr-defined]
        return s.scalar(select(Device).where(Device.id == dev_id))


def test_negotiate_takes_the_highest_version_both_speak() -> None:
    assert negotiate(None) == 1 and negotiate([1, 2]) == 2 and negotiate([2, 7]) == 2 and negotiate([1, 2, 3]) == 3
    assert negotiate([1], (1, 2)) == 1 and negotiate([7]) is None and negotiate(None, (2,)) is None
    assert max(PROTOCOL_VERSIONS) == 3


def test_each_device_is_answered_in_its_version(client: TestClient) -> None:
    new = client.post("/v1/devices", json=_body(protocols=[1, 2]))
    assert new.status_code == 201, new.text
    assert new.json()["protocol"] == 2 and new.json()["mqtt_client_id"].startswith("pfl-")
    assert _row(client, new.json()["device_id"]).protocol == 2
    old = client.post("/v1/devices", json=_body())  # an earlier release: names none
    assert old.status_code == 201
    assert "protocol" not in old.json() and "mqtt_client_id" not in old.json()  # it would refuse them
    assert _row(client, old.json()["device_id"]).protocol == 1
    one = client.post("/v1/devices", json=_body(protocols=[1]))
    assert one.json()["protocol"] == 1 and "mqtt_client_id" not in one.json()


def test_a_task_names_its_version_for_a_device_of_version_2_only(client: TestClient) -> None:
    new = Dev(client, "f")  # this release's device: versions 1 and 2
    old = Dev(client, "f", keyed=False)  # an earlier release's
    Dev(client, "f", keyed=False)  # the third: round 1 opens
    wait_for(lambda: fed_state(client, ADMIN, "f") == (1, "collecting"), what="round 1")
    got_new = client.get("/v1/rounds/current/task", headers=new.h).json()
    got_old = client.get("/v1/rounds/current/task", headers=old.h).json()
    assert got_new["protocol"] == 2 and got_new["round"] == 1
    assert "protocol" not in got_old and got_old["round"] == 1  # it would refuse the field, even as null
    assert set(got_new) - set(got_old) == {"protocol"}


def test_a_device_speaking_no_version_of_the_server_is_refused_naming_both(client: TestClient) -> None:
    engine = client.app.state.pfl.engine  # type: ignore[attr-defined]
    before = snapshot(engine)
    r = client.post("/v1/devices", json=_body(protocols=[7, 9]))
    assert r.status_code == 426
    detail = r.json()["detail"]
    assert "speaks protocol versions 1, 2, 3" in detail and "the device speaks 7, 9" in detail
    # a server that no longer speaks version 1, and a device of an earlier release (it names none)
    client.app.state.pfl.coordinator.enrolment.speaks = (2,)  # type: ignore[attr-defined]
    r = client.post("/v1/devices", json=_body())
    assert r.status_code == 426
    assert "speaks protocol versions 2; the device speaks 1 (it named none: an earlier release)" in r.json()["detail"]
    assert snapshot(engine) == before  # nothing kept
    for bad in ([], [0], [1001], ["2"], [1] * 17):
        assert client.post("/v1/devices", json=_body(protocols=bad)).status_code == 422, bad


def test_what_a_device_is_sent_is_read_tolerantly_and_what_it_sends_is_not() -> None:
    task = {"federation": "f", "round": 2, "algorithm": "fedper", "base": "a" * 64, "deadline": 1.8e9,
            "neighbours": [{"index": 1, "device_id": "dev-2", "digest": "b" * 64, "later": 1}], "final": False}
    got = Task.model_validate({**task, "added_in_version_3": {"x": 1}})
    assert got.round == 2 and "added_in_version_3" not in got.model_dump()
    assert "later" not in got.neighbours[0].model_dump()
    Enrolment.model_validate({"device_id": "dev-1", "token": "t", "index": 0, "federation": "f", "config": {},
                              "density": 1.0, "kp": 0, "broker_url": "mqtt://h:1883", "mqtt_username": "dev-1",
                              "mqtt_password": "p", "round": 0, "init_digest": "0" * 64, "expires": 1.8e9})
    with pytest.raises(ValueError, match="Extra inputs"):
        UpdateRequest.model_validate({"digest": "a" * 64, "n_samples": 1, "train_loss": 0.1, "extra": 1})
