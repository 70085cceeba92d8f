"""Issue 50: the model card is versioned like every answer. A device of protocol version 1 gets the card the
previous release's schema accepts (no field it does not know: FedRep's `training.fedrep` is left off, and so are
the null `mask_schedule` and `ditto` that a card of the card's first releases refused); a device of version 2 gets
every field and reads a card tolerantly (an added field is ignored), while an unknown *value* is still refused."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pydantic import ValidationError
from server_testkit import DISPFL, FEDPER

from pfl_edge.modelcard import ModelCard, build_card, card_wire
from server.fedmodel import fed_model

ROOT = Path(__file__).resolve().parents[2]
PREVIOUS = "93074b31c0b28c1a4c24a842eb5f9bae1de0ef7f"  # tests/integration/old_release.py, PREVIOUS_RELEASE
CONFIGS: dict[str, dict[str, Any]] = {
    "fedper": FEDPER,
    "fedrep": dict(FEDPER, algorithm="fedrep", options={"head_epochs": 3}),
    "ditto": dict(FEDPER, algorithm="ditto", kp=0, options={"lam": 0.5}),
    "dispfl": DISPFL,
}


def _card(name: str) -> ModelCard:
    fm = fed_model(CONFIGS[name])
    kp = 2 if name in ("fedper", "fedrep") else 0
    return build_card(federation="f", cfg=fm.cfg, spec=fm.spec, model=fm.model, profile="phone-mid", kp=kp,
                      density=0.5, base_keys=fm.base_keys(kp), programs=[])


def _previous_schema() -> dict[str, Any]:
    got = subprocess.run(["git", "show", f"{PREVIOUS}:docs/schemas/ModelCard.json"], cwd=ROOT, capture_output=True)
    if got.returncode != 0:
        pytest.skip(f"no git history of the previous release here ({got.stderr.decode()[:100]})")
    return dict(json.loads(got.stdout))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_version_1_device_gets_a_card_the_previous_releases_schema_accepts(name: str) -> None:
    card = _card(name)
    old, new = card_wire(card, 1), card_wire(card, 2)
    jsonschema.validate(old, _previous_schema())  # its bundled schema: additionalProperties false everywhere
    with pytest.raises(jsonschema.ValidationError, match="'fedrep' was unexpected"):
        jsonschema.validate(new, _previous_schema())  # version 2's card carries a field it does not know
    assert "fedrep" not in old["training"]
    assert {k: v for k, v in new["training"].items() if k != "fedrep"} == {
        **old["training"], **{k: new["training"][k] for k in ("mask_schedule", "ditto")}}
    assert {k: v for k, v in new.items() if k != "training"} == {k: v for k, v in old.items() if k != "training"}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_version_2_device_gets_every_field_and_the_current_schema_accepts_it(name: str) -> None:
    wire = card_wire(_card(name), 2)
    jsonschema.validate(wire, json.loads((ROOT / "docs/schemas/ModelCard.json").read_text()))
    tr = wire["training"]
    assert tr["fedrep"] == ({"head_epochs": 3} if name == "fedrep" else None)
    assert tr["ditto"] == ({"lam": 0.5, "personal_epochs": FEDPER["local_epochs"]} if name == "ditto" else None)
    assert (tr["mask_schedule"] is None) == (name != "dispfl")
    assert wire["density"] == (0.5 if name == "dispfl" else 1.0)  # only a mask trains below 1


def test_a_card_is_read_tolerantly_of_fields_but_not_of_values() -> None:
    wire = card_wire(_card("dispfl"), 2)
    grown = json.loads(json.dumps(wire))
    grown["added_later"] = {"x": 1}
    grown["training"]["added_later"] = 2
    grown["layers"][0]["added_later"] = [3]
    grown["tensors"][0]["added_later"] = "4"
    assert ModelCard.model_validate(grown) == ModelCard.model_validate(wire)
    schema = json.loads((ROOT / "docs/schemas/ModelCard.json").read_text())
    jsonschema.validate(grown, schema)  # a device that bundled this release's schemas accepts it too
    for path, value in ((("format",), "pfl-edge-model-card/2"), (("layers", 0, "type"), "softmax2"),
                        (("tensors", 0, "dtype"), "f16"), (("training", "momentum_reset"), "never")):
        bad = json.loads(json.dumps(wire))
        node = bad
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        with pytest.raises(ValidationError):
            ModelCard.model_validate(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)

