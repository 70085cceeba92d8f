"""The model as an artefact: a machine-readable description of a federation's model for one device profile
(its input and normalisation, its architecture as data, its blocks and tensors, what a device of that profile
keeps personal, how it trains) and the exported programs that run it. A device reads this card and downloads
the programs it lists; it needs none of this repository's Python to know the model (docs/model.md).

``ModelCard`` and ``ProgramInfo`` are the wire format (JSON, ``GET /v1/federations/{fed}/model``);
``describe_layers`` walks a real ``nn.Module`` (torch.fx) to produce ``layers``; ``build_card`` assembles a card.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import fx, nn

from .checkpoint import ModelSpec
from .errors import ConfigError
from .federation import FederationConfig, model_id
from .models import BlockModel, Flatten, LinearBase, SpatialMean

__all__ = [
    "CARD_FORMAT",
    "BlockInfo",
    "InputInfo",
    "Layer",
    "LrSchedule",
    "ModelCard",
    "Normalisation",
    "ProgramInfo",
    "TensorInfo",
    "TrainingInfo",
    "build_card",
    "card_sections",
    "dataset_normalisation",
    "describe_blocks",
    "describe_layers",
    "describe_tensors",
    "own_images_normalisation",
    "training_info",
]

CARD_FORMAT: Literal["pfl-edge-model-card/1"] = "pfl-edge-model-card/1"

_FROZEN = ConfigDict(extra="forbid", frozen=True)


class Normalisation(BaseModel):
    """How a raw sample becomes the model's input: ``x = (raw * scale - mean[c]) / std[c]`` per channel ``c``.

    ``statistics``: ``fixed`` (``mean`` and ``std`` are constants, given here), ``own_data`` (``mean`` and ``std``
    are computed per channel over the device's own images after scaling, ``std`` with Bessel's correction and
    floored at ``std_floor``; the lists here are empty) or ``none`` (the samples are already model inputs:
    ``scale`` 1, ``mean`` 0, ``std`` 1)."""

    model_config = _FROZEN

    statistics: Literal["fixed", "own_data", "none"]
    scale: float
    mean: list[float]
    std: list[float]
    std_floor: float | None = None
    description: str = ""


class InputInfo(BaseModel):
    model_config = _FROZEN

    shape: list[int]  # one sample: [C, H, W]
    dtype: Literal["f32"] = "f32"
    layout: Literal["NCHW"] = "NCHW"
    normalisation: Normalisation  # the federation's data set
    own_images: Normalisation  # a device's own labelled images (edge_runtime.data.load_image_folder)


LayerType = Literal["conv2d", "linear", "groupnorm", "batchnorm", "relu", "flatten", "mean", "add", "reshape",
                    "maxpool", "avgpool", "identity"]


class Layer(BaseModel):
    """One operation of the forward pass. ``inputs`` names earlier layers (or ``input``, the model's input);
    the last layer's output is the logits. Only the fields of the layer's type are set."""

    model_config = _FROZEN

    name: str
    type: LayerType
    inputs: list[str]
    output_shape: list[int]  # one sample's, without the batch dimension
    module: str | None = None  # the module's path in the model (state-dict prefix)
    weight: str | None = None  # state-dict key
    bias: str | None = None
    in_channels: int | None = None
    out_channels: int | None = None
    in_features: int | None = None
    out_features: int | None = None
    kernel: list[int] | None = None  # [kH, kW]
    stride: list[int] | None = None
    padding: list[int] | None = None  # [pH, pW], zeros on both sides
    dilation: list[int] | None = None
    groups: int | None = None  # conv2d: channel groups (depthwise: = in_channels)
    num_groups: int | None = None  # groupnorm
    num_channels: int | None = None
    eps: float | None = None
    dims: list[int] | None = None  # mean: the dimensions averaged (of the batched NCHW tensor)
    order: Literal["NCHW"] | None = None  # flatten: row-major over C, then H, then W
    shape: list[int] | None = None  # reshape: the per-sample target shape


class TensorInfo(BaseModel):
    model_config = _FROZEN

    name: str  # state-dict key
    shape: list[int]
    block: str
    dtype: Literal["f32"] = "f32"
    kind: Literal["parameter", "buffer"] = "parameter"


class BlockInfo(BaseModel):
    model_config = _FROZEN

    name: str
    tensors: list[str]
    personal: bool  # for this card's profile (K_P): kept on the device, never sent


class LrSchedule(BaseModel):
    model_config = _FROZEN

    formula: str  # "lr * lr_decay ** (t - 1)"
    lr: float
    lr_decay: float
    round_index: str  # what t is


class TrainingInfo(BaseModel):
    """Local SGD exactly as pfl_edge.train runs it (``torch.optim.SGD`` semantics, docs/model.md)."""

    model_config = _FROZEN

    optimiser: Literal["sgd"] = "sgd"
    lr: float  # round 1's
    lr_schedule: LrSchedule
    momentum: float
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float  # added to the gradient (g + wd * w) after clipping and masking, before momentum
    clip_norm: float | None  # total L2 norm over the trained tensors; coefficient clip_norm / (norm + 1e-6), <= 1
    clip_unmasked: bool  # clip before masking the gradient (DisPFL) rather than after
    batch_size: int
    local_epochs: int
    ft_epochs: int  # FedPer-FT: epochs of personal-blocks-only fine-tuning before the whole-model epochs
    loss: Literal["cross_entropy"] = "cross_entropy"
    momentum_reset: Literal["every_round"] = "every_round"  # the optimiser starts afresh each round


class ProgramInfo(BaseModel):
    model_config = _FROZEN

    file: str
    kind: Literal["inference", "training"]
    runtime: Literal["onnxruntime", "executorch"]
    mode: Literal["fedper", "personal", "dispfl"] | None = None
    sha256: str
    bytes: int
    url: str  # path on the server: GET it with the same bearer token
    details: dict[str, Any] = Field(default_factory=dict)


class ModelCard(BaseModel):
    model_config = _FROZEN

    format: Literal["pfl-edge-model-card/1"] = CARD_FORMAT
    model_id: str  # pfl_edge.federation.model_id: every payload's header carries it
    model: str  # registry name
    federation: str
    profile: str
    algorithm: str
    num_classes: int
    input: InputInfo
    layers: list[Layer]
    blocks: list[BlockInfo]
    tensors: list[TensorInfo]
    base_keys: list[str]  # sent to and received from the server (DisPFL: every key)
    personal_keys: list[str]  # kept on the device
    kp: int  # personal blocks (from the end)
    density: float  # DisPFL: fraction of each device's weights kept by its mask; 1 elsewhere
    training: TrainingInfo
    programs: list[ProgramInfo]


# ------------------------------------------------------------------------------------------- normalisation

# What pfl_edge.data's loaders apply (pfl_edge/data/sources.py); tests/server/test_artefacts.py holds the loaders
# to these numbers.
_FIXED: dict[str, tuple[list[float], list[float]]] = {
    "fashion-mnist": ([0.2860], [0.3530]),
    "cifar10": ([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]),
}


def dataset_normalisation(dataset: str, channels: int) -> Normalisation:
    """The normalisation pfl_edge.data applies to the named data set's 8-bit pixels."""
    if dataset in _FIXED:
        mean, std = _FIXED[dataset]
        return Normalisation(statistics="fixed", scale=1 / 255, mean=mean, std=std,
                             description="8-bit pixels divided by 255, then standardised per channel")
    if dataset == "synthetic":
        return Normalisation(statistics="none", scale=1.0, mean=[0.0] * channels, std=[1.0] * channels,
                             description="generated already as model inputs (no pixels)")
    raise ConfigError(f"no normalisation is known for data set {dataset!r}")


def own_images_normalisation() -> Normalisation:
    """pfl_edge.data.folder.read_image_folder: pixels / 255, standardised over the folder."""
    return Normalisation(statistics="own_data", scale=1 / 255, mean=[], std=[], std_floor=1e-6,
                         description="8-bit pixels (grey: L, colour: RGB, resized to H x W) divided by 255, then "
                                     "standardised per channel by the mean and std of all the device's images")


# ------------------------------------------------------------------------------------------- layers


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, Flatten | SpatialMean | LinearBase) or super().is_leaf_module(m, qualname)


