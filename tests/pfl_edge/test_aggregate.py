import statistics

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


def test_default_bound_is_one_low_median() -> None:
    """The default multiple is 1 (issue 49; 3 before), defined once: the server's settings, the rule and the
    simulator's ``DEFAULT_RULE`` agree."""
    from pfl_edge.aggregate import DEFAULT_RULE
    from pfl_edge.protocol import DEFAULT_NORM_MULTIPLE, AggregationSettings

    rule = AggregationRule()
    assert DEFAULT_NORM_MULTIPLE == 1.0 and rule == DEFAULT_RULE == AggregationRule("mean", None, 1.0, 0.2)
    assert AggregationSettings().norm_multiple == rule.norm_multiple and AggregationSettings().rule == rule.rule
    assert rule.relative and rule.bound([1.0, 2.0, 5.0, 2.0, 500.0]) == 2.0
    assert AggregationRule(norm_multiple=3).bound([1.0, 2.0, 5.0, 2.0, 500.0]) == 6.0
    assert AggregationRule(max_update_norm=4.0).bound([1.0, 500.0]) == 4.0
    assert AggregationRule(norm_multiple=None).bound([1.0, 500.0]) is None


def test_each_updates_bound_leaves_it_out_by_hand() -> None:
    """``bounds``: 3 x the low median of the *other* norms (a multiple of 3, the default before issue 49, keeps
    the hand-worked numbers apart; the default's own are checked last). Norms (1, 2, 10): the 10 is judged by
    (1, 2) -> 3, not by the median of all three (2 -> 6); the 2 by (1, 10) -> 3; the 1 by (2, 10) -> 6. A round of 2
    adds the last round's norms; a lone update with no history is unbounded; an absolute bound is everyone's."""
    rule = AggregationRule(norm_multiple=3)
    assert rule.bounds([1.0, 2.0, 10.0]) == [6.0, 3.0, 3.0]
    assert rule.bounds([1.0, 2.0, 5.0, 2.0, 500.0]) == [6.0] * 5
    assert rule.bounds([1.0, 50.0], history=[2.0, 2.0]) == [6.0, 6.0]
    assert rule.bounds([1.0, 2.0, 10.0], history=[100.0, 100.0]) == [6.0, 3.0, 3.0]  # 3 or more: no history
    assert rule.bounds([50.0], history=[2.0, 3.0]) == [6.0] and rule.bounds([50.0]) == [None]
    assert AggregationRule(max_update_norm=4.0).bounds([1.0, 500.0]) == [4.0, 4.0]
    assert AggregationRule(norm_multiple=None).bounds([1.0, 500.0]) == [None, None]
    # the default (1): (1, 2, 10) -> the low median of the others: (2, 10) -> 2, (1, 10) -> 1, (1, 2) -> 1
    assert AggregationRule().bounds([1.0, 2.0, 10.0]) == [2.0, 1.0, 1.0]
    assert AggregationRule().bounds([1.0, 2.0, 5.0, 2.0, 500.0]) == [2.0, 2.0, 2.0, 2.0, 2.0]


def test_mean_with_a_bound_of_three_medians_by_hand() -> None:
    # multiple 3 (the default before issue 49): bound 3 * median_low of the others (2 for each) = 6: only the
    # attacker's (300, 400) is clipped, to (3.6, 4.8); weights 1,1,1,1,6
    out = robust_aggregate(ZERO, list(zip(FIVE, [1.0, 1.0, 1.0, 1.0, 6.0], strict=True)),
                           AggregationRule(norm_multiple=3))
    want = torch.tensor([(1 + 2 + 3 + 0 + 6 * 3.6) / 10, (0 + 0 + 4 + 2 + 6 * 4.8) / 10], dtype=torch.float64)
    assert torch.allclose(out["w"], want, atol=1e-12)


def test_mean_with_the_default_bound_by_hand() -> None:
    # the default, 1 x median_low of the others (2 for each of the five): (3, 4) is clipped to (1.2, 1.6), the
    # attacker's (300, 400) to the same; (1, 0), (2, 0), (0, 2) pass; weights 1,1,1,1,6
    out = robust_aggregate(ZERO, list(zip(FIVE, [1.0, 1.0, 1.0, 1.0, 6.0], strict=True)), AggregationRule())
    want = torch.tensor([(1 + 2 + 1.2 + 0 + 6 * 1.2) / 10, (0 + 0 + 1.6 + 2 + 6 * 1.6) / 10], dtype=torch.float64)
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
    """``bounded``: norms 1, 1 and 10 from a zero start; each bound is the default 1x the low median of the others'
    norms (1 for each), so the third update (10) is held to 1 and the first two (at the bound, not over it) pass as
    the same objects; given bounds are used as they are; given norms spare the pass over the updates; without a
    rule or bounds it refuses."""
    from pfl_edge.aggregate import bounded

    prev = {"w": torch.zeros(2)}
    ups = [({"w": torch.tensor([1.0, 0.0])}, 1.0), ({"w": torch.tensor([0.0, 1.0])}, 2.0),
           ({"w": torch.tensor([6.0, 8.0])}, 3.0)]
    out = list(bounded(prev, iter(ups), AggregationRule()))
    assert out[0][0] is ups[0][0] and out[1][0] is ups[1][0] and [w for _, w in out] == [1.0, 2.0, 3.0]
    assert torch.allclose(out[2][0]["w"], torch.tensor([0.6, 0.8]))  # (6, 8) * 1 / 10
    three = list(bounded(prev, iter(ups), AggregationRule(norm_multiple=3)))
    assert torch.allclose(three[2][0]["w"], torch.tensor([1.8, 2.4]))  # (6, 8) * 3 / 10
    given = list(bounded(prev, iter(ups), None, bounds=[None, 0.5, None]))
    assert torch.allclose(given[1][0]["w"], torch.tensor([0.0, 0.5])) and given[2][0] is ups[2][0]
    wrong = list(bounded(prev, iter(ups), AggregationRule(), norms=[1.0, 1.0, 100.0]))  # the norms given are used
    assert torch.allclose(wrong[2][0]["w"], torch.tensor([0.06, 0.08]))
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
    # the default multiple, 1: the two smaller steps bound each other's (the 0.012 one is held to the 0.01 one's
    # norm), the large one is held to the smaller of the two
    bounds = [min(norms[1], norms[2]), min(norms[0], norms[2]), min(norms[0], norms[1])]
    scale = [min(1.0, b / n) for b, n in zip(bounds, norms, strict=True)]
    assert scale[2] < 1 and scale[1] < 1 and scale[0] == 1
    got = algo.aggregate(prev, ups, rule=AggregationRule())
    plain = algo.aggregate(prev, ups)
    assert got is not None and plain is not None
    for k, p in prev.items():
        p64 = p.double()
        want = sum(w * (p64 + (u[k].double() - p64) * c) for (u, w), c in zip(ups, scale, strict=True)) / 60
        assert torch.allclose(got[k].double(), want, atol=1e-6), k
        want_plain = sum(w * u[k].double() for u, w in ups) / 60
        assert torch.allclose(plain[k].double(), want_plain, atol=1e-6), k


