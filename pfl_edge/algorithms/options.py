"""Algorithms' own options: each a frozen dataclass that validates itself on creation, given as a federation
config's ``options`` table (``Algorithm.Options``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError

__all__ = ["FinetuneOptions", "NoOptions"]


@dataclass(frozen=True)
class NoOptions:
    """The options of an algorithm that has none."""


@dataclass(frozen=True)
class FinetuneOptions:
    """When a -FT baseline fine-tunes what its clients deploy: ``ft_every`` 1 fine-tunes in every round (pfl-edge's
    default, the strongest at short budgets); K > 1 in rounds K, 2K, ... and the last; 0 in the last round only
    (the DisPFL reference's FedAvg-FT). A round that does not fine-tune deploys (and evaluates) the model as is.
    ``ft_from`` (D-PSGD-FT): fine-tune each client's neighbourhood average, or the average of all clients' models
    (the reference's D-PSGD-FT: ``ft_every = 100, ft_from = "all"``)."""

    ft_every: int = 1
    ft_from: Literal["neighbourhood", "all"] = "neighbourhood"

    def __post_init__(self) -> None:
        e = self.ft_every
        if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e <= 1_000_000:
            raise ConfigError(f"ft_every must be an integer >= 0 (0: the last round only), got {e!r:.40}")
        if self.ft_from not in ("neighbourhood", "all"):
            raise ConfigError(f"ft_from must be 'neighbourhood' or 'all', got {self.ft_from!r:.40}")

    def due(self, t: int, rounds: int) -> bool:
        """Does round ``t`` of ``rounds`` fine-tune?"""
        return t == rounds or (self.ft_every > 0 and t % self.ft_every == 0)
