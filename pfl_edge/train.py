"""Local training and evaluation of many clients at once.

Client states are *stacks*: ``dict[str, Tensor]`` whose tensors carry a leading client dimension. Two engines
train a stack with identical semantics (plain SGD as ``torch.optim.SGD`` defines it, per-client shuffling,
a partial last batch, optional masks and gradient clipping):

- ``vmap``: every client's step in one call (``torch.func.vmap`` over ``grad``), which turns per-client small
  batches into one large batched computation. Used whenever the model has no buffers.
- ``loop``: one client after another with ``torch.optim.SGD``; the reference, and the engine for models with
  buffers (BatchNorm's running statistics cannot be updated under vmap).

The tests check that both give the same weights.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from .arrays import Stack, is_broadcast, stack_states, unstack
from .errors import ConfigError
from .sgd import TrainConfig, TrainResult, epoch_batches

__all__ = [
    "ClientTensors",
    "Engine",
    "Stack",
    "TrainConfig",
    "TrainResult",
    "batch_schedule",
    "dense_gradients",
    "evaluate",
    "index_stack",
    "stack_states",
    "train",
    "unstack",
]

Engine = Literal["auto", "vmap", "loop"]


@dataclass(frozen=True, eq=False)
class ClientTensors:
    """Every client's samples, padded to one length: ``idx`` (C, n_max) into ``images`` (the data set's own
    tensor, shared rather than copied: a simulation holds its data set once), ``y`` (C, n_max), ``n`` (C,).
    ``take(rows, cols)`` gathers samples; ``x`` materialises (C, n_max, ...) for small uses."""

    images: Tensor
    idx: Tensor
    y: Tensor
    n: Tensor

    @staticmethod
    def build(images: Tensor, indices: Sequence[Tensor], labels: Sequence[Tensor]) -> ClientTensors:
        n = torch.tensor([len(i) for i in indices], dtype=torch.int64)
        n_max = int(n.max()) if len(n) else 0
        idx = torch.zeros((len(indices), n_max), dtype=torch.int64)  # past a client's n: sample 0, never read
        y = torch.zeros((len(indices), n_max), dtype=torch.int64)
        for c, (ix, lab) in enumerate(zip(indices, labels, strict=True)):
            idx[c, : len(ix)] = torch.as_tensor(ix, dtype=torch.int64)
            y[c, : len(ix)] = lab
        return ClientTensors(images, idx, y, n)

    @staticmethod
    def of(x: Tensor, y: Tensor, n: Tensor) -> ClientTensors:
        """From padded samples ``x`` (C, n_max, ...)."""
        c, n_max = x.shape[:2]
        return ClientTensors(x.reshape(c * n_max, *x.shape[2:]), torch.arange(c * n_max).reshape(c, n_max), y, n)

    def take(self, rows: Tensor | int, cols: Tensor | slice) -> Tensor:
        """Samples ``[rows, cols]`` of the padded (C, n_max, ...) view, gathered from ``images``."""
        return self.images[self.idx[rows, cols]]

    @property
    def x(self) -> Tensor:
        return self.images[self.idx]

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.images.shape[1:])

    def shard(self, a: int, b: int) -> ClientTensors:
        """Clients ``a..b`` in tensors of their own, holding only their samples (what a remote worker is sent)."""
        n_max = self.idx.shape[1]
        return ClientTensors(self.images[self.idx[a:b].reshape(-1)], torch.arange((b - a) * n_max).reshape(-1, n_max),
                             self.y[a:b].clone(), self.n[a:b].clone())


def index_stack(stack: Mapping[str, Tensor], rows: Tensor) -> Stack:
    """Rows ``rows`` of every tensor; one model seen in every row (``arrays.broadcast_rows``) stays a view."""
    return {k: v[:1].expand(len(rows), *v.shape[1:]) if is_broadcast(v) else v[rows] for k, v in stack.items()}


def batch_schedule(n: Tensor, epochs: int, batch_size: int,
                   gens: Sequence[torch.Generator]) -> tuple[Tensor, Tensor]:
    """Sample indices ``(S, C, B)`` and validity weights ``(S, C, B)`` for every client's steps: each epoch a
    fresh permutation from the client's own generator, the last batch of an epoch partial. Clients with fewer
    steps than the longest get all-zero weights at the end (they sit out)."""
    per_client = [epoch_batches(int(n[c]), epochs, batch_size, gen) for c, gen in enumerate(gens)]
    s_max = max((len(s) for s in per_client), default=0)
    idx = torch.zeros((s_max, len(gens), batch_size), dtype=torch.int64)
    w = torch.zeros((s_max, len(gens), batch_size), dtype=torch.float32)
    for c, steps in enumerate(per_client):
        for s, b in enumerate(steps):
            idx[s, c, : len(b)] = b
            w[s, c, : len(b)] = 1.0
    return idx, w


def _engine(model: nn.Module, engine: Engine) -> Literal["vmap", "loop"]:
    has_buffers = any(True for _ in model.buffers())
    if engine == "auto":
        return "loop" if has_buffers else "vmap"
    if engine == "vmap" and has_buffers:
        raise ConfigError("the vmap engine cannot train models with buffers (BatchNorm); use engine='loop'")
    return engine


def train(
    model: nn.Module,
    stack: Mapping[str, Tensor],
    data: ClientTensors,
    rows: Tensor,
    cfg: TrainConfig,
    gens: Sequence[torch.Generator],
    *,
    trainable: Collection[str] | None = None,
    masks: Mapping[str, Tensor] | None = None,
    anchor: Mapping[str, Tensor] | None = None,
    engine: Engine = "auto",
    out: Mapping[str, Tensor] | None = None,
) -> TrainResult:
    """Train client ``rows[c]`` of ``data`` from state ``stack[*][c]`` for ``cfg.epochs`` epochs.

    ``trainable``: parameter names to update (default: all parameters); the rest stay fixed. ``masks``: 0/1
    tensors stacked like ``stack`` for some parameters; gradients are masked and the mask is re-applied after
    every step, so masked-out weights stay zero. ``anchor``: tensors stacked like ``stack`` that the proximal
    term ``cfg.prox`` pulls the trained weights towards (ignored when ``cfg.prox`` is 0). Returns a new stack
    (``out``: written into those tensors, shaped like ``stack``, e.g. shared memory a caller reads); the input is
    not modified, and may be read-only (``arrays.broadcast_rows``).
    """
    if len(rows) != len(gens):
        raise ConfigError(f"{len(rows)} clients but {len(gens)} generators")
    param_names = [k for k, _ in model.named_parameters()]
    names = list(param_names if trainable is None else [k for k in param_names if k in set(trainable)])
    unknown = set(trainable or ()) - set(param_names)
    if unknown:
        raise ConfigError(f"trainable names that are not parameters: {sorted(unknown)}")
    pull = _anchor(anchor, names, stack, cfg)
    idx, w = batch_schedule(data.n[rows], cfg.epochs, cfg.batch_size, gens)
    chosen = _engine(model, engine)
    fn = _train_vmap if chosen == "vmap" else _train_loop
    return fn(model, stack, data, rows, cfg, idx, w, names, masks or {}, pull, _output(stack, out))


def _output(stack: Mapping[str, Tensor], out: Mapping[str, Tensor] | None) -> dict[str, Tensor]:
    """Where a training writes its result: ``out`` (checked against the stack), else new tensors."""
    if out is None:
        return {k: torch.empty(v.shape, dtype=v.dtype) for k, v in stack.items()}
    if out.keys() != stack.keys() or any(out[k].shape != v.shape for k, v in stack.items()):
        raise ConfigError("the output stack must have the input stack's keys and shapes")
    return dict(out)


def _anchor(anchor: Mapping[str, Tensor] | None, names: Sequence[str], stack: Mapping[str, Tensor],
            cfg: TrainConfig) -> dict[str, Tensor]:
    """The anchors of the trained tensors, checked against the stack's shapes; none without a proximal term."""
    if not cfg.prox or anchor is None:
        return {}
    out = {k: anchor[k] for k in names if k in anchor}
    for k, a in out.items():
        if a.shape != stack[k].shape:
            raise ConfigError(f"anchor {k} has shape {tuple(a.shape)}, the stack {tuple(stack[k].shape)}")
    return out


