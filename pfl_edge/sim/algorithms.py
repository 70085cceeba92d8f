"""The simulator's one runner: it drives an algorithm's ``Simulation`` (``pfl_edge.algorithms``: every client's
state, the round over every row, its bytes and FLOPs) round by round, evaluates what every client deploys, and
records the round."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..algorithms import Algorithm, Clients, get_algorithm
from ..algorithms.simulation import Simulation, World
from ..federation import FederationConfig
from ..models import BlockModel
from ..parallel import Trainer
from ..split import Split
from ..train import ClientTensors, Stack

__all__ = ["Context", "RoundStats", "Runner", "weighted_loss"]


@dataclass(frozen=True, eq=False)
class Context:
    """What every algorithm of a run shares: config, model skeleton, split, client data, initial state."""

    cfg: FederationConfig
    model: BlockModel
    split: Split
    train_data: ClientTensors
    test_data: ClientTensors
    init_state: dict[str, Tensor]
    trainer: Trainer
    dense_flops: int  # forward FLOPs per sample of the dense model
    num_classes: int

    @property
    def num_clients(self) -> int:
        return int(self.train_data.n.numel())

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.train_data.sample_shape

    @property
    def clients(self) -> Clients:
        """Every client, as the algorithms see them."""
        return Clients(self.cfg, self.model, self.trainer, torch.arange(self.num_clients), self.train_data.n)

    @property
    def algorithm(self) -> Algorithm:
        return get_algorithm(self.cfg, self.model)


@dataclass(frozen=True)
class RoundStats:
    client_acc: list[float]
    client_loss: list[float]
    train_loss: float
    client_bytes_up: list[int]
    client_bytes_down: list[int]
    busiest_node_bytes: int  # sent + received by the node that moves the most
    busiest_node_received: int  # one direction, as the DisPFL paper counts: the most any node receives
    participants: list[int]
    client_flops: list[int]
    client_density: list[float]
    extra: dict[str, object] = field(default_factory=dict)


class Runner:
    """An algorithm's simulation over every client (``Algorithm.simulation``), round by round: the algorithm
    runs and accounts for the round; the runner evaluates what the clients deploy."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.algo: Algorithm = ctx.algorithm
        y, n = ctx.train_data.y, ctx.train_data.n
        counts = torch.stack([torch.bincount(y[i, : int(n[i])], minlength=ctx.num_classes)
                              for i in range(ctx.num_clients)])
        self.sim: Simulation = self.algo.simulation(World(ctx.clients, ctx.init_state, ctx.dense_flops,
                                                          ctx.input_shape, counts))

    def run_round(self, t: int, participants: Tensor) -> RoundStats:
        """Round ``t`` (1-based) with the drawn ``participants`` (sorted client ids)."""
        r = self.sim.round(t, participants)
        acc, loss = self.ctx.trainer.evaluate(r.deployed, self.ctx.clients.slots)
        return RoundStats(acc.tolist(), loss.tolist(), weighted_loss(r.loss, r.loss_n), r.bytes_up, r.bytes_down,
                          r.busiest, r.received, participants.tolist(), r.flops, r.density, r.extra)

    def deployed(self) -> Stack:
        """Every client's model as it would deploy it now, stacked."""
        return self.sim.deployed()

    def shared(self) -> dict[str, Tensor] | None:
        """The shared part (a global model or base), if the algorithm has one."""
        return self.sim.shared()

    def analysis(self) -> dict[str, object]:
        """Extra end-of-run analysis for the result JSON (DisPFL: masks against label similarity)."""
        return self.sim.analysis()


def weighted_loss(loss: Tensor, n: Tensor) -> float:
    """Mean training loss over clients weighted by their samples (NaN where nobody trained: a round of
    differential privacy's Poisson draw may draw nobody)."""
    w = n.to(torch.float64)
    if not len(w):
        return math.nan
    return float((loss.to(torch.float64) * w).sum() / w.sum())
