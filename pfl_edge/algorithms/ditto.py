"""Ditto (Li et al., ICML 2021; docs/algorithms.md): a global model trained as FedAvg, and on each client a
personal model regularised towards it.

A client keeps two models: ``w``, its copy of the global model (what it trains and sends, as in FedAvg), and
``v``, its personal model (what it deploys and is evaluated on; it never leaves the client). A round, for
client i, from the global model ``w^t`` it received:

1. ``w_i``: ``local_epochs`` of SGD on its data from ``w^t``, sent to the server, which averages them (FedAvg);
2. ``v_i``: ``personal_epochs`` of SGD on ``F_i(v) + (lam / 2) ||v - w^t||^2`` from its own ``v_i``; the
   proximal term is ``pfl_edge.train``'s ``TrainConfig.prox`` with ``w^t`` as the anchor.

The two are independent given ``w^t`` (each draws its batches from its own stream), so a device trains them in
either order and gets the simulator's numbers. ``lam = 0`` gives local training beside FedAvg; a large ``lam``
pins ``v`` to the global model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..arrays import Array as Tensor
from ..arrays import Stack, copy
from ..config_bounds import Range, check_fields, meta
from ..seeding import Stream
from ..sgd import TrainResult
from .algorithm import register_algorithm
from .base import Clients
from .central import FedAvg, train_round

__all__ = ["Ditto", "DittoOptions", "global_part", "personal_part"]

_PERSONAL = "personal:"  # prefix of the personal model's tensors in a client's state


@dataclass(frozen=True)
class DittoOptions:
    lam: float = field(default=0.1, metadata=meta(
        "lambda: how strongly the personal model is pulled towards the global one", Range(0, 1e6)))
    personal_epochs: int | None = field(default=None, metadata=meta(
        "epochs of the personal model per round (null: local_epochs)", Range(1, 1_000)))

    def __post_init__(self) -> None:
        check_fields(self, "ditto's ")
        object.__setattr__(self, "lam", float(self.lam))


def personal_part(state: Mapping[str, Tensor]) -> Stack:
    """The personal model in a client's state, under the model's own names."""
    return {k.removeprefix(_PERSONAL): v for k, v in state.items() if k.startswith(_PERSONAL)}


def global_part(state: Mapping[str, Tensor]) -> Stack:
    """The client's copy of the global model."""
    return {k: v for k, v in state.items() if not k.startswith(_PERSONAL)}


@register_algorithm("ditto")
class Ditto(FedAvg):
    """FedAvg's global model, and a personal model per client trained towards it (``lam``) and deployed."""

    Options = DittoOptions

    def init_clients(self, cl: Clients, init: Mapping[str, Tensor]) -> Stack:
        out = super().init_clients(cl, init)
        return {**out, **{_PERSONAL + k: copy(v) for k, v in out.items()}}  # v starts as the initial model

    def local_round(self, cl: Clients, state: Stack, t: int) -> TrainResult:
        received = global_part(state)
        shared = train_round(cl, received, t)
        opts: DittoOptions = self.options
        pcfg = dataclasses.replace(self.cfg.train_config(t, opts.personal_epochs), prox=opts.lam)
        own = cl.trainer.train(personal_part(state), cl.slots, pcfg, cl.gens(Stream.PERSONAL, t), anchor=received)
        out = {**shared.stack, **{_PERSONAL + k: v for k, v in own.stack.items()}}
        # the global model's training loss is the one reported (FedAvg's); steps count both models' training
        return TrainResult(out, shared.loss, shared.steps + own.steps, shared.samples)

    def deployed_view(self, state: Stack) -> Stack:
        return personal_part(state)

    def train_epochs(self, participated: bool, t: int | None = None) -> int:
        opts: DittoOptions = self.options
        personal = self.cfg.local_epochs if opts.personal_epochs is None else opts.personal_epochs
        return self.cfg.local_epochs + personal if participated else 0
