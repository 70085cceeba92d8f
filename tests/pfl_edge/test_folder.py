"""A device's own labelled images (pfl-edge client --data-dir)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pfl_edge.data.folder import read_image_folder
from pfl_edge.errors import DataError


def _write(root: Path, label: str, n: int, value: int) -> None:
    (root / label).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.fromarray(np.full((40, 40, 3), value + i, dtype=np.uint8)).save(root / label / f"{i}.png")


def test_reads_classes_resizes_and_standardises(tmp_path: Path) -> None:
    _write(tmp_path, "0", 3, 10)
    _write(tmp_path, "2", 2, 200)
    (tmp_path / "2" / "notes.txt").write_text("ignored: not an image")
    x, y = read_image_folder(tmp_path, 1, 28, 10)
    assert x.shape == (5, 1, 28, 28) and x.dtype == torch.float32
    assert y.tolist() == [0, 0, 0, 2, 2]  # numeric folder names are the class indices
    assert abs(float(x.mean())) < 1e-5 and abs(float(x.std()) - 1) < 0.05
    assert float(x[3].mean()) > float(x[0].mean())  # brighter images stay brighter


def test_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not a folder"):
        read_image_folder(tmp_path / "missing", 1, 28, 10)
    with pytest.raises(DataError, match="no class folders"):
        read_image_folder(tmp_path, 1, 28, 10)
    _write(tmp_path, "12", 1, 0)
    with pytest.raises(DataError, match="has 10"):
        read_image_folder(tmp_path, 1, 28, 10)
    bad = tmp_path / "b"
    (bad / "0").mkdir(parents=True)
    (bad / "0" / "x.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match="cannot read image"):
        read_image_folder(bad, 1, 28, 10)
