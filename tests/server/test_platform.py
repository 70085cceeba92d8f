"""A device says what it is at enrolment (issue 47 item 4): its architecture, OS, language, training runtime and
threads. The server keeps it as reported, shows it in the devices listing beside the declared profile, and flags
what disagrees: an architecture that is not its profile's, a mean step time far from the other devices of its
profile. A hostile description is refused before anything is kept; a device that says nothing (an earlier
release) still enrols. Against a real app (TestClient), on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_testkit import FEDPER, SECRET, Dev, create, fed_state, snapshot, wait_for

from pfl_edge.device_key import enrol_message, public_of, sign
from server.app import create_app
from server.services.metrics import STEP_RATIO, median_without, platform_flags
from server.settings import Settings

ADMIN = "admin-token-for-platform-tests"
PI = {"machine": "aarch64", "os": "Linux 6.6.51+rpt-rpi-v8", "language": "python 3.11.2",
      "runtime": "onnxruntime 1.22.1", "threads": 4, "cpus": 4}


@pytest.fixture
def client(tmp_path: Path, database_url: str, broker_url: str) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path / "data", database_url=database_url, broker_url=broker_url,
                        admin_token=ADMIN, tick_s=0.05)  # type: ignore[arg-type]
    with TestClient(create_app(settings)) as c:
        yield c


def listing(c: TestClient) -> dict[int, dict[str, Any]]:
    r = c.get("/v1/federations/f/devices", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    return {d["index"]: d for d in r.json()}


@pytest.mark.parametrize("bad", [
    {"machine": "aarch64; rm -rf /"},  # not an architecture's name
    {"os": "Linux\x1b[31m"},  # a terminal escape, for whoever reads the table
    {"language": "x" * 65},
    {"runtime": ""},
    {"threads": 0},
    {"threads": "4"},  # strict: a JSON integer
    {"cpus": 10**6},
    {"gpu": "H100"},  # an unknown field
])
def test_a_hostile_platform_is_refused_and_nothing_kept(client: TestClient, bad: dict[str, Any]) -> None:
    create(client, ADMIN, "f", FEDPER)
    engine = client.app.state.pfl.engine  # type: ignore[attr-defined]
    before = snapshot(engine)
    r = client.post("/v1/devices", json={"federation": "f", "enrol_secret": SECRET, "profile": "raspberry-pi-4",
                                         "platform": {**PI, **bad}})
    assert r.status_code == 422, r.text
    assert "platform" in r.text
    assert snapshot(engine) == before


def test_the_listing_shows_what_each_device_says_and_flags_what_disagrees(client: TestClient) -> None:
    create(client, ADMIN, "f", FEDPER)
    pi = Dev(client, "f", "raspberry-pi-4", index=0, platform=PI)
    pc = Dev(client, "f", "raspberry-pi-4", index=1, platform={**PI, "machine": "x86_64", "runtime": "torch 2.13.0"},
             nonce="a" * 32)
    old = Dev(client, "f", "raspberry-pi-4", index=2)  # an earlier release: says nothing
    wait_for(lambda: fed_state(client, ADMIN, "f") == (1, "collecting"), what="round 1")
    devs = listing(client)
    assert devs[0]["platform"] == PI and devs[0]["flags"] == []
    assert devs[1]["platform"]["machine"] == "x86_64"
    assert devs[1]["flags"] == ["reports a x86_64 machine; profile raspberry-pi-4 is aarch64"]
    assert devs[2]["platform"] is None and devs[2]["flags"] == []
    # step times: the PC runs 10x the class's others; with two peers at 40 and 44 ms only it is flagged
    for dev, ms in ((pi, 40.0), (pc, 4.2), (old, 44.0)):
        r = client.post("/v1/rounds/0/metrics", json={"accuracy": 0.5, "loss": 1.0, "n_test": 32, "step_ms": ms},
                        headers=dev.h)
        assert r.status_code == 200, r.text
    devs = listing(client)
    assert devs[0]["flags"] == [] and devs[2]["flags"] == []
    assert devs[1]["step_ms"] == pytest.approx(4.2)
    assert devs[1]["flags"][1] == "steps take 4.2 ms, 0.1x the 42.0 ms of the other 2 raspberry-pi-4 device(s)"
    # the device enrolling again with its nonce (its token chain ended; upgraded since) replaces what it said
    assert pc.key is not None
    public = public_of(pc.key)  # signed by its key, as the device enrols again
    again = {"federation": "f", "enrol_secret": SECRET, "profile": "raspberry-pi-4", "nonce": "a" * 32,
             "platform": {**PI, "runtime": "onnxruntime 1.23.0"}, "public_key": public,
             "proof": {"counter": 2, "signature": sign(pc.key, enrol_message("f", "a" * 32, public, 2))}}
    r = client.post("/v1/devices", json=again)
    assert r.status_code == 201 and r.json()["device_id"] == pc.id, r.text
    assert listing(client)[1]["platform"]["runtime"] == "onnxruntime 1.23.0"


def test_architecture_names_of_one_machine_agree() -> None:
    """Node's arm64 and x64 are the OS's aarch64 and x86_64; a phone's profile says arm64-v8a (Android's ABI)."""
    for machine, profile, flagged in (("arm64", "raspberry-pi-4", False), ("aarch64", "jetson-nano", False),
                                      ("arm64", "phone-mid", False), ("x64", "raspberry-pi-4", True),
                                      ("AMD64", "phone-mid", True)):
        row = {"profile": profile, "platform": {"machine": machine}, "step_ms": None}
        assert bool(platform_flags(row, [])) == flagged, (machine, profile)


def test_step_flags_need_a_class_and_a_factor_of_three() -> None:
    assert median_without([5.0], 5.0) is None  # alone in its class: nothing to compare with
    row = {"profile": "phone-mid", "platform": None, "step_ms": 30.0}
    assert platform_flags(row, sorted([30.0, 10.0 * 1.01])) == []  # 2.97x: within STEP_RATIO
    assert len(platform_flags(row, sorted([30.0, 30.0 / STEP_RATIO - 0.1]))) == 1
    assert median_without([1.0, 2.0, 3.0, 10.0], 10.0) == 2.0 and median_without([1.0, 2.0, 3.0, 10.0], 1.0) == 3.0