def describe_layers(model: nn.Module, input_shape: Sequence[int]) -> list[Layer]:
    """The forward pass of ``model`` as data, traced (torch.fx) and shape-propagated on one sample."""
    graph = _Tracer().trace(model)
    gm = fx.GraphModule(model, graph)
    env: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}  # fx node -> the layer name its output is known by
    layers: list[Layer] = []
    with torch.no_grad():
        for node in graph.nodes:
            if node.op == "placeholder":
                env[node.name] = torch.zeros(1, *input_shape)
                names[node.name] = "input"
                continue
            if node.op == "output":
                continue
            args = [env[a.name] if isinstance(a, fx.Node) else a for a in node.args]
            out = _run(gm, node, args)
            env[node.name] = out
            inputs = [names[a.name] for a in node.args if isinstance(a, fx.Node)]
            made = _layers(gm, node, inputs, list(out.shape[1:]), [list(a.shape[1:]) for a in args
                                                                  if isinstance(a, torch.Tensor)])
            layers.extend(made)
            names[node.name] = made[-1].name if made else inputs[0]
    return layers


def _run(gm: fx.GraphModule, node: fx.Node, args: list[Any]) -> torch.Tensor:
    if node.op == "call_module":
        out: torch.Tensor = gm.get_submodule(str(node.target))(*args)
    elif node.op == "call_function":
        out = node.target(*args)  # type: ignore[operator]
    else:
        raise ConfigError(f"cannot describe {node.op} {node.target} of the model")
    return out