def _pull(grads: dict[str, Tensor], params: Mapping[str, Tensor], anchor: Mapping[str, Tensor], prox: float) -> None:
    """The proximal term's gradient, prox (w - anchor), added in place."""
    for k, a in anchor.items():
        if k in grads:
            grads[k].add_(params[k] - a, alpha=prox)


def _train_vmap(model: nn.Module, stack: Mapping[str, Tensor], data: ClientTensors, rows: Tensor,
                cfg: TrainConfig, idx: Tensor, w: Tensor, names: list[str],
                masks: Mapping[str, Tensor], anchor: Mapping[str, Tensor], out: dict[str, Tensor]) -> TrainResult:
    for k, v in stack.items():
        out[k].copy_(v.detach())
    fixed = {k: v for k, v in out.items() if k not in set(names)}
    params = {k: out[k] for k in names}
    for k, m in masks.items():
        out[k].mul_(m)  # training starts from w * m
    bufs = {k: torch.zeros_like(v) for k, v in params.items()} if cfg.momentum else {}
    n_clients = len(rows)

    def loss_fn(p: dict[str, Tensor], f: dict[str, Tensor], x: Tensor, y: Tensor, wt: Tensor) -> Tensor:
        logits = functional_call(model, {**p, **f}, (x,))
        losses = F.cross_entropy(logits, y, reduction="none")
        return (losses * wt).sum() / wt.sum().clamp_min(1.0)

    step_fn = vmap(grad_and_value(loss_fn))
    loss_sum = torch.zeros(n_clients)
    steps = torch.zeros(n_clients, dtype=torch.int64)
    row_col = rows[:, None]
    was_training = model.training
    model.train()
    try:
        for s in range(idx.shape[0]):
            x = data.take(row_col, idx[s])
            y = data.y[row_col, idx[s]]
            wt = w[s]
            active = wt.sum(dim=1) > 0  # (C,)
            grads, loss = step_fn(params, fixed, x, y, wt)
            with torch.no_grad():
                loss_sum += torch.where(active, loss, 0.0)
                steps += active.to(torch.int64)
                _pull(grads, params, anchor, cfg.prox)
                _sgd_step(params, grads, bufs, masks, active, cfg)
    finally:
        model.train(was_training)
    n = data.n[rows]
    return TrainResult(out, loss_sum / steps.clamp_min(1), steps, n * cfg.epochs)


