import pytest
import torch

from pfl_edge.aggregate import (
    AggregationRule,
    RunningAverage,
    clip_update,
    coordinate_median,
    robust_aggregate,
    trimmed_mean,
    update_norm,
    weighted_average,
)
from pfl_edge.errors import ConfigError


def test_hand_worked_weighted_average() -> None:
    # clients with 1, 3 and 4 samples: gamma = 1/8, 3/8, 4/8
    a = {"w": torch.tensor([8.0, 0.0]), "b": torch.tensor(1.0)}
    b = {"w": torch.tensor([0.0, 8.0]), "b": torch.tensor(2.0)}
    c = {"w": torch.tensor([2.0, 2.0]), "b": torch.tensor(4.0)}
    out = weighted_average([a, b, c], [1, 3, 4])
    assert torch.allclose(out["w"], torch.tensor([1.0 + 0 + 1.0, 0 + 3.0 + 1.0]))
    assert torch.allclose(out["b"], torch.tensor(1 / 8 + 6 / 8 + 16 / 8))


def test_matches_float64_reference_and_keeps_dtype() -> None:
    g = torch.Generator().manual_seed(0)
    states = [{"x": torch.randn(5, 3, generator=g)} for _ in range(7)]
    weights = [float(w) for w in torch.randint(1, 100, (7,), generator=g)]
    out = weighted_average(states, weights)
    ref = sum(s["x"].double() * w for s, w in zip(states, weights, strict=True)) / sum(weights)
    assert out["x"].dtype == torch.float32
    assert torch.allclose(out["x"].double(), ref, atol=1e-6)


def test_integer_buffers_are_rounded() -> None:
    out = weighted_average([{"n": torch.tensor(1)}, {"n": torch.tensor(4)}], [1, 1])
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 2  # 2.5 rounds to even


def test_streaming_equals_batch() -> None:
    g = torch.Generator().manual_seed(1)
    states = [{"x": torch.randn(4, generator=g)} for _ in range(5)]
    avg = RunningAverage()
    for i, s in enumerate(states):
        avg.add(s, i + 1.0)
    assert torch.equal(avg.result()["x"], weighted_average(states, [1.0, 2.0, 3.0, 4.0, 5.0])["x"])


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_weights(weight: float) -> None:
    with pytest.raises(ConfigError):
        weighted_average([{"x": torch.zeros(1)}], [weight])


def test_mismatched_updates() -> None:
    with pytest.raises(ConfigError, match="shape"):
        weighted_average([{"x": torch.zeros(2)}, {"x": torch.zeros(3)}], [1, 1])
    with pytest.raises(ConfigError, match="missing"):
        weighted_average([{"x": torch.zeros(2)}, {"y": torch.zeros(2)}], [1, 1])
    with pytest.raises(ConfigError, match="zero updates"):
        weighted_average([], [])


# ------------------------------------------------------------------------------------------- robust rules
# hand-worked in float64: start model 0, five updates of one 2-vector (the last an attacker's)

def _ups(*rows: tuple[float, float]) -> list[dict[str, torch.Tensor]]:
    return [{"w": torch.tensor(r, dtype=torch.float64)} for r in rows]


ZERO = {"w": torch.zeros(2, dtype=torch.float64)}
FIVE = _ups((1.0, 0.0), (2.0, 0.0), (3.0, 4.0), (0.0, 2.0), (300.0, 400.0))  # norms 1, 2, 5, 2, 500


def test_update_norm_and_clip_by_hand() -> None:
    assert update_norm(ZERO, FIVE[2]) == 5.0
    assert clip_update(ZERO, FIVE[2], 5.0) is FIVE[2]  # within the bound: the very same tensors
    half = clip_update(ZERO, FIVE[2], 2.5)
    assert torch.equal(half["w"], torch.tensor([1.5, 2.0], dtype=torch.float64))
    # around a non-zero start: only the difference is scaled
    start = {"w": torch.tensor([10.0, 10.0], dtype=torch.float64)}
    got = clip_update(start, {"w": torch.tensor([13.0, 14.0], dtype=torch.float64)}, 1.0)
    assert torch.allclose(got["w"], torch.tensor([10.6, 10.8], dtype=torch.float64))


def test_default_bound_is_three_medians() -> None:
    rule = AggregationRule()
    assert rule.relative and rule.bound([1.0, 2.0, 5.0, 2.0, 500.0]) == 6.0
    assert AggregationRule(max_update_norm=4.0).bound([1.0, 500.0]) == 4.0
    assert AggregationRule(norm_multiple=None).bound([1.0, 500.0]) is None


