"""Built-in data sets: Fashion-MNIST (Debian's package), CIFAR-10 (python batches), a synthetic one."""

from __future__ import annotations

import gzip
import io
import pickle
import zlib
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from ..errors import DataError
from .registry import DatasetArrays, InputShape, Labels, register_dataset
from .synthetic import make_synthetic, make_synthetic_labels

__all__ = ["FASHION_MNIST_DIRS", "load_idx", "normalise"]

FASHION_MNIST_DIRS = (Path("/usr/share/datasets/fashion-mnist"),)
FASHION_MNIST_HINT = (
    "Fashion-MNIST not found. On Debian/Ubuntu: sudo apt-get update && sudo apt-get install -y "
    "dataset-fashion-mnist (installs /usr/share/datasets/fashion-mnist), or name the folder with the four "
    "files train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, "
    "t10k-labels-idx1-ubyte.gz (pfl-edge simulate/demo: --data-dir; pfl-edge client: --dataset-dir)."
)


def load_idx(path: Path) -> np.ndarray:
    """Read a (gzipped) IDX file of unsigned bytes: magic 0x0000_08_NN, NN dims, big-endian sizes, then data."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as e:  # missing, truncated or corrupt gzip
        raise DataError(f"cannot read {path}: {e}") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path} is not an IDX file of unsigned bytes")
    ndim = raw[3]
    header = 4 + 4 * ndim
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    if len(raw) != header + int(np.prod(dims)):
        raise DataError(f"{path}: size {len(raw)} does not match its header {dims}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def normalise(images: np.ndarray, mean: list[float], std: list[float]) -> NDArray[np.float32]:
    """8-bit pixels ``(N, C, H, W)`` as model inputs: ``(x / 255 - mean) / std`` per channel, every step in float32
    (mean and std rounded to float32 first), the one definition both the numpy and the torch forms of a data set
    hold. Bit for bit what torch gives for ``x.float().div_(255.0)``, then ``(x - mean) / std`` with float32
    tensors (true division, not a multiplication by the reciprocal): tests/pfl_edge/test_data_numpy.py."""
    x = images.astype(np.float32, order="C")  # a C-contiguous copy; the steps below work in place on it
    x /= np.float32(255.0)
    x -= np.asarray(mean, dtype=np.float32).reshape(1, -1, 1, 1)
    x /= np.asarray(std, dtype=np.float32).reshape(1, -1, 1, 1)
    return x


def _fashion_mnist_dir(data_dir: Path | None) -> Path:
    for d in (data_dir,) if data_dir is not None else FASHION_MNIST_DIRS:
        if (d / "train-images-idx3-ubyte.gz").exists():
            return d
    raise DataError(FASHION_MNIST_HINT)


def _idx_shape(path: Path) -> list[int]:
    """The dimensions in an IDX file's header (its first bytes only: the images need not be read)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            head = f.read(4)
            if len(head) < 4 or head[:3] != b"\x00\x00\x08":
                raise DataError(f"{path} is not an IDX file of unsigned bytes")
            dims = f.read(4 * head[3])
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read {path}: {e}") from e
    return [int.from_bytes(dims[4 * i: 4 * i + 4], "big") for i in range(len(dims) // 4)]


def fashion_mnist_labels(data_dir: Path | None) -> Labels:
    """Both label files and the images' shape from the train images' header: ~70 KB read, not 30 MB."""
    import torch

    d = _fashion_mnist_dir(data_dir)
    ys = [torch.from_numpy(load_idx(d / f"{p}-labels-idx1-ubyte.gz").astype(np.int64)) for p in ("train", "t10k")]
    dims = _idx_shape(d / "train-images-idx3-ubyte.gz")
    if len(dims) != 3 or dims[0] != len(ys[0]) or dims[1] != dims[2]:
        raise DataError(f"{d}: train images {dims} and {len(ys[0])} labels do not match")
    if any(y.numel() and (int(y.min()) < 0 or int(y.max()) >= 10) for y in ys):
        raise DataError(f"{d}: labels outside [0, 10)")
    return Labels("fashion-mnist", ys[0], ys[1], num_classes=10, in_channels=1, image_size=dims[1])


@register_dataset("fashion-mnist", labels=fashion_mnist_labels, shape=InputShape(1, 28, 10))
def fashion_mnist(data_dir: Path | None) -> DatasetArrays:
    d = _fashion_mnist_dir(data_dir)

    def part(prefix: str) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
        imgs = load_idx(d / f"{prefix}-images-idx3-ubyte.gz")
        labels = load_idx(d / f"{prefix}-labels-idx1-ubyte.gz")
        if imgs.ndim != 3 or labels.shape != (imgs.shape[0],):
            raise DataError(f"{d}: {prefix} images {imgs.shape} and labels {labels.shape} do not match")
        return normalise(imgs[:, None], [0.2860], [0.3530]), labels.astype(np.int64)

    train_x, train_y = part("train")
    test_x, test_y = part("t10k")
    return DatasetArrays("fashion-mnist", train_x, train_y, test_x, test_y, num_classes=10)


class _ArraysOnly(pickle.Unpickler):
    """CIFAR's python batches are pickles. Even from a local folder, allow only what they contain: numpy
    arrays and plain containers; anything else (an arbitrary callable) is refused."""

    _ALLOWED: ClassVar[set[tuple[str, str]]] = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise DataError(f"refusing to unpickle {module}.{name}: not a CIFAR batch")
        return super().find_class(module, name)


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        obj = _ArraysOnly(io.BytesIO(path.read_bytes()), encoding="bytes").load()
    except DataError:
        raise
    except Exception as e:  # a truncated or foreign file: say which
        raise DataError(f"{path} is not a CIFAR-10 python batch: {e}") from e
    if not isinstance(obj, dict):
        raise DataError(f"{path} is not a CIFAR-10 python batch (no dict)")
    data = obj.get(b"data", obj.get("data"))
    labels = obj.get(b"labels", obj.get("labels"))
    if not isinstance(data, np.ndarray) or labels is None:
        raise DataError(f"{path} has no 'data' array and 'labels'")
    data = np.asarray(data, dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != data.shape[0]:
        raise DataError(f"{path}: data {data.shape} and {len(labels)} labels are not CIFAR-10's (N, 3072)")
    return data.reshape(-1, 3, 32, 32), np.asarray(labels, dtype=np.int64)


@register_dataset("cifar10", shape=InputShape(3, 32, 10))
def cifar10(data_dir: Path | None) -> DatasetArrays:
    if data_dir is None:
        raise DataError("cifar10 needs --data-dir: the folder with data_batch_1..5 and test_batch "
                        "(cifar-10-batches-py from https://www.cs.toronto.edu/~kriz/cifar.html)")
    d = data_dir / "cifar-10-batches-py" if (data_dir / "cifar-10-batches-py").is_dir() else data_dir
    train = sorted(d.glob("data_batch_*"))
    if not train or not (d / "test_batch").exists():
        raise DataError(f"{d} has no data_batch_* and test_batch files (CIFAR-10 python version)")
    parts = [_cifar_batch(p) for p in train]
    te_x, te_y = _cifar_batch(d / "test_batch")
    mean, std = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]
    return DatasetArrays(
        "cifar10",
        normalise(np.concatenate([p[0] for p in parts]), mean, std),
        np.concatenate([p[1] for p in parts]),
        normalise(te_x, mean, std),
        te_y,
        num_classes=10,
    )


def synthetic_labels(data_dir: Path | None) -> Labels:
    """The synthetic set's labels alone (``make_synthetic_labels``): a server deals from them in milliseconds."""
    import torch

    train_y, test_y = make_synthetic_labels()
    return Labels("synthetic", torch.from_numpy(train_y), torch.from_numpy(test_y), num_classes=10, in_channels=1,
                  image_size=28)


@register_dataset("synthetic", labels=synthetic_labels, shape=InputShape(1, 28, 10))
def synthetic(data_dir: Path | None) -> DatasetArrays:
    """10 classes of 1x28x28 inputs: a fixed random smooth prototype per class plus noise. Learnable in a few
    hundred steps; for tests and quick runs. Always the same data, made without torch or numpy's samplers
    (pfl_edge.data.synthetic: the arithmetic docs/determinism.md gives, which the JavaScript device repeats)."""
    train_x, train_y, test_x, test_y = make_synthetic()
    return DatasetArrays("synthetic", train_x, train_y, test_x, test_y, num_classes=10)
