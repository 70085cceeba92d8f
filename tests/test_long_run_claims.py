"""The long run's rankings (bench/dispfl_long.py, issue 37) read from every seed: each margin is DisPFL's accuracy
minus the baseline's as each deploys it (a -FT baseline's fine-tuned value in the round it fine-tunes), per seed,
with its mean, spread and verdict. Checked on hand-made runs whose margins are worked out here."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def long_run() -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("dispfl_long")


def _write(out: Path, name: str, seed: int, acc: list[float]) -> None:
    rounds = [{"round": t, "mean_acc": x, "client_acc": [x, x], "train_loss": 0.1} for t, x in enumerate(acc, 1)]
    (out / "runs" / f"{name}-s{seed}.json").write_text(json.dumps({"config": {"seed": seed}, "rounds": rounds}))


@pytest.mark.parametrize(("margins", "verdict"), [
    ([0.02, 0.015], "holds"),
    ([-0.02, -0.03], "reversed"),
    ([0.018, -0.001], "tie"),  # the mean (0.85 points) is within a point though one seed is past it
    ([0.03, -0.005], "seeds disagree"),  # the mean (1.25 points) is past a point but one seed is below zero
    ([0.011, 0.009], "tie"),  # one seed under a point: not both past it, the mean within it
])
def test_a_verdict_needs_every_seed_past_a_point(long_run: ModuleType, margins: list[float], verdict: str) -> None:
    assert long_run._verdict(margins) == verdict


def test_claims_read_each_seed_and_the_fine_tuned_round(long_run: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    rounds = long_run.ROUNDS
    for seed in (0, 1):
        _write(tmp_path, "dispfl-patho", seed, [0.90 + 0.01 * seed] * rounds)
        _write(tmp_path, "local-patho", seed, [0.88] * rounds)
        # FedAvg's global model until its one fine-tune in the last round (ft_every = 0)
        _write(tmp_path, "fedavg-ft-patho", seed, [0.80] * (rounds - 1) + [0.905])
    part, tag = "pathological-random:2", "patho"
    curves = {part: {s: long_run._curves(tmp_path, part, tag, s) for s in long_run._seeds(tmp_path)}}
    found = long_run.claims(curves, {part: tag}, tmp_path)[part]

    dispfl, local, fedavg = (r.label for r in long_run._rows(part, tag)[:3])
    assert dispfl not in found and set(found) == {local, fedavg}

    at = found[local]["dispfl_minus_baseline"]
    assert at["300"]["per_seed"] == {"0": pytest.approx(0.02), "1": pytest.approx(0.03)}
    assert at["300"]["mean"] == pytest.approx(0.025) and at["300"]["spread"] == pytest.approx(0.01)
    assert at["300"]["verdict"] == at["251-300"]["verdict"] == "holds"
    assert found[local]["rounds_dispfl_above_per_seed"] == {"0": rounds, "1": rounds}

    at = found[fedavg]["dispfl_minus_baseline"]
    # in round 300 the fine-tuned value counts (0.905): -0.5 and +0.5 points, a tie; before it FedAvg's model
    assert at["300"]["per_seed"] == {"0": pytest.approx(-0.005), "1": pytest.approx(0.005)}
    assert at["300"]["verdict"] == "tie"
    assert at["100"]["per_seed"] == {"0": pytest.approx(0.10), "1": pytest.approx(0.11)}
    assert at["100"]["verdict"] == "holds"
    assert "251-300" not in at  # a -FT baseline deploys two kinds of model there: no mean of them is a claim
    assert found[fedavg]["rounds_dispfl_above_per_seed"] == {"0": rounds - 1, "1": rounds - 1}

    md = (tmp_path / "claims.md").read_text()
    assert f"| {local} | " in md and "+2.5 [+2.0, +3.0] holds" in md
    assert json.loads((tmp_path / "claims.json").read_text())[part][local]["seeds"] == [0, 1]
