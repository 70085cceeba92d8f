"""The protocol's JSON Schemas (pfl_edge.schemas): the committed docs/schemas are what the models make now, each
is a valid draft 2020-12 schema that says what every field is, accepts the messages the models accept and
refuses what they refuse (an extra field, NaN, a round out of range, a malformed digest)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
from pydantic import BaseModel, ValidationError

from pfl_edge import protocol as P
from pfl_edge import schemas

DOCS = Path(__file__).resolve().parents[2] / "docs" / "schemas"
D1, D2 = "a" * 64, "0123456789abcdef" * 4

# one valid message of each kind, as a device or the server sends it
GOOD: dict[str, dict[str, Any]] = {
    "FederationCreate": {"id": "f1", "enrol_secret": "1234567890123456",
                         "config": {"algorithm": "fedper", "clients": 2},
                         "aggregation": {"rule": "trimmed-mean", "trim": 0.1}},
    "FederationInfo": {"id": "f1", "config": {"clients": 2}, "round": 3, "state": "collecting", "devices": 2,
                       "quorum": 1.0, "deadline_s": 600.0, "profile_capacity": False},
    "AggregationSettings": {"rule": "median", "max_update_norm": 5.0},
    "EnrolRequest": {"federation": "f1", "enrol_secret": "12345678", "profile": "phone-mid", "nonce": "ab" * 16,
                     "platform": {"machine": "aarch64", "os": "Linux 6.6", "language": "python 3.11.2",
                                  "runtime": "onnxruntime 1.22.1", "threads": 4}},
    "Platform": {"machine": "arm64", "os": "Darwin 24.1", "language": "node 20.19.2",
                 "runtime": "onnxruntime-node 1.31.1", "threads": 1, "cpus": 8},
    "Enrolment": {"device_id": "dev-1", "token": "t", "index": 0, "federation": "f1", "config": {"kp": 2},
                  "density": 0.5, "kp": 2, "broker_url": "mqtt://h:1883", "mqtt_username": "dev-1",
                  "mqtt_password": "p", "round": 0, "init_digest": D1},
    "TokenIssued": {"device_id": "dev-1", "token": "t", "expires": 1.8e9},
    "KeyProof": {"counter": 3, "signature": "ab" * 64},
    "TokenRotation": {"proof": {"counter": 4, "signature": "cd" * 64}},
    "BrokerInfo": {"broker_url": "mqtts://h:8883"},
    "Task": {"federation": "f1", "round": 2, "algorithm": "dispfl", "base": None, "deadline": 1.8e9,
             "neighbours": [{"index": 1, "device_id": "dev-2", "digest": D2}], "final": False},
    "Neighbour": {"index": 1, "device_id": "dev-2", "digest": D2},
    "RoundAnnouncement": {"federation": "f1", "round": 2, "state": "finished", "base": D1, "deadline": None},
    "DeviceStatus": {"device_id": "dev-1", "state": "offline"},
    "BlobStored": {"digest": D1, "size": 10, "created": True},
    "UpdateRequest": {"digest": D1, "n_samples": 48, "train_loss": 0.5, "train_s": 1.5, "bytes_down": 100},
    "UpdateAccepted": {"round": 2, "accepted": False, "updates": 1},
    "MetricsReport": {"accuracy": 0.9, "loss": 0.3, "n_test": 32, "step_ms": 4.5},
    "MetricsStored": {"round": 1, "device_id": "dev-1"},
    "ErrorBody": {"detail": [{"loc": ["body", "n_samples"], "msg": "too small", "type": "greater_than_equal"}]},
    "ValidationIssue": {"loc": ["path", "t"], "msg": "m", "type": "t"},
    "SecAggStep": {"round": 2, "step": "unmask", "deadline": 1.8e9,
                   "params": {"degree": 2, "threshold": 2, "size": 10},
                   "neighbours": [{"index": 1, "c_public": "ab" * 32, "s_public": "cd" * 32}],
                   "inbox": [{"index": 1, "box": "ef" * 168, "commits": "0a" * 64}], "survivors": [0, 1],
                   "dropped": [2]},
    "SecAggParams": {"degree": 4, "threshold": 3, "size": 1},
    "SecAggNeighbour": {"index": 0, "c_public": "00" * 32, "s_public": "ff" * 32},
    "SecAggSealed": {"index": 3, "box": "01" * 168, "commits": "0b" * 64},
    "SecAggKeys": {"c_public": "ab" * 32, "s_public": "cd" * 32},
    "SecAggShares": {"shares": [{"index": 3, "box": "01" * 168, "commits": "0c" * 64}]},
    "SecAggShare": {"about": 1, "kind": "s", "share": "02" * 66},
    "SecAggUnmask": {"shares": [{"about": 1, "kind": "b", "share": "02" * 66}]},
    "SecAggComplaint": {"c_secret": "0d" * 32, "accused": [2, 5]},
}

# (message, change) pairs that both pydantic and the schema must refuse
BAD: list[tuple[str, dict[str, Any]]] = [
    ("UpdateRequest", {"personal": {"w": 1}}),  # an extra field
    ("KeyProof", {"counter": 0}),  # counters start at 1 and grow
    ("KeyProof", {"counter": 2**53}),  # past what every JSON reader holds exactly
    ("KeyProof", {"signature": "ab" * 63}),  # an Ed25519 signature is 64 bytes
    ("TokenRotation", {"proof": {"counter": 1}}),  # a proof without its signature
    ("FederationCreate", {"enrol_secret": "x" * 15}),  # a new federation's secret is 16 characters or more
    ("SecAggKeys", {"c_public": "AB" * 32}),  # upper-case hex
    ("SecAggSealed", {"box": "01" * 167}),  # a sealed pair is 168 bytes exactly
    ("SecAggSealed", {"commits": "0b" * 63}),  # two 32-byte commitments
    ("SecAggComplaint", {"accused": []}),  # a complaint accuses someone
    ("SecAggShare", {"kind": "both"}),
    ("SecAggStep", {"step": "closing"}),
    ("UpdateRequest", {"digest": "A" * 64}),  # upper-case hex
    ("UpdateRequest", {"digest": "../../etc/passwd"}),
    ("UpdateRequest", {"n_samples": 0}),
    ("UpdateRequest", {"train_loss": math.nan}),
    ("UpdateRequest", {"train_loss": math.inf}),
    ("MetricsReport", {"loss": math.nan}),
    ("MetricsReport", {"loss": -math.inf}),
    ("MetricsReport", {"accuracy": math.nan}),
    ("MetricsReport", {"accuracy": 1.5}),
    ("Task", {"round": P.MAX_ROUND + 1}),
    ("Task", {"round": -1}),
    ("Task", {"round": 1.5}),
    ("Task", {"base": "xyz"}),
    ("Task", {"deadline": math.nan}),
    ("RoundAnnouncement", {"state": "paused"}),
    ("RoundAnnouncement", {"round": P.MAX_ROUND + 1}),
    ("DeviceStatus", {"state": "busy"}),
    ("DeviceStatus", {"device_id": "a/b"}),
    ("EnrolRequest", {"nonce": "xyz"}),
    ("EnrolRequest", {"index": P.MAX_CLIENTS}),
    ("Platform", {"machine": "x86 64"}),
    ("Platform", {"os": "Linux\n6.6"}),
    ("Platform", {"threads": 0}),
    ("Platform", {"threads": "2"}),
    ("FederationCreate", {"config": {f"k{i}": i for i in range(65)}}),  # over 64 keys
    ("FederationCreate", {"config": {"bad key": 1}}),
    ("FederationCreate", {"quorum": 0}),
    ("Enrolment", {"density": 0}),
    ("Neighbour", {"digest": D1[:-1]}),
    ("UpdateAccepted", {"updates": -1}),
    ("BlobStored", {"size": -1}),
    ("TokenIssued", {"expires": math.inf}),
    ("ErrorBody", {"detail": 3}),
]


def _validator(name: str) -> Any:
    return jsonschema_rs.validator_for(json.loads((DOCS / f"{name}.json").read_text()))


def _model(name: str) -> type[BaseModel]:
    return schemas.message_types()[name]


def test_the_committed_schemas_are_the_generated_ones() -> None:
    made = {f"{n}.json": schemas.dumps(s) for n, s in schemas.schemas().items()}
    made["index.json"] = schemas.dumps(schemas.index())
    on_disk = {p.name: p.read_text(encoding="utf-8") for p in DOCS.glob("*.json")}
    assert set(on_disk) == set(made), "run: python -m pfl_edge.schemas --out docs/schemas"
    for name, text in made.items():
        assert on_disk[name] == text, f"docs/schemas/{name} is stale: run python -m pfl_edge.schemas"


def test_every_message_has_a_schema() -> None:
    names = set(schemas.message_types())
    assert {"Task", "RoundAnnouncement", "Enrolment", "UpdateRequest", "MetricsReport", "TokenIssued",
            "ErrorBody", "DeviceStatus", "BrokerInfo", "BlobStored", "MetricsStored"} <= names
    models = {n for n in P.__all__ if isinstance(getattr(P, n), type) and issubclass(getattr(P, n), BaseModel)}
    assert models <= names  # every message the protocol module defines
    assert set(GOOD) == {m.__name__ for m in schemas.MESSAGES}


@pytest.mark.parametrize("name", sorted(schemas.message_types()))
def test_each_schema_is_valid_and_described(name: str) -> None:
    doc = json.loads((DOCS / f"{name}.json").read_text())
    jsonschema_rs.meta.validate(doc)  # against the draft 2020-12 meta-schema
    assert doc["$schema"] == schemas.DIALECT and doc["$id"] == f"{name}.json" and doc["title"] == name
    if _model(name) in schemas.MESSAGES:
        # what a device sends is refused with an unknown field; what it is sent, a device reads tolerantly
        tolerant = _model(name).model_config.get("extra") == "ignore"
        assert doc["description"] and (doc.get("additionalProperties", True) is False) == (not tolerant)
        for field, prop in doc["properties"].items():
            assert prop.get("description"), f"{name}.{field} has no description"


@pytest.mark.parametrize("name", sorted(GOOD))
def test_good_messages_validate(name: str) -> None:
    msg = _model(name).model_validate(GOOD[name])  # what pydantic accepts ...
    assert _validator(name).is_valid(msg.model_dump(mode="json"))  # ... as it is sent
    assert _validator(name).is_valid(GOOD[name])  # and as written, defaults left out


@pytest.mark.parametrize(("name", "change"), BAD, ids=[f"{n}-{next(iter(c))}" for n, c in BAD])
def test_bad_messages_are_refused_by_both(name: str, change: dict[str, Any]) -> None:
    bad = {**GOOD[name], **change}
    with pytest.raises(ValidationError):
        _model(name).model_validate(bad)
    assert not _validator(name).is_valid(bad)


def test_the_schema_states_the_bounds_the_model_enforces() -> None:
    task = json.loads((DOCS / "Task.json").read_text())["properties"]
    assert task["round"]["maximum"] == P.MAX_ROUND and task["round"]["minimum"] == 0
    loss = json.loads((DOCS / "MetricsReport.json").read_text())["properties"]["loss"]
    assert loss["maximum"] == 1.7976931348623157e308  # finite: NaN and Infinity fail it
    ann = json.loads((DOCS / "RoundAnnouncement.json").read_text())["properties"]
    assert "whole model" in ann["base"]["description"] and "Task.base" in ann["base"]["description"]


def test_write_replaces_only_its_own_files(tmp_path: Path) -> None:
    keep = tmp_path / "notes.json"
    keep.write_text("{}")
    schemas.write(tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    (tmp_path / "Gone.json").write_text("{}")  # a message an earlier index listed, removed since
    index["schemas"].append({"name": "Gone", "url": "Gone.json"})
    (tmp_path / "index.json").write_text(json.dumps(index))
    schemas.write(tmp_path)
    assert keep.exists() and not (tmp_path / "Gone.json").exists() and (tmp_path / "Task.json").exists()
    assert schemas.main(["--out", str(tmp_path)]) == 0


def _doc_examples() -> list[tuple[str, Any]]:
    """Every JSON block of docs/protocol.md marked ``<!-- schema: Name -->``, with that name."""
    text = (DOCS.parent / "protocol.md").read_text()
    found = re.findall(r"<!-- schema: (\w+) -->\n```json\n(.*?)\n```", text, flags=re.S)
    return [(name, json.loads(body)) for name, body in found]


def test_the_protocol_doc_examples_satisfy_their_schemas() -> None:
    examples = _doc_examples()
    names = {n for n, _ in examples}
    assert {"EnrolRequest", "Enrolment", "Task", "RoundAnnouncement", "DeviceStatus", "BlobStored", "UpdateRequest",
            "UpdateAccepted", "MetricsReport", "MetricsStored", "FederationInfo", "TokenIssued", "ErrorBody"} <= names
    for name, body in examples:
        errors = [e.message for e in _validator(name).iter_errors(body)]
        assert not errors, f"docs/protocol.md: a {name} example is invalid: {errors}"
        _model(name).model_validate(body)  # and the server's models take it
    finals = [b for n, b in examples if n == "Task" and b["final"]]
    metrics_paths = re.findall(r"`POST /v1/rounds/(\d+)/metrics`", (DOCS.parent / "protocol.md").read_text())
    assert finals and str(finals[0]["round"]) in metrics_paths  # the final task's metrics: its own round
