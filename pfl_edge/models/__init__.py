"""Model registry and the built-in models (each an ordered list of named blocks)."""

from . import zoo as _zoo  # noqa: F401  (registers the built-in models)
from .blocks import BlockModel, Flatten, SpatialMean
from .linear_base import LinearBase, linear_base_model
from .registry import ModelBuilder, ModelEntry, get_model, list_models, model_entry, register_model

__all__ = [
    "BlockModel",
    "Flatten",
    "LinearBase",
    "ModelBuilder",
    "ModelEntry",
    "SpatialMean",
    "get_model",
    "linear_base_model",
    "list_models",
    "model_entry",
    "register_model",
]
