import pytest
import torch

from pfl_edge.aggregate import RunningAverage, weighted_average
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