def _sgd_step(params: dict[str, Tensor], grads: dict[str, Tensor], bufs: dict[str, Tensor],
              masks: Mapping[str, Tensor], active: Tensor, cfg: TrainConfig) -> None:
    """One ``torch.optim.SGD`` step (dampening 0, no Nesterov) for every active client, in place."""
    if cfg.clip_unmasked:
        _clip(grads, cfg.clip_norm)
    for k, m in masks.items():
        if k in grads:
            grads[k].mul_(m)
    if not cfg.clip_unmasked:
        _clip(grads, cfg.clip_norm)
    for k, p in params.items():
        g = grads[k]
        if cfg.weight_decay:
            g = g.add(p, alpha=cfg.weight_decay)
        act = active.view(-1, *([1] * (p.dim() - 1)))
        if cfg.momentum:
            buf = bufs[k]
            buf.copy_(torch.where(act, buf * cfg.momentum + g, buf))
            g = buf
        p.copy_(torch.where(act, p - cfg.lr * g, p))
        if k in masks:
            p.mul_(masks[k])


def _clip(grads: dict[str, Tensor], clip_norm: float | None) -> None:
    """clip_grad_norm_ per client: total norm over its tensors, coefficient max/(norm + 1e-6) capped at 1."""
    if clip_norm is None:
        return
    sq = sum(g.flatten(1).pow(2).sum(1) for g in grads.values())
    if not isinstance(sq, Tensor):
        return  # nothing trainable
    coef = (clip_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads.values():
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))


