"""Aggregation rules as pure functions over named tensors.

Robust aggregation (a server's round, or anyone holding a round's updates): every update's difference from the
round's start model is first clipped to a norm bound (``AggregationRule.bounds``: an absolute ``max_update_norm``,
or by default ``norm_multiple`` (1, ``pfl_edge.protocol.DEFAULT_NORM_MULTIPLE``) times the low median of the norms
of the round's *other* updates -- a relative bound needs no tuning per model or learning rate, the update being
judged never counts towards its own bound, and the low median (the lower middle value of an even count) is one of
the honest norms while honest updates are at least half of the others; a round of fewer than 3 updates takes the
previous round's norms into its median as well), then combined by the rule:
``mean`` (weighted by training samples, streamable), ``clipped-mean`` (equal weights: a device's weight is a
number it reports), ``median`` (coordinate-wise) or ``trimmed-mean`` (coordinate-wise, ``trim`` of the updates
dropped from each end). The last two ignore weights too.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .errors import ConfigError
from .neighbourhood import neighbourhood_average
from .protocol import DEFAULT_NORM_MULTIPLE

__all__ = [
    "DEFAULT_RULE",
    "MIN_UPDATES",
    "RULES",
    "AggregationRule",
    "PartialAverage",
    "RunningAverage",
    "bounded",
    "clip_update",
    "clipped",
    "coordinate_median",
    "masked_average",
    "neighbourhood_average",
    "robust_aggregate",
    "trimmed_mean",
    "update_norm",
    "weighted_average",
]

RULES = ("mean", "clipped-mean", "median", "trimmed-mean")
MIN_UPDATES = 3  # a round with fewer updates bounds them with the previous round's norms too (AggregationRule.bound)
# the dtypes a model's tensors come in, by name (a partial sum names them when it is stored)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
           "int64": torch.int64, "int32": torch.int32}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


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
            if k in self._acc:
                # acc + weight * v in one pass, in float64 (no product tensor made per update); the product of a
                # float32 value and a sample count is exact in float64, so this is the product-then-sum to the bit
                self._acc[k].add_(v.detach(), alpha=weight)
                self._weight[k] += weight
            else:
                self._acc[k] = v.detach().to(torch.float64) * weight
                self._weight[k] = 0.0 + weight
                self._meta[k] = (v.shape, v.dtype)
        self.total_weight += weight
        self.count += 1

    def merge(self, other: PartialAverage) -> None:
        """Fold ``other``'s updates into this sum (a replica's partial sum, at a round's close): per tensor the
        sums and weights add, so the result averages both sets of updates, up to float64 rounding in the order
        of the additions."""
        for k in other._acc:
            if k in self._meta and other._meta[k] != self._meta[k]:
                raise ConfigError(f"tensor {k!r}: {tuple(other._meta[k][0])} {other._meta[k][1]} does not merge "
                                  f"with {tuple(self._meta[k][0])} {self._meta[k][1]}")
        for k, acc in other._acc.items():
            if k in self._acc:
                self._acc[k].add_(acc)
                self._weight[k] += other._weight[k]
            else:
                self._acc[k] = acc.clone()
                self._weight[k] = other._weight[k]
                self._meta[k] = other._meta[k]
        self.total_weight += other.total_weight
        self.count += other.count

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The float64 sums, and what else ``from_state`` needs (per tensor its weight and dtype; the count)."""
        meta = {"count": self.count, "total_weight": self.total_weight,
                "tensors": {k: {"weight": self._weight[k], "dtype": _DTYPE_NAMES[self._meta[k][1]]}
                            for k in self._acc}}
        return dict(self._acc), meta

    @classmethod
    def from_state(cls, sums: Mapping[str, Tensor], meta: Mapping[str, Any]) -> PartialAverage:
        """The partial sum ``state`` described; ConfigError for anything that does not describe one."""
        out = cls()
        tensors = meta.get("tensors")
        count, total = meta.get("count"), meta.get("total_weight")
        if not isinstance(tensors, dict) or set(tensors) != set(sums) or not isinstance(count, int) or count < 1 \
                or isinstance(count, bool) or not isinstance(total, float) or not (math.isfinite(total) and total > 0):
            raise ConfigError("a partial sum's description does not match its tensors")
        for k, v in sums.items():
            d = tensors[k]
            w, dtype = (d.get("weight"), _DTYPES.get(d.get("dtype", ""))) if isinstance(d, dict) else (None, None)
            if not isinstance(w, float) or not (math.isfinite(w) and 0 < w <= total) or dtype is None \
                    or v.dtype != torch.float64 or not bool(torch.isfinite(v).all()):
                raise ConfigError(f"partial sum: tensor {k!r} has no valid weight, dtype or float64 sums")
            out._acc[k], out._weight[k], out._meta[k] = v, w, (v.shape, dtype)
        out.count, out.total_weight = count, total
        return out

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


