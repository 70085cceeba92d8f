"""Data set registry: ``list_datasets()``, ``get_dataset(name, data_dir=...)``, ``get_arrays(name, ...)``,
``get_labels(name, ...)``, ``@register_dataset``.

A data set exists in two forms sharing one memory: ``DatasetArrays`` (numpy, what a device without PyTorch
trains on) and ``Dataset`` (torch tensors made from those arrays by ``torch.from_numpy``, no copy). A loader
returns either; the built-in ones that need no torch (Fashion-MNIST, CIFAR-10) return arrays, so both forms
hold the very same bits. ``get_arrays`` works without torch installed for those.

``get_labels`` is what a coordinator needs to deal a federation's data without holding it: the labels of both
splits and the images' shape. A data set registers a loader of its own for them where its files allow reading
the labels without the images (Fashion-MNIST's label files); otherwise they are taken from the full load."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from ..errors import ConfigError, DataError, UnknownNameError

if TYPE_CHECKING:  # torch is imported where a tensor is made: pfl_edge.data imports without it
    from torch import Tensor

__all__ = ["Dataset", "DatasetArrays", "DatasetLoader", "InputShape", "Labels", "LabelsLoader", "get_arrays",
           "get_dataset", "get_labels", "get_shape", "list_datasets", "register_dataset"]


class ImageShape:
    """What a model's input shape is read from: the training images ``(N, C, H, W)`` (square)."""

    train_x: Any

    @property
    def in_channels(self) -> int:
        return int(self.train_x.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.train_x.shape[2])


def _check(name: str, d: Dataset | DatasetArrays, float32: Any, int64: Any) -> None:
    """One set of checks for both forms (numpy arrays and torch tensors answer the same questions)."""
    for split, x, y in (("train", d.train_x, d.train_y), ("test", d.test_x, d.test_y)):
        if x.ndim != 4 or x.dtype != float32:
            raise DataError(f"{name}: {split} images must be float32 (N, C, H, W), got {x.dtype} {tuple(x.shape)}")
        if tuple(y.shape) != (x.shape[0],) or y.dtype != int64:
            raise DataError(f"{name}: {split} labels must be int64 of length {x.shape[0]}")
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= d.num_classes):
            raise DataError(f"{name}: {split} labels outside [0, {d.num_classes})")
    if tuple(d.train_x.shape[1:]) != tuple(d.test_x.shape[1:]):
        raise DataError(f"{name}: train and test images differ in shape")
    if d.train_x.shape[2] != d.train_x.shape[3]:
        raise DataError(f"{name}: images must be square, got {tuple(d.train_x.shape[2:])}")


@dataclass(frozen=True, eq=False)
class DatasetArrays(ImageShape):
    """A data set as numpy arrays: images normalised float32 ``(N, C, H, W)``, labels int64 ``(N,)``, a train and
    a test split. What ``Dataset``'s tensors are made from where the loader needs no torch."""

    name: str
    train_x: NDArray[np.float32]
    train_y: NDArray[np.int64]
    test_x: NDArray[np.float32]
    test_y: NDArray[np.int64]
    num_classes: int

    def __post_init__(self) -> None:
        _check(self.name, self, np.float32, np.int64)


@dataclass(frozen=True, eq=False)
class Dataset(ImageShape):
    """Images as normalised float32 ``(N, C, H, W)``, labels as int64 ``(N,)``, a train and a test split."""

    name: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    num_classes: int

    def __post_init__(self) -> None:
        import torch

        _check(self.name, self, torch.float32, torch.int64)

    @staticmethod
    def of(a: DatasetArrays) -> Dataset:
        """The arrays as tensors, sharing their memory (``torch.from_numpy``: not a copy, the same bits)."""
        import torch

        return Dataset(a.name, torch.from_numpy(a.train_x), torch.from_numpy(a.train_y), torch.from_numpy(a.test_x),
                       torch.from_numpy(a.test_y), a.num_classes)

    def arrays(self) -> DatasetArrays:
        """The tensors as numpy arrays, sharing their memory."""
        return DatasetArrays(self.name, self.train_x.numpy(), self.train_y.numpy(), self.test_x.numpy(),
                             self.test_y.numpy(), self.num_classes)


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


@dataclass(frozen=True)
class InputShape:
    """What a model trained on a data set takes and predicts: ``(channels, size, size)`` images, ``num_classes``
    labels. Declared where the data set is registered, so that a federation whose devices bring their own data
    builds its model without the data set's files (on the server, and on a phone)."""

    in_channels: int
    image_size: int
    num_classes: int


