"""Data set registry: ``list_datasets()``, ``get_dataset(name, data_dir=...)``, ``@register_dataset``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import ConfigError, DataError, UnknownNameError

__all__ = ["Dataset", "DatasetLoader", "get_dataset", "list_datasets", "register_dataset"]


@dataclass(frozen=True, eq=False)
class Dataset:
    """Images as normalised float32 ``(N, C, H, W)``, labels as int64 ``(N,)``, a train and a test split."""

    name: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    num_classes: int

    def __post_init__(self) -> None:
        for split, x, y in (("train", self.train_x, self.train_y), ("test", self.test_x, self.test_y)):
            if x.dim() != 4 or x.dtype != torch.float32:
                raise DataError(f"{self.name}: {split} images must be float32 (N, C, H, W), got "
                                f"{x.dtype} {tuple(x.shape)}")
            if y.shape != (x.shape[0],) or y.dtype != torch.int64:
                raise DataError(f"{self.name}: {split} labels must be int64 of length {x.shape[0]}")
            if y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
                raise DataError(f"{self.name}: {split} labels outside [0, {self.num_classes})")
        if self.train_x.shape[1:] != self.test_x.shape[1:]:
            raise DataError(f"{self.name}: train and test images differ in shape")
        if self.train_x.shape[2] != self.train_x.shape[3]:
            raise DataError(f"{self.name}: images must be square, got {tuple(self.train_x.shape[2:])}")

    @property
    def in_channels(self) -> int:
        return int(self.train_x.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.train_x.shape[2])


DatasetLoader = Callable[[Path | None], Dataset]
_DATASETS: dict[str, DatasetLoader] = {}


def register_dataset(name: str) -> Callable[[DatasetLoader], DatasetLoader]:
    """Register ``loader(data_dir: Path | None) -> Dataset``; raise ``DataError`` when files are missing."""

    def deco(loader: DatasetLoader) -> DatasetLoader:
        if name in _DATASETS:
            raise ConfigError(f"data set {name!r} is already registered")
        _DATASETS[name] = loader
        return loader

    return deco


def list_datasets() -> list[str]:
    return sorted(_DATASETS)


def get_dataset(name: str, *, data_dir: str | Path | None = None) -> Dataset:
    """Load (once per process; later calls share the tensors, which nobody may modify)."""
    if name not in _DATASETS:
        raise UnknownNameError("data set", name, list_datasets())
    return _load(name, None if data_dir is None else Path(data_dir).expanduser().resolve())


@functools.lru_cache(maxsize=4)
def _load(name: str, data_dir: Path | None) -> Dataset:
    return _DATASETS[name](data_dir)
