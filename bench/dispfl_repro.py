"""Reproduce, in kind, the DisPFL paper's main comparison on Fashion-MNIST with the fixed round bookkeeping
(docs/algorithms.md; issue 9): DisPFL against Local, FedAvg-FT, D-PSGD and D-PSGD-FT on the reference's two splits,
client-wise Dir(0.3) (``dirichlet-client:0.3``, equal client sizes) and pathological:2.

The reference's optimiser for every method: SGD lr 0.1 x 0.998^round, momentum 0, weight decay 5e-4, gradient
norm clipped at 10 (for DisPFL on the whole unmasked gradient, before the mask), batch 128; 10 random
neighbours per round (the same graphs for every decentralised method, from the seed), the centralised
baseline sampling 10 % of clients per round. The budget is smaller than the paper's (500 rounds, 5 local
epochs, 600 samples per client): 100 clients, at most 200 training samples each, 2 local epochs, and as many
rounds as fit in about two hours on the 2-core reference machine.

Rows run interleaved across the two tables (the first of each, then the second, ...), cached in OUT/runs:

    nohup .venv/bin/python bench/dispfl_repro.py > bench/results/dispfl-ref/log.txt 2>&1 &
"""

from __future__ import annotations

from repro import Row, Table, main

BUDGET = dict(model="cnn", dataset="fashion-mnist", clients=100, samples_per_client=200, local_epochs=2,
              rounds=50, batch_size=128, lr=0.1, lr_decay=0.998, momentum=0.0, weight_decay=5e-4, clip_norm=10.0,
              topology="random:10", density=0.5, alpha0=0.5, regrow="gradient")
CENTRAL = dict(participation=0.1)


def _rows(part: str, tag: str) -> tuple[Row, ...]:
    p = dict(partition=part)
    return (
        Row(f"dispfl-{tag}", "DisPFL (d=0.5)", dict(algorithm="dispfl", **p)),
        Row(f"dpsgd-{tag}", "D-PSGD", dict(algorithm="dpsgd", **p)),
        Row(f"dpsgd-ft-{tag}", "D-PSGD-FT", dict(algorithm="dpsgd-ft", **p)),
        Row(f"local-{tag}", "Local", dict(algorithm="local", **p)),
        Row(f"fedavg-ft-{tag}", "FedAvg-FT (10 %/round)", dict(algorithm="fedavg-ft", **p, **CENTRAL)),
    )


TABLES = [
    Table("1a", "DisPFL vs baselines, client-wise dirichlet:0.3, 100 clients", _rows("dirichlet-client:0.3", "dir")),
    Table("1b", "DisPFL vs baselines, pathological:2, 100 clients", _rows("pathological:2", "patho")),
]

if __name__ == "__main__":
    main(__doc__, TABLES, BUDGET, "dispfl-ref", interleave=True)
