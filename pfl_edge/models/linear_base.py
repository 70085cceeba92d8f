"""FedPer's control: the deep base replaced by one fully connected layer on the flattened input."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from .blocks import BlockModel

__all__ = ["LinearBase", "linear_base_model"]


class LinearBase(nn.Module):
    """Flatten, one linear layer, ReLU, reshaped to what the first personal block expects."""

    def __init__(self, in_features: int, out_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.out_shape = out_shape
        self.fc = nn.Linear(in_features, int(torch.Size(out_shape).numel()))

    def forward(self, x: Tensor) -> Tensor:
        y = torch.relu(self.fc(x.reshape(x.shape[0], -1)))
        return y.reshape(x.shape[0], *self.out_shape)


def linear_base_model(model: BlockModel, kp: int, *, in_channels: int, image_size: int) -> BlockModel:
    """A copy of ``model`` whose first ``len(blocks) - kp`` blocks are one block ``base`` (a LinearBase)."""
    names = model.block_names
    if not 1 <= kp < len(names):
        raise ConfigError(f"a linear base needs 1 <= kp < {len(names)} (the model's blocks), got kp={kp}")
    x = torch.zeros(1, in_channels, image_size, image_size)
    with torch.no_grad():
        for name in names[: len(names) - kp]:
            x = model.get_submodule(name)(x)
    base = LinearBase(in_channels * image_size * image_size, tuple(x.shape[1:]))
    personal = [(n, copy.deepcopy(model.get_submodule(n))) for n in names[len(names) - kp:]]
    return BlockModel([("base", base), *personal])
