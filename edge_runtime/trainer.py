"""A device's ``pfl_edge.algorithms.Trainer``: its one slot, trained by its training backend (torch, or an
ExecuTorch program) and evaluated in eager PyTorch or, on a device without torch, by the server's ONNX program in
ONNX Runtime. The algorithms call it exactly as the simulator calls its trainer over every client, so a device
computes its slot's row of the simulator's round; a device without torch passes numpy arrays throughout."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pfl_edge.algorithms import Clients, one_row
from pfl_edge.arrays import Array, Stack, to_numpy, unstack
from pfl_edge.errors import ConfigError, InternalError
from pfl_edge.federation import FederationConfig
from pfl_edge.sgd import TrainConfig, TrainResult

from .backends import onnx_session
from .data import ArrayData, LocalData
from .training import TrainingBackend

if TYPE_CHECKING:
    from pfl_edge.models import BlockModel
    from pfl_edge.skeleton import ModelSkeleton

__all__ = ["DeviceTrainer", "OnnxEvaluator", "device_clients", "evaluate_logits"]

#: ``evaluate(state)``: accuracy and mean loss of a model (one client's state) on the device's test samples
Evaluate = Callable[[Mapping[str, Array]], tuple[float, float]]


def evaluate_logits(logits: np.ndarray, y: np.ndarray) -> tuple[int, float]:
    """Correct predictions and the summed cross-entropy of ``logits`` (N, classes) against ``y``, in float64."""
    z = logits.astype(np.float64)
    top = z.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(z - top).sum(axis=1))
    return int((z.argmax(axis=1) == y).sum()), float((lse - z[np.arange(len(y)), y]).sum())


class OnnxEvaluator:
    """The federation's ONNX inference program (every state-dict tensor an input after ``input``, docs/model.md)
    in ONNX Runtime, fed the model to evaluate: what a device without torch evaluates with."""

    def __init__(self, program: bytes, details: Mapping[str, Any], x: np.ndarray, y: np.ndarray, *,
                 threads: int = 1, chunk: int = 1000) -> None:
        if details.get("kind") != "inference":
            raise ConfigError(f"evaluation needs the ONNX inference program, got kind {details.get('kind')!r}")
        self.weights: list[str] = list(details["weights"])
        self._sess = onnx_session(program, threads)
        self.x, self.y, self.chunk = x, y, chunk

    def __call__(self, state: Mapping[str, Array]) -> tuple[float, float]:
        feed = {k: np.ascontiguousarray(to_numpy(state[k])) for k in self.weights}
        correct, loss = 0, 0.0
        for s in range(0, len(self.y), self.chunk):
            logits = self._sess.run(["logits"], {"input": self.x[s: s + self.chunk], **feed})[0]
            c, lsum = evaluate_logits(np.asarray(logits), self.y[s: s + self.chunk])
            correct, loss = correct + c, loss + lsum
        n = max(len(self.y), 1)
        return correct / n, loss / n


class DeviceTrainer:
    def __init__(self, data: LocalData | ArrayData, backend: TrainingBackend,
                 evaluate: Evaluate | None = None) -> None:
        self.data = data
        self.backend = backend
        self.numpy = isinstance(data, ArrayData)  # no torch: numpy arrays in and out
        if evaluate is None:
            if self.numpy:
                raise ConfigError("a device without torch evaluates with the server's ONNX program: give evaluate")
            evaluate = _eager_evaluate(data)  # type: ignore[arg-type]
        self._evaluate = evaluate
        self.train_s = 0.0  # seconds spent training since reset_clock()

    def reset_clock(self) -> None:
        self.train_s = 0.0

    @staticmethod
    def _one(rows: Array) -> None:
        if len(rows) != 1:
            raise InternalError(f"a device trains its own slot only, asked for {len(rows)} clients")

    def _vector(self, v: float | int) -> Array:
        if self.numpy:
            return np.array([v], np.float32 if isinstance(v, float) else np.int64)
        import torch

        return torch.tensor([v])

    def train(self, stack: Mapping[str, Array], rows: Array, cfg: TrainConfig, gens: Sequence[Any],
              *, trainable: Collection[str] | None = None, masks: Mapping[str, Array] | None = None,
              anchor: Mapping[str, Array] | None = None) -> TrainResult:
        self._one(rows)
        state = unstack(stack, 0)
        start = time.perf_counter()
        self.backend.load(state)
        x, y = self.data.xy
        st = self.backend.train(x, y, cfg, gens[0], trainable=trainable,
                                mask=None if masks is None else unstack(masks, 0),
                                anchor=None if anchor is None else unstack(anchor, 0))
        self.train_s += time.perf_counter() - start
        return TrainResult(one_row({**state, **self.backend.state()}), self._vector(float(st.loss)),
                           self._vector(int(st.steps)), self._vector(int(st.samples)))

    def evaluate(self, stack: Mapping[str, Array], rows: Array) -> tuple[Array, Array]:
        self._one(rows)
        acc, loss = self._evaluate(unstack(stack, 0))
        return self._vector(float(acc)), self._vector(float(loss))

    def dense_gradients(self, stack: Mapping[str, Array], rows: Array, batch_size: int,
                        gens: Sequence[Any]) -> Stack:
        self._one(rows)
        self.backend.load(unstack(stack, 0))
        x, y = self.data.xy
        return one_row(self.backend.dense_gradients(x, y, batch_size, gens[0]))


def _eager_evaluate(data: LocalData) -> Evaluate:
    """Eager PyTorch on the device's model (``pfl_edge.train.evaluate``, the simulator's)."""
    import torch

    from pfl_edge.train import evaluate

    row = torch.zeros(1, dtype=torch.int64)  # the device's data is a stack of one client

    def run(state: Mapping[str, Array]) -> tuple[float, float]:
        acc, loss = evaluate(data.model, one_row(state), data.test, row)
        return float(acc[0]), float(loss[0])

    return run


def device_clients(cfg: FederationConfig, trainer: DeviceTrainer, slot: int,
                   model: BlockModel | ModelSkeleton | None = None) -> Clients:
    """The device as the algorithms see it: one client, its slot, its samples, trained by ``trainer``; ``model``
    its model (default: its data's), a card's skeleton on a device without torch. Numpy slots make the
    algorithms draw from numpy streams (``Clients.stream``)."""
    if trainer.numpy:
        if model is None:
            raise ConfigError("a device without torch takes its model's skeleton from the card: give model")
        return Clients(cfg, model, trainer, np.array([slot], np.int64),  # type: ignore[arg-type]
                       np.array([trainer.data.n_train], np.int64))
    import torch

    data: LocalData = trainer.data  # type: ignore[assignment]
    return Clients(cfg, model if model is not None else data.model, trainer,  # type: ignore[arg-type]
                   torch.tensor([slot]), torch.tensor([data.n_train]))