def _layers(gm: fx.GraphModule, node: fx.Node, inputs: list[str], out: list[int],
            in_shapes: list[list[int]]) -> list[Layer]:
    if node.op == "call_function":
        if node.target in (operator.add, torch.add):
            return [Layer(name=node.name, type="add", inputs=inputs, output_shape=out)]
        if node.target in (torch.relu, torch.nn.functional.relu):
            return [Layer(name=node.name, type="relu", inputs=inputs, output_shape=out)]
        raise ConfigError(f"cannot describe function {node.target} of the model")
    path = str(node.target)
    m = gm.get_submodule(path)
    if isinstance(m, LinearBase):  # flatten, linear, relu, reshape: expanded so every op is a plain one
        n = node.name
        feats = [m.fc.in_features]
        return [Layer(name=f"{n}_flatten", type="flatten", inputs=inputs, output_shape=feats, order="NCHW",
                      module=path),
                _module_layer(f"{n}_fc", f"{path}.fc", m.fc, [f"{n}_flatten"], [m.fc.out_features]),
                Layer(name=f"{n}_relu", type="relu", inputs=[f"{n}_fc"], output_shape=[m.fc.out_features]),
                Layer(name=n, type="reshape", inputs=[f"{n}_relu"], output_shape=out, shape=list(m.out_shape),
                      module=path)]
    return [_module_layer(node.name, path, m, inputs, out)]


def _pair(v: Any) -> list[int]:
    return [int(v), int(v)] if isinstance(v, int) else [int(a) for a in v]


_SIMPLE: dict[type[nn.Module], Callable[[nn.Module], dict[str, Any]]] = {
    nn.ReLU: lambda m: {"type": "relu"},
    nn.Identity: lambda m: {"type": "identity"},
    Flatten: lambda m: {"type": "flatten", "order": "NCHW"},
    SpatialMean: lambda m: {"type": "mean", "dims": [2, 3]},
    nn.Linear: lambda m: {"type": "linear", "in_features": m.in_features, "out_features": m.out_features},
    nn.GroupNorm: lambda m: {"type": "groupnorm", "num_groups": m.num_groups, "num_channels": m.num_channels,
                             "eps": m.eps},
    nn.BatchNorm2d: lambda m: {"type": "batchnorm", "num_channels": m.num_features, "eps": m.eps},
    nn.MaxPool2d: lambda m: {"type": "maxpool", "kernel": _pair(m.kernel_size), "stride": _pair(m.stride),
                             "padding": _pair(m.padding), "dilation": _pair(m.dilation)},
    nn.AvgPool2d: lambda m: {"type": "avgpool", "kernel": _pair(m.kernel_size), "stride": _pair(m.stride),
                             "padding": _pair(m.padding)},
    nn.Conv2d: lambda m: {"type": "conv2d", "in_channels": m.in_channels, "out_channels": m.out_channels,
                          "kernel": _pair(m.kernel_size), "stride": _pair(m.stride), "padding": _pair(m.padding),
                          "dilation": _pair(m.dilation), "groups": m.groups},
}


