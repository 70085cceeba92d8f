"""The pieces of a server-coordinated round (``pfl_edge.algorithms.central``), as functions over stacks: a client
takes the base under its own blocks, trains, deploys and sends its base; a coordinator averages the bases. The
simulator calls them over every row, a device over its one row."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ..arrays import Array as Tensor
from ..arrays import Stack, broadcast_rows, copy
from ..seeding import Stream
from ..sgd import TrainConfig, TrainResult
from ..split import Split, take
from .base import Clients

if TYPE_CHECKING:
    from ..aggregate import PartialAverage

__all__ = ["aggregate_bases", "all_finite", "deploy", "personal_finetune", "train_round", "upload", "with_base"]


def with_base(state: Mapping[str, Tensor], base: Mapping[str, Tensor] | None, split: Split) -> Stack:
    """A new stack: the clients' own tensors (copied) under ``base`` for the keys of ``split.base``, as one model
    seen in every row (``broadcast_rows``: held once, read-only; whoever trains from it writes elsewhere); without
    a base, the clients' own."""
    if base is None:
        return {k: copy(v) for k, v in state.items()}
    shared = set(split.base)
    rows = len(next(iter(state.values())))
    return {k: broadcast_rows(base[k], rows) if k in shared else copy(v) for k, v in state.items()}


def personal_finetune(cl: Clients, state: Stack, split: Split, t: int) -> Stack:
    """FedPer-FT: the personal blocks alone for ``ft_epochs`` on the base just received, base frozen."""
    personal = [k for k in cl.param_names if k in set(split.personal)]
    if not personal or cl.cfg.ft_epochs == 0:
        return state
    return cl.trainer.train(state, cl.slots, cl.cfg.train_config(t, cl.cfg.ft_epochs), cl.gens(Stream.FINETUNE, t),
                            trainable=personal).stack


def train_round(cl: Clients, state: Stack, t: int) -> TrainResult:
    """Local SGD of round ``t`` over every block."""
    return cl.trainer.train(state, cl.slots, cl.cfg.train_config(t), cl.gens(Stream.TRAIN, t))


def deploy(cl: Clients, state: Stack, t: int, *, finetune: TrainConfig | None) -> Stack:
    """What the clients deploy (and are evaluated on): their model, or (``finetune``: FedAvg-FT's fine-tuning) a
    copy of the global model fine-tuned on their data (not kept)."""
    if finetune is None or not finetune.epochs:
        return state
    return cl.trainer.train(state, cl.slots, finetune, cl.gens(Stream.FINETUNE, t)).stack


def upload(state: Mapping[str, Tensor], split: Split) -> dict[str, Tensor]:
    """What a client sends: its base only; the personal blocks never leave it."""
    return take(state, split.base)


def aggregate_bases(prev: Mapping[str, Tensor], updates: Iterable[tuple[Mapping[str, Tensor], float]],
                    start: PartialAverage | None = None) -> dict[str, Tensor]:
    """Per tensor, sum_j n_j x_j / sum_j n_j in float64 over the updates that hold it (in the order given: callers
    pass slot order, so the result never depends on who finished first), after those already summed in ``start``;
    a tensor nobody sent keeps its value."""
    from ..aggregate import PartialAverage  # the coordinator's side (torch); a device never aggregates

    avg = PartialAverage() if start is None else start
    for tensors, n in updates:
        avg.add(tensors, n)
    return avg.result(prev)


def all_finite(state: Mapping[str, Tensor]) -> bool:
    """No NaN or Inf in any floating tensor of ``state``."""
    return all(bool(v.isfinite().all()) for v in state.values() if v.is_floating_point())
