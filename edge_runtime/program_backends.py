"""The program backends: a device that trains through a training program (a gradient program: weights and a batch
in, loss and gradients out; docs/model.md), ``OnnxBackend`` (ONNX Runtime, numpy alone, Python 3.10+) and
``ExecuTorchBackend`` (the pip ExecuTorch runtime, or executorch-numpy-runtime), both ``ProgramBackend``: the device
holds the weights as numpy arrays and steps them with ``ProgramSGD`` (``pfl_edge.sgd.SGD``: masking and clipping
on the gradients, then torch.optim.SGD's update with momentum and weight decay, then the mask re-applied, in
``pfl_edge.train``'s order), over ``pfl_edge.sgd.epoch_batches``. Each sizes its runtime's threads from the device
profile."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pfl_edge.arrays import is_numpy, randperm, to_numpy
from pfl_edge.errors import ConfigError
from pfl_edge.modelcard import TRAINING_SIGNATURE
from pfl_edge.sgd import SGD, TrainConfig, epoch_batches

from .backend_types import BackendRequest, TrainStats

__all__ = ["ExecuTorchBackend", "OnnxBackend", "ProgramBackend", "ProgramSGD", "load_onnx_program", "load_program"]


class ProgramSGD(SGD):
    """``pfl_edge.sgd.SGD`` over the weights a gradient program is fed (numpy arrays), stepped with the gradients
    of either kind (the program's own, or torch tensors from a caller comparing with eager PyTorch)."""

    def step(self, grads: Mapping[str, Any]) -> None:
        super().step({k: to_numpy(v) for k, v in grads.items()})


def load_program(program: bytes, runtime: str = "auto", *,
                 threads: int | None = None) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
    """The program's ``forward`` as a function of numpy arrays, on the pip ``executorch`` runtime (which links
    libtorch; ``runtime="pip"``) or on ``executorch-numpy-runtime`` (no torch: ``runtime="numpy"``); ``auto``:
    the pip runtime where torch is installed, else the numpy one. Both run the same program bytes. ``threads``:
    the pip runtime's thread pool is resized to it (it ignores ``OMP_NUM_THREADS`` and otherwise takes a thread
    per core); the numpy runtime's pool cannot be sized from Python."""
    if runtime not in ("auto", "pip", "numpy"):
        raise ConfigError(f"unknown ExecuTorch runtime {runtime!r}; valid: auto, pip, numpy")
    pip_error: Exception | None = None
    if runtime in ("auto", "pip"):
        try:
            import torch
            from executorch.extension.pybindings import portable_lib
        except (ImportError, OSError) as e:  # not installed, or a broken build: say which, fall back in auto
            if runtime == "pip":
                raise ConfigError(f"the pip executorch runtime cannot be loaded ({e})") from e
            pip_error = e
        else:
            if threads is not None and portable_lib._threadpool_get_thread_count() != threads:
                portable_lib._unsafe_reset_threadpool(threads)  # "unsafe": not while a program runs; none does yet
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = portable_lib._load_for_executorch_from_buffer(program)

            def run_pip(args: list[np.ndarray]) -> list[np.ndarray]:
                out = module.forward(tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in args))
                return [o.numpy() for o in out]

            run_pip.keep = program  # type: ignore[attr-defined]  # the runtime reads the buffer without owning it
            return run_pip
    try:
        import executorch_numpy_runtime as en
    except ImportError as e:
        why = "" if runtime == "numpy" else f" (pip executorch: {pip_error})"
        raise ConfigError("no ExecuTorch runtime: install executorch (with torch) or executorch-numpy-runtime "
                          f"(numpy only, Python >= 3.12); or train with the ONNX program (--training-backend "
                          f"onnxruntime){why}") from e
    method = en.Runtime.get().load_program(program).load_method("forward")

    def run_numpy(args: list[np.ndarray]) -> list[np.ndarray]:
        return list(method([np.ascontiguousarray(a) for a in args]))

    return run_numpy


