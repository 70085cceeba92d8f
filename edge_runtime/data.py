"""A device's own data: its partition of a registered data set (dealt exactly as the simulator deals it), or the
user's own labelled images; and the model it trains."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pfl_edge.checkpoint import ModelSpec
from pfl_edge.data import ClientArrays
from pfl_edge.errors import ConfigError
from pfl_edge.federation import FederationConfig, deal_arrays, model_spec

if TYPE_CHECKING:  # the torch device's data; a device without torch holds ArrayData
    from torch import Tensor

    from pfl_edge.models import BlockModel
    from pfl_edge.train import ClientTensors

    from .config import AgentConfig

__all__ = ["ArrayData", "LocalData", "device_data", "load_image_folder", "load_local_arrays", "load_local_data"]

log = logging.getLogger("pfl_edge.client")


@dataclass(frozen=True, eq=False)
class LocalData:
    """A device's training and test data (stacks of one client) and the model it trains."""

    train: ClientTensors
    test: ClientTensors
    spec: ModelSpec
    model: BlockModel

    @property
    def n_train(self) -> int:
        return int(self.train.n[0])

    @property
    def n_test(self) -> int:
        return int(self.test.n[0])

    @property
    def xy(self) -> tuple[Tensor, Tensor]:
        """Its training samples and labels, unpadded."""
        n = self.n_train
        return self.train.take(0, slice(0, n)), self.train.y[0, :n]


@dataclass(frozen=True, eq=False)
class ArrayData:
    """A device's training and test data as numpy arrays (a device without torch: ``pfl_edge.data.ClientArrays``)
    and its model's spec; the model itself is the server's card (``pfl_edge.skeleton``) and programs."""

    arrays: ClientArrays
    spec: ModelSpec

    @property
    def n_train(self) -> int:
        return self.arrays.n_train

    @property
    def n_test(self) -> int:
        return self.arrays.n_test

    @property
    def xy(self) -> tuple[np.ndarray, np.ndarray]:
        return self.arrays.train_x, self.arrays.train_y


def _check_index(cfg: FederationConfig, index: int) -> None:
    if cfg.own_data:
        raise ConfigError("this federation's devices bring their own data (partition 'device'): start the client "
                          "with --data-dir FOLDER, one sub-folder of images per class")
    if not 0 <= index < cfg.clients:
        raise ConfigError(f"partition index {index} out of range for {cfg.clients} partitions")


def load_local_arrays(cfg: FederationConfig, index: int, *, data_dir: str | None = None) -> ArrayData:
    """Partition ``index`` of ``cfg``'s data set as numpy arrays: the very samples, in the same order and with the
    same values, as ``load_local_data`` (``pfl_edge.data.client_arrays``)."""
    _check_index(cfg, index)
    c = deal_arrays(cfg, index, data_dir=data_dir)
    return ArrayData(c, model_spec(cfg, c.num_classes, c.in_channels, c.image_size))


def load_local_data(cfg: FederationConfig, index: int, *, data_dir: str | None = None) -> LocalData:
    """Partition ``index`` of ``cfg``'s data set, dealt exactly as the simulator deals it."""
    from pfl_edge.checkpoint import build_model
    from pfl_edge.federation import deal
    from pfl_edge.train import ClientTensors

    _check_index(cfg, index)
    ds, part, spec = deal(cfg, data_dir=data_dir)
    c = part.clients[index]
    return LocalData(ClientTensors.build(ds.train_x, [c.train_idx], [c.train_y]),
                     ClientTensors.build(ds.test_x, [c.test_idx], [c.test_y]), spec, build_model(spec))


def load_image_folder(root: str, cfg: FederationConfig, *, slot: int, arrays: str = "torch",
                      test_fraction: float = 0.2) -> LocalData | ArrayData:
    """The user's own labelled images: one sub-folder per class, named by the class index (``0``, ``1``, ...)
    or by the class's position in the sorted folder names. Images are converted to the federation's model
    input (its data set's registered shape: the data set's files are not needed) and standardised over the
    folder; ``test_fraction`` of each class is held out (drawn from the config's seed and the device's slot).
    ``arrays``: "numpy" for a device without torch (``ArrayData``), else ``LocalData``."""
    from pfl_edge.data import get_shape
    from pfl_edge.data.folder import read_image_folder_arrays
    from pfl_edge.seeding import Stream, numpy_rng

    shape = get_shape(cfg.dataset, data_dir=cfg.data_dir)
    x, y = read_image_folder_arrays(root, shape.in_channels, shape.image_size, shape.num_classes)
    rng = numpy_rng(cfg.seed, Stream.HOLDOUT.value, slot)
    test_idx: list[np.ndarray] = []
    train_idx: list[np.ndarray] = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        k = round(test_fraction * len(idx))
        test_idx.append(idx[:k])
        train_idx.append(idx[k:])
    tr, te = np.concatenate(train_idx), np.concatenate(test_idx)
    if len(tr) == 0:
        raise ConfigError(f"{root}: no training images left after holding out {test_fraction:.0%} for testing")
    spec = model_spec(cfg, shape.num_classes, shape.in_channels, shape.image_size)
    if arrays == "numpy":
        return ArrayData(ClientArrays(x[tr], y[tr], x[te], y[te], shape.num_classes), spec)
    import torch

    from pfl_edge.checkpoint import build_model
    from pfl_edge.train import ClientTensors

    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    trt, tet = torch.from_numpy(tr), torch.from_numpy(te)
    return LocalData(ClientTensors.build(xt, [trt], [yt[trt]]), ClientTensors.build(xt, [tet], [yt[tet]]), spec,
                     build_model(spec))


def device_data(cfg: AgentConfig, fed: FederationConfig, data_cfg: FederationConfig, slot: int,
                arrays: str) -> LocalData | ArrayData:
    """The device's own data: its images (``cfg.image_dir``), or its slot's share of the registered data set
    dealt as ``data_cfg`` says (the federation's config with the device's ``data_overrides``)."""
    if cfg.image_dir is not None:
        return load_image_folder(cfg.image_dir, fed, slot=slot, arrays=arrays)
    if cfg.partition_id not in (None, slot) and fed.participation < 1:
        log.info("slot %d drawn (asked for %s): where rounds sample, the server draws", slot, cfg.partition_id)
    elif cfg.partition_id is not None and cfg.partition_id != slot:
        raise ConfigError(f"asked for partition {cfg.partition_id} but the server gave slot {slot} "
                          f"(that partition's slot is taken); pick a free --partition-id or leave it out")
    if arrays == "numpy":
        return load_local_arrays(data_cfg, slot, data_dir=cfg.data_dir)
    return load_local_data(data_cfg, slot, data_dir=cfg.data_dir)
