"""The protocol module: messages refuse what they do not define, and docs/protocol.md describes all of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pfl_edge import protocol as P

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def test_messages_refuse_unknown_fields_and_bad_digests() -> None:
    d = "a" * 64
    assert P.UpdateRequest(digest=d, n_samples=3).digest == d
    with pytest.raises(ValidationError):
        P.UpdateRequest(digest=d, n_samples=3, personal={"w": 1})  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        P.UpdateRequest(digest="A" * 64, n_samples=3)
    with pytest.raises(ValidationError):
        P.UpdateRequest(digest=d, n_samples=0)
    with pytest.raises(ValidationError):
        P.Task(federation="f", round=1, algorithm="fedper", base="../../etc/passwd", deadline=0.0)
    with pytest.raises(ValidationError):
        P.FederationCreate(id="bad id/slash", enrol_secret="12345678", config={})
    with pytest.raises(ValidationError):
        P.MetricsReport(accuracy=1.5, loss=0.1, n_test=1)


def test_topics() -> None:
    assert P.round_topic("f") == "pfl/f/round"
    assert P.task_topic("f", "d") == "pfl/f/device/d/task"
    assert P.status_topic("f", "d") == "pfl/f/device/d/status"


def test_the_doc_names_every_message_and_topic() -> None:
    text = DOC.read_text()
    for name in P.__all__:
        obj = getattr(P, name)
        if isinstance(obj, type) and issubclass(obj, P.BaseModel):
            assert f"**{name}**" in text, f"docs/protocol.md does not describe {name}"
            for field in obj.model_fields:
                assert f"`{field}`" in text, f"docs/protocol.md does not mention {name}.{field}"
    for topic in ("pfl/<fed>/round", "pfl/<fed>/device/<dev>/task", "pfl/<fed>/device/<dev>/status"):
        assert topic in text


def test_the_captured_configs_hold_every_config_key() -> None:
    """The exchange captured in docs/protocol.md shows the config exactly as the server echoes it: every
    FederationConfig key (options included), in the dataclass's order."""
    import dataclasses
    import json
    import re

    from pfl_edge.federation import FederationConfig

    keys = [f.name for f in dataclasses.fields(FederationConfig)]
    configs = re.findall(r'^  "config": (\{.*\}),$', DOC.read_text(), flags=re.M)
    assert len(configs) >= 2  # the Enrolment's and the FederationInfo's
    for c in configs:
        assert list(json.loads(c)) == keys
