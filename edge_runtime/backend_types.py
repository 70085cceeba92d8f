"""What a training backend is (``TrainingBackend``), what a device asks of one (``BackendRequest``) and what a
round of training reports (``TrainStats``): shared by the torch backend (``edge_runtime.training``) and the program
backends (``edge_runtime.program_backends``)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from device_profiles import Profile
from pfl_edge.arrays import Array as Tensor
from pfl_edge.checkpoint import ModelSpec
from pfl_edge.sgd import TrainConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["BackendRequest", "TrainStats", "TrainingBackend"]


@dataclass(frozen=True)
class TrainStats:
    loss: float  # mean training loss over the steps
    steps: int  # optimizer steps taken
    samples: int  # samples processed (epochs x n)


@dataclass(frozen=True, eq=False)
class BackendRequest:
    """What a device asks of its training backend: its model, the program mode its algorithm trains with
    (``fedper``: whole model; ``dispfl``: masked, with the dense gradient), the federation's batch size, and where
    a training program comes from: a packaged file (``program``, beside its manifest) or ``download(mode,
    runtime)``, the server's program of that mode for the backend's runtime and its details, checked against the
    model card
    (``edge_runtime.programs.ProgramSource.training``)."""

    model: nn.Module
    spec: ModelSpec
    profile: Profile
    mode: str
    batch_size: int
    program: str | None = None
    download: Callable[[str, str], tuple[bytes, Mapping[str, Any]]] | None = None
    threads: int | None = None  # the runtime's threads; None: the profile's


class TrainingBackend(Protocol):
    name: str

    def load(self, state: Mapping[str, Tensor]) -> None:
        """Replace every weight (a new base from the server, the neighbours' average, ...)."""
        ...

    def state(self) -> dict[str, Tensor]:
        """Every state-dict tensor, detached copies."""
        ...

    def train(self, x: Tensor, y: Tensor, cfg: TrainConfig, gen: torch.Generator, *,
              trainable: Collection[str] | None = None, mask: Mapping[str, Tensor] | None = None,
              anchor: Mapping[str, Tensor] | None = None) -> TrainStats:
        """``cfg.epochs`` epochs of SGD on ``(x, y)``; ``trainable``: parameter names to update (default all);
        ``mask``: 0/1 tensors for some parameters, held at zero where 0; ``anchor``: what ``cfg.prox``'s
        proximal term pulls the weights towards (``pfl_edge.train.TrainConfig.prox``)."""
        ...

    def dense_gradients(self, x: Tensor, y: Tensor, batch_size: int, gen: torch.Generator) -> dict[str, Tensor]:
        """The gradient of the loss on one random batch w.r.t. every parameter at the current (masked) weights:
        DisPFL's regrowth screen (``pfl_edge.train.dense_gradients``)."""
        ...
