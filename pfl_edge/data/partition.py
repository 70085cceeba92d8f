"""Partitioners: how a data set's train split is dealt out to clients, and how each client's test set is drawn.

Specs are ``name`` or ``name:ARG``: ``iid``, ``pathological:K``, ``dirichlet:ALPHA`` (class-wise, FedML's),
``pathological-random:K`` (K random classes per client, the DisPFL reference's ``n_cls``),
``dirichlet-client:ALPHA`` (client-wise with equal sizes, the DisPFL reference's), ``groups:G``, ``preference`` (or
``preference:P``, the probability that a user re-draws a class's rating; 0.1 by default). Register a new one with
``@register_partitioner``.

Every client's test set follows the label distribution of its training set and is drawn from the test split, in
one of two ways (``test_draw``): ``disjoint`` gives each test sample to one client at most (a class asked for more
often than the split holds is scaled down for everyone who asks); ``shared`` draws each client's test set on its
own from the whole split, as the DisPFL reference does (``ceil(share_c x per)`` samples of each class c, images
shared between clients), the default for the reference's splits (``pathological-random``, ``dirichlet-client``).
No training sample goes to two clients, except ``pathological-random``'s where a class runs out (the reference
deals it again).

The deal is numpy's (``partition_arrays``, no torch needed); ``partition`` is the same deal with the indices and
labels as tensors sharing its arrays' memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from ..errors import ConfigError, DataError, UnknownNameError
from .testdraw import draw_disjoint, draw_shared

if TYPE_CHECKING:  # torch is imported where a tensor is made: pfl_edge.data imports without it
    from torch import Tensor

__all__ = [
    "TEST_DRAWS",
    "ClientData",
    "ClientIndices",
    "Partition",
    "PartitionArrays",
    "PartitionerFn",
    "default_test_draw",
    "list_partitioners",
    "partition",
    "partition_arrays",
    "register_partitioner",
]

NUM_RATINGS = 5  # the preference task's ratings
TEST_DRAWS = ("disjoint", "shared")
# the DisPFL reference's splits: their test sets are drawn as the reference draws them, unless a config says
_SHARED_BY_DEFAULT = ("pathological-random", "dirichlet-client")


def default_test_draw(spec: str) -> str:
    """How a partition ``spec``'s test sets are drawn when the config leaves ``test_draw`` unset."""
    return "shared" if spec.partition(":")[0] in _SHARED_BY_DEFAULT else "disjoint"


@dataclass(frozen=True, eq=False)
class ClientIndices:
    """Indices (int64, ascending) into the data set's train / test split and the labels (int64) this client sees
    for them, as numpy arrays."""

    train_idx: NDArray[np.int64]
    train_y: NDArray[np.int64]
    test_idx: NDArray[np.int64]
    test_y: NDArray[np.int64]

    @property
    def n_train(self) -> int:
        return len(self.train_idx)


@dataclass(frozen=True, eq=False)
class PartitionArrays:
    """The deal as numpy arrays (``partition_arrays``)."""

    clients: tuple[ClientIndices, ...]
    num_classes: int  # what the model predicts (5 for the preference task)
    label_maps: tuple[tuple[int, ...], ...] | None = None  # preference: class -> rating, per client


@dataclass(frozen=True, eq=False)
class ClientData:
    """Indices into the data set's train / test split and the labels this client sees for them."""

    train_idx: Tensor
    train_y: Tensor
    test_idx: Tensor
    test_y: Tensor

    @staticmethod
    def of(c: ClientIndices) -> ClientData:
        """The arrays as tensors, sharing their memory."""
        import torch

        return ClientData(torch.from_numpy(c.train_idx), torch.from_numpy(c.train_y), torch.from_numpy(c.test_idx),
                          torch.from_numpy(c.test_y))

    @property
    def n_train(self) -> int:
        return int(self.train_idx.numel())


@dataclass(frozen=True, eq=False)
class Partition:
    clients: tuple[ClientData, ...]
    num_classes: int  # what the model predicts (5 for the preference task)
    label_maps: tuple[tuple[int, ...], ...] | None = None  # preference: class -> rating, per client

    @staticmethod
    def of(p: PartitionArrays) -> Partition:
        """The numpy deal as tensors, sharing its arrays' memory."""
        return Partition(tuple(ClientData.of(c) for c in p.clients), p.num_classes, p.label_maps)


# (train labels, num clients, arg or None, num classes, rng) -> (train index arrays, label maps or None)
PartitionerFn = Callable[
    [np.ndarray, int, str | None, int, np.random.Generator],
    tuple[list[np.ndarray], list[np.ndarray] | None],
]
_PARTITIONERS: dict[str, PartitionerFn] = {}


