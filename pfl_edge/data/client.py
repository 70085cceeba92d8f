"""One client's data as numpy arrays: what a device without PyTorch trains on.

``client_arrays`` deals a registered data set exactly as ``partition`` (and so ``pfl_edge.federation.deal``)
deals it, with the same numpy generator, and takes the client's samples from the arrays ``get_dataset``'s tensors
share: the same samples, in the same order, with the same float32 bits as the torch path gives."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from ..errors import ConfigError
from .partition import partition_arrays
from .registry import ImageShape, get_arrays

__all__ = ["ClientArrays", "client_arrays"]


@dataclass(frozen=True, eq=False)
class ClientArrays(ImageShape):
    """One client's train and test samples: images normalised float32 ``(N, C, H, W)``, labels int64 ``(N,)``
    (the labels this client sees: the preference task's ratings where its partition maps them)."""

    train_x: NDArray[np.float32]
    train_y: NDArray[np.int64]
    test_x: NDArray[np.float32]
    test_y: NDArray[np.int64]
    num_classes: int  # what the model predicts (the partition's: 5 for the preference task)
    label_map: tuple[int, ...] | None = None  # preference: class -> rating

    @property
    def n_train(self) -> int:
        return len(self.train_y)

    @property
    def n_test(self) -> int:
        return len(self.test_y)


def client_arrays(
    dataset: str,
    spec: str,
    num_clients: int,
    index: int,
    rng: np.random.Generator,
    *,
    data_dir: str | Path | None = None,
    samples_per_client: int | None = None,
    test_per_client: int | None = None,
    test_draw: str | None = None,
) -> ClientArrays:
    """Client ``index``'s data when ``dataset`` is dealt to ``num_clients`` by partition ``spec`` with ``rng``
    (the federation's: ``pfl_edge.seeding.numpy_rng(cfg.seed, Stream.PARTITION.value)``, a fresh one per
    call, as ``pfl_edge.federation.deal`` draws it). The whole federation is dealt (each client's share depends
    on the draws for the others) but only this client's samples are gathered. Needs no torch for a data set
    read from files (``get_arrays``)."""
    if not 0 <= index < num_clients:
        raise ConfigError(f"partition index {index} out of range for {num_clients} partitions")
    ds = get_arrays(dataset, data_dir=data_dir)
    part = partition_arrays(spec, ds.train_y, ds.test_y, num_clients, ds.num_classes, rng,
                            samples_per_client=samples_per_client, test_per_client=test_per_client,
                            test_draw=test_draw)
    c = part.clients[index]
    return ClientArrays(ds.train_x[c.train_idx], c.train_y, ds.test_x[c.test_idx], c.test_y, part.num_classes,
                        None if part.label_maps is None else part.label_maps[index])