DatasetLoader = Callable[[Path | None], Dataset | DatasetArrays]
LabelsLoader = Callable[[Path | None], Labels]
_DATASETS: dict[str, DatasetLoader] = {}
_LABELS: dict[str, LabelsLoader] = {}
_SHAPES: dict[str, InputShape] = {}


def register_dataset(name: str, *, labels: LabelsLoader | None = None,
                     shape: InputShape | None = None) -> Callable[[DatasetLoader], DatasetLoader]:
    """Register ``loader(data_dir: Path | None) -> Dataset | DatasetArrays`` (raise ``DataError`` when files are
    missing; return ``DatasetArrays`` where the data set needs no torch, so that a device without it can load
    it) and, where its files allow, ``labels(data_dir) -> Labels`` reading no image; it must give what the full
    load gives (tests/pfl_edge/test_data.py holds every data set to it). ``shape``: its images' shape and class
    count, known without its files (``get_shape``); every load is checked against it."""

    def deco(loader: DatasetLoader) -> DatasetLoader:
        if name in _DATASETS:
            raise ConfigError(f"data set {name!r} is already registered")
        _DATASETS[name] = loader
        if labels is not None:
            _LABELS[name] = labels
        if shape is not None:
            _SHAPES[name] = shape
        return loader

    return deco


def get_shape(name: str, *, data_dir: str | Path | None = None) -> InputShape:
    """The data set's input shape and class count: as registered (no file read), else from its labels."""
    key = _key(name, data_dir)
    if name in _SHAPES:
        return _SHAPES[name]
    lab = _load_labels(*key)
    return InputShape(lab.in_channels, lab.image_size, lab.num_classes)


def _declared(name: str, d: Dataset | DatasetArrays | Labels) -> None:
    """A load against the shape its data set declared: one definition, checked wherever it is read."""
    want = _SHAPES.get(name)
    if want is not None and want != InputShape(d.in_channels, d.image_size, d.num_classes):
        raise DataError(f"{name}: loaded {d.in_channels}x{d.image_size}x{d.image_size} images of {d.num_classes} "
                        f"classes, but it was registered as {want}")


def list_datasets() -> list[str]:
    return sorted(_DATASETS)


def _key(name: str, data_dir: str | Path | None) -> tuple[str, Path | None]:
    if name not in _DATASETS:
        raise UnknownNameError("data set", name, list_datasets())
    return name, None if data_dir is None else Path(data_dir).expanduser().resolve()


def get_dataset(name: str, *, data_dir: str | Path | None = None) -> Dataset:
    """Load (once per process; later calls share the tensors, which nobody may modify)."""
    return _load_tensors(*_key(name, data_dir))


def get_arrays(name: str, *, data_dir: str | Path | None = None) -> DatasetArrays:
    """The data set as numpy arrays: the memory ``get_dataset``'s tensors share, so the same bits. Needs no
    torch for a data set whose loader returns arrays (every built-in one: Fashion-MNIST, CIFAR-10, synthetic); a
    registered one generated with torch is a ``DataError`` where torch is not installed. Loaded once per
    process, like ``get_dataset``; nobody may modify the arrays."""
    key = _key(name, data_dir)
    try:
        got = _load(*key)
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise DataError(f"data set {name!r} is made with PyTorch, which is not installed here; a device without "
                        "it can load only the data sets read from files (e.g. fashion-mnist, cifar10)") from e
    return got if isinstance(got, DatasetArrays) else got.arrays()


def get_labels(name: str, *, data_dir: str | Path | None = None) -> Labels:
    """The data set's labels and shape, without its images where it registered a labels loader."""
    return _load_labels(*_key(name, data_dir))


@functools.lru_cache(maxsize=4)
def _load(name: str, data_dir: Path | None) -> Dataset | DatasetArrays:
    got = _DATASETS[name](data_dir)
    _declared(name, got)
    return got


@functools.lru_cache(maxsize=4)
def _load_tensors(name: str, data_dir: Path | None) -> Dataset:
    got = _load(name, data_dir)
    return got if isinstance(got, Dataset) else Dataset.of(got)


@functools.lru_cache(maxsize=16)
def _load_labels(name: str, data_dir: Path | None) -> Labels:
    own = _LABELS.get(name)
    got = own(data_dir) if own is not None else Labels.of(_load_tensors(name, data_dir))
    _declared(name, got)
    return got