def test_each_updates_bound_leaves_it_out_by_hand() -> None:
    """``bounds``: 3 x the low median of the *other* norms. Norms (1, 2, 10): the 10 is judged by (1, 2) -> 3, not
    by the median of all three (2 -> 6); the 2 by (1, 10) -> 3; the 1 by (2, 10) -> 6. A round of 2 adds the last
    round's norms; a lone update with no history is unbounded; an absolute bound is everyone's."""
    rule = AggregationRule()
    assert rule.bounds([1.0, 2.0, 10.0]) == [6.0, 3.0, 3.0]
    assert rule.bounds([1.0, 2.0, 5.0, 2.0, 500.0]) == [6.0] * 5
    assert rule.bounds([1.0, 50.0], history=[2.0, 2.0]) == [6.0, 6.0]
    assert rule.bounds([1.0, 2.0, 10.0], history=[100.0, 100.0]) == [6.0, 3.0, 3.0]  # 3 or more: no history
    assert rule.bounds([50.0], history=[2.0, 3.0]) == [6.0] and rule.bounds([50.0]) == [None]
    assert AggregationRule(max_update_norm=4.0).bounds([1.0, 500.0]) == [4.0, 4.0]
    assert AggregationRule(norm_multiple=None).bounds([1.0, 500.0]) == [None, None]


def test_mean_with_the_default_bound_by_hand() -> None:
    # bound 3 * median(1, 2, 5, 2, 500) = 6: the attacker's (300, 400) is clipped to (3.6, 4.8); weights 1,1,1,1,6
    out = robust_aggregate(ZERO, list(zip(FIVE, [1.0, 1.0, 1.0, 1.0, 6.0], strict=True)), AggregationRule())
    want = torch.tensor([(1 + 2 + 3 + 0 + 6 * 3.6) / 10, (0 + 0 + 4 + 2 + 6 * 4.8) / 10], dtype=torch.float64)
    assert torch.allclose(out["w"], want, atol=1e-12)


def test_clipped_mean_ignores_weights_by_hand() -> None:
    rule = AggregationRule("clipped-mean", max_update_norm=2.0)
    # clipped: (1,0), (2,0), (1.2,1.6), (0,2), (1.2,1.6); equal weights whatever was reported
    out = robust_aggregate(ZERO, list(zip(FIVE, [1.0, 1.0, 1.0, 1.0, 1e9], strict=True)), rule)
    assert torch.allclose(out["w"], torch.tensor([5.4 / 5, 5.2 / 5], dtype=torch.float64), atol=1e-12)


def test_coordinate_median_by_hand() -> None:
    rule = AggregationRule("median", norm_multiple=None)
    out = robust_aggregate(ZERO, [(s, 1.0) for s in FIVE], rule)
    assert torch.equal(out["w"], torch.tensor([2.0, 2.0], dtype=torch.float64))  # sorted x: 0 1 2 3 300
    even = coordinate_median(ZERO, FIVE[:4])  # x: 0 1 2 3 -> 1.5; y: 0 0 2 4 -> 1
    assert torch.equal(even["w"], torch.tensor([1.5, 1.0], dtype=torch.float64))


def test_trimmed_mean_by_hand() -> None:
    out = trimmed_mean(ZERO, FIVE, 0.2)  # one dropped per end: x 1 2 3 -> 2; y 0 2 4 -> 2
    assert torch.equal(out["w"], torch.tensor([2.0, 2.0], dtype=torch.float64))
    assert torch.equal(trimmed_mean(ZERO, FIVE, 0.0)["w"], torch.tensor([61.2, 81.2], dtype=torch.float64))
    assert torch.equal(trimmed_mean(ZERO, FIVE[:2], 0.4)["w"], torch.tensor([1.5, 0.0], dtype=torch.float64))


def test_robust_rules_keep_unsent_tensors_dtypes_and_partial_updates() -> None:
    prev = {"a": torch.zeros(2), "b": torch.ones(1), "n": torch.tensor(0)}
    states = [{"a": torch.tensor([1.0, 3.0]), "n": torch.tensor(3)}, {"a": torch.tensor([2.0, 5.0])},
              {"a": torch.tensor([9.0, 4.0]), "n": torch.tensor(4)}]
    out = coordinate_median(prev, states)
    assert list(out) == ["a", "b", "n"] and out["b"] is prev["b"]
    assert out["a"].dtype == torch.float32 and torch.equal(out["a"], torch.tensor([2.0, 4.0]))
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 4  # median of 3, 4 = 3.5 rounds to even