def test_the_default_rule_holds_a_sign_flipped_update_to_the_honest_low_median() -> None:
    """Issue 49: one device of five sends its step sign-flipped and scaled x1000. At the default rule each update
    is held to 1x the low median of the others' norms, so the attacker's step counts at most the honest low-median
    norm (6 here) at 1/5 of the weight; at the old default (3x) it counted 18, and the published step fell from
    3.4 along the honest direction to 2.2. Hand-computed in float64 (start 0, steps along (0.6, 0.8), equal
    weights): honest norms 5, 6, 8, 10; the attacker's -1000 x (3, 4), norm 5000."""
    from pfl_edge.aggregate import DEFAULT_RULE

    honest = _ups((3.0, 4.0), (3.6, 4.8), (4.8, 6.4), (6.0, 8.0))
    attack = _ups((-3000.0, -4000.0))[0]
    ups = [(u, 1.0) for u in [*honest, attack]]
    norms = [update_norm(ZERO, u) for u, _ in ups]
    assert norms == [5.0, 6.0, 8.0, 10.0, 5000.0]
    # each bound by hand, the low median of the other four: 8, 8, 6, 6 and, for the attacker, 6 (of 5, 6, 8, 10)
    assert DEFAULT_RULE.bounds(norms) == [8.0, 8.0, 6.0, 6.0, 6.0]
    out = robust_aggregate(ZERO, ups, DEFAULT_RULE)["w"]
    # clipped: (3, 4), (3.6, 4.8), then 8 and 10 held to 6: (3.6, 4.8) twice; the attacker to (-3.6, -4.8)
    want = torch.tensor([(3 + 3.6 + 3.6 + 3.6 - 3.6) / 5, (4 + 4.8 + 4.8 + 4.8 - 4.8) / 5], dtype=torch.float64)
    assert torch.allclose(out, want, atol=1e-12) and torch.allclose(out.norm(), torch.tensor(3.4, dtype=out.dtype))
    # the attacker's pull: the published step less the honest clipped ones' share is its own clipped step / 5
    honest_share = torch.tensor([(3 + 3.6 + 3.6 + 3.6) / 5, (4 + 4.8 + 4.8 + 4.8) / 5], dtype=torch.float64)
    pull = float((out - honest_share).norm())
    assert abs(pull - 6.0 / 5) < 1e-12 and pull <= statistics.median_low(norms[:4]) / 5 + 1e-12
    # and through the algorithm's aggregate (the server's and the simulator's path), float32 tensors, same numbers
    from pfl_edge.algorithms import get_algorithm
    from pfl_edge.federation import FederationConfig
    from pfl_edge.models import get_model

    algo = get_algorithm(FederationConfig.from_dict({"algorithm": "fedavg", "clients": 5, "model": "cnn"}),
                         get_model("cnn", num_classes=10, in_channels=1))
    g = torch.Generator().manual_seed(49)
    prev = {k: torch.randn(v.shape, generator=g) for k, v in algo.model.state_dict().items()}
    steps = [{k: torch.randn(v.shape, generator=g) for k, v in prev.items()} for _ in range(4)]
    sizes = (0.01, 0.012, 0.016, 0.02)
    sent = [{k: prev[k] + s * d[k] for k in prev} for s, d in zip(sizes, steps, strict=True)]
    flipped = {k: prev[k] - 1000 * (sent[0][k] - prev[k]) for k in prev}
    all_ = [(u, 1.0) for u in [*sent, flipped]]
    got = algo.aggregate(prev, all_, rule=DEFAULT_RULE)
    assert got is not None
    n = [update_norm(prev, u) for u, _ in all_]
    scale = [min(1.0, DEFAULT_RULE.norm_multiple * statistics.median_low(n[:i] + n[i + 1:]) / n[i]) for i in range(5)]
    assert n[4] * scale[4] == pytest.approx(statistics.median_low(n[:4]), rel=1e-12)  # held to the honest low median
    for k, p in prev.items():
        p64 = p.double()
        want_k = sum(p64 + (u[k].double() - p64) * c for (u, _), c in zip(all_, scale, strict=True)) / 5
        assert torch.allclose(got[k].double(), want_k, atol=1e-6), k