def _train_loop(model: nn.Module, stack: Mapping[str, Tensor], data: ClientTensors, rows: Tensor,
                cfg: TrainConfig, idx: Tensor, w: Tensor, names: list[str],
                masks: Mapping[str, Tensor], anchor: Mapping[str, Tensor], out: dict[str, Tensor]) -> TrainResult:
    n_clients = len(rows)
    loss_sum = torch.zeros(n_clients)
    steps = torch.zeros(n_clients, dtype=torch.int64)
    named = dict(model.named_parameters())
    was_training = model.training
    model.train()
    train_params = [named[k] for k in names]
    for k, p in named.items():
        p.requires_grad_(k in names)
    # one optimizer for every client, its momentum buffers dropped between clients: the same steps as a fresh
    # torch.optim.SGD per client, without its set-up per client (which dominates for clients of a few batches)
    opt = torch.optim.SGD(train_params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    try:
        for c in range(n_clients):
            model.load_state_dict(unstack(stack, c))
            opt.state.clear()
            cmask = {k: m[c] for k, m in masks.items()}
            canchor = {k: a[c] for k, a in anchor.items()}
            with torch.no_grad():
                for k, m in cmask.items():
                    named[k].mul_(m)
            r = int(rows[c])
            for s in range(idx.shape[0]):
                valid = w[s, c] > 0
                if not valid.any():
                    break
                b = idx[s, c][valid]
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(data.take(r, b)), data.y[r, b])
                loss.backward()
                if canchor:
                    with torch.no_grad():
                        for k, a in canchor.items():
                            named[k].grad.add_(named[k] - a, alpha=cfg.prox)  # type: ignore[union-attr]
                if cfg.clip_norm is not None and cfg.clip_unmasked:
                    torch.nn.utils.clip_grad_norm_(train_params, cfg.clip_norm)
                for k, m in cmask.items():
                    if named[k].grad is not None:
                        named[k].grad.mul_(m)  # type: ignore[union-attr]
                if cfg.clip_norm is not None and not cfg.clip_unmasked:
                    torch.nn.utils.clip_grad_norm_(train_params, cfg.clip_norm)
                opt.step()
                with torch.no_grad():
                    for k, m in cmask.items():
                        named[k].mul_(m)
                loss_sum[c] += loss.detach()
                steps[c] += 1
            state = model.state_dict()
            for k in out:
                out[k][c] = state[k].detach()
    finally:
        for p in model.parameters():
            p.requires_grad_(True)
        model.train(was_training)
    n = data.n[rows]
    return TrainResult(out, loss_sum / steps.clamp_min(1), steps, n * cfg.epochs)


@torch.no_grad()
def evaluate(model: nn.Module, stack: Mapping[str, Tensor], data: ClientTensors, rows: Tensor,
             *, chunk: int = 1000) -> tuple[Tensor, Tensor]:
    """Accuracy and mean loss ``(C,)`` of client ``rows[c]``'s model ``stack[*][c]`` on its own samples.

    One client at a time: for a forward pass alone, vmap's grouped convolutions are slower than the plain
    loop (measured: 2.5x slower for the cnn)."""
    n_clients = len(rows)
    n = data.n[rows]
    correct = torch.zeros(n_clients)
    loss_sum = torch.zeros(n_clients)
    was_training = model.training
    model.eval()
    try:
        for c in range(n_clients):
            model.load_state_dict(unstack(stack, c))
            r, nc = int(rows[c]), int(n[c])
            for s in range(0, nc, chunk):
                x, y = data.take(r, slice(s, min(s + chunk, nc))), data.y[r, s: min(s + chunk, nc)]
                logits = model(x)
                correct[c] += (logits.argmax(-1) == y).sum()
                loss_sum[c] += F.cross_entropy(logits, y, reduction="sum")
    finally:
        model.train(was_training)
    denom = n.clamp_min(1).float()
    return correct / denom, loss_sum / denom


def dense_gradients(model: nn.Module, stack: Mapping[str, Tensor], data: ClientTensors, rows: Tensor,
                    batch_size: int, gens: Sequence[torch.Generator]) -> Stack:
    """Per client, the gradient of the loss on one random local batch with respect to *every* parameter,
    including those a mask holds at zero: DisPFL's regrowth screen. (Gradients of ``w * m`` with respect
    to ``w`` would be masked; here the weights are the variables, so zeros get a gradient too.)"""
    names = [k for k, _ in model.named_parameters()]
    out = {k: torch.zeros_like(stack[k]) for k in names}
    named = dict(model.named_parameters())
    was_training = model.training
    model.train()
    try:
        for c in range(len(rows)):
            model.load_state_dict(unstack(stack, c))
            r, n = int(rows[c]), int(data.n[rows[c]])
            b = torch.randperm(n, generator=gens[c])[:batch_size]
            loss = F.cross_entropy(model(data.take(r, b)), data.y[r, b])
            grads = torch.autograd.grad(loss, [named[k] for k in names])
            for k, g in zip(names, grads, strict=True):
                out[k][c] = g
    finally:
        model.train(was_training)
    return out
