"""One device's side of a round, as pure functions over ``dict[str, Tensor]``: what the device agent runs, and
exactly what the in-process simulator does for that client (same seeds, same batches, same rules), so a
federation of device processes ends with the simulator's models.

A device is client ``index`` of its federation's config: it holds partition ``index`` of the data set, draws
its batches from ``generator(seed, "train", t, index)`` and its mask from ``generator(seed, "mask", index)``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from .aggregate import neighbourhood_average
from .checkpoint import ModelSpec, build_model
from .codec import Decoded, decode, encode
from .data import get_dataset
from .errors import ConfigError
from .models import BlockModel
from .seeding import derive_seed, generator
from .sim.config import SimConfig
from .sparse import erk_densities, init_masks, prune_rate, prune_regrow
from .split import Split, split_keys, take
from .train import ClientTensors, TrainConfig, dense_gradients, evaluate, stack_states, train, unstack

__all__ = [
    "DEVICE_ALGORITHMS",
    "Backend",
    "LocalData",
    "base_payload",
    "check_device_config",
    "decode_model",
    "device_split",
    "dispfl_average",
    "dispfl_init",
    "dispfl_payload",
    "dispfl_update_mask",
    "evaluate_local",
    "init_state",
    "load_image_folder",
    "load_local_data",
    "model_id",
    "personal_finetune",
    "train_local",
]

DEVICE_ALGORITHMS = ("fedavg", "fedper", "fedper-ft", "dispfl")

_ROW = torch.zeros(1, dtype=torch.int64)  # a device's data is a stack of one client


@dataclass(frozen=True, eq=False)
class LocalData:
    """A device's own training and test data (stacks of one client) and the model it trains."""

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


def model_id(spec: ModelSpec) -> str:
    """The id in every payload's header: a device refuses weights of another model."""
    return f"{spec.model}/{spec.num_classes}/{spec.in_channels}x{spec.image_size}/{spec.base}{spec.kp}"


def check_device_config(cfg: SimConfig) -> None:
    if cfg.algorithm not in DEVICE_ALGORITHMS:
        raise ConfigError(f"algorithm {cfg.algorithm!r} does not run on devices; valid: {', '.join(DEVICE_ALGORITHMS)}")


def load_local_data(cfg: SimConfig, index: int, *, data_dir: str | None = None) -> LocalData:
    """Partition ``index`` of ``cfg``'s data set, dealt exactly as the simulator deals it."""
    if not 0 <= index < cfg.clients:
        raise ConfigError(f"partition index {index} out of range for {cfg.clients} partitions")
    from .sim.simulator import deal

    ds, part, spec = deal(cfg, data_dir=data_dir)
    c = part.clients[index]
    return LocalData(ClientTensors.build(ds.train_x, [c.train_idx], [c.train_y]),
                     ClientTensors.build(ds.test_x, [c.test_idx], [c.test_y]), spec, build_model(spec))


def load_image_folder(root: str, cfg: SimConfig, *, seed: int, test_fraction: float = 0.2) -> LocalData:
    """The user's own labelled images: one sub-folder per class, named by the class index (``0``, ``1``, ...)
    or by the class's position in the sorted folder names. Images are converted to the federation's model
    input (channels, size) and standardised over the folder; ``test_fraction`` of each class is held out."""
    from .data.folder import read_image_folder

    ds = get_dataset(cfg.dataset, data_dir=cfg.data_dir)  # the federation's model shape and classes
    x, y = read_image_folder(root, ds.in_channels, ds.image_size, ds.num_classes)
    gen = torch.Generator().manual_seed(seed)
    test_idx: list[Tensor] = []
    train_idx: list[Tensor] = []
    for c in torch.unique(y).tolist():
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=gen)]
        k = round(test_fraction * len(idx))
        test_idx.append(idx[:k])
        train_idx.append(idx[k:])
    tr, te = torch.cat(train_idx), torch.cat(test_idx)
    if len(tr) == 0:
        raise ConfigError(f"{root}: no training images left after holding out {test_fraction:.0%} for testing")
    spec = ModelSpec(cfg.model, ds.num_classes, ds.in_channels, ds.image_size, cfg.base,
                     cfg.kp if cfg.base == "linear" else 0)
    return LocalData(ClientTensors.build(x, [tr], [y[tr]]), ClientTensors.build(x, [te], [y[te]]), spec,
                     build_model(spec))


