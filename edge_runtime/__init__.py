"""What runs on a device: inference and training backends, and the profiler that measures a device class.
(The device agent arrives with the federation.)"""

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

__all__ = [
    "TRAINING_BACKENDS",
    "ExecuTorchBackend",
    "InferenceBackend",
    "Measurement",
    "TorchBackend",
    "TorchTrainer",
    "TrainStats",
    "TrainingBackend",
    "get_training_backend",
    "load_inference",
    "measure",
    "profile_devices",
]
