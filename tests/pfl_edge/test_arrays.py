"""The one array interface: each function the rounds use gives the same numbers on numpy arrays (a device without
torch) as on torch tensors (the simulator), and each is checked against an independent computation."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from pfl_edge.arrays import select_largest, select_smallest
from pfl_edge.neighbourhood import neighbourhood_average
from pfl_edge.seeding import MT, Stream, mt_stream, stream
from pfl_edge.sgd import SGD, TrainConfig, epoch_batches
from pfl_edge.sparse import erk_densities, init_masks, prune_regrow
from pfl_edge.train import batch_schedule


def _np(d: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.numpy().copy() for k, v in d.items()}


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        x = a[k].numpy() if isinstance(a[k], torch.Tensor) else a[k]
        y = b[k].numpy() if isinstance(b[k], torch.Tensor) else b[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert np.array_equal(x, y), k


@pytest.mark.parametrize("largest", [False, True])
def test_selection_breaks_ties_by_the_lower_index_on_both(largest: bool) -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        x = rng.integers(0, 4, n).astype(np.float32)  # many ties
        x[rng.random(n) < 0.2] = np.inf if not largest else -np.inf
        k = int(rng.integers(0, n + 1))
        # the reference: a stable sort by value (descending for largest), the first k, as a set
        order = sorted(range(n), key=lambda i: (-x[i] if largest else x[i], i))
        want = sorted(order[:k])
        sel = select_largest if largest else select_smallest
        assert sel(x, k).tolist() == want
        assert sel(torch.from_numpy(x), k).tolist() == want


def test_init_masks_are_the_same_from_mt_and_from_torch() -> None:
    shapes = {"a.weight": (8, 4, 3, 3), "a.bias": (8,), "b.weight": (10, 72)}
    dens = erk_densities(shapes, 0.5)
    t = init_masks(shapes, dens, stream(3, Stream.MASK, 7))
    n = init_masks(shapes, dens, mt_stream(3, Stream.MASK, 7))
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in n.values())
    _same(t, n)
    assert int(n["b.weight"].sum()) == int(dens["b.weight"] * 720)


@pytest.mark.parametrize("regrow", ["gradient", "random"])
def test_prune_regrow_is_the_same_on_numpy_and_torch(regrow: str) -> None:
    g = torch.Generator().manual_seed(1)
    shapes = {"w": (20, 30), "v": (50,)}
    masks = init_masks(shapes, {"w": 0.3, "v": 0.5}, torch.Generator().manual_seed(2))
    weights = {k: torch.randn(s, generator=g) * masks[k] for k, s in shapes.items()}
    grads = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    grads["w"][:5] = 0.0  # ties among the candidates
    if regrow == "gradient":
        t = prune_regrow(weights, masks, 0.4, grads=grads)
        n = prune_regrow(_np(weights), _np(masks), 0.4, grads=_np(grads))
    else:
        t = prune_regrow(weights, masks, 0.4, gen=torch.Generator().manual_seed(9))
        n = prune_regrow(_np(weights), _np(masks), 0.4, gen=MT(9))
    _same(t, n)
    for k in shapes:  # and it did something: ones kept, some moved
        assert int(n[k].sum()) == int(masks[k].sum())
        assert not np.array_equal(n[k], masks[k].numpy())


def test_neighbourhood_average_is_the_same_on_numpy_and_torch() -> None:
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(4, 6, 5, generator=g), "b": torch.randn(4, 3, generator=g)}
    m = {"a": (torch.rand(4, 6, 5, generator=g) < 0.5).float()}
    mixing = torch.tensor([[1.0, 1, 0, 1], [0, 1, 1, 0], [1, 1, 1, 1]])
    t = neighbourhood_average(w, mixing, m)
    n = neighbourhood_average(_np(w), mixing.numpy(), _np(m))
    _same(t, n)
    # against a float64 hand computation: sum of w*m over the sum of m, 0 where nothing covers
    wa, ma = w["a"].double().numpy(), m["a"].double().numpy()
    for i in range(3):
        pick = mixing[i].numpy() > 0
        num, den = (wa * ma)[pick].sum(0), ma[pick].sum(0)
        ref = np.where(den > 0, num / np.maximum(den, 1), 0.0)
        assert np.allclose(n["a"][i], ref, atol=1e-6)
        assert np.allclose(n["b"][i], w["b"].double().numpy()[pick].mean(0), atol=1e-6)


def test_epoch_batches_are_batch_schedules_rows() -> None:
    n, gens = [23, 9], [stream(0, Stream.TRAIN, 1, c) for c in range(2)]
    idx, w = batch_schedule(torch.tensor(n), 2, 5, gens)
    for c in range(2):
        mine = epoch_batches(n[c], 2, 5, mt_stream(0, Stream.TRAIN, 1, c))
        rows = [idx[s, c][w[s, c] > 0].numpy() for s in range(idx.shape[0]) if w[s, c].sum() > 0]
        assert len(mine) == len(rows) == 2 * math.ceil(n[c] / 5)
        assert all(np.array_equal(a, b) for a, b in zip(mine, rows, strict=True))


@pytest.mark.parametrize("cfg", [
    TrainConfig(lr=0.1, momentum=0.9, weight_decay=1e-3, clip_norm=0.5),
    TrainConfig(lr=0.05, momentum=0.0, clip_norm=0.5, clip_unmasked=True, prox=0.3),
    TrainConfig(lr=0.1, momentum=0.5),
])
def test_sgd_is_torch_optim_sgd_on_numpy_and_torch(cfg: TrainConfig) -> None:
    g = torch.Generator().manual_seed(4)
    w0 = {"a": torch.randn(5, 4, generator=g), "b": torch.randn(7, generator=g)}
    mask = {"a": (torch.rand(5, 4, generator=g) < 0.6).float()}
    anchor = {k: torch.randn(v.shape, generator=g) for k, v in w0.items()}
    steps = [{k: 3 * torch.randn(v.shape, generator=g) for k, v in w0.items()} for _ in range(4)]
    # the reference: torch.optim.SGD with the gradients prepared as pfl_edge.train's loop engine does
    ref = {k: (v * mask.get(k, 1.0)).clone().requires_grad_(False) for k, v in w0.items()}
    opt = torch.optim.SGD(list(ref.values()), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    for st in steps:
        for k, p in ref.items():
            p.grad = st[k] + (cfg.prox * (p - anchor[k]) if cfg.prox else 0)
        if cfg.clip_unmasked:
            torch.nn.utils.clip_grad_norm_(list(ref.values()), cfg.clip_norm)
        ref["a"].grad.mul_(mask["a"])
        if not cfg.clip_unmasked and cfg.clip_norm:
            torch.nn.utils.clip_grad_norm_(list(ref.values()), cfg.clip_norm)
        opt.step()
        ref["a"].mul_(mask["a"])
    for kind in ("torch", "numpy"):
        conv = (lambda d: {k: v.clone() for k, v in d.items()}) if kind == "torch" else _np
        w = conv({k: v * mask.get(k, 1.0) for k, v in w0.items()})
        sgd = SGD(w, cfg, conv(mask), conv(anchor))
        for st in steps:
            sgd.step(conv(st))
        for k in ref:
            got = w[k].numpy() if kind == "torch" else w[k]
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, ref[k].numpy(), rtol=0, atol=2e-6, err_msg=f"{kind} {k}")
        assert not np.allclose(w["b"], w0["b"].numpy())  # it moved


def test_the_round_functions_import_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "import numpy as np\n"
            "from pfl_edge.sparse import init_masks, prune_regrow\n"
            "from pfl_edge.seeding import MT\n"
            "import pfl_edge.algorithms, pfl_edge.neighbourhood, pfl_edge.sgd\n"
            "m = init_masks({'w': (6, 5)}, {'w': 0.5}, MT(1))\n"
            "w = {'w': np.arange(30, dtype=np.float32).reshape(6, 5) * m['w']}\n"
            "print(int(prune_regrow(w, m, 0.5, gen=MT(2))['w'].sum()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "15"
