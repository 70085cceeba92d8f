"""Algorithms' own options: each a frozen dataclass that validates itself on creation, given as a federation
config's ``options`` table (``Algorithm.Options``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..config_bounds import Range, check_fields, meta
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..federation import FederationConfig
    from ..sgd import TrainConfig

__all__ = ["DecentralFinetuneOptions", "DecentralOptions", "FinetuneOptions", "NoOptions", "check_topology"]


@dataclass(frozen=True)
class NoOptions:
    """The options of an algorithm that has none."""


def check_topology(topology: str | None) -> None:
    """A topology's spec as text of bounded length (``pfl_edge.topology`` checks what it says)."""
    if topology is not None and (not isinstance(topology, str) or not 0 < len(topology) <= 256):
        raise ConfigError(f"topology must be a spec such as random:K, ring or full, got {topology!r:.40}")


@dataclass(frozen=True)
class DecentralOptions:
    """What every decentralised algorithm (DisPFL, D-PSGD) takes: ``topology`` (its field's ``doc``; the default's
    K is the paper's 10 neighbours). Before it was an option, it was a flat key of the federation config; a config
    that has it there is read as if it were here (``pfl_edge.config_migration``)."""

    topology: str | None = field(default=None, metadata=meta(
        "each round's neighbour graph: random:K, ring or full (null: random:K, K = min(10, clients - 1))"))

    def __post_init__(self) -> None:
        check_topology(self.topology)

    def topology_spec(self, clients: int) -> str:
        """The topology's spec for a federation of ``clients``, the default filled in."""
        return self.topology if self.topology is not None else f"random:{max(1, min(10, clients - 1))}"


@dataclass(frozen=True)
class FinetuneOptions:
    """How a -FT baseline fine-tunes what its clients deploy (not kept); each key's meaning: its field's ``doc``.

    ``ft_every``: 1 (every round) is pfl-edge's default, the strongest at short budgets; a round that does not
    fine-tune deploys (and evaluates) the model as is. ``ft_recipe = "reference"`` is as the DisPFL authors' code
    does (``client.train(w, -1)``), whatever the round. ``ft_from = "all"`` was pfl-edge's earlier reading of the
    reference's ``w_global`` (``"uniform"``): it weights a client by how many neighbourhoods hold it.

    The reference's baselines: FedAvg-FT ``ft_every = 0, ft_recipe = "reference"``; D-PSGD-FT ``ft_every = 100,
    ft_from = "uniform", ft_recipe = "reference"`` (docs/algorithms.md)."""

    ft_every: int = field(default=1, metadata=meta(
        "which rounds fine-tune: 1 every round, K rounds K, 2K, ... and the last, 0 the last only",
        Range(0, 1_000_000)))
    ft_from: Literal["neighbourhood", "uniform", "all"] = field(default="neighbourhood", metadata=meta(
        "D-PSGD-FT: what a client fine-tunes: its neighbourhood average of the round, the uniform mean of every "
        "client's trained model, or all: the mean of every neighbourhood average"))
    ft_recipe: Literal["pfl-edge", "reference"] = field(default="pfl-edge", metadata=meta(
        "pfl-edge: ft_epochs at the round's lr; reference: the local epoch count at lr * lr_decay ** -1"))

    def __post_init__(self) -> None:
        check_fields(self)

    def due(self, t: int, rounds: int) -> bool:
        """Does round ``t`` of ``rounds`` fine-tune?"""
        return t == rounds or (self.ft_every > 0 and t % self.ft_every == 0)

    def epochs(self, cfg: FederationConfig) -> int:
        """Epochs of one fine-tuning: the config's ``ft_epochs``, or (the reference's) its local epoch count."""
        return cfg.local_epochs if self.ft_recipe == "reference" else cfg.ft_epochs

    def train_config(self, cfg: FederationConfig, t: int) -> TrainConfig:
        """Local SGD of round ``t``'s fine-tuning."""
        tc = cfg.train_config(t, self.epochs(cfg))
        # the reference computes lr * lr_decay ** round at round -1; written as it does, to the last bit
        return dataclasses.replace(tc, lr=cfg.lr * cfg.lr_decay ** -1) if self.ft_recipe == "reference" else tc


@dataclass(frozen=True)
class DecentralFinetuneOptions(FinetuneOptions, DecentralOptions):
    """D-PSGD-FT's: ``FinetuneOptions`` and a decentralised algorithm's ``topology`` (``DecentralOptions``)."""

    def __post_init__(self) -> None:
        FinetuneOptions.__post_init__(self)
        DecentralOptions.__post_init__(self)
