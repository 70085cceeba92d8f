"""Issue 49: one sign-flipping device of five costs the honest FedPer devices at most 2 points of accuracy under the
default aggregation rule (the sample-weighted mean, each update held to 1x the low median of the round's other
updates' norms). The simulator applies the server's default rule (``CentralSimulation._bounded`` reads
``pfl_edge.aggregate.DEFAULT_RULE``; that the server and devices end with its models is tests/edge_runtime/
test_device_round.py's and tests/integration/test_federation.py's), so the accuracy is measured there, as
``bench/default_rule.py`` measured it (BENCHMARKS.md, "Issue 49: choosing a robust default rule"): its small
setting, 20 seeds, on one torch thread (``--threads 1``, bench/results/default_rule_threads1.json): 1.5 points
(standard error 1.9; seeds 0-9 alone 2.9, 10-19 0.1: one seed's cost ranges from -18 to +19 points, 32 test samples a
client). At the old default (3x) the same runs cost 15.9 points (-6 to +52 a seed), so the test fails there."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from pfl_edge.algorithms.central import CentralSimulation
from pfl_edge.errors import DivergedError
from pfl_edge.sim import SimConfig, simulate

# bench/default_rule.py's SMALL (bench/attackers.py's FedPer federation): 5 clients of 200 training samples, 6 rounds
SMALL: dict[str, Any] = dict(algorithm="fedper", dataset="fashion-mnist", partition="pathological:2", clients=5,
                             rounds=6, samples_per_client=200, test_per_client=32, local_epochs=1, batch_size=16,
                             lr=0.05, participation=1.0, workers=1)
SEEDS = range(20)  # the mean is the figure: one seed is noise (module docstring)
ATTACKER, HONEST = 4, 4  # client 4 hostile, clients 0-3 honest
BUDGET = 0.02  # issue 49: at most 2 points


def _honest_final(seed: int, attacked: bool, monkeypatch: pytest.MonkeyPatch) -> float:
    """The honest clients' mean final accuracy; ``attacked``: client 4 uploads ``start - 1000 x (trained - start)``
    (its step sign-flipped, x1000). Its claim of 2^31-1 samples would count for its dealt share (200, the server's
    ``counted_samples``), which is the weight the simulator already gives it."""
    orig = CentralSimulation._trained

    def trained(sim: CentralSimulation, t: int, participants: Tensor, losses: list[tuple[Tensor, Tensor]]
                ) -> Iterator[tuple[dict[str, Tensor], float]]:
        start = sim.base or {}
        for slot, (up, w) in zip(participants.tolist(), orig(sim, t, participants, losses), strict=True):
            if attacked and slot == ATTACKER:
                up = {k: start[k] - 1000.0 * (v - start[k]) for k, v in up.items()}
            yield up, w

    with monkeypatch.context() as m:
        m.setattr(CentralSimulation, "_trained", trained)
        try:
            res = simulate(SimConfig.from_dict({**SMALL, "seed": seed}), progress=False)
        except DivergedError as e:  # the old default (3x) let the attack drive the base to NaN (seed 0, round 4)
            pytest.fail(f"seed {seed}{' attacked' if attacked else ''}: the shared base diverged: {e}")
    return statistics.fmean(res["final"]["client_acc"][:HONEST])


@pytest.mark.slow
@pytest.mark.needs_fmnist
def test_one_sign_flipping_device_of_five_costs_the_honest_devices_at_most_two_points(
        monkeypatch: pytest.MonkeyPatch) -> None:
    threads = torch.get_num_threads()
    # the bench's thread count, and 40 runs of ~6 s (on 2 threads beside other work, OpenMP's spinning made each 2-3
    # min; float sums split over 2 threads round otherwise, and seeds 0-9 then cost 0.9 points on average, not 2.9)
    torch.set_num_threads(1)
    try:
        costs = [_honest_final(s, False, monkeypatch) - _honest_final(s, True, monkeypatch) for s in SEEDS]
    finally:
        torch.set_num_threads(threads)
    print("honest accuracy lost per seed:", [round(c, 3) for c in costs], "mean", statistics.fmean(costs))
    assert statistics.fmean(costs) <= BUDGET, costs
