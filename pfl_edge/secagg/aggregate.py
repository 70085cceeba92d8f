"""A federation's secure aggregation of the shared part (docs/secagg.md): its config table and the round's mean,
computed from the sum SecAgg+ unmasks.

Each participant's update (its trained base minus the round's base; under differential privacy's distributed
mode clipped and noised first, ``pfl_edge.privacy.privatize``) is clipped per coordinate to ``bound``, quantized
to ``bits``-bit integers, and goes through a whole SecAgg+ round (``run_round``: keys, shares, masked inputs,
unmasking); the server's unmasked integer sum, dequantized and divided by the count (q N under differential
privacy, else the participants), is added to the round's base. Every client counts once: a sample count would
have to be multiplied in on the device, where no server could cap it.

Runs in the simulator today; a federation of devices refuses the table until the protocol's four steps are on
the wire (docs/secagg.md, "What wiring it takes").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ConfigError
from ..privacy import SecAggConfig
from ..seeding import derive_seed
from .protocol import dequantize_sum, quantize
from .rounds import run_round

if TYPE_CHECKING:
    from torch import Tensor

    from ..federation import FederationConfig

__all__ = ["secure_mean"]

def secure_mean(cfg: FederationConfig, prev: Mapping[str, Tensor],
                updates: Iterable[tuple[Mapping[str, Tensor], float]], t: int) -> dict[str, Tensor]:
    """The round's new shared part (module docstring): float tensors in ``prev``'s order; integer ones, and every
    tensor of a round with fewer than ``MIN_CLIENTS`` participants, stay ``prev``'s."""
    import dataclasses

    import torch

    sa = SecAggConfig.parse(cfg.secure_aggregation)
    if sa is None:
        raise ConfigError("this federation has no [secure_aggregation] table")
    keys = [k for k, v in prev.items() if v.is_floating_point()]
    base = np.concatenate([prev[k].detach().double().numpy().ravel() for k in keys])
    deltas = [np.concatenate([s[k].detach().double().numpy().ravel() for k in keys]) - base for s, _ in updates]
    bound, bits, params = sa.resolved(cfg, len(deltas))
    if params is None:
        return dict(prev)
    params = dataclasses.replace(params, size=len(base), round_id=f"round-{t}".encode())
    inputs = {i: quantize(d, bound, bits) for i, d in enumerate(deltas)}
    total, survivors, _ = run_round(inputs, params, seed=derive_seed(cfg.seed, "secagg-graph", t))
    dp = cfg.dp
    count = cfg.participation * cfg.clients if dp is not None else len(survivors)
    mean = dequantize_sum(total, len(survivors), bound, bits) / count
    out, at = dict(prev), 0
    for k in keys:
        n = prev[k].numel()
        out[k] = torch.from_numpy(base[at:at + n] + mean[at:at + n]).reshape(prev[k].shape).to(prev[k].dtype)
        at += n
    return out
