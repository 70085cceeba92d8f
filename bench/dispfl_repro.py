"""Reproduce, in kind, the DisPFL paper's findings on Fashion-MNIST (ALGORITHMS.md; issue 3).

One budget for every method: the cnn, 100 clients (20 for the mask study), at most 200 training samples per
client, 2 local epochs, 20 rounds, batch 32, SGD lr 0.03 x 0.998^round, momentum 0.9, weight decay 5e-4, gradient
norm clipped at 10, 10 random neighbours; the centralised baselines sample 10 % of clients per round, as in the
paper. Tables:
  1. DisPFL (density 0.5) vs local, FedAvg, FedAvg-FT, D-PSGD, D-PSGD-FT on dirichlet:0.3 and pathological:2
  2. topologies ring / random:10 / full for DisPFL and D-PSGD (dirichlet:0.3)
  3. heterogeneous densities 0.2/0.4/0.6/0.8/1.0 against everyone at 0.2 (dirichlet:0.3)
  4. density sweep 0.2-0.8 (dirichlet:0.3)
  5. masks against label similarity: 20 clients in 4 groups with disjoint classes (groups:4)

Runs are cached in OUT/runs (add seeds later); OUT/summary.{json,md} and PNGs come from whatever exists:

    nohup .venv/bin/python bench/dispfl_repro.py > bench/results/dispfl/log.txt 2>&1 &
"""

from __future__ import annotations

import json
from pathlib import Path

from repro import Row, Table, main

from pfl_edge.sim.report import plot_masks

BUDGET = dict(model="cnn", dataset="fashion-mnist", clients=100, samples_per_client=200, local_epochs=2,
              rounds=20, batch_size=32, lr=0.03, lr_decay=0.998, momentum=0.9, weight_decay=5e-4, clip_norm=10.0,
              topology="random:10", density=0.5, alpha0=0.5, regrow="gradient")
DIR = dict(partition="dirichlet:0.3")
CENTRAL = dict(participation=0.1)


def _baselines(part: str, tag: str) -> tuple[Row, ...]:
    p = dict(partition=part)
    return (
        Row(f"dispfl-{tag}", "DisPFL (d=0.5)", dict(algorithm="dispfl", **p)),
        Row(f"local-{tag}", "Local", dict(algorithm="local", **p)),
        Row(f"fedavg-{tag}", "FedAvg (10 %/round)", dict(algorithm="fedavg", **p, **CENTRAL)),
        Row(f"fedavg-ft-{tag}", "FedAvg-FT (10 %/round)", dict(algorithm="fedavg-ft", **p, **CENTRAL)),
        Row(f"dpsgd-{tag}", "D-PSGD", dict(algorithm="dpsgd", **p)),
        Row(f"dpsgd-ft-{tag}", "D-PSGD-FT", dict(algorithm="dpsgd-ft", **p)),
    )


TABLES = [
    Table("1a", "DisPFL vs baselines, dirichlet:0.3, 100 clients", _baselines("dirichlet:0.3", "dir")),
    Table("3", "Heterogeneous capacity vs everyone at the weakest density, dirichlet:0.3", (
        Row("dispfl-hetero-dir", "DisPFL d=0.2/0.4/0.6/0.8/1.0",
            dict(algorithm="dispfl", densities=(0.2, 0.4, 0.6, 0.8, 1.0), **DIR)),
        Row("dispfl-d0.2-dir", "DisPFL all d=0.2", dict(algorithm="dispfl", density=0.2, **DIR)),
    )),
    Table("4", "Density sweep, dirichlet:0.3", tuple(
        Row(f"dispfl-d{d}-dir" if d != 0.5 else "dispfl-dir", f"DisPFL d={d}",
            dict(algorithm="dispfl", density=d, **DIR)) for d in (0.2, 0.4, 0.5, 0.6, 0.8))),
    Table("5", "Masks vs label similarity: 20 clients in 4 groups (groups:4), 5 random neighbours", (
        Row("dispfl-groups", "DisPFL d=0.5", dict(algorithm="dispfl", partition="groups:4", clients=20,
                                                 topology="random:5")),
    )),
    Table("2", "Topologies, dirichlet:0.3", tuple(
        Row(f"{alg}-{name}-dir" if name != "random" else f"{alg}-dir", f"{label} {name}",
            dict(algorithm=alg, topology=topo, **DIR))
        for name, topo in (("ring", "ring"), ("random", "random:10"), ("full", "full"))
        for alg, label in (("dispfl", "DisPFL"), ("dpsgd", "D-PSGD")))),
    Table("1b", "DisPFL vs baselines, pathological:2, 100 clients", _baselines("pathological:2", "patho")),
]


def _plot_mask_study(out: Path) -> None:
    groups = out / "runs" / "dispfl-groups-s0.json"
    if groups.exists():
        plot_masks(json.loads(groups.read_text()), out / "masks.png")


if __name__ == "__main__":
    main(__doc__, TABLES, BUDGET, "dispfl", after=_plot_mask_study)
