"""Training backends: what the device agent calls to train its model each round.

Two backends behind one interface (``TrainingBackend``), with the simulator's semantics (``pfl_edge.train``):
``torch.optim.SGD`` with momentum and weight decay, ``clip_grad_norm_``, masks applied to the gradients and
re-applied to the weights after every step, and the batch schedule of ``pfl_edge.train.batch_schedule``, so that
both backends see the same batches for the same generator.

- ``TorchBackend``: ``pfl_edge.train.train`` on a one-client stack (the loop engine, as the simulator uses), so
  a device's round is exactly the simulator's.
- ``ExecuTorchBackend``: an ExecuTorch training program (``export.lower_executorch_training``) computes loss and
  gradients; the runtime's own SGD (``get_sgd_optimizer``) applies momentum and the update to the program's
  weights in place. Three parts of the step run in torch on the gradients the program returns, because the
  runtime optimizer cannot do them: masking (before momentum, as ``torch.optim.SGD`` sees a masked ``.grad``),
  clipping, and weight decay. Weight decay is there because executorch 1.4.1's ``get_sgd_optimizer`` accepts
  ``weight_decay`` and ignores it (measured: the step is ``lr * g`` whatever its value); adding ``wd * p`` to
  the gradient is what ``torch.optim.SGD`` does itself, so the result is unchanged.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from device_profiles import Profile
from pfl_edge.checkpoint import ModelSpec
from pfl_edge.errors import ConfigError
from pfl_edge.train import ClientTensors, TrainConfig, batch_schedule, dense_gradients, stack_states, train, unstack

__all__ = [
    "TRAINING_BACKENDS",
    "BackendRequest",
    "ExecuTorchBackend",
    "TorchBackend",
    "TrainStats",
    "TrainingBackend",
    "get_training_backend",
]

_PREFIX = "net."  # export.training wraps the model as ``net``; the runtime names parameters after it


@dataclass(frozen=True)
class TrainStats:
    loss: float  # mean training loss over the steps
    steps: int  # optimizer steps taken
    samples: int  # samples processed (epochs x n)


@dataclass(frozen=True, eq=False)
class BackendRequest:
    """What a device asks of its training backend: its model, the program mode its algorithm trains with
    (``fedper``: whole model; ``dispfl``: masked, with the dense gradient), the federation's batch size, and where
    an ExecuTorch program comes from: a packaged file (``program``, beside its manifest) or ``download(mode)``,
    the server's program of that mode and its details, checked against the model card
    (``edge_runtime.programs.ProgramSource.training``)."""

    model: nn.Module
    spec: ModelSpec
    profile: Profile
    mode: str
    batch_size: int
    program: str | None = None
    download: Callable[[str], tuple[bytes, Mapping[str, Any]]] | None = None


class TrainingBackend(Protocol):
    name: str

    def load(self, state: Mapping[str, Tensor]) -> None:
        """Replace every weight (a new base from the server, the neighbours' average, ...)."""
        ...

    def state(self) -> dict[str, Tensor]:
        """Every state-dict tensor, detached copies."""
        ...

    def train(self, x: Tensor, y: Tensor, cfg: TrainConfig, gen: torch.Generator, *,
              trainable: Collection[str] | None = None, mask: Mapping[str, Tensor] | None = None) -> TrainStats:
        """``cfg.epochs`` epochs of SGD on ``(x, y)``; ``trainable``: parameter names to update (default all);
        ``mask``: 0/1 tensors for some parameters, held at zero where 0."""
        ...

    def dense_gradients(self, x: Tensor, y: Tensor, batch_size: int, gen: torch.Generator) -> dict[str, Tensor]:
        """The gradient of the loss on one random batch w.r.t. every parameter at the current (masked) weights:
        DisPFL's regrowth screen (``pfl_edge.train.dense_gradients``)."""
        ...


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
        return ClientTensors(x[None], y[None], torch.tensor([len(x)], dtype=torch.int64))

    def train(self, x: Tensor, y: Tensor, cfg: TrainConfig, gen: torch.Generator, *,
              trainable: Collection[str] | None = None, mask: Mapping[str, Tensor] | None = None) -> TrainStats:
        masks = None if mask is None else {k: m[None] for k, m in mask.items()}
        # engine "loop": what the simulator's Trainer runs ("auto" there means the loop), so results are identical
        res = train(self.model, stack_states([self._state]), self._one(x, y), torch.tensor([0]), cfg, [gen],
                    trainable=trainable, masks=masks, engine="loop")
        self._state = unstack(res.stack, 0)
        return TrainStats(float(res.loss[0]), int(res.steps[0]), int(res.samples[0]))

    def dense_gradients(self, x: Tensor, y: Tensor, batch_size: int, gen: torch.Generator) -> dict[str, Tensor]:
        grads = dense_gradients(self.model, stack_states([self._state]), self._one(x, y), torch.tensor([0]),
                                batch_size, [gen])
        return unstack(grads, 0)


class _RuntimeSGD:
    """``torch.optim.SGD`` (dampening 0, no Nesterov) over the program's weights: mask, clip and weight decay in
    torch on the gradients, momentum and the update in the runtime's optimizer; then the mask re-applied."""

    def __init__(self, params: dict[str, Tensor], cfg: TrainConfig, masks: Mapping[str, Tensor]) -> None:
        from executorch.extension.training import get_sgd_optimizer

        self.params, self.cfg = params, cfg
        self.masks = {k: m for k, m in masks.items() if k in params}
        # weight_decay stays 0 here: the runtime ignores it (module docstring); it is added to the gradient below
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._opt = get_sgd_optimizer(params, lr=cfg.lr, momentum=cfg.momentum)

    def step(self, grads: Mapping[str, Tensor]) -> None:
        g = {k: grads[k] for k in self.params}  # fresh copies from the runtime: safe to change in place
        if self.cfg.clip_unmasked:  # the DisPFL reference's order: clip the whole gradient, then mask it
            self._clip(g)
        for k, m in self.masks.items():
            g[k].mul_(m)
        if not self.cfg.clip_unmasked:
            self._clip(g)
        if self.cfg.weight_decay:
            g = {k: v.add(self.params[k], alpha=self.cfg.weight_decay) for k, v in g.items()}
        self._opt.step(g)
        with torch.no_grad():
            for k, m in self.masks.items():
                self.params[k].mul_(m)


    def _clip(self, g: dict[str, Tensor]) -> None:
        """clip_grad_norm_: the norm of the per-tensor norms, coefficient max/(norm + 1e-6) capped at 1."""
        if self.cfg.clip_norm is not None:
            tensors = list(g.values())
            total = torch.nn.utils.get_total_norm(tensors)
            torch._foreach_mul_(tensors, torch.clamp(self.cfg.clip_norm / (total + 1e-6), max=1.0))


class ExecuTorchBackend:
    """An ExecuTorch training program, loaded once; weights are swapped into it in place every round."""

    name = "executorch"

    def __init__(self, program: bytes, details: Mapping[str, Any]) -> None:
        from executorch.extension.training import _load_for_executorch_for_training_from_buffer

        if details.get("kind") != "training":
            raise ConfigError("ExecuTorchBackend needs a training program (export.lower_executorch_training); "
                              f"this one is kind {details.get('kind')!r}")
        self.details = dict(details)
        self.batch_size = int(details["batch_size"])
        self.keys: list[str] = list(details["keys"])
        self.trainable: list[str] = list(details["trainable"])
        self.frozen: list[str] = list(details["frozen"])
        self.input_shape = tuple(int(s) for s in details["input_shape"])
        shapes = {k: tuple(v) for k, v in details["shapes"].items()}
        # the runtime reads the program from this buffer without owning it: keep it for our lifetime
        self._data = program
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "experimental API" on every load: known, and said in DESIGN.md
            self._module: Any = _load_for_executorch_for_training_from_buffer(self._data)
        self._frozen = {k: torch.zeros(shapes[k]) for k in self.frozen}
        self._loaded = False
        # the runtime hands out its parameters only after a first forward_backward; these tensors alias the
        # program's memory, so copy_ into them (load) and the optimizer's in-place update both reach the program
        self._fb(torch.zeros(self.batch_size, *self.input_shape), torch.zeros(self.batch_size, dtype=torch.int64),
                 torch.ones(self.batch_size))
        got = self._module.named_parameters()
        self._params: dict[str, Tensor] = {k.removeprefix(_PREFIX): v for k, v in got.items()}
        if set(self._params) != set(self.trainable):
            raise ConfigError(f"program's parameters {sorted(self._params)} are not its manifest's trainable "
                              f"{sorted(self.trainable)}")

    @staticmethod
    def from_lowered(lowered: Any) -> ExecuTorchBackend:
        return ExecuTorchBackend(lowered.program, lowered.details)

    @classmethod
    def for_device(cls, req: BackendRequest) -> ExecuTorchBackend:
        """The program ``req.program``, or the server's for the device's mode (each round's weights are swapped
        into it, never re-exported; a device exports nothing)."""
        if req.program is not None:
            backend = cls.from_file(req.program)
        elif req.download is not None:
            program, details = req.download(req.mode)
            backend = cls(program, details)
        else:
            raise ConfigError("an ExecuTorch training backend needs a program: the server's (from its model card) "
                              "or --training-program")
        if backend.frozen:  # the device's modes (fedper, dispfl) train every parameter
            raise ConfigError(f"the training program (mode {backend.details.get('mode')!r}) freezes "
                              f"{len(backend.frozen)} tensors; this device trains all of them (mode {req.mode!r})")
        if backend.batch_size < req.batch_size:
            raise ConfigError(f"the training program takes batches of {backend.batch_size}, the federation trains "
                              f"with {req.batch_size}: export one at the federation's batch size")
        return backend

    @staticmethod
    def from_file(path: str | Path) -> ExecuTorchBackend:
        """A packaged program, described by its entry in the ``manifest.json`` beside it."""
        p = Path(path)
        entries = json.loads((p.parent / "manifest.json").read_text())
        entry = next((e for e in entries if e.get("path") == p.name), None)
        if entry is None:
            raise ConfigError(f"{p.parent / 'manifest.json'} has no entry for {p.name}")
        return ExecuTorchBackend(p.read_bytes(), entry)

    def _fb(self, x: Tensor, y: Tensor, w: Tensor) -> float:
        out = self._module.forward_backward("forward", (x, y, w, *(self._frozen[k] for k in self.frozen)))
        return float(out[0])

    def load(self, state: Mapping[str, Tensor]) -> None:
        missing = set(self.keys) - set(state)
        if missing:
            raise ConfigError(f"state lacks {sorted(missing)}")
        with torch.no_grad():
            for k in self.trainable:
                self._params[k].copy_(state[k])
        self._frozen = {k: state[k].detach().to(torch.float32).contiguous().clone() for k in self.frozen}
        self._loaded = True

    def state(self) -> dict[str, Tensor]:
        self._require_loaded()
        return {k: (self._params[k] if k in self._params else self._frozen[k]).detach().clone() for k in self.keys}

    def _require_loaded(self) -> None:
        if not self._loaded:
            raise ConfigError("load a state into the ExecuTorch backend first (its frozen inputs have no values)")

    def gradients(self, x: Tensor, y: Tensor) -> tuple[float, dict[str, Tensor]]:
        """Loss and gradients (of the trainable parameters) on one batch of at most ``batch_size`` samples."""
        self._require_loaded()
        n = len(x)
        if not 1 <= n <= self.batch_size:
            raise ConfigError(f"a batch of {n} samples; this program takes 1 to {self.batch_size}")
        w = torch.ones(self.batch_size)
        if n < self.batch_size:
            # pad with copies of a real sample at weight 0: finite activations (0 * inf would be NaN), zero effect
            pad = self.batch_size - n
            x = torch.cat([x, x[:1].expand(pad, *x.shape[1:])])
            y = torch.cat([y, y[:1].expand(pad)])
            w[n:] = 0.0
        loss = self._fb(x.to(torch.float32).contiguous(), y.to(torch.int64).contiguous(), w)
        grads = {k.removeprefix(_PREFIX): g for k, g in self._module.named_gradients().items()}
        return loss, grads

    def sgd(self, cfg: TrainConfig, *, trainable: Collection[str] | None = None,
            mask: Mapping[str, Tensor] | None = None) -> _RuntimeSGD:
        """A fresh optimizer over ``trainable`` (default: every trainable parameter of the program)."""
        names = self._names(trainable)
        return _RuntimeSGD({k: self._params[k] for k in names}, cfg, mask or {})

    def _names(self, trainable: Collection[str] | None) -> list[str]:
        if trainable is None:
            return list(self.trainable)
        beyond = set(trainable) - set(self.trainable)
        if beyond:
            raise ConfigError(f"this program (mode {self.details.get('mode')!r}) cannot train {sorted(beyond)}: "
                              "they are frozen inputs or not parameters; export a program that trains them")
        return [k for k in self.trainable if k in set(trainable)]

    def train(self, x: Tensor, y: Tensor, cfg: TrainConfig, gen: torch.Generator, *,
              trainable: Collection[str] | None = None, mask: Mapping[str, Tensor] | None = None) -> TrainStats:
        self._require_loaded()
        if cfg.batch_size > self.batch_size:
            raise ConfigError(f"batch size {cfg.batch_size} > the program's {self.batch_size}; export for it")
        masks = dict(mask or {})
        unknown = set(masks) - set(self.keys)
        if unknown:
            raise ConfigError(f"masks for {sorted(unknown)}, which the model does not have")
        with torch.no_grad():  # training starts from w * m, as pfl_edge.train's does
            for k, m in masks.items():
                if k in self._params:
                    self._params[k].mul_(m)
                else:
                    self._frozen[k] = self._frozen[k] * m
        opt = self.sgd(cfg, trainable=trainable, mask=masks)
        n = len(x)
        idx, w = batch_schedule(torch.tensor([n]), cfg.epochs, cfg.batch_size, [gen])
        loss_sum, steps = 0.0, 0
        for s in range(idx.shape[0]):
            valid = w[s, 0] > 0
            if not valid.any():
                break
            b = idx[s, 0][valid]
            loss, grads = self.gradients(x[b], y[b])
            opt.step(grads)
            loss_sum += loss
            steps += 1
        return TrainStats(loss_sum / max(steps, 1), steps, n * cfg.epochs)

    def dense_gradients(self, x: Tensor, y: Tensor, batch_size: int, gen: torch.Generator) -> dict[str, Tensor]:
        if self.frozen:
            raise ConfigError(f"dense gradients need every parameter trainable (mode fedper or dispfl); this "
                              f"program (mode {self.details.get('mode')!r}) freezes {len(self.frozen)} tensors")
        # the same draw as pfl_edge.train.dense_gradients: one permutation, its first batch_size samples
        b = torch.randperm(len(x), generator=gen)[:batch_size]
        out = {k: torch.zeros_like(v) for k, v in self._params.items()}
        for s in range(0, len(b), self.batch_size):  # a batch larger than the program's: a weighted sum of chunks
            chunk = b[s: s + self.batch_size]
            _, grads = self.gradients(x[chunk], y[chunk])
            share = len(chunk) / len(b)
            for k, g in grads.items():
                out[k] += g if share == 1.0 else g * share
        return {k: out[k] for k in self.trainable}


TRAINING_BACKENDS: dict[str, type[TorchBackend] | type[ExecuTorchBackend]] = {
    "torch": TorchBackend,
    "executorch": ExecuTorchBackend,
}


def get_training_backend(name: str) -> type[TorchBackend] | type[ExecuTorchBackend]:
    """The backend class for a profile's ``training_backend``; ``.for_device(BackendRequest)`` opens one for a
    device (the agent), ``TorchBackend(model)`` / ``ExecuTorchBackend.from_file(path)`` directly."""
    try:
        return TRAINING_BACKENDS[name]
    except KeyError:
        raise ConfigError(f"unknown training backend {name!r}; valid: {', '.join(sorted(TRAINING_BACKENDS))}") from None
