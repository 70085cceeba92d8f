"""Checkpoints as safetensors (never pickle): tensors plus string metadata that says how to rebuild the model."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:  # torch, safetensors.torch and the models are imported where a model or a file is made:
    # ModelSpec imports without torch
    from torch import Tensor

    from .models import BlockModel

__all__ = ["FORMAT", "ModelSpec", "build_model", "load_checkpoint", "save_checkpoint"]

FORMAT = "pfl-edge-checkpoint/1"


@dataclass(frozen=True)
class ModelSpec:
    """Enough to rebuild a model's skeleton: the registry name, its shape, and FedPer's linear-base control."""

    model: str
    num_classes: int
    in_channels: int
    image_size: int
    base: str = "deep"
    kp: int = 0

    def to_metadata(self) -> dict[str, str]:
        return {"model": self.model, "num_classes": str(self.num_classes), "in_channels": str(self.in_channels),
                "image_size": str(self.image_size), "base": self.base, "kp": str(self.kp)}

    @staticmethod
    def from_metadata(meta: Mapping[str, str]) -> ModelSpec:
        try:
            return ModelSpec(meta["model"], int(meta["num_classes"]), int(meta["in_channels"]),
                             int(meta["image_size"]), meta.get("base", "deep"), int(meta.get("kp", "0")))
        except (KeyError, ValueError) as e:
            raise ConfigError(f"checkpoint metadata does not describe a model: {e}") from e


def build_model(spec: ModelSpec) -> BlockModel:
    from .models import get_model, linear_base_model

    model = get_model(spec.model, num_classes=spec.num_classes, in_channels=spec.in_channels,
                      image_size=spec.image_size)
    if spec.base == "linear":
        model = linear_base_model(model, spec.kp, in_channels=spec.in_channels, image_size=spec.image_size)
    return model


def save_checkpoint(path: str | Path, state: Mapping[str, Tensor], spec: ModelSpec,
                    extra: Mapping[str, object] | None = None) -> Path:
    """Write ``state`` (a full model's or a part's tensors) with the spec and ``extra`` (JSON) as metadata."""
    from safetensors.torch import save_file

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, **spec.to_metadata(), "extra": json.dumps(dict(extra or {}), sort_keys=True)}
    tmp = p.with_suffix(p.suffix + ".tmp")
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(tmp), metadata=meta)
    tmp.replace(p)  # atomic: a reader never sees half a file
    return p


def load_checkpoint(path: str | Path) -> tuple[dict[str, Tensor], ModelSpec, dict[str, object]]:
    """The tensors, the model spec and the extra metadata of a checkpoint written by ``save_checkpoint``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    p = Path(path)
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
        state = load_file(str(p))
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"{p} is not a readable safetensors checkpoint: {e}") from e
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{p} is not a pfl-edge checkpoint (format {meta.get('format')!r}, expected {FORMAT!r})")
    try:
        extra = json.loads(meta.get("extra", "{}"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: corrupt metadata: {e}") from e
    return state, ModelSpec.from_metadata(meta), extra
