import math

import pytest
import torch

from pfl_edge.errors import ConfigError
from pfl_edge.models import get_model
from pfl_edge.sparse import density_of, erk_densities, init_masks, prune_rate, prune_regrow

SHAPES = {"a": (10, 10), "b": (4, 5), "c": (5,)}


def test_erk_hand_computed() -> None:
    # raw: a = 20/100 = 0.2, b = 9/20 = 0.45, c = 5/5 = 1. d = 0.5:
    # all sparse: eps = 62.5 / 34 = 1.84, c would exceed 1 -> dense;
    # then eps = (0.5 * 120 - 0.5 * 5) / (20 + 9) = 57.5 / 29; b = 0.45 eps = 0.892 < 1, stop.
    d = erk_densities(SHAPES, 0.5)
    eps = 57.5 / 29
    assert d == pytest.approx({"a": 0.2 * eps, "b": 0.45 * eps, "c": 1.0})
    # d = 0.8: c dense, then b (0.45 * 95/29 > 1) dense, then a = 0.2 * 75/20 = 0.75
    assert erk_densities(SHAPES, 0.8) == pytest.approx({"a": 0.75, "b": 1.0, "c": 1.0})


@pytest.mark.parametrize("density", [0.05, 0.2, 0.5, 0.8, 1.0])
def test_erk_meets_the_overall_density_on_real_models(density: float) -> None:
    for name in ("cnn", "resnet18-gn"):
        model = get_model(name, num_classes=10, in_channels=3, image_size=32)
        shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
        d = erk_densities(shapes, density)
        total = sum(math.prod(s) for s in shapes.values())
        assert sum(d[k] * math.prod(s) for k, s in shapes.items()) / total == pytest.approx(density)
        assert all(0 < v <= 1 for v in d.values())
        assert all(d[k] == 1.0 for k, s in shapes.items() if len(s) == 1)  # 1-D tensors come out dense


def test_init_masks_exact_counts_and_seeded() -> None:
    d = erk_densities(SHAPES, 0.5)
    m1 = init_masks(SHAPES, d, torch.Generator().manual_seed(1))
    m2 = init_masks(SHAPES, d, torch.Generator().manual_seed(1))
    m3 = init_masks(SHAPES, d, torch.Generator().manual_seed(2))
    for k, s in SHAPES.items():
        assert m1[k].shape == s and int(m1[k].sum()) == int(d[k] * math.prod(s))
        assert torch.equal(m1[k], m2[k])
    assert not torch.equal(m1["a"], m3["a"])
    assert density_of(m1, SHAPES) == pytest.approx((39 + 17 + 5) / 125)


def test_prune_rate_is_cosine_annealed() -> None:
    assert prune_rate(0.5, 0, 100) == pytest.approx(0.5)
    assert prune_rate(0.5, 50, 100) == pytest.approx(0.25)
    assert prune_rate(0.5, 100, 100) == pytest.approx(0.0, abs=1e-12)


def _setup() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    masks = init_masks(SHAPES, {"a": 0.4, "b": 0.5, "c": 1.0}, g)
    weights = {k: torch.randn(s, generator=g) * masks[k] for k, s in SHAPES.items()}
    grads = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    return weights, masks, grads


@pytest.mark.parametrize("mode", ["gradient", "random"])
def test_prune_regrow_invariants(mode: str) -> None:
    w, m, g = _setup()
    alpha = 0.3
    kw = {"grads": g} if mode == "gradient" else {"gen": torch.Generator().manual_seed(5)}
    nm = prune_regrow(w, m, alpha, **kw)
    for k in SHAPES:
        assert int(nm[k].sum()) == int(m[k].sum())  # nnz preserved per tensor
    assert torch.equal(nm["c"], m["c"])  # dense tensor untouched
    a_old, a_new = m["a"].bool(), nm["a"].bool()
    k_swap = math.ceil(alpha * int(a_old.sum()))
    # pruned: exactly k_swap active weights leave the mask (some may be regrown at once), the smallest magnitudes
    left = a_old & ~a_new
    assert 0 < int(left.sum()) <= k_swap
    mag = torch.where(a_old, w["a"].abs(), torch.inf).flatten()
    smallest = set(torch.topk(mag, k_swap, largest=False).indices.tolist())
    assert set(left.flatten().nonzero().flatten().tolist()) <= smallest
    # regrown: as many new positions as left, all outside the old mask or re-grown pruned ones
    assert int((a_new & ~a_old).sum()) == int(left.sum())


def test_regrow_by_gradient_takes_the_largest_gradients_among_zeros() -> None:
    w, m, g = _setup()
    alpha = 0.25
    nm = prune_regrow(w, m, alpha, grads=g)
    # reference by hand: prune ceil(alpha * nnz) smallest |w|, grow the same number among the remaining zeros
    flat_m, flat_w, flat_g = m["a"].flatten(), w["a"].flatten(), g["a"].flatten()
    active = flat_m.nonzero().flatten().tolist()
    k = math.ceil(alpha * len(active))
    drop = sorted(active, key=lambda i: abs(float(flat_w[i])))[:k]
    after = set(active) - set(drop)
    zeros = [i for i in range(flat_m.numel()) if i not in after]
    grow = sorted(zeros, key=lambda i: -abs(float(flat_g[i])))[:k]
    assert set(nm["a"].flatten().nonzero().flatten().tolist()) == after | set(grow)


def test_prune_regrow_needs_one_regrowth_source() -> None:
    w, m, g = _setup()
    with pytest.raises(ConfigError):
        prune_regrow(w, m, 0.2)
    with pytest.raises(ConfigError):
        prune_regrow(w, m, 0.2, grads=g, gen=torch.Generator())
    with pytest.raises(ConfigError):
        erk_densities(SHAPES, 0.0)
