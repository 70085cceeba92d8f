"""Does a model fit a device class at its density? The numbers, not just a verdict."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pfl_edge.sparse import erk_densities

from .registry import Profile

if TYPE_CHECKING:  # torch is imported where a model is measured: the profiles import without it
    from torch import nn

__all__ = ["Fit", "check"]

MB = 1024 * 1024


@dataclass(frozen=True)
class Fit:
    profile: str
    params: int  # all parameters
    active_params: int  # kept by the profile's density (ERK per tensor)
    density: float
    weights_mb: float  # active values (float32) plus a 1-bit mask per element where sparse
    gradients_mb: float  # dense float32 gradients (masked training and the regrowth screen need them dense)
    optimizer_mb: float  # SGD momentum: one float32 per parameter
    activations_mb: float  # every layer's output at the profile's batch size, kept for backward
    train_mb: float  # the sum of the four above
    infer_mb: float  # weights plus batch-1 activations
    fits_training: bool
    fits_ram: bool

    @property
    def ok(self) -> bool:
        return self.fits_training and self.fits_ram

    def reasons(self) -> list[str]:
        out = []
        if not self.fits_training:
            out.append(f"training needs {self.train_mb:.1f} MB > ceiling")
        if not self.fits_ram:
            out.append(f"inference needs {self.infer_mb:.1f} MB > RAM budget")
        return out


def _activation_elements(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Elements of every leaf module's output for one sample (what autograd keeps for the backward pass)."""
    from pfl_edge.flops import module_outputs

    outs = module_outputs(model, input_shape, lambda _n, m: not list(m.children()))
    return sum(int(o[0].numel()) for _m, calls in outs.values() for o in calls)


def check(profile: Profile, model: nn.Module, input_shape: tuple[int, ...],
          *, density: float | None = None) -> Fit:
    """Memory of ``model`` on ``profile`` at its density (or ``density``) and batch size."""
    d = profile.density if density is None else density
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    dens = erk_densities(shapes, d)
    params = sum(math.prod(s) for s in shapes.values())
    active = sum(int(dens[k] * math.prod(s)) for k, s in shapes.items())
    mask_bits = sum(math.prod(s) for k, s in shapes.items() if dens[k] < 1)
    weights = (4 * active + mask_bits / 8) / MB
    grads = 4 * params / MB
    optim = 4 * params / MB
    per_sample = 4 * _activation_elements(model, input_shape) / MB
    activations = per_sample * profile.batch_size
    train = weights + grads + optim + activations
    infer = weights + per_sample
    return Fit(profile.name, params, active, d, weights, grads, optim, activations, train, infer,
               train <= profile.train_memory_mb, infer <= profile.ram_budget_mb)
