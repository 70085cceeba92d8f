"""Differential privacy of the shared part (docs/privacy.md): client-level DP-FedAvg (McMahan et al., ICLR 2018)
for the server-averaged algorithms (FedPer, FedAvg, Ditto and their -FT variants).

A round, under a federation's ``[privacy]`` table:

1. **Who**: each client takes part independently with probability q = ``participation`` (Poisson sampling, from
   the round's participants stream, or under the server's sampling key where ``secret_draw``;
   ``Algorithm.sampled``), the draw the accountant assumes. A round may draw
   nobody; it still releases a noised base.
2. **The device** clips its update, the difference of the base it trained from the base it received, to L2 norm
   ``clip`` (just inside it, ``MARGIN``: the server's clip then leaves an honest update's bits alone); in the
   ``distributed`` mode it adds its share of the noise, N(0, (z C)^2 / (q N)) per coordinate, so that the sum of
   the expected q N shares holds the central mode's noise (``privatize``, the device's and the simulator's).
3. **The server** clips every update to ``clip`` again (it trusts no device to have done so), sums the updates
   with equal weights (a sample count would raise one client's sensitivity), adds N(0, (z C)^2) per coordinate
   to the sum in the ``central`` mode, and divides by the expected count q N, not the count that came
   (``private_mean``): the estimator DP-FedAvg's accounting is for. Integer buffers (a BatchNorm's batch count)
   stay the round's start: they are not noised, so they are not shared.

Sensitivity C of the sum under adding or removing a client, noise z C: the sampled Gaussian mechanism, run once
per round. Its privacy loss is Opacus's RDP accountant's (``epsilon``); a target epsilon is turned into a noise
multiplier by Opacus's calibration (``noise_multiplier``). Neither is written here.

The server's noise comes from a 256-bit key it makes for the federation and never sends (``secret_noise``, the
default): a device that knew the stream could subtract it. ``secret_noise = false`` draws it from the config's
seed instead, reproducible and equal to the simulator's, for research and tests only. The simulator draws from
the seed always (there is nobody to hide it from). A distributed-mode device draws its share from the operating
system's randomness (from its slot's seeded stream with ``secret_noise = false``).

With secret noise the draw is secret too (``secret_draw``: amplification by sampling assumes nobody knows who
took part): the server draws under a key of its own, and a device learns only its own draw, from its task. In the
distributed mode the epsilon reported is what each round's realised count achieved
(``pfl_edge.privacy_spent``).
"""

from __future__ import annotations

import functools
import hashlib
import math
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .arrays import Array, is_numpy, to_numpy
from .config_bounds import Range, check_fields, meta
from .config_bounds import check_table_keys as _check_keys
from .errors import ConfigError
from .secagg_config import MIN_CLIENTS, SecAggConfig, max_bits
from .seeding import Stream, numpy_rng

if TYPE_CHECKING:
    from torch import Tensor

    from .federation import FederationConfig

__all__ = [
    "MARGIN",
    "MIN_CLIENTS",
    "ORDERS",
    "PrivacyConfig",
    "SecAggConfig",
    "check_device_privacy",
    "device_noise",
    "epsilon",
    "expected_count",
    "max_bits",
    "new_key",
    "noise_multiplier",
    "noise_rng",
    "private_mean",
    "privatize",
    "round_noise",
    "secret_draw",
    "seed_key",
    "server_bound",
]

#: a device clips to ``clip * MARGIN``: float rounding then never puts an honest update past the server's bound
MARGIN = 1.0 - 1e-6
MAX_NOISE = 1e4  # the largest noise multiplier a config may ask for or a target epsilon calibrate to
#: the RDP orders the accountant converts at: Opacus's default (1.1 to 63) and larger ones, which a large noise
#: multiplier's tightest bound needs (Opacus warns that the largest order won); more orders never loosen it
ORDERS: tuple[float, ...] = (*(1 + x / 10.0 for x in range(1, 100)), *range(12, 64), 80, 96, 128, 192, 256, 512)


