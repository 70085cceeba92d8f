"""A model's skeleton without the model: its blocks, and each tensor's name, shape, block and kind, as a model card
states them (``pfl_edge.modelcard``). What the algorithms ask of a model (``split_keys``, ``Clients.shapes``,
DisPFL's mask counts) is answered from here on a device that cannot build the ``nn.Module`` (it has no torch)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .errors import ConfigError

if TYPE_CHECKING:
    from .modelcard import ModelCard

__all__ = ["ModelSkeleton"]


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
    def from_card(card: ModelCard) -> ModelSkeleton:
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
