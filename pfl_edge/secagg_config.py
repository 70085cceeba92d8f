"""A federation's ``[secure_aggregation]`` table (docs/secagg.md), kept beside ``pfl_edge.privacy`` (which
re-exports it): its keys, the rules it adds to a config, and the parameters of a round."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .config_bounds import Range, check_fields, meta
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
    """A federation's ``[secure_aggregation]`` table (docs/secagg.md; each key's meaning: its field's ``doc``).
    ``min_group`` above 0 is grouped secure aggregation: the round's devices split by the round's public seed into
    groups of at least ``min_group``, each group's sum unmasked alone (the server learns sums over ``min_group``
    devices or more), and a group whose sum fails its check left out."""

    bound: float | None = field(default=None, metadata=meta(
        "each coordinate of an update is clipped to [-bound, bound] before it is quantized (null: privacy.clip)",
        Range(0, 1e6, lo_open=True)))
    bits: int | None = field(default=None, metadata=meta(
        "the quantization's bits per coordinate (null: the most that cannot wrap, 32 - ceil(log2(clients + 1)))",
        Range(2, 31)))
    degree: int | None = field(default=None, metadata=meta(
        "SecAgg+'s neighbours per device (null: about 3 log2 n, even)", Range(2, 10_000)))
    threshold: int | None = field(default=None, metadata=meta(
        "SecAgg+'s shares needed to rebuild a secret (null: 2 degree / 3 + 1)", Range(2, 10_000)))
    step_s: float = field(default=60.0, metadata=meta(
        "on devices, how long each step after a device's training may wait for the slow (seconds)",
        Range(0, 86_400, lo_open=True)))
    min_group: int = field(default=0, metadata=meta(
        "0: one sum of every participant; else the least devices in a group, each group's sum unmasked alone",
        Range(MIN_CLIENTS, 100_000, off=True)))
    across: Literal["median", "mean"] = field(default="median", metadata=meta(
        "how the groups' means combine: their coordinate-wise median (one hostile device moves only its group's) "
        "or their mean weighted by the groups' sizes"))

    def __post_init__(self) -> None:
        check_fields(self, "secure_aggregation.")

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
