"""A federation's ``[secure_aggregation]`` table (docs/secagg.md), kept beside ``pfl_edge.privacy`` (which
re-exports it): its keys, the rules it adds to a config, and the parameters of a round."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config_bounds import check_table_keys as _check_keys
from .errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .federation import FederationConfig
    from .secagg.protocol import Params

__all__ = ["MIN_CLIENTS", "SecAggConfig", "max_bits"]


#: a round of fewer participants releases nothing: the sum of two would tell each the other's update
MIN_CLIENTS = 3


@dataclass(frozen=True)
class SecAggConfig:
    """A federation's ``[secure_aggregation]`` table. ``bound``: each coordinate of an update is clipped to
    [-bound, bound] before it is quantized (None: the privacy table's ``clip``, which bounds every coordinate
    already); ``bits``: the quantization's (None: the most that cannot wrap, 32 - ceil(log2(clients + 1)));
    ``degree`` and ``threshold``: SecAgg+'s graph (None: about 3 log2 n neighbours, threshold 2k/3 + 1);
    ``step_s``: on devices, how long each step after a device's training may wait for the slow (seconds).
    ``min_group``: 0 (one sum of every participant), or grouped secure aggregation: the round's devices split by
    the round's public seed into groups of at least ``min_group`` (each group's sum unmasked alone: the server
    learns sums over ``min_group`` devices or more), combined ``across`` them: "median" (the coordinate-wise
    median of the groups' means: one hostile device moves only its group's) or "mean" (weighted by the groups'
    sizes: the plain mean); a group whose sum fails its check is left out either way."""

    bound: float | None = None
    bits: int | None = None
    degree: int | None = None
    threshold: int | None = None
    step_s: float = 60.0
    min_group: int = 0
    across: str = "median"

    def __post_init__(self) -> None:
        if self.bound is not None and (isinstance(self.bound, bool) or not isinstance(self.bound, int | float)
                                       or not (math.isfinite(self.bound) and 0 < self.bound <= 1e6)):
            raise ConfigError(f"secure_aggregation.bound must be in (0, 1e6], got {self.bound!r:.40}")
        for name, lo, hi in (("bits", 2, 31), ("degree", 2, 10_000), ("threshold", 2, 10_000)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
                raise ConfigError(f"secure_aggregation.{name} must be an integer in [{lo}, {hi}], got {v!r:.40}")
        if isinstance(self.min_group, bool) or not isinstance(self.min_group, int) or not (
                self.min_group == 0 or MIN_CLIENTS <= self.min_group <= 100_000):
            raise ConfigError(f"secure_aggregation.min_group must be 0 (one group) or an integer in [{MIN_CLIENTS}, "
                              f"100000], got {self.min_group!r:.40}")
        if self.across not in ("median", "mean"):
            raise ConfigError(f"secure_aggregation.across must be 'median' or 'mean', got {self.across!r:.40}")
        if isinstance(self.step_s, bool) or not isinstance(self.step_s, int | float) or not (
                math.isfinite(self.step_s) and 0 < self.step_s <= 86_400):
            raise ConfigError(f"secure_aggregation.step_s must be in (0, 86400] seconds, got {self.step_s!r:.40}")

    @classmethod
    def parse(cls, table: Mapping[str, Any] | None) -> SecAggConfig | None:
        if table is None:
            return None
        _check_keys(cls, table, "secure_aggregation")
        return cls(**table)

    def check(self, cfg: FederationConfig) -> None:
        """The rules a federation adds: a bound, bits that cannot wrap, a privacy mode that composes."""
        dp = cfg.dp
        if dp is not None and dp.mode != "distributed":
            raise ConfigError("secure aggregation with differential privacy needs privacy.mode = 'distributed': "
                              "the server cannot clip or noise what it cannot see (docs/secagg.md)")
        if self.bound is None and dp is None:
            raise ConfigError("secure_aggregation.bound (each coordinate's clip before quantizing) is required "
                              "without a privacy table")
        if self.bits is not None and cfg.clients * ((1 << self.bits) - 1) >= 1 << 32:
            raise ConfigError(f"secure_aggregation.bits {self.bits}: {cfg.clients} clients' sums wrap around 2^32; "
                              f"at most {max_bits(cfg.clients)}")

    def resolved(self, cfg: FederationConfig, n: int) -> tuple[float, int, Params | None]:
        """The bound, the bits and a round's parameters for ``n`` participants (None: too few)."""
        dp = cfg.dp
        bound = float(self.bound if self.bound is not None else dp.clip if dp is not None else 0.0)
        bits = self.bits if self.bits is not None else max_bits(cfg.clients)
        if n < MIN_CLIENTS:
            return bound, bits, None
        k = self.degree if self.degree is not None else 2 * math.ceil(1.5 * math.log2(max(n, 2)))
        k = min(k, n - 1)
        k -= k % 2
        t = self.threshold if self.threshold is not None else 2 * k // 3 + 1
        from .secagg.protocol import Params  # the protocol's own checks (cryptography: imported only here)

        return bound, bits, Params(k, max(k // 2 + 1, min(t, k)), 1)


def max_bits(clients: int) -> int:
    """The most bits per coordinate whose sum over ``clients`` cannot wrap around 2^32."""
    return min(31, 32 - math.ceil(math.log2(clients + 1)))
