"""The user's own labelled images: ``ROOT/<class>/<image>``, one sub-folder per class."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from ..errors import DataError

if TYPE_CHECKING:  # torch is imported where a tensor is made: pfl_edge.data imports without it
    from torch import Tensor

__all__ = ["read_image_folder", "read_image_folder_arrays"]

_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".pgm", ".ppm"}


def read_image_folder(root: str | Path, channels: int, size: int, num_classes: int) -> tuple[Tensor, Tensor]:
    """``read_image_folder_arrays`` as tensors (the same memory)."""
    import torch

    x, y = read_image_folder_arrays(root, channels, size, num_classes)
    return torch.from_numpy(x), torch.from_numpy(y)


def read_image_folder_arrays(root: str | Path, channels: int, size: int,
                             num_classes: int) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
    """Images as float32 ``(N, channels, size, size)``, standardised over the folder (zero mean, unit variance
    per channel), and int64 labels; numpy and Pillow only (a device without torch reads its own images too).
    Class folders named ``0``..``C-1`` are those classes; otherwise the sorted folder names are classes 0, 1, ...
    Unreadable files are an error naming the file."""
    from PIL import Image, UnidentifiedImageError

    base = Path(root)
    if not base.is_dir():
        raise DataError(f"--data-dir {base} is not a folder of class folders")
    folders = sorted(p for p in base.iterdir() if p.is_dir())
    if not folders:
        raise DataError(f"{base} has no class folders (expected {base}/<class>/<image>.png)")
    numeric = all(p.name.isdigit() for p in folders)
    labels = [int(p.name) if numeric else i for i, p in enumerate(folders)]
    if max(labels) >= num_classes:
        raise DataError(f"{base}: {len(folders)} classes (largest label {max(labels)}) but the federation's model "
                        f"has {num_classes}")
    xs: list[np.ndarray] = []
    ys: list[int] = []
    mode = "L" if channels == 1 else "RGB"
    for folder, label in zip(folders, labels, strict=True):
        for f in sorted(folder.iterdir()):
            if f.suffix.lower() not in _SUFFIXES:
                continue
            try:
                with Image.open(f) as im:
                    arr = np.asarray(im.convert(mode).resize((size, size)), dtype=np.float32) / 255.0
            except (OSError, UnidentifiedImageError) as e:
                raise DataError(f"cannot read image {f}: {e}") from None
            xs.append(arr[None] if channels == 1 else arr.transpose(2, 0, 1))
            ys.append(label)
    if not xs:
        raise DataError(f"{base}: no images ({', '.join(sorted(_SUFFIXES))}) in its class folders")
    x = np.stack(xs)
    mean = x.mean(axis=(0, 2, 3), keepdims=True, dtype=np.float64)
    std = np.maximum(x.std(axis=(0, 2, 3), keepdims=True, ddof=1 if len(x) > 1 else 0, dtype=np.float64), 1e-6)
    return np.ascontiguousarray((x - mean) / std, dtype=np.float32), np.asarray(ys, dtype=np.int64)
