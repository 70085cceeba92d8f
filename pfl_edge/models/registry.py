"""Model registry: ``list_models()``, ``get_model(name, ...)`` and ``@register_model`` for a user's own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import ConfigError, UnknownNameError
from .blocks import BlockModel

__all__ = ["ModelBuilder", "ModelEntry", "get_model", "list_models", "model_entry", "register_model"]


class ModelBuilder(Protocol):
    def __call__(self, *, num_classes: int, in_channels: int, image_size: int, **kwargs: Any) -> BlockModel: ...


@dataclass(frozen=True)
class ModelEntry:
    name: str
    builder: ModelBuilder
    description: str
    image_sizes: tuple[int, ...] | None  # None: any size


_MODELS: dict[str, ModelEntry] = {}


def register_model(
    name: str, *, description: str = "", image_sizes: tuple[int, ...] | None = None
) -> Callable[[ModelBuilder], ModelBuilder]:
    """Register a builder ``f(*, num_classes, in_channels, image_size, **kwargs) -> BlockModel``.

    >>> @register_model("tiny")
    ... def tiny(*, num_classes, in_channels, image_size, **_):
    ...     return BlockModel([("body", Flatten()), ("head", nn.Linear(in_channels * image_size**2, num_classes))])
    """

    def deco(builder: ModelBuilder) -> ModelBuilder:
        if name in _MODELS:
            raise ConfigError(f"model {name!r} is already registered")
        _MODELS[name] = ModelEntry(name, builder, description, image_sizes)
        return builder

    return deco


def list_models() -> list[str]:
    return sorted(_MODELS)


def model_entry(name: str) -> ModelEntry:
    try:
        return _MODELS[name]
    except KeyError:
        raise UnknownNameError("model", name, list_models()) from None


def get_model(
    name: str, *, num_classes: int, in_channels: int, image_size: int = 28, **kwargs: Any
) -> BlockModel:
    """Build a fresh model. Initialisation draws from torch's global generator: seed it first
    (``pfl_edge.seeding``) or load a state dict."""
    entry = model_entry(name)
    if num_classes < 2:
        raise ConfigError(f"num_classes must be >= 2, got {num_classes}")
    if in_channels < 1:
        raise ConfigError(f"in_channels must be >= 1, got {in_channels}")
    if entry.image_sizes is not None and image_size not in entry.image_sizes:
        raise ConfigError(f"model {name!r} takes image sizes {entry.image_sizes}, got {image_size}")
    model = entry.builder(num_classes=num_classes, in_channels=in_channels, image_size=image_size, **kwargs)
    if not isinstance(model, BlockModel):
        raise ConfigError(f"builder of model {name!r} must return a BlockModel, got {type(model).__name__}")
    return model