def _module_layer(name: str, path: str, m: nn.Module, inputs: list[str], out: list[int]) -> Layer:
    describe = _SIMPLE.get(type(m))
    if describe is None:
        raise ConfigError(f"cannot describe module {path} ({type(m).__name__}) of the model")
    if isinstance(m, nn.Conv2d) and (m.padding_mode != "zeros" or isinstance(m.padding, str)):
        raise ConfigError(f"cannot describe {path}: only explicit zero padding is described")
    fields: dict[str, Any] = describe(m)
    own = dict(m.named_parameters(recurse=False))
    if "weight" in own:
        fields["weight"] = f"{path}.weight"
    if own.get("bias") is not None:
        fields["bias"] = f"{path}.bias"
    return Layer(name=name, inputs=inputs, output_shape=out, module=path, **fields)


# ------------------------------------------------------------------------------------------- tensors and blocks


def describe_tensors(model: BlockModel) -> list[TensorInfo]:
    owner = model.block_of()
    params = {k for k, _ in model.named_parameters()}
    return [TensorInfo(name=k, shape=list(v.shape), block=owner[k], kind="parameter" if k in params else "buffer")
            for k, v in model.state_dict().items()]


def describe_blocks(model: BlockModel, personal_keys: Sequence[str]) -> list[BlockInfo]:
    owner = model.block_of()
    personal = set(personal_keys)
    out = []
    for name in model.block_names:
        keys = [k for k in model.state_dict() if owner[k] == name]
        out.append(BlockInfo(name=name, tensors=keys, personal=bool(keys) and all(k in personal for k in keys)))
    return out


def card_sections(model: BlockModel, input_shape: Sequence[int], personal_keys: Sequence[str], *,
                  layers: Sequence[Layer] | None = None) -> Mapping[str, Any]:
    """``layers`` (traced unless given: a caller may keep them per model id), ``blocks`` and ``tensors`` of a
    card, from the real model."""
    return {"layers": list(layers) if layers is not None else describe_layers(model, input_shape),
            "blocks": describe_blocks(model, personal_keys), "tensors": describe_tensors(model)}


# ------------------------------------------------------------------------------------------- the card


def training_info(cfg: FederationConfig) -> TrainingInfo:
    """FederationConfig.train_config's SGD, its lr_at schedule and the epochs of a round."""
    tc = cfg.train_config(1)
    return TrainingInfo(
        lr=tc.lr, lr_schedule=LrSchedule(formula="lr * lr_decay ** (t - 1)", lr=cfg.lr, lr_decay=cfg.lr_decay,
                                          round_index="t: the round, from 1; round 0 (a late joiner's first "
                                                      "fine-tuning) uses round 1's lr"),
        momentum=tc.momentum, weight_decay=tc.weight_decay, clip_norm=tc.clip_norm, clip_unmasked=tc.clip_unmasked,
        batch_size=tc.batch_size, local_epochs=cfg.local_epochs,
        ft_epochs=cfg.ft_epochs if cfg.algorithm == "fedper-ft" else 0)


def build_card(*, federation: str, cfg: FederationConfig, spec: ModelSpec, model: BlockModel, profile: str,
               kp: int, density: float, base_keys: Sequence[str], programs: Sequence[ProgramInfo],
               layers: Sequence[Layer] | None = None) -> ModelCard:
    """The card of ``federation``'s model for a device of ``profile`` keeping ``kp`` blocks (``base_keys``
    travel; the rest stay on the device); ``layers``: ``describe_layers(model, ...)`` if already known."""
    shape = [spec.in_channels, spec.image_size, spec.image_size]
    base = set(base_keys)
    personal = [k for k in model.state_dict() if k not in base]
    return ModelCard(
        model_id=model_id(spec), model=spec.model, federation=federation, profile=profile, algorithm=cfg.algorithm,
        num_classes=spec.num_classes,
        input=InputInfo(shape=shape, normalisation=dataset_normalisation(cfg.dataset, spec.in_channels),
                        own_images=own_images_normalisation()),
        base_keys=[k for k in model.state_dict() if k in base], personal_keys=personal, kp=kp,
        density=density if cfg.algorithm == "dispfl" else 1.0, training=training_info(cfg), programs=list(programs),
        **card_sections(model, shape, personal, layers=layers))
