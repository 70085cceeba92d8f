"""A device's ``pfl_edge.algorithms.Trainer``: its one slot, trained by its training backend (torch, or an
ExecuTorch program), evaluated in eager PyTorch. The algorithms call it exactly as the simulator calls its
trainer over every client, so a device computes its slot's row of the simulator's round."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence

import torch
from torch import Tensor

from pfl_edge.algorithms import Clients, one_row
from pfl_edge.errors import InternalError
from pfl_edge.federation import FederationConfig
from pfl_edge.train import Stack, TrainConfig, TrainResult, evaluate, unstack

from .data import LocalData
from .training import TrainingBackend

__all__ = ["DeviceTrainer", "device_clients"]

_ROW = torch.zeros(1, dtype=torch.int64)  # the device's data is a stack of one client


class DeviceTrainer:
    def __init__(self, data: LocalData, backend: TrainingBackend) -> None:
        self.data = data
        self.backend = backend
        self.train_s = 0.0  # seconds spent training since reset_clock()

    def reset_clock(self) -> None:
        self.train_s = 0.0

    @staticmethod
    def _one(rows: Tensor) -> None:
        if len(rows) != 1:
            raise InternalError(f"a device trains its own slot only, asked for {len(rows)} clients")

    def train(self, stack: Mapping[str, Tensor], rows: Tensor, cfg: TrainConfig, gens: Sequence[torch.Generator],
              *, trainable: Collection[str] | None = None, masks: Mapping[str, Tensor] | None = None,
              anchor: Mapping[str, Tensor] | None = None) -> TrainResult:
        self._one(rows)
        state = unstack(stack, 0)
        start = time.perf_counter()
        self.backend.load(state)
        x, y = self.data.xy
        st = self.backend.train(x, y, cfg, gens[0], trainable=trainable,
                                mask=None if masks is None else unstack(masks, 0),
                                anchor=None if anchor is None else unstack(anchor, 0))
        self.train_s += time.perf_counter() - start
        return TrainResult(one_row({**state, **self.backend.state()}), torch.tensor([st.loss]),
                           torch.tensor([st.steps]), torch.tensor([st.samples]))

    def evaluate(self, stack: Mapping[str, Tensor], rows: Tensor) -> tuple[Tensor, Tensor]:
        self._one(rows)
        return evaluate(self.data.model, stack, self.data.test, _ROW)

    def dense_gradients(self, stack: Mapping[str, Tensor], rows: Tensor, batch_size: int,
                        gens: Sequence[torch.Generator]) -> Stack:
        self._one(rows)
        self.backend.load(unstack(stack, 0))
        x, y = self.data.xy
        return one_row(self.backend.dense_gradients(x, y, batch_size, gens[0]))


def device_clients(cfg: FederationConfig, trainer: DeviceTrainer, slot: int) -> Clients:
    """The device as the algorithms see it: one client, its slot, its samples, trained by ``trainer``."""
    return Clients(cfg, trainer.data.model, trainer, torch.tensor([slot]), torch.tensor([trainer.data.n_train]))
