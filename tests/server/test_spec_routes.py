"""``GET /v1/schemas`` and ``/v1/schemas/<Name>.json`` serve exactly docs/schemas, without a token; and every
message a whole FedPer federation exchanges (HTTP bodies both ways, every MQTT message a device receives or
publishes, the refusals it meets) validates against the schema the server serves for it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import pytest
from spec_capture import Exchange, run, serve

from pfl_edge import schemas
from server.launch import BackgroundServer

DOCS = Path(__file__).resolve().parents[2] / "docs" / "schemas"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    s = serve(tmp_path_factory.mktemp("spec"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def exchanges(srv: BackgroundServer) -> list[Exchange]:
    return run(srv)


def test_served_schemas_are_the_files(srv: BackgroundServer) -> None:
    c = httpx.Client(base_url=srv.url, timeout=30)
    idx = c.get("/v1/schemas")  # no token
    assert idx.status_code == 200
    listed = idx.json()["schemas"]
    assert [i["name"] for i in listed] == list(schemas.message_types())
    for item in listed:
        assert item["url"] == f"/v1/schemas/{item['name']}.json"
        r = c.get(item["url"])
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/schema+json")
        assert r.json() == json.loads((DOCS / f"{item['name']}.json").read_text())
    for unknown in ("Nope", "task", "ModelCard.json%00"):  # names are exact: case matters
        r = c.get(f"/v1/schemas/{unknown}.json")
        assert r.status_code == 404 and "no schema" in r.json()["detail"]
    assert c.get("/v1/schemas/..%2Fprotocol.json").status_code == 404  # no path leaves the list


def _served(srv: BackgroundServer) -> dict[str, Any]:
    c = httpx.Client(base_url=srv.url, timeout=30)
    return {n: jsonschema_rs.validator_for(c.get(f"/v1/schemas/{n}.json").json()) for n in schemas.message_types()}


def test_every_exchanged_message_satisfies_its_schema(srv: BackgroundServer, exchanges: list[Exchange]) -> None:
    v = _served(srv)
    checked: dict[str, int] = {}
    for x in exchanges:
        for name, body in ((x.request_schema, x.request), (x.response_schema, x.response)):
            if name is None:
                continue
            errors = [e.message for e in v[name].iter_errors(body)]
            assert not errors, f"{x.method} {x.path} ({x.step}): {name} invalid: {errors}"
            checked[name] = checked.get(name, 0) + 1
    # the whole sequence ran: enrolment, tasks (HTTP and MQTT), announcements, updates, metrics, errors
    assert {"EnrolRequest", "Enrolment", "Task", "RoundAnnouncement", "DeviceStatus", "BlobStored",
            "UpdateRequest", "UpdateAccepted", "MetricsReport", "MetricsStored", "FederationCreate",
            "FederationInfo", "BrokerInfo", "TokenIssued", "ErrorBody"} <= set(checked)
    statuses = sorted(x.status or 0 for x in exchanges if x.step == "error")
    assert statuses == [401, 404, 409, 422]
    finals = [x.response for x in exchanges if x.step == "task" and x.response["final"]]
    assert finals and all(t["round"] == 2 for t in finals)  # the final task is the last round's


def test_fedper_metrics_are_of_the_round_before(exchanges: list[Exchange]) -> None:
    """During round t a FedPer device reports round t - 1; at the final task (round T) it reports round T."""
    seen: list[tuple[int, bool, int]] = []  # (task round, final, metrics round)
    task: dict[str, Any] | None = None
    for x in exchanges:
        if x.step == "task":
            task = x.response
        elif x.step == "metrics" and task is not None:
            seen.append((task["round"], task["final"], int(x.path.split("/")[3])))
    assert sorted(set(seen)) == [(2, False, 1), (2, True, 2)]


def test_the_refused_messages_are_refused_by_the_schema_too(srv: BackgroundServer,
                                                             exchanges: list[Exchange]) -> None:
    v = _served(srv)
    bad = next(x for x in exchanges if x.step == "error" and x.status == 422)
    assert not v["UpdateRequest"].is_valid(bad.request)  # what the server refused, the schema refuses
    kinds = {tuple(i["loc"]) for i in bad.response["detail"]}
    assert kinds == {("body", "n_samples"), ("body", "extra")}


def test_the_api_docs_are_a_setting_off_in_the_shipped_compose_files(tmp_path: Path, broker_url: str) -> None:
    """/docs, /redoc, /openapi.json and /v1/schemas told strangers every route and message (issue 49): with
    ``api_docs`` off they are 404 (the device routes unchanged); on by default; off in both compose files."""
    import yaml
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    paths = ("/docs", "/redoc", "/openapi.json", "/v1/schemas", "/v1/schemas/Task.json")
    for docs in (True, False):
        s = Settings(data_dir=tmp_path / f"d{docs}", broker_url=broker_url, admin_token="admin-token-docs",  # type: ignore[arg-type]
                     tick_s=0.05, api_docs=docs)
        with TestClient(create_app(s)) as c:
            got = {p: c.get(p).status_code for p in paths}
            assert got == dict.fromkeys(paths, 200 if docs else 404), got
            assert c.get("/healthz").status_code == 200
            assert c.get("/v1/rounds/current/task").status_code == 401  # a device route: there, and guarded
    root = Path(__file__).resolve().parents[2]
    for name in ("compose.yaml", "compose.replicated.yaml"):
        doc = yaml.safe_load((root / name).read_text())
        envs = [svc.get("environment", {}) for svc in doc["services"].values()]
        servers = [e for e in envs if isinstance(e, dict) and "PFL_ADMIN_TOKEN" in e]
        assert servers and all(e.get("PFL_API_DOCS") == "false" for e in servers), name
