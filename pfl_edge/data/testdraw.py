"""How each client's test set is drawn from the test split, in proportion to its training label counts
(``pfl_edge.data.partition``'s ``test_draw``): ``draw_disjoint`` (no sample in two clients) and ``draw_shared``
(the DisPFL reference's: each client on its own, samples shared)."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["draw_disjoint", "draw_shared"]


def draw_shared(yte: np.ndarray, counts: np.ndarray, per: int, rng: np.random.Generator) -> list[np.ndarray]:
    """The DisPFL reference's draw (its ``load_partition_data_cifar10``): for each client, for each class c it
    trains on, ``ceil(n_c / n x per)`` distinct test samples of class c from a fresh permutation of the class's
    whole pool (every pool as the test split holds it: samples are shared between clients, never repeated
    within one; a class smaller than the ask gives all it has)."""
    pools = [np.flatnonzero(yte == c) for c in range(counts.shape[1])]
    out = []
    for row in counts:
        total = row.sum()
        got = [pools[c][rng.permutation(len(pools[c]))[:math.ceil(row[c] / total * per)]]
               for c in range(len(row)) if row[c]]
        out.append(np.sort(np.concatenate(got)) if got else np.zeros(0, np.int64))
    return out


def draw_disjoint(yte: np.ndarray, counts: np.ndarray, per: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Each client's test indices in proportion to its train label counts; a class asked for more often than
    the test split holds is scaled down for every client that asks, so no test sample is used twice."""
    n_clients, n_classes = counts.shape
    want = np.zeros_like(counts)
    for i in range(n_clients):
        exact = per * counts[i] / counts[i].sum()
        w = np.floor(exact).astype(np.int64)
        rest = per - w.sum()  # largest remainders get the rest
        w[np.argsort(-(exact - w), kind="stable")[:rest]] += 1
        want[i] = w
    out: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    for c in range(n_classes):
        pool = rng.permutation(np.flatnonzero(yte == c))
        demand = want[:, c]
        if demand.sum() > len(pool):
            demand = np.floor(demand * len(pool) / demand.sum()).astype(np.int64)
        ends = np.cumsum(demand)
        for i in range(n_clients):
            out[i].append(pool[ends[i] - demand[i]: ends[i]])
    return [np.sort(np.concatenate(o)) for o in out]