def load_onnx_program(program: bytes, details: Mapping[str, Any], *,
                      threads: int = 1) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
    """An ONNX training program's graph as a function of numpy arrays (inputs in ``details["inputs"]`` order,
    outputs in ``details["outputs"]``'s), in an ONNX Runtime inference session on ``threads`` threads (intra-op;
    one inter-op: the graph runs its nodes in order)."""
    from .backends import onnx_session

    sess = onnx_session(program, threads)
    names, outputs = list(details["inputs"]), list(details["outputs"])
    got = [i.name for i in sess.get_inputs()]
    if got != names:
        raise ConfigError(f"the ONNX training program's inputs {got[:4]}... are not its details' {names[:4]}...")

    def run_onnx(args: list[np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(o) for o in sess.run(outputs, dict(zip(names, args, strict=True)))]

    return run_onnx


def _like(x: Any, a: np.ndarray) -> Any:
    """``a`` as the kind of ``x``: a torch tensor (sharing memory) for a torch ``x``, else ``a``."""
    if is_numpy(x):
        return a
    import torch

    return torch.from_numpy(a)


class ProgramBackend:
    """A training program (a gradient program: weights in, loss and gradients out, docs/model.md), loaded once;
    the device holds the weights as numpy arrays and steps them (``ProgramSGD``). The runtime that runs the
    program is the subclass's (``OnnxBackend``: ONNX Runtime; ``ExecuTorchBackend``: ExecuTorch); everything
    else (padding, SGD, masks, the regrowth gradient) is here, once. States, batches and gradients come and go as
    torch tensors or numpy arrays, whichever the caller gives."""

    name = "program"
    program_runtime = ""  # the card's ProgramInfo.runtime of the programs this backend runs

    def __init__(self, forward: Callable[[list[np.ndarray]], list[np.ndarray]], details: Mapping[str, Any]) -> None:
        if details.get("kind") != "training":
            raise ConfigError(f"{type(self).__name__} needs a training program; this one is kind "
                              f"{details.get('kind')!r}")
        if details.get("signature") != TRAINING_SIGNATURE:
            raise ConfigError(f"this training program's signature is {details.get('signature')!r}, not the gradient "
                              "program this device drives (weights in, loss and gradients out): export it again")
        self.details = dict(details)
        self.batch_size = int(details["batch_size"])
        self.keys: list[str] = list(details["keys"])
        self.trainable: list[str] = list(details["trainable"])
        self.frozen: list[str] = list(details["frozen"])
        self.input_shape = tuple(int(s) for s in details["input_shape"])
        shapes = {k: tuple(v) for k, v in details["shapes"].items()}
        self._forward = forward
        self._w = {k: np.zeros(shapes[k], np.float32) for k in self.keys}
        self._torch_state = False  # was the last state loaded a torch one (then state() gives torch back)
        self._loaded = False
        # one call at load: a program this runtime cannot run (an operator it lacks) fails here, not mid-round
        _, grads = self._run(np.zeros((self.batch_size, *self.input_shape), np.float32),
                             np.zeros(self.batch_size, np.int64), np.ones(self.batch_size, np.float32))
        if list(grads) != self.trainable:
            raise ConfigError(f"program's gradients {list(grads)} are not its manifest's trainable {self.trainable}")

    @classmethod
    def open(cls, program: bytes, details: Mapping[str, Any], *, threads: int = 1) -> ProgramBackend:
        """The backend of ``program`` on ``threads`` threads (the device profile's)."""
        raise NotImplementedError

    @classmethod
    def from_lowered(cls, lowered: Any, *, threads: int = 1) -> ProgramBackend:
        return cls.open(lowered.program, lowered.details, threads=threads)

    @classmethod
    def for_device(cls, req: BackendRequest) -> ProgramBackend:
        """The program ``req.program``, or the server's for the device's mode (each round's weights are fed to it,
        never re-exported; a device exports nothing), on the profile's threads."""
        threads = req.threads or req.profile.threads
        if req.program is not None:
            backend = cls.from_file(req.program, threads=threads)
        elif req.download is not None:
            program, details = req.download(req.mode, cls.program_runtime)
            backend = cls.open(program, details, threads=threads)
        else:
            raise ConfigError(f"the {cls.name} training backend needs a program: the server's (from its model "
                              "card) or --training-program")
        if backend.frozen:  # the device's modes (fedper, dispfl) train every parameter
            raise ConfigError(f"the training program (mode {backend.details.get('mode')!r}) freezes "
                              f"{len(backend.frozen)} tensors; this device trains all of them (mode {req.mode!r})")
        if backend.batch_size < req.batch_size:
            raise ConfigError(f"the training program takes batches of {backend.batch_size}, the federation trains "
                              f"with {req.batch_size}: export one at the federation's batch size")
        want = {k: tuple(v.shape) for k, v in req.model.state_dict().items()}
        got = {k: tuple(backend._w[k].shape) for k in backend.keys}
        if any(want.get(k) != s for k, s in got.items()):
            raise ConfigError("the training program's weights are not this device's model's tensors (names, shapes)")
        return backend

    @classmethod
    def from_file(cls, path: str | Path, *, threads: int = 1) -> ProgramBackend:
        """A packaged program, described by its entry in the ``manifest.json`` beside it."""
        p = Path(path)
        entries = json.loads((p.parent / "manifest.json").read_text())
        entry = next((e for e in entries if e.get("path") == p.name), None)
        if entry is None:
            raise ConfigError(f"{p.parent / 'manifest.json'} has no entry for {p.name}")
        return cls.open(p.read_bytes(), entry, threads=threads)

    def _run(self, x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        out = self._forward([x, y, w, *(self._w[k] for k in self.keys)])
        return float(out[0]), dict(zip(self.trainable, out[1:], strict=True))

    def load(self, state: Mapping[str, Any]) -> None:
        missing = set(self.keys) - set(state)
        if missing:
            raise ConfigError(f"state lacks {sorted(missing)}")
        self._w = {k: np.array(to_numpy(state[k]), dtype=np.float32, order="C", copy=True) for k in self.keys}
        self._torch_state = not is_numpy(state[self.keys[0]]) if self.keys else False
        self._loaded = True

    def state(self) -> dict[str, Any]:
        self._require_loaded()
        out = {k: self._w[k].copy() for k in self.keys}
        if self._torch_state:
            import torch

            return {k: torch.from_numpy(v) for k, v in out.items()}
        return out

    def _require_loaded(self) -> None:
        if not self._loaded:
            raise ConfigError(f"load a state into the {self.name} backend first (its weights have no values)")

    def gradients(self, x: Any, y: Any) -> tuple[float, dict[str, Any]]:
        """Loss and gradients (of the trainable parameters) on one batch of at most ``batch_size`` samples, as
        the kind of ``x`` (torch tensors or numpy arrays)."""
        loss, grads = self._gradients(to_numpy(x), to_numpy(y))
        return loss, {k: _like(x, g) for k, g in grads.items()}

    def _gradients(self, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        self._require_loaded()
        n = len(x)
        if not 1 <= n <= self.batch_size:
            raise ConfigError(f"a batch of {n} samples; this program takes 1 to {self.batch_size}")
        w = np.ones(self.batch_size, np.float32)
        if n < self.batch_size:
            # pad with copies of a real sample at weight 0: finite activations (0 * inf would be NaN), zero effect
            pad = self.batch_size - n
            x = np.concatenate([x, np.broadcast_to(x[:1], (pad, *x.shape[1:]))])
            y = np.concatenate([y, np.broadcast_to(y[:1], (pad,))])
            w[n:] = 0.0
        return self._run(x.astype(np.float32), y.astype(np.int64), w)

    def sgd(self, cfg: TrainConfig, *, trainable: Collection[str] | None = None,
            mask: Mapping[str, Any] | None = None, anchor: Mapping[str, Any] | None = None) -> ProgramSGD:
        """A fresh optimizer over ``trainable`` (default: every trainable parameter of the program)."""
        names = self._names(trainable)
        self._require_loaded()
        return ProgramSGD({k: self._w[k] for k in names}, cfg, {k: to_numpy(m) for k, m in (mask or {}).items()},
                          {k: to_numpy(a) for k, a in (anchor or {}).items()})

    def _names(self, trainable: Collection[str] | None) -> list[str]:
        if trainable is None:
            return list(self.trainable)
        beyond = set(trainable) - set(self.trainable)
        if beyond:
            raise ConfigError(f"this program (mode {self.details.get('mode')!r}) cannot train {sorted(beyond)}: "
                              "they are frozen inputs or not parameters; export a program that trains them")
        return [k for k in self.trainable if k in set(trainable)]

    def train(self, x: Any, y: Any, cfg: TrainConfig, gen: Any, *,
              trainable: Collection[str] | None = None, mask: Mapping[str, Any] | None = None,
              anchor: Mapping[str, Any] | None = None) -> TrainStats:
        self._require_loaded()
        if cfg.batch_size > self.batch_size:
            raise ConfigError(f"batch size {cfg.batch_size} > the program's {self.batch_size}; export for it")
        masks = {k: to_numpy(m) for k, m in (mask or {}).items()}
        unknown = set(masks) - set(self.keys)
        if unknown:
            raise ConfigError(f"masks for {sorted(unknown)}, which the model does not have")
        for k, m in masks.items():  # training starts from w * m, as pfl_edge.train's does
            self._w[k] *= m
        opt = self.sgd(cfg, trainable=trainable, mask=masks, anchor=anchor)
        xs, ys = to_numpy(x), to_numpy(y)
        n = len(xs)
        loss_sum, steps = 0.0, 0
        for b in epoch_batches(n, cfg.epochs, cfg.batch_size, gen):  # pfl_edge.train's schedule, one client
            idx = to_numpy(b)
            loss, grads = self._gradients(xs[idx], ys[idx])
            opt.step(grads)
            loss_sum += loss
            steps += 1
        return TrainStats(loss_sum / max(steps, 1), steps, n * cfg.epochs)

    def dense_gradients(self, x: Any, y: Any, batch_size: int, gen: Any) -> dict[str, Any]:
        if self.frozen:
            raise ConfigError(f"dense gradients need every parameter trainable (mode fedper or dispfl); this "
                              f"program (mode {self.details.get('mode')!r}) freezes {len(self.frozen)} tensors")
        xs, ys = to_numpy(x), to_numpy(y)
        # the same draw as pfl_edge.train.dense_gradients: one permutation, its first batch_size samples
        b = to_numpy(randperm(gen, len(xs)))[:batch_size]
        out = {k: np.zeros_like(self._w[k]) for k in self.trainable}
        for s in range(0, len(b), self.batch_size):  # a batch larger than the program's: a weighted sum of chunks
            chunk = b[s: s + self.batch_size]
            _, grads = self._gradients(xs[chunk], ys[chunk])
            share = len(chunk) / len(b)
            for k, g in grads.items():
                out[k] += g if share == 1.0 else g * np.float32(share)
        return {k: _like(x, out[k]) for k in self.trainable}


class ExecuTorchBackend(ProgramBackend):
    """An ExecuTorch training program (``export.lower_executorch_training``) on the pip runtime or, on a device
    without torch, on ``executorch-numpy-runtime`` (``load_program``)."""

    name = "executorch"
    program_runtime = "executorch"

    def __init__(self, program: bytes, details: Mapping[str, Any], *, runtime: str = "auto",
                 threads: int | None = None) -> None:
        super().__init__(load_program(program, runtime, threads=threads), details)

    @classmethod
    def open(cls, program: bytes, details: Mapping[str, Any], *, threads: int = 1) -> ExecuTorchBackend:
        return cls(program, details, threads=threads)


class OnnxBackend(ProgramBackend):
    """An ONNX training program (``export.lower_onnx_training``) in an ONNX Runtime inference session: numpy and
    onnxruntime alone, on every platform ONNX Runtime ships for (Python 3.10+ on Linux x86_64 and aarch64)."""

    name = "onnxruntime"
    program_runtime = "onnxruntime"

    def __init__(self, program: bytes, details: Mapping[str, Any], *, threads: int = 1) -> None:
        super().__init__(load_onnx_program(program, details, threads=threads), details)

    @classmethod
    def open(cls, program: bytes, details: Mapping[str, Any], *, threads: int = 1) -> OnnxBackend:
        return cls(program, details, threads=threads)