def register_partitioner(name: str) -> Callable[[PartitionerFn], PartitionerFn]:
    def deco(fn: PartitionerFn) -> PartitionerFn:
        if name in _PARTITIONERS:
            raise ConfigError(f"partitioner {name!r} is already registered")
        _PARTITIONERS[name] = fn
        return fn

    return deco


def list_partitioners() -> list[str]:
    return sorted(_PARTITIONERS)


def partition(
    spec: str,
    train_y: Tensor,
    test_y: Tensor,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    samples_per_client: int | None = None,
    test_per_client: int | None = None,
    test_draw: str | None = None,
) -> Partition:
    """Deal the data out (``partition_arrays``'s deal, as tensors). ``test_per_client`` defaults to
    ceil(len(test) / num_clients), as in DisPFL."""
    return Partition.of(partition_arrays(spec, train_y.numpy(), test_y.numpy(), num_clients, num_classes, rng,
                                         samples_per_client=samples_per_client, test_per_client=test_per_client,
                                         test_draw=test_draw))


def partition_arrays(
    spec: str,
    train_y: NDArray[np.int64],
    test_y: NDArray[np.int64],
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    samples_per_client: int | None = None,
    test_per_client: int | None = None,
    test_draw: str | None = None,
) -> PartitionArrays:
    """Deal the data out, in numpy: the train and test labels (int64) in, each client's indices and labels out.
    ``test_per_client`` defaults to ceil(len(test) / num_clients), as in DisPFL; ``test_draw`` (None: the
    spec's ``default_test_draw``) is ``"disjoint"`` or ``"shared"`` (module docstring)."""
    draw = default_test_draw(spec) if test_draw is None else test_draw
    if draw not in TEST_DRAWS:
        raise ConfigError(f"test_draw must be one of {', '.join(TEST_DRAWS)}, got {draw!r:.40}")
    name, _, arg = spec.partition(":")
    if name not in _PARTITIONERS:
        raise UnknownNameError("partitioner", name, list_partitioners())
    if num_clients < 1:
        raise ConfigError(f"num_clients must be >= 1, got {num_clients}")
    ytr, yte = np.asarray(train_y), np.asarray(test_y)
    parts, maps = _PARTITIONERS[name](ytr, num_clients, arg or None, num_classes, rng)
    if samples_per_client is not None:
        if samples_per_client < 1:
            raise ConfigError(f"samples_per_client must be >= 1, got {samples_per_client}")
        parts = [p if len(p) <= samples_per_client else rng.choice(p, samples_per_client, replace=False)
                 for p in parts]
    parts = [np.sort(p) for p in parts]
    for i, p in enumerate(parts):
        if len(p) == 0:
            raise DataError(f"partition {spec!r} left client {i} without training data; use fewer clients")
    per = test_per_client if test_per_client is not None else math.ceil(len(test_y) / num_clients)
    counts = np.stack([np.bincount(ytr[p], minlength=num_classes) for p in parts])
    test_parts = (draw_shared if draw == "shared" else draw_disjoint)(yte, counts, per, rng)
    for i, q in enumerate(test_parts):
        if len(q) == 0:
            raise DataError(f"client {i} got no test samples (its classes are exhausted in the test split); "
                            "use fewer clients or a larger --test-per-client")
    clients = []
    for i, (p, q) in enumerate(zip(parts, test_parts, strict=True)):
        a, b = ytr[p], yte[q]
        if maps is not None:
            a, b = maps[i][a], maps[i][b]
        clients.append(ClientIndices(p.astype(np.int64), a.astype(np.int64), q.astype(np.int64), b.astype(np.int64)))
    return PartitionArrays(
        tuple(clients),
        NUM_RATINGS if maps is not None else num_classes,
        None if maps is None else tuple(tuple(int(v) for v in m) for m in maps),
    )


def _float_arg(arg: str | None, name: str) -> float:
    try:
        return float(arg) if arg is not None else math.nan
    except ValueError:
        raise ConfigError(f"{name} takes a number, got {arg!r}") from None


@register_partitioner("iid")
def _iid(y: np.ndarray, n: int, arg: str | None, num_classes: int,
         rng: np.random.Generator) -> tuple[list[np.ndarray], None]:
    if arg is not None:
        raise ConfigError("iid takes no argument")
    return list(np.array_split(rng.permutation(len(y)), n)), None