def init_state(cfg: SimConfig, spec: ModelSpec) -> dict[str, Tensor]:
    """The model every device (and the simulator) starts from."""
    torch.manual_seed(derive_seed(cfg.seed, "init"))
    return {k: v.detach().clone() for k, v in build_model(spec).state_dict().items()}


def device_split(model: BlockModel, cfg: SimConfig, kp: int) -> Split:
    return split_keys(model, 0 if cfg.algorithm in ("fedavg", "dispfl") else kp,
                      local_norm_stats=cfg.local_norm_stats)


def _one(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.unsqueeze(0) for k, v in state.items()}


class Backend(Protocol):
    """A training backend the device brings (``edge_runtime.training``: ExecuTorch); without one, training
    runs here in eager PyTorch, exactly as the simulator trains."""

    def load(self, state: Mapping[str, Tensor]) -> None: ...

    def state(self) -> dict[str, Tensor]: ...

    def train(self, x: Tensor, y: Tensor, cfg: TrainConfig, gen: torch.Generator, *,
              trainable: Collection[str] | None = None, mask: Mapping[str, Tensor] | None = None) -> Any: ...

    def dense_gradients(self, x: Tensor, y: Tensor, batch_size: int, gen: torch.Generator) -> dict[str, Tensor]: ...


def _own(data: LocalData) -> tuple[Tensor, Tensor]:
    n = data.n_train
    return data.train.x[0, :n], data.train.y[0, :n]


def train_local(data: LocalData, state: Mapping[str, Tensor], cfg: SimConfig, t: int, index: int, *,
                epochs: int | None = None, label: str = "train", trainable: Sequence[str] | None = None,
                masks: Mapping[str, Tensor] | None = None,
                backend: Backend | None = None) -> tuple[dict[str, Tensor], float, int]:
    """Local SGD of round ``t`` from ``state``: returns the new state, the mean training loss and the steps."""
    tc = TrainConfig(epochs=cfg.local_epochs if epochs is None else epochs, batch_size=cfg.batch_size,
                     lr=cfg.lr_at(max(t, 1)), momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                     clip_norm=cfg.clip_norm)
    gen = generator(cfg.seed, label, t, index)
    if backend is not None:
        backend.load(state)
        x, y = _own(data)
        stats = backend.train(x, y, tc, gen, trainable=trainable, mask=masks)
        return {**state, **backend.state()}, float(stats.loss), int(stats.steps)
    res = train(data.model, _one(state), data.train, _ROW, tc, [gen],
                trainable=trainable, masks=None if masks is None else _one(masks), engine="loop")
    return unstack(res.stack, 0), float(res.loss[0]), int(res.steps[0])


def personal_finetune(data: LocalData, state: Mapping[str, Tensor], split: Split, cfg: SimConfig, t: int,
                      index: int, *, backend: Backend | None = None) -> dict[str, Tensor]:
    """FedPer-FT: the personal blocks alone for ``ft_epochs`` on a new base (ALGORITHMS.md)."""
    personal = [k for k, _ in data.model.named_parameters() if k in set(split.personal)]
    if not personal or cfg.ft_epochs == 0:
        return dict(state)
    return train_local(data, state, cfg, t, index, epochs=cfg.ft_epochs, label="finetune", trainable=personal,
                       backend=backend)[0]


def evaluate_local(data: LocalData, state: Mapping[str, Tensor]) -> tuple[float, float]:
    acc, loss = evaluate(data.model, _one(state), data.test, _ROW)
    return float(acc[0]), float(loss[0])


# ------------------------------------------------------------------------------------------------------------ DisPFL


