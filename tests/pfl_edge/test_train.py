import pytest
import torch

from pfl_edge.data import get_dataset, partition
from pfl_edge.errors import ConfigError
from pfl_edge.models import get_model
from pfl_edge.seeding import generator, numpy_rng
from pfl_edge.train import ClientTensors, TrainConfig, batch_schedule, evaluate, stack_states, train

N_CLIENTS = 4


@pytest.fixture(scope="module")
def data() -> ClientTensors:
    ds = get_dataset("synthetic")
    p = partition("dirichlet:0.5", ds.train_y, ds.test_y, N_CLIENTS, 10, numpy_rng(0, "p"), samples_per_client=90)
    # unequal sizes on purpose: clients finish at different steps
    idx = [c.train_idx[: 40 + 15 * i] for i, c in enumerate(p.clients)]
    lab = [c.train_y[: 40 + 15 * i] for i, c in enumerate(p.clients)]
    return ClientTensors.build(ds.train_x, idx, lab)


def _gens() -> list[torch.Generator]:
    return [generator(0, "t", i) for i in range(N_CLIENTS)]


def _start(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # different starting points per client
    states = []
    for i in range(N_CLIENTS):
        torch.manual_seed(i)
        states.append({k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()})
    return stack_states(states)


def test_batch_schedule_visits_every_sample_once_per_epoch() -> None:
    n = torch.tensor([10, 7])
    idx, w = batch_schedule(n, 3, 4, [generator(0, "a"), generator(0, "b")])
    assert idx.shape == (9, 2, 4)  # client 0: 3 epochs x ceil(10/4) = 9 steps
    for c, nc in enumerate(n.tolist()):
        seen = idx[:, c][w[:, c] > 0]
        assert torch.equal(torch.bincount(seen, minlength=nc), torch.full((nc,), 3))
    assert w[6:, 1].sum() == 0  # client 1 has 3 x 2 = 6 steps, then sits out


@pytest.mark.parametrize("cfg", [
    TrainConfig(epochs=2, batch_size=16, lr=0.05, momentum=0.0),
    TrainConfig(epochs=2, batch_size=16, lr=0.05, momentum=0.9, weight_decay=5e-3),
    TrainConfig(epochs=1, batch_size=32, lr=0.1, momentum=0.5, clip_norm=0.5),
])
def test_vmap_engine_matches_torch_optim_loop(data: ClientTensors, cfg: TrainConfig) -> None:
    # in float64: the two engines run different convolution kernels, whose float32 rounding (which can depend on
    # the kernel chosen and on memory alignment) would otherwise be all this compares
    model = get_model("cnn", num_classes=10, in_channels=1).double()
    start = {k: v.double() for k, v in _start(model).items()}
    data = ClientTensors.of(data.x.double(), data.y, data.n)
    rows = torch.arange(N_CLIENTS)
    a = train(model, start, data, rows, cfg, _gens(), engine="vmap")
    b = train(model, start, data, rows, cfg, _gens(), engine="loop")
    assert torch.equal(a.steps, b.steps)
    assert a.steps.tolist() == [cfg.epochs * -(-(40 + 15 * i) // cfg.batch_size) for i in range(N_CLIENTS)]
    for k in start:
        assert torch.allclose(a.stack[k], b.stack[k], atol=1e-10, rtol=1e-8), k
        assert not torch.equal(a.stack[k], start[k]), f"{k} did not train"
    assert torch.allclose(a.loss, b.loss, atol=1e-10)


def test_frozen_parameters_do_not_move(data: ClientTensors) -> None:
    model = get_model("cnn", num_classes=10, in_channels=1)
    start = _start(model)
    trainable = ["head.weight", "head.bias"]
    for engine in ("vmap", "loop"):
        out = train(model, start, data, torch.arange(N_CLIENTS), TrainConfig(lr=0.1, weight_decay=0.1),
                    _gens(), trainable=trainable, engine=engine).stack
        for k in start:
            assert torch.equal(out[k], start[k]) != (k in trainable), (engine, k)


def test_masked_weights_stay_zero_through_momentum_and_weight_decay(data: ClientTensors) -> None:
    model = get_model("cnn", num_classes=10, in_channels=1)
    start = _start(model)
    g = torch.Generator().manual_seed(0)
    masks = {k: (torch.rand(start[k].shape, generator=g) < 0.3).float()
             for k in ("fc1.1.weight", "conv2.0.weight")}
    cfg = TrainConfig(epochs=2, batch_size=16, lr=0.1, momentum=0.9, weight_decay=0.01)
    outs = [train(model, start, data, torch.arange(N_CLIENTS), cfg, _gens(), masks=masks, engine=e).stack
            for e in ("vmap", "loop")]
    for out in outs:
        for k, m in masks.items():
            assert torch.all(out[k][m == 0] == 0)
            assert torch.all(out[k][m == 1] != start[k][m == 1])  # the active ones trained
    for k in start:
        assert torch.allclose(outs[0][k], outs[1][k], atol=2e-5, rtol=1e-4)


def test_batchnorm_models_use_the_loop_engine(data: ClientTensors) -> None:
    model = get_model("mobilenet-v1", num_classes=10, in_channels=1, norm="batch", width_mult=0.25)
    start = stack_states([model.state_dict()] * N_CLIENTS)
    with pytest.raises(ConfigError, match="buffers"):
        train(model, start, data, torch.arange(N_CLIENTS), TrainConfig(), _gens(), engine="vmap")
    out = train(model, start, data, torch.arange(N_CLIENTS), TrainConfig(batch_size=64), _gens()).stack
    key = "stem.1.running_mean"
    assert not torch.equal(out[key], start[key])  # running statistics were updated


def test_evaluate_matches_plain_forward(data: ClientTensors) -> None:
    model = get_model("cnn", num_classes=10, in_channels=1)
    start = _start(model)
    rows = torch.arange(N_CLIENTS)
    acc, loss = evaluate(model, start, data, rows, chunk=7)
    for c in range(N_CLIENTS):
        model.load_state_dict({k: v[c] for k, v in start.items()})
        n = int(data.n[c])
        with torch.no_grad():
            logits = model(data.x[c, :n])
        assert acc[c].item() == pytest.approx((logits.argmax(1) == data.y[c, :n]).float().mean().item())
        assert loss[c].item() == pytest.approx(
            torch.nn.functional.cross_entropy(logits, data.y[c, :n]).item(), rel=1e-5)


def test_training_learns(data: ClientTensors) -> None:
    model = get_model("cnn", num_classes=10, in_channels=1)
    start = stack_states([model.state_dict()] * N_CLIENTS)
    rows = torch.arange(N_CLIENTS)
    before, _ = evaluate(model, start, data, rows)
    out = train(model, start, data, rows, TrainConfig(epochs=8, lr=0.05), _gens()).stack
    after, _ = evaluate(model, out, data, rows)
    assert after.mean() > before.mean() + 0.3


@pytest.mark.parametrize("kw", [dict(epochs=-1), dict(batch_size=0), dict(lr=0.0), dict(lr=float("nan")),
                                dict(momentum=1.0), dict(weight_decay=-1.0), dict(clip_norm=0.0)])
def test_bad_train_config(kw: dict) -> None:
    with pytest.raises(ConfigError):
        TrainConfig(**kw)


@pytest.mark.parametrize("unmasked", [True, False])
@pytest.mark.parametrize("engine", ["vmap", "loop"])
def test_clipping_before_or_after_the_mask_matches_a_hand_computed_step(data: ClientTensors, engine: str,
                                                                      unmasked: bool) -> None:
    """One full-batch step under a mask with clipping: the DisPFL reference clips the whole gradient and then
    masks it; the other order clips the masked gradient. Checked against the step computed by hand in float64."""
    import torch.nn.functional as F
    from torch.func import functional_call

    model = get_model("cnn", num_classes=10, in_channels=1)
    start = _start(model)
    g = torch.Generator().manual_seed(1)
    masks = {k: (torch.rand(start[k].shape, generator=g) < 0.5).float() for k, _ in model.named_parameters()
             if start[k].dim() > 1}
    n = int(data.n[0])
    cfg = TrainConfig(epochs=1, batch_size=n, lr=0.1, momentum=0.0, clip_norm=0.05, clip_unmasked=unmasked)
    rows = torch.tensor([0])
    res = train(model, {k: v[:1] for k, v in start.items()}, data, rows, cfg, [generator(0, "t", 0)],
                masks={k: m[:1] for k, m in masks.items()}, engine=engine)
    # by hand, float64: the gradient at w * m over the client's n samples, clipped in the chosen order
    w0 = {k: (v[0] * masks[k][0] if k in masks else v[0]).double() for k, v in start.items()}
    params = {k: w0[k].clone().requires_grad_(True) for k, _ in model.named_parameters()}
    logits = functional_call(model.double(), params, (data.x[0, :n].double(),))
    model.float()
    grads = dict(zip(params, torch.autograd.grad(F.cross_entropy(logits, data.y[0, :n]), list(params.values())),
                     strict=True))
    masked = {k: gr * masks[k][0].double() if k in masks else gr for k, gr in grads.items()}
    norm = torch.sqrt(sum((gr ** 2).sum() for gr in (grads if unmasked else masked).values()))
    coef = min(1.0, cfg.clip_norm / (float(norm) + 1e-6))
    assert coef < 0.5  # the clip really bites
    for k, gr in masked.items():
        want = w0[k] - cfg.lr * coef * gr
        torch.testing.assert_close(res.stack[k][0].double(), want, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("engine", ["vmap", "loop"])
def test_the_proximal_term_matches_a_hand_computed_step(data: ClientTensors, engine: str) -> None:
    """Two full-batch steps with momentum on F(w) + (lam/2)||w - a||^2 (Ditto's personal objective), against the
    same two steps computed by hand in float64, where a tensor without an anchor feels no pull."""
    import torch.nn.functional as F
    from torch.func import functional_call

    model = get_model("cnn", num_classes=10, in_channels=1)
    start = _start(model)
    names = [k for k, _ in model.named_parameters()]
    torch.manual_seed(7)
    anchor = {k: start[k][:1] + 0.5 * torch.randn_like(start[k][:1]) for k in names[:-1]}  # the last: none
    n = int(data.n[0])
    cfg = TrainConfig(epochs=2, batch_size=n, lr=0.1, momentum=0.5, prox=0.7)
    res = train(model, {k: v[:1] for k, v in start.items()}, data, torch.tensor([0]), cfg, [generator(0, "t", 0)],
                anchor=anchor, engine=engine)
    w = {k: start[k][0].double() for k in names}
    buf: dict[str, torch.Tensor] = {}
    m64 = model.double()
    for _ in range(2):
        params = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        loss = F.cross_entropy(functional_call(m64, params, (data.x[0, :n].double(),)), data.y[0, :n])
        grads = dict(zip(names, torch.autograd.grad(loss, list(params.values())), strict=True))
        for k in names:
            g = grads[k] + (cfg.prox * (w[k] - anchor[k][0].double()) if k in anchor else 0.0)
            buf[k] = g if k not in buf else cfg.momentum * buf[k] + g
            w[k] = w[k] - cfg.lr * buf[k]
    model.float()
    for k in names:
        torch.testing.assert_close(res.stack[k][0].double(), w[k], atol=2e-6, rtol=1e-4)
    # and the pull is real: without it the anchored tensors end elsewhere
    free = train(model, {k: v[:1] for k, v in start.items()}, data, torch.tensor([0]), cfg, [generator(0, "t", 0)],
                 engine=engine)
    assert max(float((free.stack[k] - res.stack[k]).abs().max()) for k in anchor) > 1e-3


def test_a_bad_proximal_term_or_anchor_is_refused(data: ClientTensors) -> None:
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="prox"):
            TrainConfig(prox=bad)
    model = get_model("cnn", num_classes=10, in_channels=1)
    start = {k: v[:1] for k, v in _start(model).items()}
    k = next(iter(start))
    with pytest.raises(ConfigError, match="anchor"):
        train(model, start, data, torch.tensor([0]), TrainConfig(prox=0.1), [generator(0, "t", 0)],
              anchor={k: torch.zeros(3)})
