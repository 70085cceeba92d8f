"""FedRep (Collins et al., ICML 2021; docs/algorithms.md): FedPer's split, trained in two phases.

The base (the paper's representation, the blocks below K_P) is averaged by the server as FedPer's; the K_P
personal blocks (the head) never leave the client. A round, for client i, from the base it received:

1. the head alone for ``head_epochs`` of SGD, the base frozen (the paper's 10);
2. the base alone for ``local_epochs``, the new head frozen (the paper's 1); the base is sent.

FedPer trains both at once; FedRep's alternation lets each head fit the shared representation before the
representation moves. The head's batches come from the client's ``PERSONAL`` stream, the base's from ``TRAIN``,
so a device reproduces the simulator's numbers. On a device both phases run the whole-model training program
with the other part's gradients left unapplied (``trainable``), so FedRep needs no program of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..arrays import Stack
from ..config_bounds import Range, check_fields, meta
from ..errors import ConfigError
from ..seeding import Stream
from ..sgd import TrainResult
from .algorithm import register_algorithm
from .base import Clients
from .central import FedPer

if TYPE_CHECKING:
    from ..federation import FederationConfig

__all__ = ["FedRep", "FedRepOptions"]


@dataclass(frozen=True)
class FedRepOptions:
    head_epochs: int = field(default=10, metadata=meta(
        "epochs of the head alone per round (base frozen), before the base's local_epochs", Range(0, 1_000)))

    def __post_init__(self) -> None:
        check_fields(self, "fedrep's ")


@register_algorithm("fedrep")
class FedRep(FedPer):
    """FedPer's base and head, the head trained first with the base frozen, then the base with the head frozen."""

    Options = FedRepOptions
    linear_base = False  # the linear base is FedPer's control

    @classmethod
    def check_config(cls, cfg: FederationConfig) -> None:
        if cfg.kp < 1:
            raise ConfigError(f"fedrep's head is the K_P personal blocks: use kp >= 1, got {cfg.kp}")

    def local_round(self, cl: Clients, state: Stack, t: int) -> TrainResult:
        opts: FedRepOptions = self.options
        personal = set(self.split.personal)
        head = [k for k in cl.param_names if k in personal]
        body = [k for k in cl.param_names if k not in personal]
        steps = None
        if head and opts.head_epochs:
            res = cl.trainer.train(state, cl.slots, self.cfg.train_config(t, opts.head_epochs),
                                   cl.gens(Stream.PERSONAL, t), trainable=head)
            state, steps = res.stack, res.steps
        out = cl.trainer.train(state, cl.slots, self.cfg.train_config(t), cl.gens(Stream.TRAIN, t), trainable=body)
        # the base's training loss is the one reported; steps count both phases
        return TrainResult(out.stack, out.loss, out.steps if steps is None else out.steps + steps, out.samples)

    def train_epochs(self, participated: bool, t: int | None = None) -> int:
        # a head epoch is counted as a whole-model epoch: an upper bound (its backward stops at the head)
        opts: FedRepOptions = self.options
        personal = set(self.split.personal)
        head = any(k in personal for k, _ in self.model.named_parameters())
        return self.cfg.local_epochs + (opts.head_epochs if head else 0) if participated else 0