# ------------------------------------------------------------------------------------------- robust rules

@dataclass(frozen=True)
class AggregationRule:
    """How a round's updates are bounded and combined (module docstring). ``max_update_norm`` (absolute) wins over
    ``norm_multiple`` (relative to the round's median update norm); both None: no norm bound."""

    rule: str = "mean"
    max_update_norm: float | None = None
    norm_multiple: float | None = DEFAULT_NORM_MULTIPLE
    trim: float = 0.2

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ConfigError(f"aggregation rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if self.max_update_norm is not None and not (math.isfinite(self.max_update_norm) and self.max_update_norm > 0):
            raise ConfigError(f"max_update_norm must be finite and > 0, got {self.max_update_norm}")
        if self.norm_multiple is not None and not (math.isfinite(self.norm_multiple) and self.norm_multiple >= 1):
            raise ConfigError(f"norm_multiple must be finite and >= 1, got {self.norm_multiple}")
        if not 0 <= self.trim < 0.5:
            raise ConfigError(f"trim must be in [0, 0.5), got {self.trim}")

    @property
    def bounds_updates(self) -> bool:
        """Does this rule hold updates to a norm bound (absolute or relative) before combining them?"""
        return self.max_update_norm is not None or self.norm_multiple is not None

    @property
    def relative(self) -> bool:
        """Does the bound depend on the round's norms (so they must be known before averaging)?"""
        return self.max_update_norm is None and self.norm_multiple is not None

    def bound(self, norms: Sequence[float], history: Sequence[float] = ()) -> float | None:
        """The round's bound on an update's norm, from every update's norm (``update_norm``) and, in a round of
        fewer than ``MIN_UPDATES``, the previous round's (``history``); None: no bound."""
        if self.max_update_norm is not None:
            return self.max_update_norm
        pool = list(norms) if len(norms) >= MIN_UPDATES else [*norms, *history]
        if self.norm_multiple is None or not pool:
            return None
        return self.norm_multiple * statistics.median_low(pool)


    def bounds(self, norms: Sequence[float], history: Sequence[float] = ()) -> list[float | None]:
        """Each update's bound: ``bound`` over the round's other updates' norms (the one being judged never
        raises its own bound), the previous round's too in a round of fewer than ``MIN_UPDATES``."""
        if not self.relative:
            return [self.bound(norms)] * len(norms)
        extra = list(history) if len(norms) < MIN_UPDATES else []
        out: list[float | None] = []
        for i in range(len(norms)):
            pool = [*norms[:i], *norms[i + 1:], *extra]
            out.append(self.norm_multiple * statistics.median_low(pool) if pool and self.norm_multiple else None)
        return out


#: the rule a server aggregates with unless its federation says otherwise (``pfl_edge.protocol.AggregationSettings``'s
#: defaults: the mean, each update held to ``DEFAULT_NORM_MULTIPLE`` (1) x the low median of the round's others'
#: norms); the simulator's too
DEFAULT_RULE = AggregationRule()


def update_norm(prev: Mapping[str, Tensor], state: Mapping[str, Tensor]) -> float:
    """||state - prev||_2 in float64 over the tensors ``state`` holds (integer buffers included)."""
    sq = 0.0
    for k, v in state.items():
        if k not in prev:
            raise ConfigError(f"update holds tensor {k!r} that the model does not")
        sq += float((v.detach().to(torch.float64) - prev[k].to(torch.float64)).square().sum())
    return math.sqrt(sq)


def clip_update(prev: Mapping[str, Tensor], state: Mapping[str, Tensor], bound: float | None,
                norm: float | None = None) -> Mapping[str, Tensor]:
    """``prev + (state - prev) * min(1, bound / ||state - prev||)``; ``state`` itself (the same object, the same
    bits) where it is within the bound. Integer buffers are rounded after scaling."""
    n = update_norm(prev, state) if norm is None else norm
    if bound is None or n <= bound:
        return state
    scale = bound / n
    out: dict[str, Tensor] = {}
    for k, v in state.items():
        p = prev[k].to(torch.float64)
        x = p + (v.detach().to(torch.float64) - p) * scale
        out[k] = (x if v.dtype.is_floating_point else x.round()).to(v.dtype)
    return out


def bounded(prev: Mapping[str, Tensor], updates: Iterable[tuple[Mapping[str, Tensor], float]],
            rule: AggregationRule | None, *, history: Sequence[float] = (),
            bounds: Sequence[float | None] | None = None,
            norms: Sequence[float] | None = None) -> Iterator[tuple[Mapping[str, Tensor], float]]:
    """The update-bound stage, defined once for the simulator and the server: each update held to its bound
    (``clip_update``: the same object, the same bits, where it is within it), weights unchanged, in order.
    ``bounds``: one per update, as given; else ``rule.bounds`` over every update's norm (``norms`` where known,
    e.g. computed by the server on accepting each update; else computed here, which holds the updates in memory
    first: a relative bound needs every norm before the first update is judged) and ``history``."""
    if bounds is None:
        if rule is None:
            raise ConfigError("an update bound needs a rule or the bounds themselves")
        if norms is None:
            updates = list(updates)
            norms = [update_norm(prev, s) for s, _ in updates]
        bounds = rule.bounds(norms, history)
    known: Sequence[float | None] = norms if norms is not None else [None] * len(bounds)
    for (state, w), b, n in zip(updates, bounds, known, strict=True):
        yield clip_update(prev, state, b, n), w


def clipped(prev: Mapping[str, Tensor], updates: Iterable[tuple[Mapping[str, Tensor], float]],
            bound: float | None) -> Iterator[tuple[Mapping[str, Tensor], float]]:
    """The updates (streamed) each clipped to ``bound``; weights unchanged."""
    for state, w in updates:
        yield clip_update(prev, state, bound), w


def _per_key(prev: Mapping[str, Tensor], states: Sequence[Mapping[str, Tensor]],
             combine: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
    """``combine`` of the float64 stack ``(n, ...)`` of each tensor over the updates that hold it; ``prev``'s value
    for a tensor nobody sent; ``prev``'s key order and dtypes."""
    out: dict[str, Tensor] = {}
    for k, p in prev.items():
        held = [s[k].detach().to(torch.float64) for s in states if k in s]
        if not held:
            out[k] = p
            continue
        x = combine(torch.stack(held))
        out[k] = (x if p.dtype.is_floating_point else x.round()).to(p.dtype)
    return out


def _sorted(stack: Tensor) -> Tensor:
    """``stack`` sorted along its first dimension (numpy's sort: ~5x torch's along a non-last dimension)."""
    return torch.from_numpy(np.sort(stack.numpy(), axis=0))


def _median(stack: Tensor) -> Tensor:
    srt = _sorted(stack)
    n = srt.shape[0]
    return srt[n // 2] if n % 2 else (srt[n // 2 - 1] + srt[n // 2]) / 2


def coordinate_median(prev: Mapping[str, Tensor], states: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Per coordinate, the median of the updates that hold the tensor (the mean of the two middle values for an
    even count); unweighted."""
    return _per_key(prev, states, _median)


def trimmed_mean(prev: Mapping[str, Tensor], states: Sequence[Mapping[str, Tensor]], trim: float) -> dict[str, Tensor]:
    """Per coordinate, the mean after dropping the ``floor(trim * n)`` smallest and largest values (at least one
    value is kept); unweighted."""
    if not 0 <= trim < 0.5:
        raise ConfigError(f"trim must be in [0, 0.5), got {trim}")

    def combine(stack: Tensor) -> Tensor:
        n = stack.shape[0]
        k = min(math.floor(trim * n + 1e-9), (n - 1) // 2)
        return _sorted(stack)[k:n - k].mean(dim=0)

    return _per_key(prev, states, combine)


def robust_aggregate(prev: Mapping[str, Tensor], updates: Sequence[tuple[Mapping[str, Tensor], float]],
                     rule: AggregationRule, history: Sequence[float] = ()) -> dict[str, Tensor]:
    """The round's new model under ``rule`` from all its updates ``(state, weight)`` (held in memory: n updates
    of the shared part at once, plus one float64 stack of one tensor; ``mean`` alone can stream, see
    ``clipped``). A tensor nobody sent keeps ``prev``'s value."""
    if not updates:
        raise ConfigError("cannot aggregate zero updates")
    norms = [update_norm(prev, s) for s, _ in updates]
    bounds = rule.bounds(norms, history)
    states = [clip_update(prev, s, b, n) for (s, _), n, b in zip(updates, norms, bounds, strict=True)]
    if rule.rule == "median":
        return coordinate_median(prev, states)
    if rule.rule == "trimmed-mean":
        return trimmed_mean(prev, states, rule.trim)
    avg = PartialAverage()
    for s, (_, w) in zip(states, updates, strict=True):
        avg.add(s, 1.0 if rule.rule == "clipped-mean" else w)
    return avg.result(prev)
