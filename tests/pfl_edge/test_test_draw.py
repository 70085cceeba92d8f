"""Each client's test set (pfl_edge.data.testdraw): the DisPFL reference's shared draw, its class counts against
the counts worked out here from the training mix, and today's disjoint draw, kept as an option; which one a
partition takes by default."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pfl_edge.data.partition import default_test_draw, partition_arrays
from pfl_edge.errors import ConfigError
from pfl_edge.federation import FederationConfig


def _labels(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 10, 6000).astype(np.int64), rng.integers(0, 10, 1000).astype(np.int64)


def test_the_reference_splits_draw_shared_test_sets_by_default() -> None:
    assert default_test_draw("pathological-random:2") == default_test_draw("dirichlet-client:0.3") == "shared"
    assert default_test_draw("pathological:2") == default_test_draw("iid") == "disjoint"
    with pytest.raises(ConfigError, match="test_draw"):
        FederationConfig(test_draw="both")  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", ["pathological-random:2", "dirichlet-client:0.3"])
def test_a_shared_draw_follows_each_clients_training_mix(spec: str) -> None:
    """Per client and class c: exactly ceil(n_c / n x per) distinct test samples of class c (the reference's
    count; the class's pool is never short here), drawn from the whole split, so clients share samples; the test
    label mix departs from the training mix by at most the rounding (total variation <= classes / per)."""
    ytr, yte = _labels()
    clients, per = 20, 50
    part = partition_arrays(spec, ytr, yte, clients, 10, np.random.default_rng(1), test_per_client=per)
    seen: list[int] = []
    for c in part.clients:
        train = np.bincount(c.train_y, minlength=10)
        test = np.bincount(c.test_y, minlength=10)
        want = [math.ceil(train[k] / train.sum() * per) for k in range(10)]
        assert test.tolist() == want
        assert len(np.unique(c.test_idx)) == len(c.test_idx) and np.array_equal(yte[c.test_idx], c.test_y)
        tv = 0.5 * np.abs(test / test.sum() - train / train.sum()).sum()
        assert tv <= 10 / per
        seen += c.test_idx.tolist()
    assert len(seen) > len(set(seen))  # images shared between clients, as the reference shares them


def test_the_disjoint_draw_stays_an_option_and_gives_each_test_sample_once() -> None:
    ytr, yte = _labels(1)
    for spec in ("pathological-random:2", "pathological:2"):
        part = partition_arrays(spec, ytr, yte, 20, 10, np.random.default_rng(2), test_per_client=60,
                                test_draw="disjoint")
        idx = np.concatenate([c.test_idx for c in part.clients])
        assert len(idx) == len(np.unique(idx))
    shared = partition_arrays("pathological-random:2", ytr, yte, 20, 10, np.random.default_rng(2),
                              test_per_client=60)
    assert sum(len(c.test_idx) for c in shared.clients) >= 20 * 60  # ceil: never fewer than asked
    with pytest.raises(ConfigError, match="test_draw"):
        partition_arrays("iid", ytr, yte, 4, 10, np.random.default_rng(0), test_draw="nope")


def test_a_config_deals_its_test_draw() -> None:
    from pfl_edge.federation import deal_labels

    base = dict(dataset="synthetic", partition="pathological-random:2", clients=6, samples_per_client=40,
                test_per_client=30)
    shared, _ = deal_labels(FederationConfig(**base))  # type: ignore[arg-type]
    disjoint, _ = deal_labels(FederationConfig(**base, test_draw="disjoint"))  # type: ignore[arg-type]
    both = [np.concatenate([c.test_idx.numpy() for c in p.clients]) for p in (shared, disjoint)]
    assert len(both[0]) > len(np.unique(both[0])) and len(both[1]) == len(np.unique(both[1]))
