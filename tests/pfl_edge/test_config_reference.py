"""docs/config.md is the config's types printed (``pfl_edge.config_reference``): a key, default, bound or meaning
changed on its field and not regenerated fails here; every key of the config and of its tables is on the page
with a meaning; and the bounds printed are the ones the config refuses outside of."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest

from pfl_edge.algorithms.algorithm import algorithm_class, list_algorithms
from pfl_edge.config_bounds import Range
from pfl_edge.config_reference import main, render
from pfl_edge.errors import ConfigError
from pfl_edge.federation import FederationConfig
from pfl_edge.privacy import PrivacyConfig, SecAggConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"
OPTIONS = sorted({algorithm_class(n).Options for n in list_algorithms()}, key=lambda c: c.__name__)
# each config dataclass, the prefix of its keys, and what else makes one valid
CLASSES: list[tuple[type, str, dict[str, Any]]] = [
    (FederationConfig, "", {}),
    (PrivacyConfig, "privacy.", {"clip": 1.0, "noise_multiplier": 1.0}),
    (SecAggConfig, "secure_aggregation.", {}),
    *((cls, "options.", {}) for cls in OPTIONS),
]


def test_the_page_is_the_config_types_printed() -> None:
    assert DOC.read_text() == render(), (
        "docs/config.md differs from the config's types (a field's type, default, metadata doc or Range changed): "
        "regenerate it with `.venv/bin/python -m pfl_edge.config_reference` and commit it")


def test_check_says_whether_the_page_is_current(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "config.md"
    assert main(["--out", str(out), "--check"]) == 1
    assert main(["--out", str(out)]) == 0 and out.read_text() == render()
    assert main(["--out", str(out), "--check"]) == 0
    assert "current" in capsys.readouterr().out


def test_every_key_is_on_the_page() -> None:
    text = DOC.read_text()
    keys = list(FederationConfig().to_dict())
    keys += [f"privacy.{f.name}" for f in dataclasses.fields(PrivacyConfig)]
    keys += [f"secure_aggregation.{f.name}" for f in dataclasses.fields(SecAggConfig)]
    keys += [f"options.{f.name}" for cls in OPTIONS for f in dataclasses.fields(cls)]
    assert len(keys) > 50
    missing = [k for k in keys if f"| `{k}` |" not in text]
    assert not missing, f"docs/config.md has no row for {missing}: regenerate it (python -m pfl_edge.config_reference)"


@pytest.mark.parametrize(("cls", "prefix"), [(c, p) for c, p, _ in CLASSES], ids=lambda x: getattr(x, "__name__", x))
def test_every_key_has_a_meaning_of_one_line(cls: type, prefix: str) -> None:
    for f in dataclasses.fields(cls):
        doc = f.metadata.get("doc")
        assert isinstance(doc, str) and doc.strip() and "\n" not in doc, (
            f"{prefix}{f.name}: give its field metadata=meta('its meaning in one line')")


def _outside(r: Range, integer: bool) -> list[float]:
    """Values just past either end of ``r`` (an integer key's: one past), and NaN."""
    def past(x: float, sign: int) -> float:
        return x + sign if integer else x + sign * max(1e-9, abs(x) * 1e-9)

    below = r.lo if r.lo_open else past(r.lo, -1)
    above = r.hi if r.hi_open else past(r.hi, 1)
    return [v for v in (below, above, float("nan")) if not (r.off and v == 0)]


@pytest.mark.parametrize(("cls", "prefix", "base"), CLASSES, ids=lambda x: getattr(x, "__name__", None))
def test_the_ranges_printed_are_the_ones_refused(cls: type, prefix: str, base: dict[str, Any]) -> None:
    """Every Range is enforced by the class that holds it: one definition, read by the check and the page."""
    cls(**base)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        r = f.metadata.get("range")
        if r is None:
            continue
        for v in _outside(r, int in (hints[f.name], *typing.get_args(hints[f.name]))):
            value = (v,) if f.name == "densities" else v
            with pytest.raises(ConfigError, match=f.name):
                cls(**{**base, f.name: value})
