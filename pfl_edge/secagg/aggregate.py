"""A federation's secure aggregation of the shared part (docs/secagg.md): its config table and the round's mean,
computed from the sum SecAgg+ unmasks.

Each participant's update (its trained base minus the round's base; under differential privacy's distributed
mode clipped and noised first, ``pfl_edge.privacy.privatize``) is clipped per coordinate to ``bound``, quantized
to ``bits``-bit integers, and goes through a whole SecAgg+ round (``run_round``: keys, shares, masked inputs,
unmasking); the server's unmasked integer sum, dequantized and divided by the count (q N under differential
privacy, else the participants), is added to the round's base. Every client counts once: a sample count would
have to be multiplied in on the device, where no server could cap it.

One definition for the simulator (``secure_mean``: the whole round in one process), a device (``secure_input``)
and the server (``secure_params``, ``apply_sum``), which carry the protocol's steps over HTTP between them
(``pfl_edge.secagg.wire``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CodecError, ConfigError
from ..privacy import MIN_CLIENTS, SecAggConfig
from ..seeding import derive_seed
from .protocol import Params, dequantize_sum, groups, quantize
from .rounds import run_round

if TYPE_CHECKING:
    from torch import Tensor

    from ..federation import FederationConfig

__all__ = ["SumOutOfRange", "apply_sum", "check_sum", "float_keys", "graph_seed", "group_seed", "passing",
           "secagg_config", "secure_input", "secure_mean", "secure_params"]

log = logging.getLogger(__name__)


class SumOutOfRange(CodecError):
    """A round's unmasked sum holds a coordinate no set of honest inputs can sum to: an input outside
    [0, 2^bits - 1] or a forged share. The round publishes nothing (docs/secagg.md, "What one device can do")."""


def float_keys(base: Mapping[str, Any]) -> list[str]:
    """The tensors whose coordinates a secure round sums, in the vector's order: the base's floating ones, by
    name (the server and every device order them alike)."""
    return sorted(k for k, v in base.items() if _floating(v))


def _vector(tensors: Mapping[str, Any], keys: list[str]) -> np.ndarray:
    return np.concatenate([np.asarray(_numpy(tensors[k]), dtype=np.float64).ravel() for k in keys])


def _floating(v: Any) -> bool:
    return bool(v.is_floating_point()) if hasattr(v, "is_floating_point") else bool(np.issubdtype(v.dtype,
                                                                                                  np.floating))


def _numpy(v: Any) -> Any:
    return v.detach().cpu().double().numpy() if hasattr(v, "detach") else v


def secure_input(cfg: FederationConfig, base: Mapping[str, Any], sent: Mapping[str, Any]) -> np.ndarray:
    """A participant's input to the round's sum: its update (``sent``, what it would send in the clear, minus
    the round's ``base``), each coordinate clipped to the bound and quantized (uint32); torch or numpy."""
    sa = secagg_config(cfg)
    keys = float_keys(base)
    bound, bits, _ = sa.resolved(cfg, MIN_CLIENTS)
    return quantize(_vector(sent, keys) - _vector(base, keys), bound, bits)


def secure_params(cfg: FederationConfig, n: int, size: int, rid: bytes) -> Params | None:
    """The parameters of a round of ``n`` participants whose vectors hold ``size`` values (None: too few to
    release anything)."""
    _, _, params = secagg_config(cfg).resolved(cfg, n)
    return None if params is None else dataclasses.replace(params, size=size, round_id=rid)


def check_sum(total: np.ndarray, survivors: int, bits: int) -> None:
    """SumOutOfRange unless every coordinate of the unmasked ``total`` (uint32, mod 2^32) is one that
    ``survivors`` inputs in [0, 2^bits - 1] can sum to: at most ``survivors * (2^bits - 1)``, so the mean update
    lies in [-bound, bound] in every coordinate. Honest inputs always pass (their sum never wraps: secagg's
    ``max_bits``); an out-of-range input or a forged unmask share makes the sum wrap or come out as noise, and a
    noise coordinate passes with probability ``survivors * 2^bits / 2^32`` (7.6e-5 for 5 devices of 16 bits), so
    a forged round fails in a handful of coordinates already."""
    top = survivors * ((1 << bits) - 1)
    over = np.asarray(total, dtype=np.int64) > top
    if over.any():
        raise SumOutOfRange(f"{int(over.sum())} of {over.size} coordinates of the unmasked sum are over the "
                            f"{top} that {survivors} inputs of {bits} bits can reach (an input out of range, or a "
                            "forged share)")


def passing(cfg: FederationConfig, sums: Sequence[tuple[np.ndarray, int]]
            ) -> tuple[list[tuple[np.ndarray, int]], list[SumOutOfRange]]:
    """The groups' sums that pass ``check_sum`` (the ones ``apply_sum`` releases: what a round's published base
    holds, and its achieved epsilon counts), and why each other one failed."""
    _, bits, _ = secagg_config(cfg).resolved(cfg, MIN_CLIENTS)
    passed, refused = [], []
    for total, survivors in sums:
        try:
            check_sum(total, survivors, bits)
        except SumOutOfRange as e:
            refused.append(e)
            continue
        passed.append((total, survivors))
    return passed, refused


def apply_sum(cfg: FederationConfig, prev: Mapping[str, Tensor],
              sums: Sequence[tuple[np.ndarray, int]]) -> dict[str, Tensor]:
    """The round's new shared part from the unmasked sums of its groups, ``(sum, survivors)`` each (one group
    unless ``min_group`` splits the round): each group's sum must pass ``check_sum`` (a group that fails is left
    out, logged; SumOutOfRange if none passes); ``prev`` plus the groups' mean update combined ``across`` them:
    the coordinate-wise median of the groups' means, or their mean weighted by survivors (the plain mean, under
    differential privacy always, divided by q N there); integer tensors stay ``prev``'s."""
    import torch

    sa = secagg_config(cfg)
    bound, bits, _ = sa.resolved(cfg, MIN_CLIENTS)
    passed, refused = passing(cfg, sums)
    for e in refused:
        log.error("a group's sum is left out of the round: %s", e)
    if not passed:
        raise refused[0] if refused else SumOutOfRange("no group's sum to release")
    kept = [(dequantize_sum(total, survivors, bound, bits), survivors) for total, survivors in passed]
    if cfg.dp is not None:  # the noise is in the sum: every kept group's, over the expected count
        mean = np.sum([v for v, _ in kept], axis=0) / (cfg.participation * cfg.clients)
    elif sa.across == "median" and len(kept) > 1:
        mean = np.median(np.stack([v / n for v, n in kept]), axis=0)
    else:
        mean = np.sum([v for v, _ in kept], axis=0) / sum(n for _, n in kept)
    keys = float_keys(prev)
    out, at = dict(prev), 0
    for k in keys:
        n = prev[k].numel()
        v = prev[k].detach().double().numpy().ravel() + mean[at:at + n]
        out[k] = torch.from_numpy(v).reshape(prev[k].shape).to(prev[k].dtype)
        at += n
    return out


def secagg_config(cfg: FederationConfig) -> SecAggConfig:
    """The federation's ``[secure_aggregation]`` table, parsed (ConfigError where it has none)."""
    sa = SecAggConfig.parse(cfg.secure_aggregation)
    if sa is None:
        raise ConfigError("this federation has no [secure_aggregation] table")
    return sa


def secure_mean(cfg: FederationConfig, prev: Mapping[str, Tensor],
                updates: Iterable[tuple[Mapping[str, Tensor], float]], t: int,
                ids: Sequence[int] | None = None) -> dict[str, Tensor]:
    """The round's new shared part (module docstring), the simulator's: every participant's ``secure_input``
    (``ids``: their slots, by default 0, 1, ...) through a whole SecAgg+ round per group in this process (the
    server's groups: ``groups`` of the slots, by the round's seed), then ``apply_sum``; every tensor of a round
    with fewer than ``MIN_CLIENTS`` participants stays ``prev``'s, as does a group of fewer."""
    updates = list(updates)
    ids = list(range(len(updates))) if ids is None else list(ids)
    inputs = {i: secure_input(cfg, prev, s) for i, (s, _) in zip(ids, updates, strict=True)}
    size = sum(prev[k].numel() for k in float_keys(prev))
    sums = []
    for g, members in enumerate(groups(ids, secagg_config(cfg).min_group, group_seed(cfg, t))):
        params = secure_params(cfg, len(members), size, f"round-{t}".encode())
        if params is None:
            continue
        total, survivors, _ = run_round({i: inputs[i] for i in members}, params, seed=graph_seed(cfg, t, g))
        sums.append((total, len(survivors)))
    return apply_sum(cfg, prev, sums) if sums else dict(prev)


def group_seed(cfg: FederationConfig, t: int) -> int:
    """The public seed of round ``t``'s groups (``protocol.groups``): the server's and the simulator's."""
    return derive_seed(cfg.seed, "secagg-groups", t)


def graph_seed(cfg: FederationConfig, t: int, group: int) -> int:
    """The public seed of round ``t``'s graph in ``group`` (the first group's is the ungrouped round's)."""
    return derive_seed(cfg.seed, "secagg-graph", t) if group == 0 else derive_seed(cfg.seed, "secagg-graph", t, group)
