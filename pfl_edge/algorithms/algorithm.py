"""The interface each algorithm implements once, and the registry.

An algorithm object is built for a federation config and a model (and, for FedPer, the K_P of the clients it
serves). Its client side is a set of pure functions over stacks (``Clients`` says whose rows they are); its
coordinator side plans a round and aggregates. The device-level methods (``device_*``) compose the client
side for one device's round, so the agent runs a round without knowing which algorithm it follows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import ConfigError, UnknownNameError
from ..federation import FederationConfig, Stream, stream
from ..models import BlockModel
from ..split import Split, split_keys
from ..topology import neighbours
from .base import Clients, Metrics, Received, Upload

__all__ = [
    "Algorithm",
    "Decentralised",
    "DeviceRound",
    "get_algorithm",
    "list_algorithms",
    "register_algorithm",
    "sample_participants",
]


@dataclass(frozen=True, eq=False)
class DeviceRound:
    """One device's round: its new state (everything it keeps, in one dict), what it uploads, the metrics it
    can report now, the model it deploys where that is not simply its state's model (DisPFL: the trained model
    of this round; FedPer: on the final step, its personal blocks on the last base), and its training's loss and
    steps."""

    state: dict[str, Tensor]
    upload: Upload | None
    metrics: list[Metrics] = field(default_factory=list)
    deployed: dict[str, Tensor] | None = None
    train_loss: float | None = None
    steps: int = 0


def sample_participants(seed: int, t: int, num_clients: int, fraction: float) -> Tensor:
    """The clients (slots) of round ``t``: ``max(1, floor(fraction * N))`` drawn from the round's own stream;
    everyone when the fraction is 1."""
    m = max(1, min(num_clients, int(fraction * num_clients + 1e-9)))
    if m == num_clients:
        return torch.arange(num_clients)
    return torch.randperm(num_clients, generator=stream(seed, Stream.PARTICIPANTS, t))[:m].sort().values


class Algorithm:
    #: devices exchange models among themselves (through the server's relay); the server never averages
    decentral: bool = False
    #: a device sends its initial model before round 1 (its first neighbours average it)
    sends_initial_model: bool = False
    #: the server ends the federation with a final task on which every device evaluates (FedPer: its personal
    #: blocks on the last base); otherwise a device's last round is its last evaluation
    final_evaluation: bool = False
    #: the on-device training program a device of this algorithm runs (``export.TRAINING_MODES``): the whole model
    #: (its personal blocks alone for -FT's fine-tuning), or DisPFL's masked program with the dense gradient
    program_mode: str = "fedper"

    @property
    def program_modes(self) -> tuple[str, ...]:
        """Every training program a device of this algorithm may run, ``program_mode`` (the one the agent trains
        with) first: what the server exports and a model card lists."""
        return (self.program_mode,)

    def __init__(self, cfg: FederationConfig, model: BlockModel, kp: int | None = None) -> None:
        self.name = cfg.algorithm
        self.cfg = cfg
        self.model = model
        eff = cfg.effective_kp  # the K_P rule: 0 where nothing is personal, every block for local training
        if eff is None:
            k = len(model.block_names)
        elif eff == 0:
            k = 0
        else:
            k = eff if kp is None else kp
        self.split: Split = split_keys(model, k, local_norm_stats=cfg.local_norm_stats)

    # ------------------------------------------------------------------------------------------ coordinator
    def participants(self, t: int) -> Tensor:
        return sample_participants(self.cfg.seed, t, self.cfg.clients, self.cfg.participation)

    def neighbours(self, t: int) -> list[list[int]] | None:
        """Decentralised algorithms: each slot's in-neighbours in round ``t``; None where a server averages."""
        return None

    def aggregate(self, prev: Mapping[str, Tensor],
                  updates: Iterable[tuple[Mapping[str, Tensor], float]]) -> dict[str, Tensor] | None:
        """The coordinator's new shared model from the round's updates (weights: training samples), streamed
        one at a time; None where nothing is shared through a server."""
        return None

    # ------------------------------------------------------------------------------------------ device
    @property
    def on_devices(self) -> bool:
        return False

    def device_init(self, dev: Clients, init: Mapping[str, Tensor], density: float) -> dict[str, Tensor]:
        """A device's state before its first round, from the federation's initial model."""
        raise ConfigError(f"algorithm {self.name!r} does not run on devices")

    def device_upload(self, state: Mapping[str, Tensor]) -> Upload:
        """What a device whose state is ``state`` (as its last round, or its initialisation, left it) sends."""
        raise ConfigError(f"algorithm {self.name!r} does not run on devices")

    def device_round(self, dev: Clients, state: Mapping[str, Tensor], received: Received, t: int, *,
                     prev: int = 0, late: bool = False, final: bool = False) -> DeviceRound:
        """Round ``t`` of a device (``dev`` holds its one row) from what its task made it fetch. ``prev``: the
        round it last trained in (0: none yet); ``late``: it joined a running federation; ``final``: the
        federation's last step (evaluate, no training, nothing to send)."""
        raise ConfigError(f"algorithm {self.name!r} does not run on devices")

    def deployed_key(self, key: str) -> bool:
        """Is ``key`` of a device's state part of the model it deploys (not bookkeeping such as masks)?"""
        return True


class Decentralised(Algorithm):
    """Clients average with their in-neighbours of the round (the federation's topology, drawn from its seed);
    no server averages."""

    decentral = True

    def neighbours(self, t: int) -> list[list[int]] | None:
        return neighbours(self.cfg.topology_spec, self.cfg.clients, t, self.cfg.seed)


_REGISTRY: dict[str, Callable[[FederationConfig, BlockModel, int | None], Algorithm]] = {}


def register_algorithm(*names: str) -> Callable[[type[Algorithm]], type[Algorithm]]:
    def deco(cls: type[Algorithm]) -> type[Algorithm]:
        for n in names:
            _REGISTRY[n] = cls
        return cls

    return deco


def list_algorithms() -> list[str]:
    return sorted(_REGISTRY)


def get_algorithm(cfg: FederationConfig, model: BlockModel, kp: int | None = None) -> Algorithm:
    """The algorithm ``cfg.algorithm`` for this config and model (``kp``: the K_P of the clients it serves; by
    default the config's)."""
    try:
        cls = _REGISTRY[cfg.algorithm]
    except KeyError:
        raise UnknownNameError("algorithm", cfg.algorithm, list_algorithms()) from None
    return cls(cfg, model, kp)
