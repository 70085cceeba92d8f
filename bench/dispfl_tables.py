"""DisPFL's tables 2-5 on the fixed round (issue 20, item 5): topologies, heterogeneous capacity, density, and
masks against label similarity, with the reference's optimiser and its client-wise Dir(0.3) split.

They replace issue 3's tables, which ran the old round (regrown weights averaged in as zeros), momentum 0.9 and
FedML's class-wise Dirichlet. One budget for every row: the cnn, 20 clients of 200 Fashion-MNIST training
samples, 2 local epochs, 50 rounds, SGD lr 0.1 x 0.998^round, momentum 0, weight decay 5e-4, gradient norm
clipped at 10 (the whole unmasked gradient), batch 128, alpha0 0.5, gradient regrowth; 10 random neighbours
unless the row says otherwise. Tables:
  2. topologies ring / random:10 / full, DisPFL and D-PSGD
  3. heterogeneous densities 0.2/0.4/0.6/0.8/1.0 (cycled over clients: 4 of each) against everyone at 0.2
  4. density sweep 0.2-0.8
  5. masks against label similarity: 20 clients in 4 groups with disjoint classes (groups:4), 5 neighbours

Each run is cached in OUT/runs (two workers of one thread each can split the rows: ``--rows``):

    OMP_NUM_THREADS=1 nohup .venv/bin/python bench/dispfl_tables.py --seeds 0,1 > bench/results/dispfl-tables/log.txt &

Beside the tables it writes ``masks.json``: the mean mask Hamming distance within and across label groups in
the mask study, and its correlation with the label distributions' cosine similarity, per seed.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
from repro import Row, Table, main

from pfl_edge.sim.report import plot_masks

BUDGET = dict(model="cnn", dataset="fashion-mnist", clients=20, samples_per_client=200, local_epochs=2, rounds=50,
              batch_size=128, lr=0.1, lr_decay=0.998, momentum=0.0, weight_decay=5e-4, clip_norm=10.0,
              topology="random:10", density=0.5, alpha0=0.5, regrow="gradient")
DIR = dict(partition="dirichlet-client:0.3")

TABLES = [
    Table("2", "Topologies, dirichlet-client:0.3, 20 clients", tuple(
        Row(f"{alg}-{name}", f"{label} {name}", dict(algorithm=alg, topology=topo, **DIR))
        for name, topo in (("ring", "ring"), ("random10", "random:10"), ("full", "full"))
        for alg, label in (("dispfl", "DisPFL"), ("dpsgd", "D-PSGD")))),
    Table("3", "Heterogeneous capacity vs everyone at the weakest density, dirichlet-client:0.3", (
        Row("dispfl-hetero", "DisPFL d=0.2/0.4/0.6/0.8/1.0",
            dict(algorithm="dispfl", densities=(0.2, 0.4, 0.6, 0.8, 1.0), **DIR)),
        Row("dispfl-d0.2", "DisPFL all d=0.2", dict(algorithm="dispfl", density=0.2, **DIR)),
    )),
    Table("4", "Density sweep, dirichlet-client:0.3", tuple(
        Row(f"dispfl-d{d}" if d != 0.5 else "dispfl-random10", f"DisPFL d={d}",
            dict(algorithm="dispfl", density=d, **DIR)) for d in (0.2, 0.4, 0.5, 0.6, 0.8))),
    Table("5", "Masks vs label similarity: 20 clients in 4 groups (groups:4), 5 random neighbours", (
        Row("dispfl-groups", "DisPFL d=0.5", dict(algorithm="dispfl", partition="groups:4", topology="random:5")),
    )),
]


def _groups(cos: np.ndarray) -> list[int]:
    """Each client's label group: clients whose label distributions overlap (cosine > 0) share one."""
    group = [-1] * len(cos)
    for i in range(len(cos)):
        if group[i] < 0:
            for j in range(len(cos)):
                if cos[i, j] > 0 and group[j] < 0:
                    group[j] = i
    return group


def mask_study(out: Path) -> None:
    """The mask study's figures per seed: mean Hamming distance within and across groups, and its correlation with
    label cosine similarity (the paper: masks of similar clients end closer)."""
    found: dict[str, Any] = {}
    for f in sorted((out / "runs").glob("dispfl-groups-s*.json")):
        res = json.loads(f.read_text())
        ham, cos = np.asarray(res["mask_analysis"]["hamming"]), np.asarray(res["mask_analysis"]["label_cosine"])
        g = _groups(cos)
        iu = np.triu_indices(len(ham), k=1)
        within = [ham[i, j] for i, j in zip(*iu, strict=True) if g[i] == g[j]]
        across = [ham[i, j] for i, j in zip(*iu, strict=True) if g[i] != g[j]]
        found[f.stem] = {"groups": len(set(g)), "hamming_within": statistics.fmean(within),
                         "hamming_across": statistics.fmean(across),
                         "corr_hamming_label_cosine": float(np.corrcoef(ham[iu], cos[iu])[0, 1])}
        plot_masks(res, out / f"masks-{f.stem}.png")
    (out / "masks.json").write_text(json.dumps(found, indent=1))
    print(json.dumps(found, indent=1))


if __name__ == "__main__":
    main(__doc__, TABLES, BUDGET, "dispfl-tables", mask_study)
