"""Reproduce, in kind, the FedPer paper's findings on Fashion-MNIST (docs/algorithms.md; issue 2).

One budget for every method: the cnn, 1,000 training samples per client, 2 local epochs, 30 rounds, batch 32,
SGD lr 0.01 momentum 0.9, all clients every round. Tables:
  1. pathological:4 / :8 / :10, 10 clients: FedAvg vs FedPer (K_P = 2)
  2. the preference task (stands in for FLICKR-AES), 30 clients: FedAvg, FedPer, local
  3. pathological:4, 10 clients: K_P = 0..4, local, the linear base, FedPer-FT

Every run is cached in OUT/runs/NAME-sSEED.json (add seeds later with --seeds 1,2); OUT/summary.{json,md} and
a PNG per table are made from whatever runs exist. In the background:

    nohup .venv/bin/python bench/fedper_repro.py --seeds 0 > bench/results/fedper/log.txt 2>&1 &
"""

from __future__ import annotations

from repro import Row, Table, main

BUDGET = dict(model="cnn", dataset="fashion-mnist", samples_per_client=1000, local_epochs=2, rounds=30,
              batch_size=32, lr=0.01, momentum=0.9, participation=1.0)
P4 = dict(partition="pathological:4", clients=10)

TABLES = [
    Table("1", "FedAvg vs FedPer (K_P=2) as classes per client k grow; 10 clients", tuple(
        Row(f"{alg}-patho{k}", f"{alg} k={k}", dict(algorithm=alg, partition=f"pathological:{k}", clients=10, kp=2))
        for k in (4, 8, 10) for alg in ("fedavg", "fedper"))),
    Table("2", "Preference task (user-dependent labels; stands in for FLICKR-AES); 30 clients", tuple(
        Row(f"{alg}-pref", alg, dict(algorithm=alg, partition="preference", clients=30, kp=2))
        for alg in ("fedavg", "fedper", "local"))),
    Table("3", "K_P sweep and controls; pathological:4, 10 clients", (
        Row("fedavg-patho4", "K_P=0 (FedAvg)", dict(algorithm="fedavg", **P4)),
        *(Row(f"fedper-kp{kp}-patho4" if kp != 2 else "fedper-patho4", f"K_P={kp}",
              dict(algorithm="fedper", kp=kp, **P4)) for kp in (1, 2, 3, 4)),
        Row("local-patho4", "local", dict(algorithm="local", **P4)),
        Row("fedper-linear-patho4", "linear base, K_P=2", dict(algorithm="fedper", kp=2, base="linear", **P4)),
        Row("fedper-ft-patho4", "FedPer-FT, K_P=2", dict(algorithm="fedper-ft", kp=2, **P4)),
    )),
]


if __name__ == "__main__":
    main(__doc__, TABLES, BUDGET, "fedper")