@register_partitioner("pathological")
def _pathological(y: np.ndarray, n: int, arg: str | None, num_classes: int,
                  rng: np.random.Generator) -> tuple[list[np.ndarray], None]:
    """K distinct classes per client. Classes are dealt cyclically after a random permutation, so every class
    goes to about n*K/C clients; each class's samples are split evenly among the clients that hold it."""
    if arg is None or not arg.isdigit() or not 1 <= int(arg) <= num_classes:
        raise ConfigError(f"pathological:K needs an integer K in [1, {num_classes}], got {arg!r}")
    k = int(arg)
    order = rng.permutation(num_classes)
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for i in range(n):
        for j in range(k):
            holders[int(order[(i * k + j) % num_classes])].append(i)
    parts: list[list[np.ndarray]] = [[] for _ in range(n)]
    for c in range(num_classes):
        if not holders[c]:
            continue
        idx = rng.permutation(np.flatnonzero(y == c))
        for i, chunk in zip(holders[c], np.array_split(idx, len(holders[c])), strict=True):
            parts[i].append(chunk)
    return [np.concatenate(p) for p in parts], None


@register_partitioner("dirichlet")
def _dirichlet(y: np.ndarray, n: int, arg: str | None, num_classes: int,
               rng: np.random.Generator) -> tuple[list[np.ndarray], None]:
    """Class-wise Dir(alpha), FedML's split: per class, proportions over clients ~ Dir(alpha); clients already
    above the average size get no more; redrawn until every client has at least 10 samples. Client sizes vary.
    (The DisPFL reference splits client-wise instead: ``dirichlet-client``.)"""
    alpha = _float_arg(arg, "dirichlet:ALPHA")
    if not alpha > 0:
        raise ConfigError(f"dirichlet:ALPHA needs ALPHA > 0, got {arg!r}")
    min_size = min(10, len(y) // n)
    for _ in range(1000):
        parts = _dirichlet_once(y, n, alpha, num_classes, rng)
        if parts is not None and min(len(q) for q in parts) >= min_size:
            return parts, None
    raise DataError(f"dirichlet:{alpha} could not give every one of {n} clients {min_size} samples")


def _dirichlet_once(y: np.ndarray, n: int, alpha: float, num_classes: int,
                    rng: np.random.Generator) -> list[np.ndarray] | None:
    parts: list[list[int]] = [[] for _ in range(n)]
    for c in range(num_classes):
        idx = rng.permutation(np.flatnonzero(y == c))
        p = rng.dirichlet(np.full(n, alpha))
        p = p * np.array([len(q) < len(y) / n for q in parts])
        if not p.sum() > 0:  # every open client drew ~0 (tiny alpha): draw again
            return None
        cuts = (np.cumsum(p / p.sum()) * len(idx)).astype(int)[:-1]
        for i, chunk in enumerate(np.split(idx, cuts)):
            parts[i].extend(chunk.tolist())
    return [np.asarray(q, dtype=np.int64) for q in parts]


@register_partitioner("dirichlet-client")
def _dirichlet_client(y: np.ndarray, n: int, arg: str | None, num_classes: int,
                      rng: np.random.Generator) -> tuple[list[np.ndarray], None]:
    """Client-wise Dir(alpha), the DisPFL reference's split: every client gets the same number of samples
    (len(train) // clients) and its own class prior p_i ~ Dir(alpha). Samples are dealt one at a time, as the
    reference deals them: the next sample goes to a random client that still has room, its class drawn from
    p_i restricted to the classes that still have samples (uniform over those if p_i puts nothing there), without
    replacement. Interleaved, so the classes that run out late in the deal fall on random clients, not on the
    last ones dealt (a client's skew does not depend on its index)."""
    alpha = _float_arg(arg, "dirichlet-client:ALPHA")
    if not alpha > 0:
        raise ConfigError(f"dirichlet-client:ALPHA needs ALPHA > 0, got {arg!r}")
    size = len(y) // n
    if size < 1:
        raise DataError(f"dirichlet-client: {len(y)} samples cannot give each of {n} clients one")
    priors = rng.dirichlet(np.full(num_classes, alpha), size=n)
    order = rng.permutation(np.repeat(np.arange(n), size))  # which client each dealt sample goes to
    left = np.array([int((y == c).sum()) for c in range(num_classes)], dtype=np.int64)
    counts = np.zeros((n, num_classes), dtype=np.int64)
    # runs of draws while no class is exhausted are drawn at once (inverse CDF of each client's prior); a draw
    # that hits an exhausted class, and everything after it, waits for the next run
    pos, open_ = 0, left > 0
    while pos < len(order):
        q = np.where(open_, priors, 0.0)
        mass = q.sum(axis=1, keepdims=True)
        q = np.where(mass > 0, q / np.where(mass > 0, mass, 1.0), open_ / open_.sum())
        clients = order[pos:]
        u = rng.random(len(clients))
        cls = (u[:, None] >= np.cumsum(q[clients], axis=1)).sum(axis=1).clip(max=num_classes - 1)
        # keep the longest prefix of draws that no class runs out within
        onehot = np.zeros((len(cls), num_classes), dtype=np.int64)
        onehot[np.arange(len(cls)), cls] = 1
        over: NDArray[np.bool_] = np.asarray((np.cumsum(onehot, axis=0) > left).any(axis=1))
        stop = int(np.argmax(over)) if over.any() else len(cls)
        if stop == 0:  # the first draw's class is exhausted only by float rounding of q: close it
            open_[cls[0]] = False
            continue
        np.add.at(counts, (clients[:stop], cls[:stop]), 1)
        left -= onehot[:stop].sum(axis=0)
        open_ = left > 0
        pos += stop
    pools = [rng.permutation(np.flatnonzero(y == c)) for c in range(num_classes)]
    ends = np.cumsum(counts, axis=0)
    return [np.concatenate([pools[c][ends[i, c] - counts[i, c]: ends[i, c]] for c in range(num_classes)])
            for i in range(n)], None


@register_partitioner("pathological-random")
def _pathological_random(y: np.ndarray, n: int, arg: str | None, num_classes: int,
                         rng: np.random.Generator) -> tuple[list[np.ndarray], None]:
    """K random classes per client, the DisPFL reference's ``n_cls`` split: each client its own K distinct classes
    and len(train) // clients samples, dealt one at a time to random clients from a class drawn uniformly among the
    client's K; an exhausted class is dealt again in the same order (the reference refills it), so two clients may
    share a sample. ``pathological:K`` is the cyclic deal (each class held by n*K/C clients, no sample shared)."""
    if arg is None or not arg.isdigit() or not 1 <= int(arg) <= num_classes:
        raise ConfigError(f"pathological-random:K needs an integer K in [1, {num_classes}], got {arg!r}")
    k = int(arg)
    size = len(y) // n
    if size < 1:
        raise DataError(f"pathological-random: {len(y)} samples cannot give each of {n} clients one")
    classes = np.stack([rng.choice(num_classes, k, replace=False) for _ in range(n)])
    order = rng.permutation(np.repeat(np.arange(n), size))
    cls = classes[order, rng.integers(0, k, len(order))]
    owners, samples = [], []
    for c in range(num_classes):
        hit = np.flatnonzero(cls == c)  # the deal's draws of class c, in order
        pool = rng.permutation(np.flatnonzero(y == c))
        if not len(hit):
            continue
        if not len(pool):
            raise DataError(f"pathological-random: class {c} has no training samples")
        owners.append(order[hit])
        samples.append(pool[np.arange(len(hit)) % len(pool)])
    own, got = np.concatenate(owners), np.concatenate(samples)  # a stable sort by owner: class by class, in order
    return np.split(got[np.argsort(own, kind="stable")], np.cumsum(np.bincount(own, minlength=n))[:-1]), None


@register_partitioner("groups")
def _groups(y: np.ndarray, n: int, arg: str | None, num_classes: int,
            rng: np.random.Generator) -> tuple[list[np.ndarray], None]:
    """G groups of clients (client i in group i mod G); the classes are split into G disjoint sets as evenly as
    possible and every client of a group draws only from its group's classes (each class's samples shared
    evenly among the group). Clients of one group have the same label distribution; for DisPFL's mask study."""
    if arg is None or not arg.isdigit() or not 1 <= int(arg) <= min(n, num_classes):
        raise ConfigError(f"groups:G needs an integer G in [1, min(clients, classes)], got {arg!r}")
    g = int(arg)
    class_sets = np.array_split(rng.permutation(num_classes), g)
    parts: list[list[np.ndarray]] = [[] for _ in range(n)]
    for grp, classes in enumerate(class_sets):
        members = list(range(grp, n, g))
        for c in classes:
            idx = rng.permutation(np.flatnonzero(y == c))
            for i, chunk in zip(members, np.array_split(idx, len(members)), strict=True):
                parts[i].append(chunk)
    return [np.concatenate(p) for p in parts], None


@register_partitioner("preference")
def _preference(y: np.ndarray, n: int, arg: str | None, num_classes: int,
                rng: np.random.Generator) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The same images, labels that depend on the user (stands in for FLICKR-AES). User i is in taste group
    g = i mod 5 and rates class c as (c + g) mod 5; then re-draws each class's rating at random with
    probability P (0.1). Images are dealt iid."""
    p = 0.1 if arg is None else _float_arg(arg, "preference:P")
    if not 0 <= p <= 1:
        raise ConfigError(f"preference:P needs 0 <= P <= 1, got {arg!r}")
    parts, _ = _iid(y, n, None, num_classes, rng)
    maps = []
    for i in range(n):
        g = i % NUM_RATINGS
        m = (np.arange(num_classes) + g) % NUM_RATINGS
        redraw = rng.random(num_classes) < p
        m[redraw] = rng.integers(0, NUM_RATINGS, int(redraw.sum()))
        maps.append(m)
    return parts, maps