@dataclass(frozen=True)
class PrivacyConfig:
    """A federation's ``[privacy]`` table (the module docstring says what a round does with it; each key's
    meaning: its field's ``doc``). Exactly one of ``noise_multiplier`` and ``target_epsilon``."""

    clip: float = field(metadata=meta("the L2 bound C on a client's update of the shared part",
                                      Range(0, 1e6, lo_open=True)))
    noise_multiplier: float | None = field(default=None, metadata=meta(
        "z: the noise's std on a round's sum is z C (this or target_epsilon)", Range(0, MAX_NOISE)))
    target_epsilon: float | None = field(default=None, metadata=meta(
        "the epsilon the whole run may spend; z is calibrated to it (this or noise_multiplier)", Range(0.01, 1e3)))
    delta: float = field(default=1e-5, metadata=meta(
        "the delta epsilon is stated at; below 1 / clients too (a larger one would let a client's data out whole)",
        Range(0, 0.1, lo_open=True, hi_open=True)))
    mode: Literal["central", "distributed"] = field(default="central", metadata=meta(
        "who adds the noise: the server to the sum (central), or each device its share (distributed)"))
    secret_noise: bool = field(default=True, metadata=meta(
        "the server's noise from a key no device sees; false: from the seed (tests only; no epsilon is reported)"))
    allow_unmasked: bool = field(default=False, metadata=meta(
        "allow devices in the distributed mode without secure aggregation (the server sees every noised update, "
        "and one device that skips its clip or noise spoils the guarantee: docs/privacy.md)"))

    def __post_init__(self) -> None:
        check_fields(self, "privacy.")
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ConfigError("privacy: give exactly one of noise_multiplier (the noise's std over clip) and "
                              "target_epsilon (the whole run's epsilon at delta)")

    @classmethod
    def parse(cls, table: Mapping[str, Any] | None) -> PrivacyConfig | None:
        """The config's ``privacy`` table as a ``PrivacyConfig`` (None: no differential privacy)."""
        if table is None:
            return None
        _check_keys(cls, table, "privacy")
        if "clip" not in table:
            raise ConfigError("privacy.clip (the L2 bound on a client's update) is required")
        return cls(**table)

    def check(self, clients: int) -> None:
        """The rules a federation of ``clients`` adds."""
        if self.delta >= 1 / clients:
            raise ConfigError(f"privacy.delta {self.delta:g} must be below 1 / clients ({1 / clients:.3g}): a "
                              "delta that large allows one client's data out whole")


def check_device_privacy(cfg: FederationConfig) -> None:
    """The rules a federation of real devices adds to its privacy table (``check_device_config`` asks)."""
    dp = cfg.dp
    if dp is not None:
        if dp.mode == "distributed" and dp.noise_multiplier is None:
            raise ConfigError("privacy: a distributed-mode device noises its own update, so it needs the noise "
                              "multiplier itself (it runs no accountant): give noise_multiplier (pfl-edge privacy "
                              "--target-epsilon E --rounds T finds the one for a target)")
        if dp.mode == "distributed" and cfg.secure_aggregation is None and not dp.allow_unmasked:
            raise ConfigError("privacy: the distributed mode without secure aggregation shows the server every "
                              "device's noised update in the clear, and one device that skips its clip or its noise "
                              "share spoils the guarantee for all (issue 48): add a [secure_aggregation] table, or "
                              "name the risk with privacy.allow_unmasked = true")
        noise_multiplier(cfg)  # a target epsilon no noise reaches fails at creation, not at round 1


# ------------------------------------------------------------------------------------------- accounting

def expected_count(cfg: FederationConfig) -> float:
    """q N: the clients a round draws on average, the fixed denominator of the private mean."""
    return cfg.participation * cfg.clients


def noise_multiplier(cfg: FederationConfig) -> float:
    """z: the config's, or the least (to Opacus's calibration tolerance, 0.01 in epsilon) whose ``cfg.rounds``
    rounds spend at most its ``target_epsilon``."""
    dp = _dp(cfg)
    if dp.noise_multiplier is not None:
        return float(dp.noise_multiplier)
    return _calibrate(float(dp.target_epsilon or 0.0), dp.delta, cfg.participation, cfg.rounds)


