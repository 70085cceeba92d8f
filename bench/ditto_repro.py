"""Ditto (Li et al., ICML 2021) beside FedPer, FedAvg-FT and Local on Fashion-MNIST, on the two label-skewed
splits of the DisPFL comparison: client-wise Dir(0.3) (``dirichlet-client:0.3``, equal client sizes) and
pathological:2 (each client two classes). Every method gets the same budget: 20 clients of 300 training samples,
20 rounds of 1 local epoch (Ditto's personal model 1 more epoch, FedAvg-FT's fine-tuning 1 epoch, both counted in
its FLOPs), SGD lr 0.05 momentum 0.5, batch 32, every client every round; 2 seeds.

Ditto's lam is the paper's grid's middle for FMNIST-like tasks (0.1), plus lam = 1 (a stronger pull), so that
the table shows how much of Ditto is its regulariser.

    nohup .venv/bin/python bench/ditto_repro.py --seeds 0,1 > bench/results/ditto/log.txt 2>&1 &
"""

from __future__ import annotations

from repro import Row, Table, main

BUDGET = dict(model="cnn", dataset="fashion-mnist", clients=20, samples_per_client=300, local_epochs=1,
              rounds=20, batch_size=32, lr=0.05, momentum=0.5, ft_epochs=1, kp=2)


def _rows(part: str, tag: str) -> tuple[Row, ...]:
    p = dict(partition=part)
    return (
        Row(f"ditto-{tag}", "Ditto (lam=0.1)", dict(algorithm="ditto", options={"lam": 0.1}, **p)),
        Row(f"ditto1-{tag}", "Ditto (lam=1)", dict(algorithm="ditto", options={"lam": 1.0}, **p)),
        Row(f"fedper-{tag}", "FedPer (K_P=2)", dict(algorithm="fedper", **p)),
        Row(f"fedavg-ft-{tag}", "FedAvg-FT", dict(algorithm="fedavg-ft", **p)),
        Row(f"local-{tag}", "Local", dict(algorithm="local", **p)),
    )


TABLES = [
    Table("dir", "Ditto vs FedPer, FedAvg-FT, Local: client-wise dirichlet:0.3, 20 clients",
          _rows("dirichlet-client:0.3", "dir")),
    Table("patho", "Ditto vs FedPer, FedAvg-FT, Local: pathological:2, 20 clients", _rows("pathological:2", "patho")),
]

if __name__ == "__main__":
    main(__doc__, TABLES, BUDGET, "ditto", interleave=True)
