"""What runs on a device: the agent (``edge_runtime.agent``), its trainer and training backends, inference
backends, the check of a training program against eager PyTorch, and the profiler that measures a device class."""

from .backends import InferenceBackend, TorchTrainer, load_inference
from .profiler import Measurement, measure, profile_devices
from .training import (
    TRAINING_BACKENDS,
    ExecuTorchBackend,
    TorchBackend,
    TrainingBackend,
    TrainStats,
    get_training_backend,
)
from .verify import TrainingVerified, verify_training

__all__ = [
    "TRAINING_BACKENDS",
    "ExecuTorchBackend",
    "InferenceBackend",
    "Measurement",
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