@functools.lru_cache(maxsize=64)
def _calibrate(target: float, delta: float, q: float, rounds: int) -> float:
    from opacus.accountants.utils import get_noise_multiplier  # the accountant's own calibration

    try:
        z = float(get_noise_multiplier(target_epsilon=target, target_delta=delta, sample_rate=q, steps=rounds,
                                       accountant="rdp", alphas=list(ORDERS)))
    except ValueError as e:  # "The privacy budget is too low."
        raise ConfigError(f"privacy.target_epsilon {target:g} over {rounds} rounds: {e}") from None
    if z > MAX_NOISE:
        raise ConfigError(f"privacy.target_epsilon {target:g} over {rounds} rounds at sample rate {q:g} needs a "
                          f"noise multiplier of {z:,.0f}, over {MAX_NOISE:,.0f}: the noise would drown every update; "
                          "allow a larger epsilon, or fewer rounds")
    return z


def epsilon(cfg: FederationConfig, rounds: int) -> float:
    """The epsilon (at the config's delta) that ``rounds`` rounds have spent: Opacus's RDP accountant for the
    sampled Gaussian mechanism at rate q and multiplier z, composed ``rounds`` times (inf without noise)."""
    dp = _dp(cfg)
    z = noise_multiplier(cfg)
    if rounds <= 0:
        return 0.0
    if z == 0:
        return math.inf
    return _epsilon(z, cfg.participation, rounds, dp.delta)


def secret_draw(cfg: FederationConfig) -> bool:
    """Whether the server draws the rounds of ``cfg`` under a sampling key no device holds: a federation with a
    privacy table, secret noise (with ``secret_noise = false`` nothing is hidden from the devices anyway) and a
    draw (participation below 1). A device of it does not compute the draw: its task says whether it was drawn."""
    dp = cfg.dp
    return dp is not None and dp.secret_noise and cfg.participation < 1


@functools.lru_cache(maxsize=4096)
def _epsilon(z: float, q: float, rounds: int, delta: float) -> float:
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = [(z, q, rounds)]
    return float(acc.get_epsilon(delta=delta, alphas=list(ORDERS)))


def _dp(cfg: FederationConfig) -> PrivacyConfig:
    dp = cfg.dp
    if dp is None:
        raise ConfigError("this federation has no [privacy] table")
    return dp


# ------------------------------------------------------------------------------------------- noise

def seed_key(seed: int) -> bytes:
    """The noise key of a run without a secret one (the simulator; ``secret_noise = false``): from its seed."""
    return hashlib.sha256(f"pfl-edge:{Stream.DP_NOISE.value}:{int(seed)}".encode()).digest()


def new_key() -> bytes:
    """A server's secret noise key for a federation (256 bits from the operating system)."""
    return secrets.token_bytes(32)


def noise_rng(key: bytes, t: int) -> np.random.Generator:
    """Round ``t``'s stream of the aggregate's noise under ``key``."""
    digest = hashlib.sha256(key + int(t).to_bytes(8, "little")).digest()
    return np.random.default_rng(np.random.SeedSequence(list(np.frombuffer(digest, dtype=np.uint32))))


def round_noise(cfg: FederationConfig, t: int, key: bytes | None = None) -> np.random.Generator | None:
    """The stream of round ``t``'s aggregate noise (None without privacy): under the server's secret ``key``,
    else (the simulator; ``secret_noise = false``) under the seed's."""
    if cfg.privacy is None:
        return None
    return noise_rng(seed_key(cfg.seed) if key is None else key, t)


def device_noise(cfg: FederationConfig, t: int, slot: int, *, seeded: bool = False) -> np.random.Generator | None:
    """A distributed-mode device's stream for its share of round ``t``'s noise (None in the central mode): the
    operating system's randomness, or its slot's seeded stream with ``secret_noise = false`` or ``seeded`` (the
    simulator: a run is reproducible from its config, and there is nobody to hide the noise from)."""
    dp = _dp(cfg)
    if dp.mode != "distributed":
        return None
    if dp.secret_noise and not seeded:
        return np.random.default_rng(np.random.SeedSequence(secrets.randbits(128)))
    return numpy_rng(cfg.seed, Stream.DP_NOISE.value, t, slot)


# ------------------------------------------------------------------------------------------- the round

