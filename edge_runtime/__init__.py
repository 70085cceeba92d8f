"""What runs on a device: the agent (``edge_runtime.agent``), its trainer and training backends (torch; ONNX
Runtime's and ExecuTorch's training programs), inference backends, the check of a training program against eager
PyTorch, and the profiler that measures a device class.

The names below are imported when first used, so that a device without torch imports the agent and the program
backends alone (the torch backend, the profiler and the check need torch)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backends import InferenceBackend, TorchTrainer, load_inference
    from .profiler import Measurement, measure, profile_devices
    from .training import (
        TRAINING_BACKENDS,
        ExecuTorchBackend,
        OnnxBackend,
        ProgramBackend,
        TorchBackend,
        TrainingBackend,
        TrainStats,
        get_training_backend,
    )
    from .verify import TrainingVerified, verify_training

_HOME = {
    "InferenceBackend": "backends", "TorchTrainer": "backends", "load_inference": "backends",
    "Measurement": "profiler", "measure": "profiler", "profile_devices": "profiler",
    "TRAINING_BACKENDS": "training", "ExecuTorchBackend": "training", "TorchBackend": "training",
    "OnnxBackend": "training", "ProgramBackend": "training",
    "TrainingBackend": "training", "TrainStats": "training", "get_training_backend": "training",
    "TrainingVerified": "verify", "verify_training": "verify",
}

__all__ = [
    "TRAINING_BACKENDS",
    "ExecuTorchBackend",
    "InferenceBackend",
    "Measurement",
    "OnnxBackend",
    "ProgramBackend",
    "TorchBackend",
    "TorchTrainer",
    "TrainStats",
    "TrainingBackend",
    "TrainingVerified",
    "get_training_backend",
    "load_inference",
    "measure",
    "profile_devices",
    "verify_training",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
