"""What the agent says it is at enrolment (issue 47 item 4), and its enrolment with a server of an earlier release,
which refuses the ``platform`` field it does not know: the agent enrols again without it, and only then."""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from edge_runtime.config import AgentConfig
from edge_runtime.enrol import enrol
from edge_runtime.http import ServerError
from edge_runtime.state import StateDir
from edge_runtime.whoami import describe
from pfl_edge.protocol import EnrolRequest, Platform


@pytest.mark.parametrize("backend,package", [("onnxruntime", "onnxruntime"), ("torch", "torch")])
def test_it_says_this_machine_and_its_runtimes_version(backend: str, package: str) -> None:
    p = describe(backend, 3)
    assert p.machine == platform.machine() and p.threads == 3
    assert p.runtime == f"{backend} {metadata.version(package)}"
    assert p.language == f"python {platform.python_version()}"
    Platform.model_validate(p.model_dump())  # what the server's schema takes


def test_an_unknown_runtime_or_absurd_threads_still_make_a_valid_report() -> None:
    p = describe("no-such-runtime", 10**6)
    assert p.runtime == "no-such-runtime ?" and p.threads == 1024


class _Http:
    """A server that refuses what ``refuse`` says, once, then enrols; it records every body it was sent."""

    def __init__(self, refuse: ServerError | None) -> None:
        self.refuse, self.bodies = refuse, []  # type: ignore[var-annotated]

    def call(self, method: str, path: str, *, json_body: Any) -> Any:
        self.bodies.append(json_body() if callable(json_body) else json_body)  # a signed body: made per attempt
        if self.refuse is not None:
            e, self.refuse = self.refuse, None
            raise e
        answer = {"device_id": "dev-1", "token": "t", "index": 0, "federation": "f", "config": {}, "density": 1.0,
                  "kp": 1, "broker_url": "mqtt://h:1883", "mqtt_username": "dev-1", "mqtt_password": "p",
                  "round": 0, "init_digest": "0" * 64}

        class R:
            def json(self) -> dict[str, Any]:
                return answer

        return R()


def _cfg(tmp_path: Path) -> AgentConfig:
    return AgentConfig(server="http://h", federation="f", enrol_secret="s" * 12, profile="raspberry-pi-4",
                       state_dir=str(tmp_path))


def test_an_earlier_server_that_refuses_the_field_gets_the_request_without_it(tmp_path: Path) -> None:
    old = ServerError("POST /v1/devices: 422 body.platform: Extra inputs are not permitted", 422)
    http = _Http(old)
    enr = enrol(StateDir(tmp_path, arrays="numpy"), http, _cfg(tmp_path), describe("onnxruntime", 1))  # type: ignore[arg-type]
    assert enr.device_id == "dev-1"
    assert "platform" in http.bodies[0] and "platform" not in http.bodies[1]
    newer = ("platform", "public_key", "proof", "protocols")  # an earlier server knows none: all left out
    assert {k: v for k, v in http.bodies[0].items() if k not in newer} == http.bodies[1]  # the same nonce
    EnrolRequest.model_validate(http.bodies[0])


@pytest.mark.parametrize("refusal", [
    ServerError("POST /v1/devices: 422 index: slots 0..2", 422),  # another 422: not the field
    ServerError("POST /v1/devices: 403 wrong enrol secret (platform)", 403),
])
def test_any_other_refusal_is_the_devices_to_see(tmp_path: Path, refusal: ServerError) -> None:
    http = _Http(refusal)
    with pytest.raises(ServerError):
        enrol(StateDir(tmp_path, arrays="numpy"), http, _cfg(tmp_path), describe("onnxruntime", 1))  # type: ignore[arg-type]
    assert len(http.bodies) == 1


def test_a_device_that_says_nothing_sends_an_earlier_releases_request(tmp_path: Path) -> None:
    http = _Http(None)
    enrol(StateDir(tmp_path, arrays="numpy"), http, _cfg(tmp_path))  # type: ignore[arg-type]
    assert set(http.bodies[0]) == set(EnrolRequest.model_fields) - {"platform"}  # its key and proof: all it adds
