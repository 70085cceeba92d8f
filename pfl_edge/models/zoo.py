"""The built-in models. All of them downsample with strided convolutions and pool with a spatial mean (or
flatten), so that every block can be trained on-device with ExecuTorch (docs/design.md, known operator limits)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..errors import ConfigError
from .blocks import BlockModel, Flatten, SpatialMean
from .registry import register_model

__all__ = ["cnn", "mobilenet_v1", "resnet18_gn"]


def _conv_out(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _norm(kind: str, channels: int, groups: int) -> nn.Module:
    if kind == "group":
        return nn.GroupNorm(min(groups, channels), channels)
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    raise ConfigError(f"norm must be 'group' or 'batch', got {kind!r}")


@register_model("cnn", description="small CNN: 2 strided 5x5 convs, 3 linear layers (5 blocks)")
def cnn(*, num_classes: int, in_channels: int, image_size: int, width: int = 32, hidden: int = 128,
        **kwargs: Any) -> BlockModel:
    _no_extra("cnn", kwargs)
    s = _conv_out(_conv_out(image_size, 5, 2, 2), 5, 2, 2)
    return BlockModel([
        ("conv1", nn.Sequential(nn.Conv2d(in_channels, width, 5, stride=2, padding=2), nn.ReLU())),
        ("conv2", nn.Sequential(nn.Conv2d(width, 2 * width, 5, stride=2, padding=2), nn.ReLU())),
        ("fc1", nn.Sequential(Flatten(), nn.Linear(2 * width * s * s, hidden), nn.ReLU())),
        ("fc2", nn.Sequential(nn.Linear(hidden, hidden // 2), nn.ReLU())),
        ("head", nn.Linear(hidden // 2, num_classes)),
    ])


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: str, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.n1 = _norm(norm, cout, groups)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.n2 = _norm(norm, cout, groups)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                          _norm(norm, cout, groups))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.n1(self.conv1(x)))
        out = self.n2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


@register_model("resnet18-gn", description="ResNet-18, GroupNorm, CIFAR-style 3x3 stem (6 blocks)")
def resnet18_gn(*, num_classes: int, in_channels: int, image_size: int, width: int = 64, groups: int = 2,
                norm: str = "group", **kwargs: Any) -> BlockModel:
    _no_extra("resnet18-gn", kwargs)
    blocks: list[tuple[str, nn.Module]] = [
        ("stem", nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
                               _norm(norm, width, groups), nn.ReLU())),
    ]
    cin = width
    for i, mult in enumerate((1, 2, 4, 8), start=1):
        cout, stride = width * mult, (1 if i == 1 else 2)
        blocks.append((f"layer{i}", nn.Sequential(BasicBlock(cin, cout, stride, norm, groups),
                                                  BasicBlock(cout, cout, 1, norm, groups))))
        cin = cout
    blocks.append(("head", nn.Sequential(SpatialMean(), nn.Linear(cin, num_classes))))
    return BlockModel(blocks)


# (output channels, stride) of MobileNet-v1's 13 depthwise-separable units
_MOBILENET_UNITS = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2),
                    (512, 1), (512, 1), (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1)]


@register_model("mobilenet-v1", description="MobileNet-v1 with width multiplier (15 blocks: stem, dw1..dw13, head)")
def mobilenet_v1(*, num_classes: int, in_channels: int, image_size: int, width_mult: float = 1.0,
                 groups: int = 2, norm: str = "group", **kwargs: Any) -> BlockModel:
    _no_extra("mobilenet-v1", kwargs)
    if not 0 < width_mult <= 4:
        raise ConfigError(f"width_mult must be in (0, 4], got {width_mult}")

    def ch(c: int) -> int:
        return max(8, int(c * width_mult + 4) // 8 * 8)  # multiples of 8, as in the reference implementations

    # Small images (CIFAR, MNIST): a stride-1 stem, as in the CIFAR variants of MobileNet.
    stem_stride = 1 if image_size <= 64 else 2
    cin = ch(32)
    blocks: list[tuple[str, nn.Module]] = [
        ("stem", nn.Sequential(nn.Conv2d(in_channels, cin, 3, stride=stem_stride, padding=1, bias=False),
                               _norm(norm, cin, groups), nn.ReLU())),
    ]
    for i, (c, stride) in enumerate(_MOBILENET_UNITS, start=1):
        cout = ch(c)
        blocks.append((f"dw{i}", nn.Sequential(
            nn.Conv2d(cin, cin, 3, stride=stride, padding=1, groups=cin, bias=False),
            _norm(norm, cin, groups), nn.ReLU(),
            nn.Conv2d(cin, cout, 1, bias=False), _norm(norm, cout, groups), nn.ReLU())))
        cin = cout
    blocks.append(("head", nn.Sequential(SpatialMean(), nn.Linear(cin, num_classes))))
    return BlockModel(blocks)


def _no_extra(name: str, kwargs: dict[str, Any]) -> None:
    if kwargs:
        raise ConfigError(f"model {name!r} got unknown options {sorted(kwargs)}")
