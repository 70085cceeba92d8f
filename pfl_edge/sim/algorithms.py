"""The simulator's side of each algorithm: it runs the round that ``pfl_edge.algorithms`` defines over every
client's row at once and adds what only a simulation knows (what every client deploys, scores and sends, the
FLOPs it spends)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..accounting import payload_bytes
from ..algorithms import Algorithm, Clients, central, get_algorithm
from ..errors import InternalError
from ..federation import FederationConfig
from ..models import BlockModel
from ..parallel import Trainer
from ..split import Split
from ..train import ClientTensors, Stack, index_stack, unstack

__all__ = ["TRAIN_CHUNK", "Algorithm", "CentralPFL", "Context", "RoundStats", "Runner", "weighted_loss"]

#: clients trained per call in a centralised round (what is held of trained models at once; a cnn client: 1.8 MB)
TRAIN_CHUNK = 128


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


class Runner(ABC):
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.algo = ctx.algorithm

    @abstractmethod
    def run_round(self, t: int, participants: Tensor) -> RoundStats:
        """Round ``t`` (1-based) with the sampled ``participants`` (sorted client ids)."""

    @abstractmethod
    def deployed(self) -> Stack:
        """Every client's model as it would deploy it now, stacked."""

    def shared(self) -> dict[str, Tensor] | None:
        """The shared part (a global model or base), if the algorithm has one."""
        return None

    def analysis(self) -> dict[str, object]:
        """Extra end-of-run analysis for the result JSON (DisPFL: masks against label similarity)."""
        return {}


def weighted_loss(loss: Tensor, n: Tensor) -> float:
    """Mean training loss over clients weighted by their samples."""
    w = n.to(torch.float64)
    return float((loss.to(torch.float64) * w).sum() / w.sum())


class CentralPFL(Runner):
    """local, FedAvg(-FT), FedPer(-FT) (``pfl_edge.algorithms.central``). FedPer-FT adapts every client's
    personal blocks to each new base, participant of the next round or not (with full participation, the
    default, the two readings agree), and its FLOPs are counted."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        if not isinstance(self.algo, central.Central):
            raise InternalError(f"{ctx.cfg.algorithm} is not a centralised algorithm")
        self.central: central.Central = self.algo
        self.clients: Stack = self.central.init_clients(ctx.clients, ctx.init_state)
        self.base: dict[str, Tensor] | None = (central.upload(ctx.init_state, self.central.split)
                                               if self.central.split.base else None)
        self._deployed: Stack | None = None
        self.clients = self.central.receive(ctx.clients, self.clients, self.base, 0)  # FedPer-FT adapts at once

    def run_round(self, t: int, participants: Tensor) -> RoundStats:
        ctx, algo = self.ctx, self.central
        everyone = ctx.clients
        shared = set(algo.split.base) if self.base is not None else set()
        losses: list[tuple[Tensor, Tensor]] = []

        def trained() -> Iterator[tuple[dict[str, Tensor], float]]:
            """The participants' uploads in slot order, trained TRAIN_CHUNK clients at a time as the average asks
            for them: a round of many small clients never holds every trained model at once, and the average,
            taken in the same order, is the same to the bit."""
            for rows in participants.split(TRAIN_CHUNK):
                part = everyone.subset(rows)
                res = algo.local_round(part, central.with_base(index_stack(self.clients, rows), self.base, algo.split),
                                       t)
                for k, v in res.stack.items():
                    if k not in shared:  # the trained base goes to the average; every client takes the new one
                        self.clients[k][rows] = v
                losses.append((res.loss, part.n_train))
                for j, n in enumerate(part.n_train):
                    yield central.upload(unstack(res.stack, j), algo.split), float(n)

        base_bytes = payload_bytes(self.base) if self.base else 0
        uploads = trained()
        if self.base is not None:
            self.base = algo.aggregate(self.base, uploads)
        for _ in uploads:  # nothing shared (local): train all the same
            pass
        loss_n = (torch.cat([a for a, _ in losses]), torch.cat([b for _, b in losses]))
        up = [0] * ctx.num_clients
        down = [0] * ctx.num_clients
        for i in participants.tolist():
            up[i] = down[i] = base_bytes
        self.clients = algo.receive(everyone, self.clients, self.base, t)
        deployed = algo.deploy(everyone, self.clients, t)
        self._deployed = deployed
        acc, loss = ctx.trainer.evaluate(deployed, everyone.slots)
        # training a sample costs 3 forwards; fine-tuning counts alike (docs/algorithms.md's accounting)
        took_part = set(participants.tolist())
        epochs = torch.tensor([algo.train_epochs(i in took_part, t) for i in range(ctx.num_clients)])
        flops = (3 * ctx.dense_flops * epochs * ctx.train_data.n).tolist()
        return RoundStats(acc.tolist(), loss.tolist(), weighted_loss(*loss_n), up, down,
                          sum(up) + sum(down), sum(up), participants.tolist(), flops, [1.0] * ctx.num_clients)

    def deployed(self) -> Stack:
        if self._deployed is not None:
            return self._deployed
        return self.central.deployed_view(central.with_base(self.clients, self.base, self.central.split))

    def shared(self) -> dict[str, Tensor] | None:
        return dict(self.base) if self.base else None
