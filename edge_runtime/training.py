"""Training backends: what the device agent calls to train its model each round.

Two backends behind one interface (``TrainingBackend``), with the simulator's semantics (``pfl_edge.train``):
``torch.optim.SGD`` with momentum and weight decay, ``clip_grad_norm_``, masks applied to the gradients and
re-applied to the weights after every step, and the batch schedule of ``pfl_edge.train.batch_schedule``, so that
both backends see the same batches for the same generator.

- ``TorchBackend``: ``pfl_edge.train.train`` on a one-client stack (the loop engine, as the simulator uses), so
  a device's round is exactly the simulator's.
- ``ExecuTorchBackend``: an ExecuTorch training program (``export.lower_executorch_training``), a pure function
  from the weights and a batch to the loss and the gradients; the device holds the weights and steps them with
  ``ProgramSGD``: masking and clipping on the gradients, then ``torch.optim.SGD`` (momentum, weight decay), then
  the mask re-applied, in ``pfl_edge.train``'s order.
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
              trainable: Collection[str] | None = None, mask: Mapping[str, Tensor] | None = None,
              anchor: Mapping[str, Tensor] | None = None) -> TrainStats:
        masks = None if mask is None else {k: m[None] for k, m in mask.items()}
        # engine "loop": what the simulator's Trainer runs ("auto" there means the loop), so results are identical
        res = train(self.model, stack_states([self._state]), self._one(x, y), torch.tensor([0]), cfg, [gen],
                    trainable=trainable, masks=masks, engine="loop",
                    anchor=None if anchor is None else {k: a[None] for k, a in anchor.items()})
        self._state = unstack(res.stack, 0)
        return TrainStats(float(res.loss[0]), int(res.steps[0]), int(res.samples[0]))

    def dense_gradients(self, x: Tensor, y: Tensor, batch_size: int, gen: torch.Generator) -> dict[str, Tensor]:
        grads = dense_gradients(self.model, stack_states([self._state]), self._one(x, y), torch.tensor([0]),
                                batch_size, [gen])
        return unstack(grads, 0)


class ProgramSGD:
    """``torch.optim.SGD`` (dampening 0, no Nesterov; its momentum and weight decay) over the weights a gradient
    program is fed: mask and clip the gradients first, in the simulator's order, then the optimiser's step; then
    the mask re-applied to the weights (``pfl_edge.train``'s step, one step at a time)."""

    def __init__(self, params: dict[str, Tensor], cfg: TrainConfig, masks: Mapping[str, Tensor],
                 anchor: Mapping[str, Tensor] | None = None) -> None:
        self.params, self.cfg = params, cfg
        self.masks = {k: m for k, m in masks.items() if k in params}
        # the proximal term's anchors (TrainConfig.prox), as pfl_edge.train adds them: to the loss's gradient
        self.anchor = {k: a for k, a in (anchor or {}).items() if k in params} if cfg.prox else {}
        self._opt = torch.optim.SGD(list(params.values()), lr=cfg.lr, momentum=cfg.momentum,
                                    weight_decay=cfg.weight_decay)

    def step(self, grads: Mapping[str, Tensor]) -> None:
        g = {k: grads[k] for k in self.params}  # fresh tensors from the runtime: safe to change in place
        for k, a in self.anchor.items():
            g[k].add_(self.params[k] - a, alpha=self.cfg.prox)
        if self.cfg.clip_unmasked:  # the DisPFL reference's order: clip the whole gradient, then mask it
            self._clip(g)
        for k, m in self.masks.items():
            g[k].mul_(m)
        if not self.cfg.clip_unmasked:
            self._clip(g)
        for k, p in self.params.items():
            p.grad = g[k]
        self._opt.step()
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
    """An ExecuTorch training program (a gradient program: weights in, loss and gradients out), loaded once; the
    device holds the weights and steps them (``ProgramSGD``)."""

    name = "executorch"

    def __init__(self, program: bytes, details: Mapping[str, Any]) -> None:
        from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

        if details.get("kind") != "training":
            raise ConfigError("ExecuTorchBackend needs a training program (export.lower_executorch_training); "
                              f"this one is kind {details.get('kind')!r}")
        if details.get("signature") != "forward(x, y, weight, *params) -> (loss, *grads)":
            raise ConfigError(f"this training program's signature is {details.get('signature')!r}, not the gradient "
                              "program this device drives (weights in, loss and gradients out): export it again")
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
            warnings.simplefilter("ignore")
            self._module: Any = _load_for_executorch_from_buffer(self._data)
        self._w = {k: torch.zeros(shapes[k]) for k in self.keys}
        self._loaded = False
        # one call at load: a program this runtime cannot run (an operator it lacks) fails here, not mid-round
        _, grads = self._run(torch.zeros(self.batch_size, *self.input_shape),
                             torch.zeros(self.batch_size, dtype=torch.int64), torch.ones(self.batch_size))
        if list(grads) != self.trainable:
            raise ConfigError(f"program's gradients {list(grads)} are not its manifest's trainable {self.trainable}")

    @staticmethod
    def from_lowered(lowered: Any) -> ExecuTorchBackend:
        return ExecuTorchBackend(lowered.program, lowered.details)

    @classmethod
    def for_device(cls, req: BackendRequest) -> ExecuTorchBackend:
        """The program ``req.program``, or the server's for the device's mode (each round's weights are fed to it,
        never re-exported; a device exports nothing)."""
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

    def _run(self, x: Tensor, y: Tensor, w: Tensor) -> tuple[float, dict[str, Tensor]]:
        out = self._module.forward((x, y, w, *(self._w[k] for k in self.keys)))
        return float(out[0]), dict(zip(self.trainable, out[1:], strict=True))

    def load(self, state: Mapping[str, Tensor]) -> None:
        missing = set(self.keys) - set(state)
        if missing:
            raise ConfigError(f"state lacks {sorted(missing)}")
        self._w = {k: state[k].detach().to(torch.float32).contiguous().clone() for k in self.keys}
        self._loaded = True

    def state(self) -> dict[str, Tensor]:
        self._require_loaded()
        return {k: self._w[k].detach().clone() for k in self.keys}

    def _require_loaded(self) -> None:
        if not self._loaded:
            raise ConfigError("load a state into the ExecuTorch backend first (its weights have no values)")

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
        return self._run(x.to(torch.float32).contiguous(), y.to(torch.int64).contiguous(), w)

    def sgd(self, cfg: TrainConfig, *, trainable: Collection[str] | None = None,
            mask: Mapping[str, Tensor] | None = None, anchor: Mapping[str, Tensor] | None = None) -> ProgramSGD:
        """A fresh optimizer over ``trainable`` (default: every trainable parameter of the program)."""
        names = self._names(trainable)
        self._require_loaded()
        return ProgramSGD({k: self._w[k] for k in names}, cfg, mask or {}, anchor)

    def _names(self, trainable: Collection[str] | None) -> list[str]:
        if trainable is None:
            return list(self.trainable)
        beyond = set(trainable) - set(self.trainable)
        if beyond:
            raise ConfigError(f"this program (mode {self.details.get('mode')!r}) cannot train {sorted(beyond)}: "
                              "they are frozen inputs or not parameters; export a program that trains them")
        return [k for k in self.trainable if k in set(trainable)]

    def train(self, x: Tensor, y: Tensor, cfg: TrainConfig, gen: torch.Generator, *,
              trainable: Collection[str] | None = None, mask: Mapping[str, Tensor] | None = None,
              anchor: Mapping[str, Tensor] | None = None) -> TrainStats:
        self._require_loaded()
        if cfg.batch_size > self.batch_size:
            raise ConfigError(f"batch size {cfg.batch_size} > the program's {self.batch_size}; export for it")
        masks = dict(mask or {})
        unknown = set(masks) - set(self.keys)
        if unknown:
            raise ConfigError(f"masks for {sorted(unknown)}, which the model does not have")
        with torch.no_grad():  # training starts from w * m, as pfl_edge.train's does
            for k, m in masks.items():
                self._w[k].mul_(m)
        opt = self.sgd(cfg, trainable=trainable, mask=masks, anchor=anchor)
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
        out = {k: torch.zeros_like(self._w[k]) for k in self.trainable}
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
