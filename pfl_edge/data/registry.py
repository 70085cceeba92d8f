"""Data set registry: ``list_datasets()``, ``get_dataset(name, data_dir=...)``, ``get_labels(name, ...)``,
``@register_dataset``.

``get_labels`` is what a coordinator needs to deal a federation's data without holding it: the labels of both
splits and the images' shape. A data set registers a loader of its own for them where its files allow reading
the labels without the images (Fashion-MNIST's label files); otherwise they are taken from the full load."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import ConfigError, DataError, UnknownNameError

__all__ = ["Dataset", "DatasetLoader", "Labels", "LabelsLoader", "get_dataset", "get_labels", "list_datasets",
           "register_dataset"]


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


@dataclass(frozen=True, eq=False)
class Labels:
    """A data set without its images: the labels of both splits (int64), the class count and the images' shape."""

    name: str
    train_y: Tensor
    test_y: Tensor
    num_classes: int
    in_channels: int
    image_size: int

    @staticmethod
    def of(ds: Dataset) -> Labels:
        return Labels(ds.name, ds.train_y, ds.test_y, ds.num_classes, ds.in_channels, ds.image_size)


DatasetLoader = Callable[[Path | None], Dataset]
LabelsLoader = Callable[[Path | None], Labels]
_DATASETS: dict[str, DatasetLoader] = {}
_LABELS: dict[str, LabelsLoader] = {}


def register_dataset(name: str, *, labels: LabelsLoader | None = None) -> Callable[[DatasetLoader], DatasetLoader]:
    """Register ``loader(data_dir: Path | None) -> Dataset`` (raise ``DataError`` when files are missing) and,
    where its files allow, ``labels(data_dir) -> Labels`` reading no image; it must give what the full load
    gives (tests/pfl_edge/test_data.py holds every data set to it)."""

    def deco(loader: DatasetLoader) -> DatasetLoader:
        if name in _DATASETS:
            raise ConfigError(f"data set {name!r} is already registered")
        _DATASETS[name] = loader
        if labels is not None:
            _LABELS[name] = labels
        return loader

    return deco


def list_datasets() -> list[str]:
    return sorted(_DATASETS)


def get_dataset(name: str, *, data_dir: str | Path | None = None) -> Dataset:
    """Load (once per process; later calls share the tensors, which nobody may modify)."""
    if name not in _DATASETS:
        raise UnknownNameError("data set", name, list_datasets())
    return _load(name, None if data_dir is None else Path(data_dir).expanduser().resolve())


def get_labels(name: str, *, data_dir: str | Path | None = None) -> Labels:
    """The data set's labels and shape, without its images where it registered a labels loader."""
    if name not in _DATASETS:
        raise UnknownNameError("data set", name, list_datasets())
    return _load_labels(name, None if data_dir is None else Path(data_dir).expanduser().resolve())


@functools.lru_cache(maxsize=4)
def _load(name: str, data_dir: Path | None) -> Dataset:
    return _DATASETS[name](data_dir)


@functools.lru_cache(maxsize=16)
def _load_labels(name: str, data_dir: Path | None) -> Labels:
    own = _LABELS.get(name)
    return own(data_dir) if own is not None else Labels.of(_load(name, data_dir))
