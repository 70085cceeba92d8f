"""Grouped secure aggregation (``secure_aggregation.min_group``; docs/secagg.md): the round's devices split by
the round's public seed into groups of at least ``min_group``, each group's sum unmasked alone, the groups'
means combined by the median (or the mean); a group whose sum fails its check is left out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pfl_edge.errors import ConfigError
from pfl_edge.federation import FederationConfig
from pfl_edge.privacy import SecAggConfig
from pfl_edge.secagg import dequantize_sum, groups, quantize
from pfl_edge.secagg.aggregate import SumOutOfRange, apply_sum, secure_input, secure_mean


@pytest.mark.parametrize("n,m", [(7, 3), (20, 10), (29, 10), (100, 7), (5, 3), (12, 0), (3, 3)])
def test_groups_partition_the_round_into_groups_of_at_least_min_group(n: int, m: int) -> None:
    ids = list(range(100, 100 + n))
    got = groups(ids, m, seed=4)
    assert sorted(i for g in got for i in g) == ids  # a partition
    assert got == groups(list(reversed(ids)), m, seed=4)  # of the set, not of the order it came in
    want = max(1, n // m) if m else 1
    assert len(got) == want
    sizes = [len(g) for g in got]
    assert max(sizes) - min(sizes) <= 1 and (want == 1 or min(sizes) >= m)
    if want > 1:
        assert got != groups(ids, m, seed=5)  # drawn from the round's seed


def test_min_group_and_across_are_checked() -> None:
    for bad in ({"min_group": 2}, {"min_group": True}, {"min_group": -1}, {"across": "trimmed"}):
        with pytest.raises(ConfigError, match=r"min_group|across"):
            SecAggConfig.parse({"bound": 0.5, **bad})
    assert SecAggConfig.parse({"bound": 0.5}).min_group == 0  # type: ignore[union-attr]


def _cfg(**sa: object) -> FederationConfig:
    return FederationConfig.from_dict({"algorithm": "fedper", "clients": 12, "kp": 2,
                                       "secure_aggregation": {"bound": 0.5, "bits": 16, **sa}})


def _sum(xs: list[np.ndarray]) -> np.ndarray:
    return np.sum([x.astype(np.uint64) for x in xs], axis=0).astype(np.uint32)


def test_the_groups_means_median_against_numpy_and_a_failing_group_left_out() -> None:
    cfg = _cfg(min_group=3)
    rng = np.random.default_rng(0)
    prev = {"w": torch.zeros(5, dtype=torch.float64), "n": torch.tensor([7])}
    xs = [quantize(rng.normal(0, 0.2, 5), 0.5, 16) for _ in range(9)]
    parts = [xs[0:3], xs[3:6], xs[6:9]]
    sums = [(_sum(p), 3) for p in parts]
    got = apply_sum(cfg, prev, sums)
    means = np.stack([dequantize_sum(_sum(p), 3, 0.5, 16) / 3 for p in parts])
    np.testing.assert_allclose(got["w"].numpy(), np.median(means, axis=0), rtol=0, atol=1e-12)
    assert torch.equal(got["n"], prev["n"])
    # the first group's sum wrapped (an input out of range in it): the median of the other two
    bad = [((sums[0][0].astype(np.uint64) + (1 << 31)) % (1 << 32)).astype(np.uint32), 3]
    got = apply_sum(cfg, prev, [tuple(bad), *sums[1:]])  # type: ignore[list-item]
    np.testing.assert_allclose(got["w"].numpy(), np.median(means[1:], axis=0), rtol=0, atol=1e-12)
    with pytest.raises(SumOutOfRange):
        apply_sum(cfg, prev, [tuple(bad)])  # type: ignore[list-item]
    # across = "mean": the plain mean of every kept input
    got = apply_sum(_cfg(min_group=3, across="mean"), prev, sums)
    np.testing.assert_allclose(got["w"].numpy(), means.mean(axis=0), rtol=0, atol=1e-12)


def test_the_simulators_grouped_round_groups_the_slots_as_the_server_does() -> None:
    """``secure_mean`` over slots 2..11 (ten participants of twelve): its groups are ``groups`` of those slots by
    the round's seed, each group's mean made of its own inputs; the base moves by their median."""
    from pfl_edge.secagg.aggregate import group_seed

    cfg = _cfg(min_group=3)
    g = torch.Generator().manual_seed(1)
    prev = {"w": torch.zeros(6)}
    ids = list(range(2, 12))
    sent = [{"w": 0.1 * torch.randn(6, generator=g)} for _ in ids]
    got = secure_mean(cfg, prev, [(s, 1.0) for s in sent], t=3, ids=ids)
    xs = {i: secure_input(cfg, prev, s) for i, s in zip(ids, sent, strict=True)}
    parts = groups(ids, 3, group_seed(cfg, 3))
    assert len(parts) == 3
    means = np.stack([dequantize_sum(_sum([xs[i] for i in p]), len(p), 0.5, 16) / len(p) for p in parts])
    np.testing.assert_allclose(got["w"].double().numpy(), np.median(means, axis=0), rtol=0, atol=1e-6)
