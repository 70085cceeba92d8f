"""Training backends: what the device agent calls to train its model each round.

Three backends, one registry (``TRAINING_BACKENDS``), behind one interface (``TrainingBackend``), with the
simulator's semantics (``pfl_edge.train``): ``torch.optim.SGD`` with momentum and weight decay,
``clip_grad_norm_``, masks applied to the gradients and re-applied to the weights after every step, and the batch
schedule of ``pfl_edge.train.batch_schedule``, so that every backend sees the same batches for the same generator.

- ``TorchBackend``: ``pfl_edge.train.train`` on a one-client stack (the loop engine, as the simulator uses), so
  a device's round is exactly the simulator's.
- ``OnnxBackend`` and ``ExecuTorchBackend`` (``ProgramBackend``, ``edge_runtime.program_backends``; the
  interface itself is ``edge_runtime.backend_types``): a training program, a pure function from the
  weights and a batch to the loss and the gradients (``export.lower_onnx_training``, run by ONNX Runtime with
  numpy alone on Python 3.10+; ``export.lower_executorch_training``, run by the pip ExecuTorch runtime or by
  executorch-numpy-runtime); the device holds the weights as numpy arrays and steps them with ``ProgramSGD``
  (``pfl_edge.sgd.SGD``: masking and clipping on the gradients, then torch.optim.SGD's update with momentum and
  weight decay, then the mask re-applied, in ``pfl_edge.train``'s order), over ``pfl_edge.sgd.epoch_batches``.
  Each sizes its runtime's threads from the device profile.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from pfl_edge.arrays import Array as Tensor
from pfl_edge.arrays import stack_states, unstack
from pfl_edge.errors import ConfigError
from pfl_edge.modelcard import TRAINING_RUNTIMES
from pfl_edge.sgd import TrainConfig

from .backend_types import BackendRequest, TrainingBackend, TrainStats
from .program_backends import ExecuTorchBackend, OnnxBackend, ProgramBackend, ProgramSGD, load_program

if TYPE_CHECKING:  # the torch backend's; the program backends run without torch
    import torch
    from torch import nn

    from pfl_edge.train import ClientTensors

__all__ = [
    "PROGRAM_BACKENDS",
    "TRAINING_BACKENDS",
    "BackendRequest",
    "ExecuTorchBackend",
    "OnnxBackend",
    "ProgramBackend",
    "ProgramSGD",
    "TorchBackend",
    "TrainStats",
    "TrainingBackend",
    "device_backend",
    "get_training_backend",
    "load_program",
]


class TorchBackend:
    """Eager PyTorch through ``pfl_edge.train``: the simulator's code path for one client."""

    name = "torch"

    @classmethod
    def for_device(cls, req: BackendRequest) -> TorchBackend:
        return cls(req.model)

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def load(self, state: Mapping[str, Tensor]) -> None:
        missing = set(self._state) - set(state)
        if missing:
            raise ConfigError(f"state lacks {sorted(missing)}")
        self._state = {k: state[k].detach().clone() for k in self._state}

    def state(self) -> dict[str, Tensor]:
        return {k: v.clone() for k, v in self._state.items()}

    def _one(self, x: Tensor, y: Tensor) -> ClientTensors:
        import torch

        from pfl_edge.train import ClientTensors

        return ClientTensors.of(x[None], y[None], torch.tensor([len(x)], dtype=torch.int64))

    def train(self, x: Tensor, y: Tensor, cfg: TrainConfig, gen: torch.Generator, *,
              trainable: Collection[str] | None = None, mask: Mapping[str, Tensor] | None = None,
              anchor: Mapping[str, Tensor] | None = None) -> TrainStats:
        import torch

        from pfl_edge.train import train

        masks = None if mask is None else {k: m[None] for k, m in mask.items()}
        # engine "loop": what the simulator's Trainer runs ("auto" there means the loop), so results are identical
        res = train(self.model, stack_states([self._state]), self._one(x, y), torch.tensor([0]), cfg, [gen],
                    trainable=trainable, masks=masks, engine="loop",
                    anchor=None if anchor is None else {k: a[None] for k, a in anchor.items()})
        self._state = unstack(res.stack, 0)
        return TrainStats(float(res.loss[0]), int(res.steps[0]), int(res.samples[0]))

    def dense_gradients(self, x: Tensor, y: Tensor, batch_size: int, gen: torch.Generator) -> dict[str, Tensor]:
        import torch

        from pfl_edge.train import dense_gradients

        grads = dense_gradients(self.model, stack_states([self._state]), self._one(x, y), torch.tensor([0]),
                                batch_size, [gen])
        return unstack(grads, 0)


TRAINING_BACKENDS: dict[str, type[TorchBackend] | type[ProgramBackend]] = {
    "torch": TorchBackend,
    "executorch": ExecuTorchBackend,
    "onnxruntime": OnnxBackend,
}
PROGRAM_BACKENDS = TRAINING_RUNTIMES  # the backends that train with a program from the model card


def device_backend(arrays: str, asked: str | None, profile_backend: str) -> str:
    """The backend a device trains with: the one asked for (``--training-backend``), else its profile's; a
    device without torch (``arrays`` numpy) trains with a program, the ONNX one unless ExecuTorch's is asked for
    or is its profile's, and refuses ``torch``."""
    if arrays == "numpy" and asked not in (None, *PROGRAM_BACKENDS):
        raise ConfigError(f"a device without torch trains with a program ({', '.join(PROGRAM_BACKENDS)}), not "
                          f"{asked!r}")
    name = asked or profile_backend
    return name if arrays != "numpy" or name in PROGRAM_BACKENDS else "onnxruntime"


def get_training_backend(name: str) -> type[TorchBackend] | type[ProgramBackend]:
    """The backend class for a profile's ``training_backend``; ``.for_device(BackendRequest)`` opens one for a
    device (the agent), ``TorchBackend(model)`` / ``ExecuTorchBackend.from_file(path)`` directly."""
    try:
        return TRAINING_BACKENDS[name]
    except KeyError:
        raise ConfigError(f"unknown training backend {name!r}; valid: {', '.join(sorted(TRAINING_BACKENDS))}") from None
