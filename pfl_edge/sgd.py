"""Local SGD as a device and the simulator run it: its configuration, its result, and one client's step over
a model's tensors (torch or numpy: ``pfl_edge.arrays``), written once.

``TrainConfig`` is SGD as ``torch.optim.SGD`` defines it (dampening 0, no Nesterov), plus gradient clipping
(``clip_grad_norm_``), masks and a proximal term; ``SGD`` applies it to one client's tensors given their
gradients: a device's ExecuTorch backend steps with it after its program has computed them, on numpy arrays. The
simulator's engines (``pfl_edge.train``) run the same step in torch over many clients (the loop engine with
``torch.optim.SGD``, the vmap engine batched); tests hold all three to ``torch.optim.SGD``, equal to float32
rounding (``SGD`` sums the clipping norm in float64).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .arrays import Array, Stack, copy, is_numpy, randperm
from .errors import ConfigError
from .seeding import MT

if TYPE_CHECKING:
    import torch

__all__ = ["SGD", "TrainConfig", "TrainResult", "epoch_batches"]


@dataclass(frozen=True)
class TrainConfig:
    """Local SGD. ``momentum`` and ``weight_decay`` as in ``torch.optim.SGD``; ``clip_norm`` as
    ``clip_grad_norm_`` (per client, over its trainable tensors). The optimizer starts afresh each call, as
    on a device that trains once per round."""

    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    clip_norm: float | None = None
    clip_unmasked: bool = False  # clip the whole gradient before masking it (the DisPFL reference's order)
    # a proximal term (lambda/2) ||w - anchor||^2 in the objective: lambda (w - anchor) is added to the loss's
    # gradient of every trained tensor that has an anchor (``train(..., anchor=)``), before masks and clipping
    # (Ditto's personal model, regularised towards the global one); 0: none
    prox: float = 0.0

    def __post_init__(self) -> None:
        if self.epochs < 0:
            raise ConfigError(f"epochs must be >= 0, got {self.epochs}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr must be finite and > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ConfigError(f"clip_norm must be > 0, got {self.clip_norm}")
        if not (math.isfinite(self.prox) and self.prox >= 0):
            raise ConfigError(f"prox must be finite and >= 0, got {self.prox}")



@dataclass(frozen=True, eq=False)
class TrainResult:
    stack: Stack
    loss: Array  # (C,) mean training loss over all steps
    steps: Array  # (C,) optimizer steps taken
    samples: Array  # (C,) samples processed (epochs x n)




def epoch_batches(n: int, epochs: int, batch_size: int, gen: torch.Generator | MT) -> list[Array]:
    """One client's batches: each epoch a fresh permutation of its ``n`` samples drawn from ``gen``, cut into
    ``batch_size`` pieces, the last one partial (``pfl_edge.train.batch_schedule`` stacks these for many)."""
    out: list[Array] = []
    for _ in range(epochs):
        perm = randperm(gen, n)
        out.extend(perm[s: s + batch_size] for s in range(0, n, batch_size))
    return out


class SGD:
    """One client's SGD over named weights a gradient program is fed, stepped with gradients the caller computed:
    the proximal term added, the gradients masked and clipped in the config's order (``clip_unmasked``), then
    ``torch.optim.SGD``'s update (dampening 0, no Nesterov: ``g += wd * w``; ``buf = g`` at the first step, then
    ``buf = momentum * buf + g``; ``w -= lr * buf``), then the mask re-applied to the weights. The weights are
    updated in place; torch tensors or numpy arrays alike."""

    def __init__(self, params: dict[str, Array], cfg: TrainConfig, masks: Mapping[str, Array],
                 anchor: Mapping[str, Array] | None = None) -> None:
        self.params, self.cfg = params, cfg
        self.masks = {k: m for k, m in masks.items() if k in params}
        self.anchor = {k: a for k, a in (anchor or {}).items() if k in params} if cfg.prox else {}
        self._buf: dict[str, Array] = {}

    def step(self, grads: Mapping[str, Array]) -> None:
        cfg = self.cfg
        g = {k: grads[k] for k in self.params}
        for k, a in self.anchor.items():
            g[k] = g[k] + cfg.prox * (self.params[k] - a)
        if cfg.clip_unmasked:  # the DisPFL reference's order: clip the whole gradient, then mask it
            g = self._clip(g)
        for k, m in self.masks.items():
            g[k] = g[k] * m
        if not cfg.clip_unmasked:
            g = self._clip(g)
        for k, p in self.params.items():
            d = g[k]
            if cfg.weight_decay:
                d = d + cfg.weight_decay * p
            if cfg.momentum:
                buf = self._buf.get(k)
                d = self._buf[k] = copy(d) if buf is None else buf * cfg.momentum + d
            p -= cfg.lr * d
            if k in self.masks:
                p *= self.masks[k]

    def _clip(self, g: dict[str, Array]) -> dict[str, Array]:
        """clip_grad_norm_: the norm over every element (summed in float64), coefficient max/(norm + 1e-6) capped at
        1."""
        if self.cfg.clip_norm is None or not g:
            return g
        total = math.sqrt(sum(float((x * x).sum()) for x in (
            v.astype(np.float64) if is_numpy(v) else v.double() for v in g.values())))
        coef = min(self.cfg.clip_norm / (total + 1e-6), 1.0)
        return {k: v * coef for k, v in g.items()} if coef < 1.0 else g