def test_mean_rule_without_clipping_is_the_weighted_average() -> None:
    g = torch.Generator().manual_seed(3)
    states = [{"x": torch.randn(4, 3, generator=g)} for _ in range(4)]
    prev = {"x": torch.zeros(4, 3)}
    ups = list(zip(states, [1.0, 2.0, 3.0, 4.0], strict=True))
    got = robust_aggregate(prev, ups, AggregationRule(norm_multiple=None))
    assert torch.equal(got["x"], weighted_average(states, [1.0, 2.0, 3.0, 4.0])["x"])


@pytest.mark.parametrize("kw", [dict(rule="mode"), dict(max_update_norm=0.0), dict(max_update_norm=float("inf")),
                                dict(norm_multiple=0.5), dict(trim=0.5), dict(trim=-0.1)])
def test_bad_rules(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        AggregationRule(**kw)  # type: ignore[arg-type]


def test_the_update_bound_stage_by_hand() -> None:
    """``bounded``: norms 1, 1 and 10 from a zero start; each bound is 3x the low median of the others' norms, so
    the third update (10) is held to 3 and the first two pass as the same objects; given bounds are used as they
    are; given norms spare the pass over the updates; without a rule or bounds it refuses."""
    from pfl_edge.aggregate import bounded

    prev = {"w": torch.zeros(2)}
    ups = [({"w": torch.tensor([1.0, 0.0])}, 1.0), ({"w": torch.tensor([0.0, 1.0])}, 2.0),
           ({"w": torch.tensor([6.0, 8.0])}, 3.0)]
    out = list(bounded(prev, iter(ups), AggregationRule()))
    assert out[0][0] is ups[0][0] and out[1][0] is ups[1][0] and [w for _, w in out] == [1.0, 2.0, 3.0]
    assert torch.allclose(out[2][0]["w"], torch.tensor([1.8, 2.4]))  # (6, 8) * 3 / 10
    given = list(bounded(prev, iter(ups), None, bounds=[None, 0.5, None]))
    assert torch.allclose(given[1][0]["w"], torch.tensor([0.0, 0.5])) and given[2][0] is ups[2][0]
    wrong = list(bounded(prev, iter(ups), AggregationRule(), norms=[1.0, 1.0, 100.0]))  # the norms given are used
    assert torch.allclose(wrong[2][0]["w"], torch.tensor([0.18, 0.24]))
    with pytest.raises(ConfigError, match="needs a rule"):
        list(bounded(prev, iter(ups), None))


def test_the_algorithms_aggregate_holds_updates_to_the_rules_bound() -> None:
    """``Central.aggregate`` with the default rule is the weighted mean of the bounded updates (a float64 reference
    written out), and with no rule the plain weighted mean: the server passes its rule, the simulator none yet."""
    from pfl_edge.algorithms import get_algorithm
    from pfl_edge.federation import FederationConfig
    from pfl_edge.models import get_model

    cfg = FederationConfig.from_dict({"algorithm": "fedavg", "clients": 3, "model": "cnn"})
    algo = get_algorithm(cfg, get_model("cnn", num_classes=10, in_channels=1))
    g = torch.Generator().manual_seed(0)
    prev = {k: torch.randn(v.shape, generator=g) for k, v in algo.model.state_dict().items()}
    ups = [({k: v + s * torch.randn(v.shape, generator=g) for k, v in prev.items()}, float(n))
           for s, n in ((0.01, 10), (0.012, 20), (1.0, 30))]
    norms = [update_norm(prev, u) for u, _ in ups]
    bounds = [3 * min(norms[1], norms[2]), 3 * min(norms[0], norms[2]), 3 * min(norms[0], norms[1])]
    scale = [min(1.0, b / n) for b, n in zip(bounds, norms, strict=True)]
    assert scale[2] < 1 and scale[0] == scale[1] == 1
    got = algo.aggregate(prev, ups, rule=AggregationRule())
    plain = algo.aggregate(prev, ups)
    assert got is not None and plain is not None
    for k, p in prev.items():
        p64 = p.double()
        want = sum(w * (p64 + (u[k].double() - p64) * c) for (u, w), c in zip(ups, scale, strict=True)) / 60
        assert torch.allclose(got[k].double(), want, atol=1e-6), k
        want_plain = sum(w * u[k].double() for u, w in ups) / 60
        assert torch.allclose(plain[k].double(), want_plain, atol=1e-6), k