def dispfl_init(data: LocalData, cfg: SimConfig, index: int, density: float,
                init: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The device's mask at its own density (ERK) and its sparse initial model."""
    shapes = {k: tuple(v.shape) for k, v in data.model.named_parameters()}
    masks = init_masks(shapes, erk_densities(shapes, density), generator(cfg.seed, "mask", index))
    return {k: v * masks[k] if k in masks else v.clone() for k, v in init.items()}, masks


def _sparse_keys(masks: Mapping[str, Tensor]) -> list[str]:
    # a tensor whose mask is all ones was left dense by ERK; prune-and-regrow never touches it
    return [k for k, m in masks.items() if not bool(m.all())]


def dispfl_payload(weights: Mapping[str, Tensor], masks: Mapping[str, Tensor], spec: ModelSpec, t: int) -> bytes:
    """The device's sparse model on the wire: values on its mask plus the mask (the support travels, as in
    the paper); tensors left dense go without a mask."""
    return encode(weights, model_id=model_id(spec), round=t, masks={k: masks[k].bool() for k in _sparse_keys(masks)})


def decode_model(payload: bytes, data: LocalData, *, max_bytes: int) -> Decoded:
    """A neighbour's sparse model (or a base), checked against this device's model: names, shapes, model id."""
    expected = {k: tuple(v.shape) for k, v in data.model.state_dict().items()}
    return decode(payload, expected=expected, model_id=model_id(data.spec), max_bytes=max_bytes, allow_missing=True)


def dispfl_average(own: Mapping[str, Tensor], own_masks: Mapping[str, Tensor], index: int,
                   others: Sequence[tuple[int, Decoded]]) -> dict[str, Tensor]:
    """Average own and neighbours' models over the intersection of masks, then keep the own support. The sums
    run in slot order through the simulator's own ``neighbourhood_average``, so a device computes the very
    numbers the simulator does (prune-and-regrow compares magnitudes: a last-bit difference could flip a mask
    bit and the two would part ways)."""
    rows = sorted([(index, dict(own), {k: m.float() for k, m in own_masks.items()})]
                  + [(j, d.tensors, {k: d.masks[k].float() if k in d.masks else torch.ones(v.shape)
                                     for k, v in d.tensors.items() if k in own_masks}) for j, d in others],
                  key=lambda r: r[0])
    stack = stack_states([r[1] for r in rows])
    masks = stack_states([r[2] for r in rows])
    me = [r[0] for r in rows].index(index)
    avg = neighbourhood_average(stack, torch.ones(len(rows), len(rows)), masks)  # every row is this average
    return {k: v[me] * own_masks[k] if k in own_masks else v[me] for k, v in avg.items()}


def dispfl_update_mask(data: LocalData, trained: Mapping[str, Tensor], masks: Mapping[str, Tensor],
                       cfg: SimConfig, t: int, index: int, *,
                       backend: Backend | None = None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Prune ``ceil(alpha_t * nnz)`` weights per sparse tensor and regrow as many (by dense gradient or at
    random), as the simulator does after round ``t``."""
    alpha = prune_rate(cfg.alpha0, t - 1, cfg.rounds)
    sparse = {k: masks[k] for k in _sparse_keys(masks)}
    grads = None
    if cfg.regrow == "gradient" and backend is not None:
        backend.load(trained)
        x, y = _own(data)
        g1 = backend.dense_gradients(x, y, cfg.batch_size, generator(cfg.seed, "regrow", t, index))
        grads = {k: g1[k] for k in sparse}
    elif cfg.regrow == "gradient":
        g = dense_gradients(data.model, _one(trained), data.train, _ROW, cfg.batch_size,
                            [generator(cfg.seed, "regrow", t, index)])
        grads = {k: g[k][0] for k in sparse}
    w, m = prune_regrow({k: trained[k] for k in sparse}, sparse, alpha, grads=grads,
                        gen=generator(cfg.seed, "regrow-random", t, index) if grads is None else None)
    new_w = {k: w.get(k, v) for k, v in trained.items()}
    new_m = {k: m.get(k, v) for k, v in masks.items()}
    return new_w, new_m


def base_payload(state: Mapping[str, Tensor], split: Split, spec: ModelSpec, t: int) -> bytes:
    """FedPer's upload: the base part only; the personal blocks never leave the device."""
    return encode(take(state, split.base), model_id=model_id(spec), round=t)
