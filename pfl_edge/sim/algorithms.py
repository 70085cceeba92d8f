"""Algorithms of the in-process simulator. Each runs one round at a time over client *stacks*
(``pfl_edge.train``) and reports what each client would deploy, how it scores and what it sent."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..accounting import payload_bytes
from ..aggregate import weighted_average
from ..errors import ConfigError
from ..models import BlockModel
from ..parallel import Trainer
from ..seeding import generator
from ..split import Split, take
from ..train import ClientTensors, Stack, TrainConfig, index_stack, stack_states, unstack
from .config import CENTRAL, SimConfig

__all__ = ["ALGORITHM_CLASSES", "Algorithm", "CentralPFL", "Context", "RoundStats", "make_algorithm"]


@dataclass(frozen=True, eq=False)
class Context:
    """What every algorithm of a run shares: config, model skeleton, split, client data, initial state."""

    cfg: SimConfig
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

    def train_config(self, t: int, epochs: int | None = None) -> TrainConfig:
        c = self.cfg
        return TrainConfig(epochs=c.local_epochs if epochs is None else epochs, batch_size=c.batch_size,
                           lr=c.lr_at(max(t, 1)), momentum=c.momentum, weight_decay=c.weight_decay,
                           clip_norm=c.clip_norm)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_data.x.shape[2:])

    def gens(self, label: str, t: int, rows: Tensor) -> list[torch.Generator]:
        return [generator(self.cfg.seed, label, t, int(i)) for i in rows]


@dataclass(frozen=True)
class RoundStats:
    client_acc: list[float]
    client_loss: list[float]
    train_loss: float
    client_bytes_up: list[int]
    client_bytes_down: list[int]
    busiest_node_bytes: int
    participants: list[int]
    client_flops: list[int]
    client_density: list[float]
    extra: dict[str, object] = field(default_factory=dict)


class Algorithm(ABC):
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

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


class CentralPFL(Algorithm):
    """local, FedAvg(-FT), FedPer(-FT): a server averages the base blocks, weighted by training samples; the
    personal blocks (the last K_P; none for FedAvg, all for local) stay on each client.

    -FT: FedAvg-FT fine-tunes the new global model on each client for ``ft_epochs`` before evaluating (the
    fine-tuned copy is what it deploys; the next round starts from the global model again). FedPer-FT trains
    the personal blocks alone for ``ft_epochs`` on every new base, base frozen, before the joint training of
    the next round (ALGORITHMS.md); its evaluation comes after that step. Every client that deploys the new
    base adapts its head this way, participants of the next round or not (with full participation, the
    default, the two readings agree), and its FLOPs are counted.
    """

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        n = ctx.num_clients
        self.clients: Stack = stack_states([ctx.init_state] * n)
        self.base = take(ctx.init_state, ctx.split.base)
        self.all_rows = torch.arange(n)
        self.personal_params = [k for k, _ in ctx.model.named_parameters() if k in set(ctx.split.personal)]
        self._deployed: Stack | None = None
        self.ft = {"fedavg-ft": "all", "fedper-ft": "personal"}.get(ctx.cfg.algorithm)
        if self.ft == "personal":
            self._personal_ft(0)

    def _with_base(self, stack: Stack) -> Stack:
        """A new stack: the clients' personal tensors (copied, so later rounds never change it) under the
        current base."""
        out = {k: v.clone() for k, v in stack.items() if k not in self.base}
        for k, v in self.base.items():
            out[k] = v.unsqueeze(0).expand(len(next(iter(stack.values()))), *v.shape).clone()
        return out

    def _personal_ft(self, t: int) -> None:
        ctx = self.ctx
        if not self.personal_params or ctx.cfg.ft_epochs == 0:
            return
        res = ctx.trainer.train(self._with_base(self.clients), self.all_rows, ctx.train_config(t, ctx.cfg.ft_epochs),
                                ctx.gens("finetune", t, self.all_rows), trainable=self.personal_params)
        self.clients = res.stack

    def run_round(self, t: int, participants: Tensor) -> RoundStats:
        ctx = self.ctx
        start = self._with_base(index_stack(self.clients, participants))
        res = ctx.trainer.train(start, participants, ctx.train_config(t), ctx.gens("train", t, participants))
        for k, v in res.stack.items():
            self.clients[k][participants] = v
        base_bytes = payload_bytes(self.base) if self.base else 0
        if ctx.split.base:
            weights = [float(n) for n in ctx.train_data.n[participants]]
            updates = [take(unstack(res.stack, j), ctx.split.base) for j in range(len(participants))]
            self.base = weighted_average(updates, weights)
        up = [0] * ctx.num_clients
        down = [0] * ctx.num_clients
        for i in participants.tolist():
            up[i] = down[i] = base_bytes

        if self.ft == "personal":
            self._personal_ft(t)
        deployed = self._with_base(self.clients)
        if self.ft == "all" and ctx.cfg.ft_epochs:
            deployed = ctx.trainer.train(deployed, self.all_rows, ctx.train_config(t, ctx.cfg.ft_epochs),
                                         ctx.gens("finetune", t, self.all_rows)).stack
        self._deployed = deployed
        acc, loss = ctx.trainer.evaluate(deployed, self.all_rows)
        n_part = ctx.train_data.n[participants].float()
        train_loss = float((res.loss * n_part).sum() / n_part.sum())
        # training a sample costs 3 forwards; fine-tuning counts alike (ALGORITHMS.md's accounting)
        epochs = torch.zeros(ctx.num_clients, dtype=torch.int64)
        epochs[participants] += ctx.cfg.local_epochs
        if self.ft is not None and (self.ft == "all" or self.personal_params):
            epochs += ctx.cfg.ft_epochs
        flops = (3 * ctx.dense_flops * epochs * ctx.train_data.n).tolist()
        return RoundStats(acc.tolist(), loss.tolist(), train_loss, up, down, sum(up) + sum(down),
                          participants.tolist(), flops, [1.0] * ctx.num_clients)

    def deployed(self) -> Stack:
        return self._deployed if self._deployed is not None else self._with_base(self.clients)

    def shared(self) -> dict[str, Tensor] | None:
        return dict(self.base) if self.base else None


ALGORITHM_CLASSES: dict[str, Callable[[Context], Algorithm]] = dict.fromkeys(CENTRAL, CentralPFL)


def _register_decentral() -> None:
    from .decentral import DPSGD, DisPFL

    ALGORITHM_CLASSES.update({"dispfl": DisPFL, "dpsgd": DPSGD, "dpsgd-ft": DPSGD})


_register_decentral()


def make_algorithm(ctx: Context) -> Algorithm:
    try:
        cls = ALGORITHM_CLASSES[ctx.cfg.algorithm]
    except KeyError:
        raise ConfigError(f"unknown algorithm {ctx.cfg.algorithm!r}; valid: {sorted(ALGORITHM_CLASSES)}") from None
    return cls(ctx)
