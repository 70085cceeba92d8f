"""What runs on a device: inference and training backends, and the profiler that measures a device class.
(The device agent arrives with the federation.)"""

from .backends import InferenceBackend, TorchTrainer, load_inference
from .profiler import Measurement, measure, profile_devices

__all__ = ["InferenceBackend", "Measurement", "TorchTrainer", "load_inference", "measure", "profile_devices"]
