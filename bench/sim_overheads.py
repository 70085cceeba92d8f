"""The simulator's per-client overheads that issue 19 removed, each side by side with what it replaced, in one run
(single thread): the streaming average's cost per cnn update (a float64 product tensor then a sum, against one
``add_`` with alpha), making the workers' shared result for 1,000 cnn clients (``share_memory_()`` against
``parallel._shared_empty``), and training 100 clients of 60 samples with the plain loop against the batched vmap
engine. Writes ``bench/results/sim_overheads.json``.

    .venv/bin/python bench/sim_overheads.py

``--rule-cost`` (issue 49) measures instead what the default aggregation rule costs the simulator: a round whose
bounds clip any update is trained twice (``CentralSimulation._bounded``'s second pass, held to the bounds), and at
the default multiple of 1 nearly every round clips. The FedPer reproduction's setting (``bench/default_rule.py``'s
LARGE: 10 clients of 1,000 samples, 2 local epochs) cut to ``--rounds``, at ``norm_multiple`` 3 (the default
before) and 1 (now) alternately, A B B A; each run's wall time and the rounds it trained twice. Writes
``bench/results/sim_overheads_rule.json``.

    .venv/bin/python bench/sim_overheads.py --rule-cost [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from pfl_edge.aggregate import PartialAverage
from pfl_edge.models import get_model
from pfl_edge.parallel import _shared_empty
from pfl_edge.seeding import generator
from pfl_edge.train import ClientTensors, TrainConfig, train

OUT = Path(__file__).resolve().parent / "results" / "sim_overheads.json"
RULE_OUT = OUT.with_name("sim_overheads_rule.json")


def _average(model_state: dict[str, torch.Tensor], n: int) -> dict[str, float]:
    ups = [{k: torch.randn_like(v) for k, v in model_state.items()} for _ in range(n)]
    t = time.perf_counter()
    acc: dict[str, torch.Tensor] = {}
    for u in ups:  # what PartialAverage.add did before: a product tensor per update, then the sum
        for k, v in u.items():
            c = v.to(torch.float64) * 60.0
            acc[k] = acc[k] + c if k in acc else c
    before = (time.perf_counter() - t) / n
    t = time.perf_counter()
    avg = PartialAverage()
    for u in ups:
        avg.add(u, 60.0)
    after = (time.perf_counter() - t) / n
    return {"before_ms_per_update": 1e3 * before, "after_ms_per_update": 1e3 * after}


def _shared(model_state: dict[str, torch.Tensor], clients: int) -> dict[str, float]:
    t = time.perf_counter()
    a = {k: torch.empty((clients, *v.shape)).share_memory_() for k, v in model_state.items()}
    before = time.perf_counter() - t
    del a
    t = time.perf_counter()
    b = {k: _shared_empty(torch.Size((clients, *v.shape)), v.dtype) for k, v in model_state.items()}
    after = time.perf_counter() - t
    del b
    return {"share_memory_s": before, "made_shared_s": after}


def _engines(model: torch.nn.Module, clients: int, samples: int) -> dict[str, float]:
    x = torch.randn(clients * samples, 1, 28, 28)
    y = torch.randint(0, 10, (clients * samples,))
    idx = [torch.arange(i * samples, (i + 1) * samples) for i in range(clients)]
    data = ClientTensors.build(x, idx, [y[i] for i in idx])
    stack = {k: v.unsqueeze(0).expand(clients, *v.shape) for k, v in model.state_dict().items()}
    cfg = TrainConfig(epochs=1, batch_size=32, lr=0.01, momentum=0.9)
    rows = torch.arange(clients)
    out = {}
    for engine in ("loop", "vmap", "loop", "vmap"):  # the second of each counts (the first warms up)
        t = time.perf_counter()
        train(model, stack, data, rows, cfg, [generator(0, "x", i) for i in range(clients)], engine=engine)  # type: ignore[arg-type]
        out[f"{engine}_ms_per_client"] = 1e3 * (time.perf_counter() - t) / clients
    return out


def _rule_cost(rounds: int) -> dict[str, object]:
    """Each run: the simulator at ``norm_multiple`` m (``DEFAULT_RULE`` set, as bench/default_rule.py sets it),
    its wall time, and per round how many times it trained (2: a bound clipped an update)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from default_rule import LARGE

    import pfl_edge.aggregate as aggregate
    from pfl_edge.aggregate import AggregationRule
    from pfl_edge.algorithms.central import CentralSimulation
    from pfl_edge.sim import SimConfig, simulate

    passes: dict[int, int] = {}
    orig = CentralSimulation._trained

    def trained(sim, t, participants, losses):  # type: ignore[no-untyped-def]
        passes[t] = passes.get(t, 0) + 1
        return orig(sim, t, participants, losses)

    CentralSimulation._trained = trained  # type: ignore[method-assign]
    torch.set_num_threads(1)  # on 2 threads beside other work OpenMP's spinning slowed runs 10-20x
    runs = []
    try:
        for m in (3.0, 1.0, 1.0, 3.0):
            aggregate.DEFAULT_RULE = AggregationRule(norm_multiple=m)
            passes.clear()
            load = os.getloadavg()[0]
            t = time.perf_counter()
            res = simulate(SimConfig.from_dict({**LARGE, "rounds": rounds, "seed": 0}), progress=False)
            wall = time.perf_counter() - t
            runs.append({"norm_multiple": m, "wall_s": wall, "passes_per_round": [passes[r] for r in sorted(passes)],
                         "final_acc": sum(res["final"]["client_acc"]) / len(res["final"]["client_acc"]),
                         "load_average_start": load})
            print(json.dumps(runs[-1]), flush=True)
    finally:
        CentralSimulation._trained = orig  # type: ignore[method-assign]
        aggregate.DEFAULT_RULE = AggregationRule()
    mean = {m: sum(r["wall_s"] for r in runs if r["norm_multiple"] == m) / 2 for m in (3.0, 1.0)}
    return {"setting": {**LARGE, "rounds": rounds, "seed": 0}, "runs": runs, "mean_wall_s": mean,
            "wall_nm1_over_nm3": mean[1.0] / mean[3.0], "torch_threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rule-cost", action="store_true", help="the default rule's second pass (issue 49) instead")
    ap.add_argument("--rounds", type=int, default=3, help="--rule-cost: rounds of each run")
    args = ap.parse_args()
    if args.rule_cost:
        res = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "load_average_start": os.getloadavg(),
               "rule_cost": _rule_cost(args.rounds), "load_average_end": os.getloadavg()}
        RULE_OUT.parent.mkdir(parents=True, exist_ok=True)
        RULE_OUT.write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = get_model("cnn", num_classes=10, in_channels=1)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    load = os.getloadavg()
    res = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "load_average_start": load,
           "average_200_updates": _average(state, 200), "shared_result_1000_clients": _shared(state, 1000),
           "train_100_clients_of_60": _engines(model, 100, 60), "load_average_end": os.getloadavg()}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
