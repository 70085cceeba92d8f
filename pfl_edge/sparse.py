"""DisPFL's sparse machinery as pure functions: ERK densities, mask initialisation, prune-and-regrow.

Masks are 0/1 float tensors of the parameter's shape (float, so that ``w * m`` needs no cast).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .arrays import Array as Tensor
from .arrays import copy, rand, randperm, select_largest, select_smallest, where, zeros
from .errors import ConfigError
from .seeding import MT

if TYPE_CHECKING:
    import torch

__all__ = [
    "density_of",
    "erk_densities",
    "init_masks",
    "mask_ones",
    "prune_rate",
    "prune_regrow",
]


def erk_densities(shapes: Mapping[str, tuple[int, ...] | torch.Size], density: float,
                  power: float = 1.0) -> dict[str, float]:
    """Per-tensor densities by the Erdős–Rényi-Kernel rule, for overall density ``density``.

    raw_l = (sum of dims / product of dims) ** power; eps solves sum_l density_l * N_l = density * sum_l N_l
    with density_l = eps * raw_l; while the largest raw_l * eps exceeds 1, every tensor at that maximum
    becomes dense and eps is recomputed. 1-D tensors (biases, norm weights) come out dense.
    """
    if not 0 < density <= 1:
        raise ConfigError(f"density must be in (0, 1], got {density}")
    numel = {k: math.prod(s) for k, s in shapes.items()}
    if any(n == 0 for n in numel.values()):
        raise ConfigError("erk_densities: empty tensors have no density")
    if density == 1:
        return dict.fromkeys(shapes, 1.0)
    raw = {k: (sum(s) / numel[k]) ** power for k, s in shapes.items()}
    dense: set[str] = set()
    while True:
        sparse_keys = [k for k in shapes if k not in dense]
        if not sparse_keys:
            break
        divisor = sum(raw[k] * numel[k] for k in sparse_keys)
        rhs = density * sum(numel[k] for k in sparse_keys) - (1 - density) * sum(numel[k] for k in dense)
        eps = rhs / divisor
        top = max(raw[k] for k in sparse_keys)
        if top * eps > 1:
            dense |= {k for k in sparse_keys if raw[k] == top}
        else:
            break
    return {k: 1.0 if k in dense else eps * raw[k] for k in shapes}


def mask_ones(shapes: Mapping[str, tuple[int, ...] | torch.Size], densities: Mapping[str, float]) -> dict[str, int]:
    """The ones each tensor's mask holds: ``int(density_l * numel)`` (prune-and-regrow keeps the count; the server
    holds a DisPFL device's masks to it)."""
    return {k: int(densities[k] * math.prod(shape)) for k, shape in shapes.items()}


def init_masks(shapes: Mapping[str, tuple[int, ...] | torch.Size], densities: Mapping[str, float],
               gen: torch.Generator | MT) -> dict[str, Tensor]:
    """Exactly ``mask_ones`` ones per tensor, at positions drawn from ``gen`` (float32 masks: numpy arrays from an
    ``MT``, tensors from a torch generator; the same masks)."""
    masks = {}
    counts = mask_ones(shapes, densities)
    for k, shape in shapes.items():
        n = math.prod(shape)
        ones = counts[k]
        perm = randperm(gen, n)
        flat = zeros((n,), perm)
        flat[perm[:ones]] = 1.0
        masks[k] = flat.reshape(*shape)
    return masks


def prune_rate(alpha0: float, t: int, total_rounds: int) -> float:
    """Cosine-annealed prune rate: alpha_t = alpha0 / 2 * (1 + cos(pi * t / T))."""
    return alpha0 / 2 * (1 + math.cos(math.pi * t / total_rounds))


def prune_regrow(weights: Mapping[str, Tensor], masks: Mapping[str, Tensor], alpha: float, *,
                 grads: Mapping[str, Tensor] | None = None,
                 gen: torch.Generator | MT | None = None) -> dict[str, Tensor]:
    """One mask update: per tensor that is not dense, prune ``ceil(alpha * nnz)`` active weights of smallest
    magnitude, then regrow as many among the zeros of the pruned mask, by largest ``|grads|`` (the dense
    gradient; ``regrow gradient``) or uniformly at random from ``gen`` (``regrow random``). Returns the new
    masks (per-tensor nnz preserved; dense tensors' masks unchanged).

    The weights are not touched: a client keeps its trained weights with the mask they were trained under (that
    pair is what its neighbours average), and its new mask selects the coordinates of its next start, where a
    regrown coordinate takes its neighbours' average (docs/algorithms.md). Ties at either cut go to the lower
    index (``pfl_edge.arrays.select_smallest``), so torch and numpy pick the same coordinates.
    """
    if (grads is None) == (gen is None):
        raise ConfigError("prune_regrow needs exactly one of grads (regrow by gradient) or gen (random)")
    if not 0 <= alpha <= 1:
        raise ConfigError(f"prune rate must be in [0, 1], got {alpha}")
    new_m: dict[str, Tensor] = {}
    for k, m in masks.items():
        flat_m = m.reshape(-1)
        nnz = int(flat_m.sum())
        n = int(flat_m.shape[0])
        k_swap = min(math.ceil(alpha * nnz), nnz)
        if nnz == n or nnz == 0 or k_swap == 0:
            new_m[k] = copy(m)
            continue
        mag = where(flat_m > 0, abs(weights[k].reshape(-1)), math.inf)
        pruned = copy(flat_m)
        pruned[select_smallest(mag, k_swap)] = 0.0
        if grads is not None:
            score = where(pruned > 0, -math.inf, abs(grads[k].reshape(-1)))
        elif gen is not None:  # checked above: exactly one of grads and gen
            score = where(pruned > 0, -math.inf, rand(gen, n))
        pruned[select_largest(score, k_swap)] = 1.0
        new_m[k] = pruned.reshape(m.shape)
    return new_m


def density_of(masks: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, ...] | torch.Size]) -> float:
    """Achieved overall density: ones in the masks over all elements of ``shapes`` (unmasked count as dense)."""
    total = sum(math.prod(s) for s in shapes.values())
    ones = sum(float(masks[k].sum()) if k in masks else math.prod(s) for k, s in shapes.items())
    return ones / total
