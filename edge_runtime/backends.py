"""Inference and training backends behind one small interface: what the device agent and the profiler call."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from pfl_edge.errors import ConfigError

if TYPE_CHECKING:  # torch for the torch trainer and the pip ExecuTorch runtime; ONNX Runtime runs without it
    import torch
    from torch import nn

__all__ = ["InferenceBackend", "TorchTrainer", "load_inference", "onnx_session"]


class InferenceBackend(Protocol):
    name: str

    def run(self, x: np.ndarray) -> np.ndarray: ...


def onnx_session(program: Path | bytes, threads: int) -> Any:
    """An ONNX Runtime session of ``program`` (a file, or its bytes) on the CPU, on ``threads`` threads."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    source = program if isinstance(program, bytes) else str(program)
    return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


class _Onnx:
    name = "onnxruntime"

    def __init__(self, path: Path, threads: int) -> None:
        self._sess = onnx_session(path, threads)

    def run(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self._sess.run(None, {"input": x.astype(np.float32, copy=False)})[0])


class _ExecuTorch:
    name = "executorch"

    def __init__(self, path: Path, threads: int) -> None:
        from executorch.runtime import Runtime

        # the runtime reads the program from this buffer without owning it: keep it for our lifetime
        self._data = path.read_bytes()
        self._program: Any = Runtime.get().load_program(self._data)
        self._method: Any = self._program.load_method("forward")
        self.threads = threads  # XNNPACK's thread pool is not settable from Python; recorded only

    def run(self, x: np.ndarray) -> np.ndarray:
        import torch

        out = self._method.execute([torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))])[0]
        return np.asarray(out.numpy())


def load_inference(path: str | Path, runtime: str, threads: int) -> InferenceBackend:
    """An exported artefact (``.onnx`` or ``.pte``) loaded in ``runtime``."""
    p = Path(path)
    if runtime == "onnxruntime":
        return _Onnx(p, threads)
    if runtime == "executorch":
        return _ExecuTorch(p, threads)
    raise ConfigError(f"unknown inference runtime {runtime!r}; valid: executorch, onnxruntime")


class TorchTrainer:
    """The ``torch`` training backend: SGD steps on the eager model, on the device's thread budget."""

    name = "torch"

    def __init__(self, model: nn.Module, *, lr: float = 0.01, momentum: float = 0.9, threads: int = 1) -> None:
        import torch

        torch.set_num_threads(threads)
        self.model = model.train()
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        import torch.nn.functional as F

        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())