def _like(x: np.ndarray, like: Array) -> Array:
    """``x`` in ``like``'s kind (numpy or torch) and dtype."""
    if is_numpy(like):
        return x.astype(like.dtype)
    import torch

    return torch.from_numpy(np.ascontiguousarray(x)).to(like.dtype)


def privatize(cfg: FederationConfig, received: Mapping[str, Array], trained: Mapping[str, Array],
              noise: np.random.Generator | None = None) -> dict[str, Array]:
    """What a client sends of its trained shared part under the federation's privacy: ``received`` plus its
    update clipped to ``clip * MARGIN`` and, with ``noise`` (the distributed mode), its share of the round's
    noise; integer buffers as received. The device's and the simulator's one definition."""
    dp = _dp(cfg)
    floats = [k for k, v in trained.items() if _floating(v)]
    delta = {k: to_numpy(trained[k]).astype(np.float64) - to_numpy(received[k]).astype(np.float64) for k in floats}
    norm = math.sqrt(sum(float(np.square(d).sum()) for d in delta.values()))
    bound = dp.clip * MARGIN
    scale = bound / norm if norm > bound else 1.0
    out: dict[str, Array] = {}
    std = dp.clip * noise_multiplier(cfg) / math.sqrt(expected_count(cfg)) if noise is not None else 0.0
    for k, v in trained.items():
        if k not in delta:
            out[k] = received[k]
            continue
        d = delta[k] * scale
        if noise is not None:
            d = d + noise.standard_normal(d.shape) * std
        out[k] = _like(to_numpy(received[k]).astype(np.float64) + d, v)
    return out


def private_mean(cfg: FederationConfig, prev: Mapping[str, Tensor],
                 updates: Iterable[tuple[Mapping[str, Tensor], float]], noise: np.random.Generator | None
                 ) -> dict[str, Tensor]:
    """The round's new shared part from its updates (weights ignored: every client counts once): each update
    clipped to ``clip``, summed per tensor in float64, the central mode's noise N(0, (z C)^2) added to each
    float tensor's sum (``noise``: the round's stream; every float tensor of ``prev``, sent or not, so that what
    is released does not depend on who came), divided by the expected count q N, added to ``prev``. Integer
    tensors keep ``prev``'s value."""
    from .aggregate import clip_update

    dp = _dp(cfg)
    sums = {k: np.zeros(tuple(v.shape), np.float64) for k, v in prev.items() if v.is_floating_point()}
    bound = server_bound(cfg, sum(int(s.size) for s in sums.values()))
    for state, _ in updates:
        shared = {k: v for k, v in state.items() if k in sums}
        for k, v in clip_update(prev, shared, bound).items():
            sums[k] += to_numpy(v).astype(np.float64) - to_numpy(prev[k]).astype(np.float64)
    if dp.mode == "central":
        if noise is None:
            raise ConfigError("the central mode's private mean needs the round's noise stream")
        std = dp.clip * noise_multiplier(cfg)
        for k in sums:  # prev's key order: the stream's draws go to the same coordinates everywhere
            sums[k] += noise.standard_normal(sums[k].shape) * std
    m = expected_count(cfg)
    return {k: _like(to_numpy(v).astype(np.float64) + sums[k] / m, v) if k in sums else v for k, v in prev.items()}


def server_bound(cfg: FederationConfig, size: int) -> float:
    """The norm the server clips an update of ``size`` float coordinates to: ``clip`` in the central mode; in
    the distributed mode the update carries its noise share too, whose norm is about sigma sqrt(size), so
    ``clip + sigma (sqrt(size) + 10)``: no honest update reaches it (a chi's tail beyond 10 sigma), and a hostile
    one moves the mean by at most that over q N (its own noise it may leave out; docs/privacy.md)."""
    dp = _dp(cfg)
    if dp.mode == "central":
        return dp.clip
    sigma = dp.clip * noise_multiplier(cfg) / math.sqrt(expected_count(cfg))
    return dp.clip + sigma * (math.sqrt(size) + 10.0)


def _floating(v: Array) -> bool:
    return bool(np.issubdtype(v.dtype, np.floating)) if is_numpy(v) else bool(v.is_floating_point())
