"""FedRep (Collins et al., ICML 2021) beside FedPer on Fashion-MNIST, on the two label-skewed splits of the DisPFL
comparison: client-wise Dir(0.3) (``dirichlet-client:0.3``, equal client sizes) and pathological:2 (each client
two classes). The budget of the Ditto comparison (``bench/ditto_repro.py``): 20 clients of 300 training samples,
20 rounds of 1 local epoch, SGD lr 0.05 momentum 0.5, batch 32, K_P = 2, every client every round; 2 seeds.

FedRep trains the head alone first: for the paper's 10 epochs, and for 1 (closer to FedPer's compute); the
GFLOPs column counts a head epoch as a whole-model epoch (an upper bound: its backward stops at the head).

    nohup .venv/bin/python bench/fedrep_repro.py --seeds 0,1 > bench/results/fedrep/log.txt 2>&1 &
"""

from __future__ import annotations

from ditto_repro import BUDGET  # the same budget, defined once
from repro import Row, Table, main


def _rows(part: str, tag: str) -> tuple[Row, ...]:
    p = dict(partition=part)
    return (
        Row(f"fedrep10-{tag}", "FedRep (head 10 epochs)", dict(algorithm="fedrep", options={"head_epochs": 10}, **p)),
        Row(f"fedrep1-{tag}", "FedRep (head 1 epoch)", dict(algorithm="fedrep", options={"head_epochs": 1}, **p)),
        Row(f"fedper-{tag}", "FedPer (K_P=2)", dict(algorithm="fedper", **p)),
    )


TABLES = [
    Table("dir", "FedRep vs FedPer: client-wise dirichlet:0.3, 20 clients", _rows("dirichlet-client:0.3", "dir")),
    Table("patho", "FedRep vs FedPer: pathological:2, 20 clients", _rows("pathological:2", "patho")),
]

if __name__ == "__main__":
    main(__doc__, TABLES, BUDGET, "fedrep", interleave=True)
