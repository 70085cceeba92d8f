"""The server coordinates a federation without its images: the model's spec, shapes and the sample cap come from
the data set's labels and the model (``deal_labels``), whatever the images hold or whether they are there."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from pfl_edge.federation import FederationConfig, deal
from server.fedmodel import fed_model

FMNIST = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.needs_fmnist
def test_a_federations_model_needs_the_labels_not_the_images(tmp_path: Path) -> None:
    d = tmp_path / "labels-only"
    d.mkdir()
    for name in ("train-labels-idx1-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (d / name).symlink_to(FMNIST / name)
    with gzip.open(d / "train-images-idx3-ubyte.gz", "wb") as f:  # the header alone: no image can be loaded
        f.write(b"\x00\x00\x08\x03" + (60000).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2)
    config = dict(algorithm="fedper", dataset="fashion-mnist", partition="preference", clients=12, kp=1,
                  model="cnn", seed=4, data_dir=str(d))
    fm = fed_model(config)
    _, part, spec = deal(FederationConfig.from_dict({**config, "data_dir": str(FMNIST)}))
    assert fm.spec == spec and fm.spec.num_classes == 5  # the preference task's ratings, from the deal
    assert fm.largest_share == max(len(c.train_idx) for c in part.clients) > 0
