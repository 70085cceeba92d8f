"""Aggregation rules as pure functions over named tensors."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from .errors import ConfigError

__all__ = ["RunningAverage", "weighted_average"]


class RunningAverage:
    """Streaming weighted average: memory is one float64 accumulator per tensor, whatever the number of updates.

    Integer tensors (e.g. BatchNorm's ``num_batches_tracked``) are averaged then rounded.
    """

    def __init__(self) -> None:
        self._acc: dict[str, Tensor] = {}
        self._meta: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self.total_weight = 0.0
        self.count = 0

    def add(self, state: Mapping[str, Tensor], weight: float) -> None:
        if not (math.isfinite(weight) and weight > 0):
            raise ConfigError(f"aggregation weight must be finite and > 0, got {weight}")
        if self.count and set(state) != set(self._acc):
            missing, extra = set(self._acc) - set(state), set(state) - set(self._acc)
            raise ConfigError(f"update does not match: missing {sorted(missing)}, unexpected {sorted(extra)}")
        for k, v in state.items():
            if self.count and v.shape != self._meta[k][0]:
                raise ConfigError(f"tensor {k!r} has shape {tuple(v.shape)}, expected {tuple(self._meta[k][0])}")
            contrib = v.detach().to(torch.float64) * weight
            if self.count:
                self._acc[k] += contrib
            else:
                self._acc[k] = contrib
                self._meta[k] = (v.shape, v.dtype)
        self.total_weight += weight
        self.count += 1

    def result(self) -> dict[str, Tensor]:
        if not self.count:
            raise ConfigError("cannot average zero updates")
        out: dict[str, Tensor] = {}
        for k, acc in self._acc.items():
            mean = acc / self.total_weight
            dtype = self._meta[k][1]
            out[k] = (mean.round() if not dtype.is_floating_point else mean).to(dtype)
        return out


def weighted_average(states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]:
    """sum_j w_j x_j / sum_j w_j for every tensor; FedAvg/FedPer use w_j = n_j, the client's training samples."""
    if len(states) != len(weights):
        raise ConfigError(f"{len(states)} states but {len(weights)} weights")
    avg = RunningAverage()
    for state, w in zip(states, weights, strict=True):
        avg.add(state, float(w))
    return avg.result()
