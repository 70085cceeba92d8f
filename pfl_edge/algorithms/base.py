"""What every algorithm's round is written against: a trainer over client stacks, the clients it runs (their
slots, which seed their random streams), what a device received for a round, and what it sends back.

The same functions serve three callers: the simulator passes every client's row at once (``pfl_edge.parallel``
trains them on all cores), a device passes its one row (``edge_runtime``'s training backends train it with
torch or an ExecuTorch program), and the server calls the coordinator's side (plan, aggregate). Random streams
are drawn by slot, not by row, so a device's one row draws exactly the simulator's numbers for its slot.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..arrays import Array as Tensor
from ..arrays import Stack, is_numpy
from ..seeding import MT, Stream, mt_stream, stream
from ..sgd import TrainConfig, TrainResult

if TYPE_CHECKING:
    import torch

    from ..federation import FederationConfig
    from ..models import BlockModel

__all__ = ["Clients", "Metrics", "Neighbour", "Participation", "Received", "Trainer", "Upload", "one_row"]


class Trainer(Protocol):
    """Local training and evaluation of the clients ``rows`` (slots) from states stacked ``(len(rows), ...)``.
    ``pfl_edge.parallel.Trainer`` is one (every client of a simulation); a device's training backend another
    (its one slot)."""

    def train(self, stack: Mapping[str, Tensor], rows: Tensor, cfg: TrainConfig, gens: Sequence[Any],
              *, trainable: Collection[str] | None = None, masks: Mapping[str, Tensor] | None = None,
              anchor: Mapping[str, Tensor] | None = None) -> TrainResult: ...

    def evaluate(self, stack: Mapping[str, Tensor], rows: Tensor) -> tuple[Tensor, Tensor]: ...

    def dense_gradients(self, stack: Mapping[str, Tensor], rows: Tensor, batch_size: int,
                        gens: Sequence[Any]) -> Stack: ...


@dataclass(frozen=True, eq=False)
class Clients:
    """Clients of a federation as a round sees them: the config, the model's skeleton (names and shapes), who
    they are (``slots``, sorted), how many training samples each holds, and what trains them."""

    cfg: FederationConfig
    model: BlockModel
    trainer: Trainer
    slots: Tensor
    n_train: Tensor

    def __len__(self) -> int:
        return len(self.slots)

    def gens(self, name: Stream, t: int) -> list[torch.Generator | MT]:
        return [self.stream(name, t, int(i)) for i in self.slots]

    def stream(self, name: Stream, *index: int) -> torch.Generator | MT:
        """A named random stream: a torch generator, or its numpy twin (the same numbers) for clients whose
        ``slots`` are a numpy array (a device without torch)."""
        return (mt_stream if is_numpy(self.slots) else stream)(self.cfg.seed, name, *index)

    def subset(self, pos: Tensor) -> Clients:
        """The clients at positions ``pos`` of this set."""
        return Clients(self.cfg, self.model, self.trainer, self.slots[pos], self.n_train[pos])

    @property
    def param_names(self) -> list[str]:
        return [k for k, _ in self.model.named_parameters()]

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.model.named_parameters()}


def one_row(state: Mapping[str, Tensor]) -> Stack:
    """A single client's state as a stack of one row."""
    return {k: v[None] for k, v in state.items()}


@dataclass(frozen=True, eq=False)
class Neighbour:
    """A neighbour's model as it arrived: its slot, its tensors and, for the masked ones, the support it was
    trained under (a tensor without one is dense)."""

    slot: int
    tensors: Mapping[str, Tensor]
    masks: Mapping[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Received:
    """What a device fetched for a round, as its task named it: the shared base (FedPer), or its neighbours'
    models (DisPFL)."""

    base: Mapping[str, Tensor] | None = None
    neighbours: Sequence[Neighbour] = ()


@dataclass(frozen=True, eq=False)
class Upload:
    """What a device sends: tensors and, for the sparse ones, the mask the values sit on."""

    tensors: dict[str, Tensor]
    masks: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Metrics:
    """A device's evaluation of the model it deploys for ``round``."""

    round: int
    accuracy: float
    loss: float


@dataclass(frozen=True)
class Participation:
    """Who takes part in round ``round``, as its algorithm defines it (``Algorithm.participation``): the
    server's plan, its acceptance of updates, its quorum and close, the metrics it accepts and a device's agent
    all read this one answer. ``slots``: the slots the round draws (None: every slot; empty: none, as round 0 of
    an algorithm that takes no initial model); ``after_initial``: a device takes part only once its initial
    model (its update of round 0) is in. Who has enrolled, joined in time and not been revoked is the server's
    own business, not the algorithm's."""

    round: int
    slots: frozenset[int] | None
    after_initial: bool

    def refusal(self, slot: int, *, has_initial: bool) -> str | None:
        """Why the device of ``slot`` (its initial model in or not) does not take part; None: it does."""
        if self.slots is not None and not self.slots:
            return f"round {self.round} takes no updates in this federation's algorithm"
        if self.slots is not None and slot not in self.slots:
            # neither the count nor the other slots: a device learns its own draw alone (docs/privacy.md)
            return f"round {self.round} did not draw this device's slot ({slot}): it has no task this round"
        if self.after_initial and not has_initial:
            return "upload the initial model as the update of round 0 first"
        return None
