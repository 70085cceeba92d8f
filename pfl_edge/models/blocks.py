"""A model is an ordered list of named blocks; K_P counts blocks from the end."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["BlockModel", "Flatten", "SpatialMean"]


class SpatialMean(nn.Module):
    """Global average pooling as a mean over H and W: trainable on-device, unlike avg-pool (docs/design.md)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


class Flatten(nn.Module):
    """Flatten everything after the batch dimension (a view; exports everywhere)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1)


class BlockModel(nn.Sequential):
    """``nn.Sequential`` of named blocks. State-dict keys are ``<block>.<rest>``, so each key's block is known
    from the module tree, never guessed from the name."""

    def __init__(self, blocks: Iterable[tuple[str, nn.Module]]) -> None:
        items = list(blocks)
        names = [n for n, _ in items]
        if not items:
            raise ConfigError("a BlockModel needs at least one block")
        if len(set(names)) != len(names):
            raise ConfigError(f"block names must be unique, got {names}")
        for name in names:
            if not name or "." in name:
                raise ConfigError(f"block name {name!r} must be non-empty and contain no '.'")
        super().__init__(OrderedDict(items))

    @property
    def block_names(self) -> list[str]:
        return list(self._modules.keys())

    def block_of(self) -> dict[str, str]:
        """Map every state-dict key (parameters and buffers) to the name of the block that owns it."""
        owner: dict[str, str] = {}
        for name, block in self._modules.items():
            if block is None:  # a block slot set to None holds nothing
                continue
            for key in block.state_dict(keep_vars=True):
                owner[f"{name}.{key}"] = name
        return owner
