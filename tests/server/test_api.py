"""The HTTP API against a real app (FastAPI's TestClient runs its lifespan: database, blob store, MQTT link,
round worker), on SQLite and on PostgreSQL. Every refusal is checked to have changed nothing in the database."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from server_testkit import FEDPER, SECRET, Dev, bearer, create, fed_state, perturbed, sha, snapshot, wait_for, with_nan

from device_profiles import list_profiles
from pfl_edge.codec import encode
from pfl_edge.split import take
from server.app import create_app
from server.settings import Settings

ADMIN = "admin-token-for-tests"
LIMIT = 4 << 20


@pytest.fixture
def client(tmp_path: Path, database_url: str, broker_url: str) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path / "data", database_url=database_url, broker_url=broker_url,
                        admin_token=ADMIN, max_blob_bytes=LIMIT, tick_s=0.05)  # type: ignore[arg-type]
    with TestClient(create_app(settings)) as c:
        yield c


def engine(c: TestClient) -> Any:
    return c.app.state.pfl.engine  # type: ignore[attr-defined]


def blob_files(c: TestClient) -> list[str]:
    root = c.app.state.pfl.settings.resolved_blob_dir  # type: ignore[attr-defined]
    return sorted(p.name for p in Path(root).rglob("*") if p.is_file())


def refused(c: TestClient, call: Any, status: int, match: str = "") -> dict[str, Any]:
    """``call()`` is refused with ``status`` and a detail containing ``match``, and nothing changed."""
    before, files = snapshot(engine(c)), blob_files(c)
    r = call()
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    assert match in str(detail), detail
    assert snapshot(engine(c)) == before
    assert blob_files(c) == files
    return dict(r.json())


def test_openapi_lists_every_path_and_health(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    paths = set(spec["paths"])
    assert paths >= {"/healthz", "/v1/federations", "/v1/federations/{fed}", "/v1/federations/{fed}/metrics",
                     "/v1/federations/{fed}/devices", "/v1/devices", "/v1/blobs/{sha256}",
                     "/v1/rounds/{t}/updates", "/v1/rounds/{t}/metrics"}
    assert set(spec["paths"]["/v1/blobs/{sha256}"]) == {"get", "put"}
    schemas = spec["components"]["schemas"]
    for name in ("FederationCreate", "FederationInfo", "EnrolRequest", "Enrolment", "UpdateRequest",
                 "UpdateAccepted", "MetricsReport"):
        assert name in schemas
    assert "application/octet-stream" in spec["paths"]["/v1/blobs/{sha256}"]["put"]["requestBody"]["content"]
    h = client.get("/healthz").json()
    assert h["status"] == "ok" and h["database"] and h["mqtt"]


def test_federation_creation_needs_the_admin_token(client: TestClient) -> None:
    body = {"id": "f", "enrol_secret": SECRET, "config": FEDPER}
    refused(client, lambda: client.post("/v1/federations", json=body), 401, "admin token")
    refused(client, lambda: client.post("/v1/federations", json=body, headers=bearer("nope")), 401, "admin token")
    bad = {**body, "config": {**FEDPER, "algorithm": "fedprox"}}
    refused(client, lambda: client.post("/v1/federations", json=bad, headers=bearer(ADMIN)), 422, "valid algorithms")
    bad = {**body, "config": {**FEDPER, "algorithm": "dpsgd"}}
    refused(client, lambda: client.post("/v1/federations", json=bad, headers=bearer(ADMIN)), 422, "on devices")
    info = create(client, ADMIN, "f", FEDPER)
    assert (info["round"], info["state"], info["devices"]) == (0, "open", 0)
    refused(client, lambda: client.post("/v1/federations", json=body, headers=bearer(ADMIN)), 409, "already exists")


def test_enrolment(client: TestClient) -> None:
    create(client, ADMIN, "f", FEDPER)
    ok = {"federation": "f", "enrol_secret": SECRET, "profile": "phone-mid"}
    refused(client, lambda: client.post("/v1/devices", json={**ok, "enrol_secret": "wrong-secret"}), 403,
            "wrong enrol secret")
    # an unknown federation is refused as a wrong secret is (names cannot be enumerated)
    refused(client, lambda: client.post("/v1/devices", json={**ok, "federation": "nope"}), 403, "wrong enrol secret")
    d = refused(client, lambda: client.post("/v1/devices", json={**ok, "profile": "toaster"}), 422, "toaster")
    assert all(p in d["detail"] for p in list_profiles())
    refused(client, lambda: client.post("/v1/devices", json={**ok, "index": 3}), 422, "slots 0..2")

    a = Dev(client, "f", index=1)
    assert a.index == 1
    e = a.e
    # density 1: FedPer keeps no mask (as its card says)
    assert e["round"] == 0 and e["kp"] == 2 and e["density"] == 1.0 and e["broker_url"].startswith("mqtt://")
    assert e["config"]["clients"] == 3 and e["mqtt_username"] == a.id
    # FedPer's init is the device's base part only: nothing personal travels
    init = a.get(e["init_digest"])
    assert set(init.tensors) == set(a.fm.base_keys(2))
    b = Dev(client, "f", index=1)  # taken: the lowest free slot
    assert b.index == 0
    Dev(client, "f")
    # the third enrolment starts round 1
    wait_for(lambda: fed_state(client, ADMIN, "f") == (1, "collecting"), what="round 1")
    refused(client, lambda: client.post("/v1/devices", json=ok), 409, "full")
    # a device reads nothing of its peers (their names, profiles, traffic, accuracy): the listing is the admin's;
    # 403, not 401: a device reads 401 as an expired token and would enrol again (issue 50)
    for path in ("/v1/federations/f/devices", "/v1/federations/f/metrics"):
        r = client.get(path, headers=a.h)
        assert r.status_code == 403 and "the admin's" in r.json()["detail"], r.text
        assert client.get(path, headers={"Authorization": "Bearer not-a-token"}).status_code == 401
    devs = client.get("/v1/federations/f/devices", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert [d["index"] for d in devs] == [0, 1, 2]
    assert {d["profile"] for d in devs} == {"phone-mid"}


def test_enrolment_names_the_whole_initial_model(client: TestClient) -> None:
    """``init_model``: the federation's whole initial model, personal blocks included, which a device that cannot
    build the model (no torch) reads with its own token to initialise its personal blocks."""
    create(client, ADMIN, "f", FEDPER)
    a, b = Dev(client, "f"), Dev(client, "f")
    assert a.e["kp"] >= 1 and a.e["init_model"] != a.e["init_digest"]
    whole, base = a.get(a.e["init_model"]), a.get(a.e["init_digest"])
    assert set(whole.tensors) == set(a.fm.shapes) and set(base.tensors) < set(whole.tensors)
    assert whole.model_id == a.fm.model_id and whole.round == 0
    init = a.fm.init_state()
    assert all(torch.equal(v, init[k]) for k, v in whole.tensors.items())  # the seeded values, not personal yet
    assert b.e["init_model"] == a.e["init_model"]  # one blob for every device of the federation
    assert b.get(a.e["init_model"]).tensors.keys() == whole.tensors.keys()


def test_profile_capacity(client: TestClient) -> None:
    create(client, ADMIN, "p", {**FEDPER, "algorithm": "dispfl", "topology": "ring"}, profile_capacity=True)
    a = Dev(client, "p", profile="jetson-nano")
    assert a.e["density"] == 0.4 and a.e["kp"] == 0
    d = a.get(a.e["init_digest"])
    assert set(d.tensors) == set(a.fm.shapes)  # DisPFL: the dense init


def test_blobs(client: TestClient) -> None:
    create(client, ADMIN, "f", FEDPER)
    create(client, ADMIN, "g", FEDPER)
    a, b = Dev(client, "f"), Dev(client, "g")
    base = take(a.fm.init_state(), a.fm.base_keys(2))
    good = encode(perturbed(base, 1), model_id=a.fm.model_id, round=1)
    dg = sha(good)

    refused(client, lambda: client.put(f"/v1/blobs/{dg}", content=good), 401, "missing bearer token")
    refused(client, lambda: client.put(f"/v1/blobs/{dg}", content=good, headers=bearer("x" * 40)), 401, "unknown")
    refused(client, lambda: client.put(f"/v1/blobs/{sha(b'x')}", content=good, headers=a.h), 422, "sha256")
    refused(client, lambda: client.put("/v1/blobs/ABC", content=good, headers=a.h), 422, "sha256 digest")
    big = b"\0" * (LIMIT + 1)
    refused(client, lambda: client.put(f"/v1/blobs/{sha(big)}", content=big, headers=a.h), 413, "limit")
    junk = b"not a payload at all, certainly no pickle"
    refused(client, lambda: client.put(f"/v1/blobs/{sha(junk)}", content=junk, headers=a.h), 422, "not a pfl-edge")
    nan = with_nan(good)
    refused(client, lambda: client.put(f"/v1/blobs/{sha(nan)}", content=nan, headers=a.h), 422, "NaN")
    other = encode(base, model_id="resnet/10/3x32/deep0", round=1)
    refused(client, lambda: client.put(f"/v1/blobs/{sha(other)}", content=other, headers=a.h), 422, "model")
    shapes = {k: torch.zeros(3) for k in base}
    wrong = encode(shapes, model_id=a.fm.model_id, round=1)
    refused(client, lambda: client.put(f"/v1/blobs/{sha(wrong)}", content=wrong, headers=a.h), 422, "shape")

    r1 = client.put(f"/v1/blobs/{dg}", content=good, headers=a.h)
    assert r1.status_code == 201 and r1.json()["created"]
    before = snapshot(engine(client))
    r2 = client.put(f"/v1/blobs/{dg}", content=good, headers=a.h)  # idempotent
    assert r2.status_code == 200 and not r2.json()["created"]
    assert snapshot(engine(client)) == before
    assert client.get(f"/v1/blobs/{dg}", headers=a.h).content == good
    assert client.get(f"/v1/blobs/{dg}", headers=bearer(ADMIN)).content == good
    # another federation's blob is answered exactly as a blob that does not exist
    foreign = refused(client, lambda: client.get(f"/v1/blobs/{dg}", headers=b.h), 404, f"no blob {dg}")
    assert foreign == {"detail": f"no blob {dg}"}
    refused(client, lambda: client.get(f"/v1/blobs/{sha(b'none')}", headers=a.h), 404, "no blob")
    refused(client, lambda: client.get(f"/v1/blobs/{dg}"), 401, "bearer")
    # the same bytes from a device of another federation: now both may read them
    assert client.put(f"/v1/blobs/{dg}", content=good, headers=b.h).status_code == 201
    assert client.get(f"/v1/blobs/{dg}", headers=b.h).content == good
    refused(client, lambda: client.get("/v1/federations/f", headers=b.h), 403, "belongs to federation 'g'")


def test_updates_and_metrics(client: TestClient) -> None:
    create(client, ADMIN, "f", FEDPER)
    devs = [Dev(client, "f") for _ in range(3)]
    a = devs[0]
    wait_for(lambda: fed_state(client, ADMIN, "f") == (1, "collecting"), what="round 1")
    fm = a.fm
    init = fm.init_state()
    base = take(init, fm.base_keys(2))
    good = a.put(encode(perturbed(base, 1), model_id=fm.model_id, round=1))

    refused(client, lambda: a.update(2, good), 409, "federation is in round 1")
    refused(client, lambda: a.update(0, good), 409, "round 0 takes no updates")
    refused(client, lambda: client.post("/v1/rounds/1/updates", json={"digest": good, "n_samples": 5},
                                        headers=bearer("forged")), 401, "unknown")
    refused(client, lambda: devs[1].update(1, good), 422, "not uploaded by this device")
    personal = encode(perturbed(init, 2), model_id=fm.model_id, round=1)  # base + personal blocks: not even kept
    refused(client, lambda: client.put(f"/v1/blobs/{sha(personal)}", content=personal, headers=a.h), 422,
            "unexpected tensors ['fc2.0.bias'")
    partial = a.put(encode(dict(list(base.items())[:2]), model_id=fm.model_id, round=1))
    refused(client, lambda: a.update(1, partial), 422, "missing tensors")
    stale = a.put(encode(perturbed(base, 3), model_id=fm.model_id, round=0))
    refused(client, lambda: a.update(1, stale), 422, "header is for round 0")
    refused(client, lambda: client.post("/v1/rounds/1/updates", json={"digest": good, "n_samples": 0},
                                        headers=a.h), 422, "n_samples")

    r = a.update(1, good)
    assert r.status_code == 200 and r.json() == {"round": 1, "accepted": True, "updates": 1}
    before = snapshot(engine(client))
    r = a.update(1, good)  # a retry
    assert r.status_code == 200 and r.json() == {"round": 1, "accepted": False, "updates": 1}
    assert snapshot(engine(client)) == before
    other = a.put(encode(perturbed(base, 4), model_id=fm.model_id, round=1))
    refused(client, lambda: a.update(1, other), 409, "different update")

    m = {"accuracy": 0.5, "loss": 1.2, "n_test": 32}
    assert client.post("/v1/rounds/0/metrics", json=m, headers=a.h).status_code == 200
    assert client.post("/v1/rounds/0/metrics", json={**m, "accuracy": 0.75}, headers=a.h).status_code == 200
    refused(client, lambda: client.post("/v1/rounds/5/metrics", json=m, headers=a.h), 409, "rounds 0..1")
    refused(client, lambda: client.post("/v1/rounds/0/metrics", json={**m, "accuracy": 2}, headers=a.h), 422,
            "accuracy")
    got = client.get("/v1/federations/f/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    r0 = next(x for x in got["rounds"] if x["round"] == 0)
    assert r0["devices"][a.id]["accuracy"] == 0.75 and r0["mean_accuracy"] == 0.75
    r1 = next(x for x in got["rounds"] if x["round"] == 1)
    assert (r1["updates"], r1["active"], r1["state"]) == (1, 3, "collecting")


@pytest.mark.skipif(os.name != "posix", reason="posix paths")
def test_settings_from_toml_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from server.settings import ensure_admin_token, load_settings

    f = tmp_path / "server.toml"
    f.write_text(f'data_dir = "{tmp_path}"\nbroker_url = "mqtt://10.0.0.1:1883"\ntick_s = 2.5\n')
    monkeypatch.setenv("PFL_TICK_S", "0.5")
    s = load_settings(f)
    assert s.broker_url == "mqtt://10.0.0.1:1883" and s.tick_s == 0.5  # the environment wins over the file
    assert s.resolved_database_url == f"sqlite:///{tmp_path.resolve()}/state.db"
    assert s.resolved_blob_dir == tmp_path / "blobs"
    assert Settings(database_url="postgresql://u@h/db").resolved_database_url == "postgresql+psycopg://u@h/db"
    assert ensure_admin_token(s, announce=False).admin_token is not None
    with pytest.raises(ValueError, match="broker_url"):
        Settings(broker_url="amqp://x")


def test_enrolment_retried_with_its_nonce_gets_the_same_device(client: TestClient) -> None:
    create(client, ADMIN, "n", FEDPER)
    body = {"federation": "n", "enrol_secret": SECRET, "profile": "phone-mid", "nonce": "ab" * 16}
    first = client.post("/v1/devices", json=body)
    again = client.post("/v1/devices", json=body)  # the first answer was "lost": the device asks again
    assert first.status_code == again.status_code == 201
    a, b = first.json(), again.json()
    assert a["device_id"] == b["device_id"] and a["index"] == b["index"] and a["token"] != b["token"]
    # one device, holding only the newest token
    assert client.get("/v1/federations/n", headers={"Authorization": f"Bearer {b['token']}"}).status_code == 200
    assert len(client.get("/v1/federations/n/devices", headers={"Authorization": f"Bearer {ADMIN}"}).json()) == 1
    old = client.get("/v1/federations/n", headers={"Authorization": f"Bearer {a['token']}"})
    assert old.status_code == 401
    # a different nonce is a different device; a malformed nonce is refused
    assert client.post("/v1/devices", json={**body, "nonce": "cd" * 16}).json()["device_id"] != a["device_id"]
    assert client.post("/v1/devices", json={**body, "nonce": "not-hex"}).status_code == 422


def test_a_device_never_reads_another_devices_fedper_upload(client: TestClient) -> None:
    create(client, ADMIN, "priv", FEDPER)
    a, b = Dev(client, "priv", index=0), Dev(client, "priv", index=1)
    base = {k: v for k, v in a.fm.init_state().items() if k in set(a.fm.base_keys(2))}
    digest = a.put(encode(base | {k: v + 1 for k, v in list(base.items())[:1]}, model_id=a.fm.model_id, round=1))
    assert a.get(digest) is not None  # its own upload
    r = client.get(f"/v1/blobs/{digest}", headers=b.h)
    assert r.status_code == 403 and "another device's upload" in r.json()["detail"]
    assert b.get(b.e["init_digest"]) is not None  # what the server made is for everyone
    assert client.get(f"/v1/blobs/{digest}", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200


def test_refusals_carry_their_typed_status(client: TestClient) -> None:
    from http import HTTPStatus

    from server.errors import ApiError, Conflict, Forbidden, NotFound, TooLarge, Unauthorized, Unprocessable

    for cls, status in [(Unauthorized, 401), (Forbidden, 403), (NotFound, 404), (Conflict, 409), (TooLarge, 413),
                        (Unprocessable, 422)]:
        err = cls("why")
        assert isinstance(err, ApiError) and isinstance(err.status, HTTPStatus) and err.status == status
    r = client.get("/v1/federations/nope")  # no token: the auth dependency refuses before anything is looked up
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer" and set(r.json()) == {"detail"}
    r = client.get("/v1/federations/nope", headers=bearer(ADMIN))
    assert r.status_code == 404 and r.json() == {"detail": "unknown federation 'nope'"}
    assert "www-authenticate" not in r.headers


def test_a_sampled_federation_that_devices_cannot_run_is_refused_with_why(client: TestClient) -> None:
    """The server samples each round's devices as the simulator does; FedPer-FT, whose clients adapt to every
    round's base (sampled or not), cannot be run so on devices: refused, saying so, and nothing is created."""
    r = client.post("/v1/federations", headers=bearer(ADMIN),
                    json={"id": "sampled", "enrol_secret": SECRET,
                          "config": {**FEDPER, "algorithm": "fedper-ft", "participation": 0.5}})
    assert r.status_code == 422 and "fedper-ft adapts" in r.json()["detail"], r.text
    assert client.get("/v1/federations/sampled", headers=bearer(ADMIN)).status_code == 404
