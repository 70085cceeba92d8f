"""Decentralised averaging over neighbourhoods, on torch tensors (the simulator: every client at once) or numpy
arrays (a device without torch: its one neighbourhood), one definition for both."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .arrays import Array, is_numpy

__all__ = ["neighbourhood_average"]


def neighbourhood_average(stack: Mapping[str, Array], mixing: Array,
                          masks: Mapping[str, Array] | None = None) -> dict[str, Array]:
    """``masked_average`` for every client at once: client i averages the rows j with ``mixing[i, j] = 1``
    (``mixing`` is (clients, rows): a device passes one row of ones over its neighbourhood's models).
    Tensors are stacked ``(C, ...)``; ``masks`` stacked likewise for the masked ones (others count as dense):
    per coordinate the sum of the weights over the number of masks covering it, 0 where none does. Sums of at
    most C terms in float32 (torch: one sparse matrix product per tensor, a client having few neighbours)."""
    if is_numpy(mixing):
        return _numpy(stack, mixing, masks)
    import torch

    out: dict[str, Array] = {}
    a = mixing.to(torch.float32).to_sparse()
    counts = mixing.sum(1, keepdim=True).to(torch.float32)
    for k, w in stack.items():
        flat = w.reshape(w.shape[0], -1).to(torch.float32)
        if masks is not None and k in masks:
            m = masks[k].reshape(w.shape[0], -1).to(torch.float32)
            num, den = torch.sparse.mm(a, flat * m), torch.sparse.mm(a, m)
            avg = torch.where(den > 0, num / den.clamp_min(1), 0.0)
        else:
            avg = torch.sparse.mm(a, flat) / counts
        out[k] = (avg if w.is_floating_point() else avg.round()).to(w.dtype).view(mixing.shape[0], *w.shape[1:])
    return out


def _sum_rows(a: np.ndarray, flat: np.ndarray) -> np.ndarray:
    """Row i: sum_j a[i, j] * flat[j] over the nonzero a[i, j], added one after another in row order (as the
    sparse product adds them)."""
    out = np.zeros((a.shape[0], flat.shape[1]), np.float32)
    for i in range(a.shape[0]):
        for j in np.flatnonzero(a[i]):
            out[i] += a[i, j] * flat[j]
    return out


def _numpy(stack: Mapping[str, Array], mixing: np.ndarray, masks: Mapping[str, Array] | None) -> dict[str, Array]:
    pick = mixing.astype(np.float32)
    counts = pick.sum(1, keepdims=True)
    out: dict[str, Array] = {}
    for k, w in stack.items():
        flat = w.reshape(w.shape[0], -1).astype(np.float32)
        if masks is not None and k in masks:
            m = masks[k].reshape(w.shape[0], -1).astype(np.float32)
            num, den = _sum_rows(pick, flat * m), _sum_rows(pick, m)
            avg = np.where(den > 0, num / np.maximum(den, 1), np.float32(0))
        else:
            avg = _sum_rows(pick, flat) / counts
        floating = np.issubdtype(w.dtype, np.floating)
        out[k] = (avg if floating else np.round(avg)).astype(w.dtype).reshape(mixing.shape[0], *w.shape[1:])
    return out
