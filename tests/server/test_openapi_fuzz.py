"""Schema-driven fuzzing of the HTTP API (schemathesis, from the app's own OpenAPI): every operation, with data
that fits the schema and data that does not, sent with no token, a device's and the admin's. The server must
never answer 5xx, and what it answers must fit the schema (body and content type of documented statuses).

Short here (``PFL_FUZZ_EXAMPLES`` examples per operation, mode and caller; 6 by default); ``bench/fuzz.py`` runs
it for minutes. Requests go through one started app (lifespan, database, broker), not schemathesis' own ASGI
client, which would start the app for each request."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import content_type_conformance, not_a_server_error, response_schema_conformance
from server_testkit import FEDPER, Dev, bearer, create

from server.app import create_app
from server.settings import Settings

ADMIN = "admin-token-for-fuzzing"
EXAMPLES = int(os.environ.get("PFL_FUZZ_EXAMPLES", "6"))
Callers = dict[str, dict[str, str]]  # caller -> its headers
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]
_TRANSPORT_KEYS = ("method", "url", "headers", "params", "json")  # the API reads no cookies

SCHEMA = schemathesis.openapi.from_dict(create_app(Settings(admin_token=ADMIN)).openapi())  # type: ignore[arg-type]
OPERATIONS = {op.label: op for op in (r.ok() for r in SCHEMA.get_all_operations())}  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory, broker_url: str) -> Iterator[tuple[TestClient, Callers]]:
    """One app for the whole module, with a federation and an enrolled device; the callers' headers."""
    tmp = tmp_path_factory.mktemp("fuzz")
    settings = Settings(data_dir=tmp / "data", database_url=f"sqlite:///{tmp / 'state.db'}", broker_url=broker_url,
                        admin_token=ADMIN, max_blob_bytes=4 << 20, tick_s=0.05)  # type: ignore[arg-type]
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        create(c, ADMIN, "f", FEDPER)
        dev = Dev(c, "f")
        yield c, {"none": {}, "device": dev.h, "admin": bearer(ADMIN)}


def _send(c: TestClient, case: Any, headers: dict[str, str]) -> Any:
    kw = case.as_transport_kwargs(base_url="http://testserver", headers=headers)
    body = kw.get("data")
    args = {k: kw[k] for k in _TRANSPORT_KEYS if k in kw}
    if body is not None:
        args["content"] = body if isinstance(body, bytes) else str(body).encode()
    return c.request(**args)


@pytest.mark.parametrize("caller", ["none", "device", "admin"])
@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_no_operation_answers_5xx_or_off_schema(api: tuple[TestClient, Callers], label: str,
                                               caller: str) -> None:
    c, callers = api
    op = OPERATIONS[label]
    strategy = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case: Any) -> None:
        headers = callers[caller]
        response = _send(c, case, headers)
        assert response.status_code < 500, f"{label} as {caller}: {response.status_code} {response.text[:500]}"
        case.validate_response(response, checks=CHECKS, headers=headers)

    run()


def test_every_operation_is_fuzzed() -> None:
    paths = {label.split(" ", 1)[1] for label in OPERATIONS}
    assert {"/healthz", "/v1/federations", "/v1/devices", "/v1/blobs/{sha256}", "/v1/rounds/{t}/updates",
            "/v1/rounds/{t}/metrics"} <= paths
    assert Path(__file__).name == "test_openapi_fuzz.py"  # bench/fuzz.py runs this file by name
