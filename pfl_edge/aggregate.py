"""Aggregation rules as pure functions over named tensors."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from .errors import ConfigError

__all__ = ["PartialAverage", "RunningAverage", "masked_average", "neighbourhood_average", "weighted_average"]


class PartialAverage:
    """Streaming weighted average, per tensor over the updates that hold it: memory is one float64 accumulator
    per tensor, whatever the number of updates. Updates may hold different tensors (FedPer devices of different
    K_P send different bases); ``result(prev)`` keeps ``prev``'s value for a tensor nobody sent. Integer tensors
    (e.g. BatchNorm's ``num_batches_tracked``) are averaged then rounded."""

    def __init__(self) -> None:
        self._acc: dict[str, Tensor] = {}
        self._weight: dict[str, float] = {}
        self._meta: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self.total_weight = 0.0
        self.count = 0

    def add(self, state: Mapping[str, Tensor], weight: float) -> None:
        if not (math.isfinite(weight) and weight > 0):
            raise ConfigError(f"aggregation weight must be finite and > 0, got {weight}")
        for k, v in state.items():
            if k in self._meta and v.shape != self._meta[k][0]:
                raise ConfigError(f"tensor {k!r} has shape {tuple(v.shape)}, expected {tuple(self._meta[k][0])}")
        for k, v in state.items():
            contrib = v.detach().to(torch.float64) * weight
            if k in self._acc:
                self._acc[k] += contrib
                self._weight[k] += weight
            else:
                self._acc[k] = contrib
                self._weight[k] = 0.0 + weight
                self._meta[k] = (v.shape, v.dtype)
        self.total_weight += weight
        self.count += 1

    def result(self, prev: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The averages (in ``prev``'s key order, its value where nobody sent a tensor; else in first-seen order)."""
        if not self.count and prev is None:
            raise ConfigError("cannot average zero updates")
        keys = list(prev) if prev is not None else list(self._acc)
        out: dict[str, Tensor] = {}
        for k in keys:
            if k not in self._acc:
                out[k] = prev[k]  # type: ignore[index]  # keys come from prev here
                continue
            mean = self._acc[k] / self._weight[k]
            dtype = self._meta[k][1]
            out[k] = (mean.round() if not dtype.is_floating_point else mean).to(dtype)
        return out


class RunningAverage(PartialAverage):
    """``PartialAverage`` whose updates must all hold the same tensors (FedAvg over whole models)."""

    def add(self, state: Mapping[str, Tensor], weight: float) -> None:
        if self.count and set(state) != set(self._acc):
            missing, extra = set(self._acc) - set(state), set(state) - set(self._acc)
            raise ConfigError(f"update does not match: missing {sorted(missing)}, unexpected {sorted(extra)}")
        super().add(state, weight)


def weighted_average(states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]:
    """sum_j w_j x_j / sum_j w_j for every tensor; FedAvg/FedPer use w_j = n_j, the client's training samples."""
    if len(states) != len(weights):
        raise ConfigError(f"{len(states)} states but {len(weights)} weights")
    avg = RunningAverage()
    for state, w in zip(states, weights, strict=True):
        avg.add(state, float(w))
    return avg.result()


def masked_average(weights: Sequence[Mapping[str, Tensor]],
                   masks: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """DisPFL's intersection-weighted average: per coordinate, sum_j w_j m_j / sum_j m_j, 0 where no mask
    covers it (equal weights). A tensor without a mask counts as dense (a plain mean)."""
    if len(weights) != len(masks) or not weights:
        raise ConfigError(f"masked_average needs as many masks as weights (>= 1), got {len(weights)}, {len(masks)}")
    out: dict[str, Tensor] = {}
    for k in weights[0]:
        num = torch.zeros(weights[0][k].shape, dtype=torch.float64)
        den = torch.zeros(weights[0][k].shape, dtype=torch.float64)
        for w, m in zip(weights, masks, strict=True):
            mk = m[k].to(torch.float64) if k in m else torch.ones_like(num)
            num += w[k].to(torch.float64) * mk
            den += mk
        out[k] = torch.where(den > 0, num / den.clamp_min(1), 0.0).to(weights[0][k].dtype)
    return out


def neighbourhood_average(stack: Mapping[str, Tensor], mixing: Tensor,
                          masks: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """``masked_average`` for every client at once: client i averages the rows j with ``mixing[i, j] = 1``
    (``mixing`` is (clients, rows): a device passes one row of ones over its neighbourhood's models).
    Tensors are stacked ``(C, ...)``; ``masks`` stacked likewise for the masked ones (others count as dense).
    One sparse matrix product per tensor (a client has few neighbours) instead of a loop over clients; sums
    of at most C terms in float32."""
    out: dict[str, Tensor] = {}
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
