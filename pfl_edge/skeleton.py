"""A model's skeleton without the model: its blocks, and each tensor's name, shape, block and kind, as a model card
states them (``pfl_edge.modelcard``). What the algorithms ask of a model (``split_keys``, ``Clients.shapes``,
DisPFL's mask counts) is answered from here on a device that cannot build the ``nn.Module`` (it has no torch)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .errors import ConfigError

if TYPE_CHECKING:
    from .modelcard import ModelCard

__all__ = ["MAX_NDIM", "ModelSkeleton"]

MAX_NDIM = 8  # the models' tensors have at most 4 dimensions


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]
    block: str
    parameter: bool


class ModelSkeleton:
    """Names, shapes and blocks of a model (``BlockModel``'s ``block_names``, ``block_of``, ``named_parameters``,
    ``named_buffers`` and ``state_dict``), each tensor standing as a read-only zero array of its shape."""

    def __init__(self, block_names: Sequence[str], tensors: Sequence[_Tensor]) -> None:
        self.block_names = list(block_names)
        self._tensors = list(tensors)
        unknown = sorted({t.block for t in tensors} - set(block_names))
        if unknown:
            raise ConfigError(f"tensors of blocks {unknown} that the model does not list ({self.block_names})")
        if len({t.name for t in tensors}) != len(tensors):
            raise ConfigError("a model's tensors must have distinct names")

    @staticmethod
    def from_card(card: ModelCard, *, max_bytes: int) -> ModelSkeleton:
        """The skeleton a card describes, checked before anything is allocated for it: every dimension >= 0, at
        most ``MAX_NDIM`` of them, the whole model in float32 at most ``max_bytes`` (a device's blob limit: it
        could never receive a larger one), and each block's tensor list the tensors that name it."""
        total = 0
        for t in card.tensors:
            if len(t.shape) > MAX_NDIM or any(d < 0 for d in t.shape):
                raise ConfigError(f"the card's tensor {t.name!r:.80} has shape {t.shape!r:.80}: not a tensor's shape")
            total += math.prod(t.shape)
            if 4 * total > max_bytes:
                raise ConfigError(f"the card's model is over {max_bytes} bytes in float32 (this device's blob limit)")
        listed = {b.name: sorted(b.tensors) for b in card.blocks}
        named: dict[str, list[str]] = {b: [] for b in listed}
        for t in card.tensors:
            named.setdefault(t.block, []).append(t.name)
        if {b: sorted(v) for b, v in named.items()} != listed:
            raise ConfigError("the card's blocks do not list the tensors that name them")
        return ModelSkeleton([b.name for b in card.blocks],
                             [_Tensor(t.name, tuple(t.shape), t.block, t.kind == "parameter") for t in card.tensors])

    @staticmethod
    def _zeros(shape: tuple[int, ...]) -> np.ndarray:
        return np.broadcast_to(np.float32(0), shape)  # no memory: only its shape is read

    def block_of(self) -> dict[str, str]:
        return {t.name: t.block for t in self._tensors}

    def named_parameters(self) -> Iterator[tuple[str, np.ndarray]]:
        return ((t.name, self._zeros(t.shape)) for t in self._tensors if t.parameter)

    def named_buffers(self) -> Iterator[tuple[str, np.ndarray]]:
        return ((t.name, self._zeros(t.shape)) for t in self._tensors if not t.parameter)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {t.name: self._zeros(t.shape) for t in self._tensors}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.name: t.shape for t in self._tensors}
