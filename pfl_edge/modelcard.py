"""The model as an artefact: a machine-readable description of a federation's model for one device profile
(its input and normalisation, its architecture as data, its blocks and tensors, what a device of that profile
keeps personal, how it trains) and the exported programs that run it. A device reads this card and downloads
the programs it lists; it needs none of this repository's Python to know the model (docs/model.md).

``ModelCard`` and ``ProgramInfo`` are the wire format (JSON, ``GET /v1/federations/{fed}/model``; every field
is described, and ``python -m pfl_edge.schemas`` makes docs/schemas/ModelCard.json of it); ``describe_layers``
(pfl_edge.modelgraph, with ``Layer``) walks a real ``nn.Module`` (torch.fx) to produce ``layers``; ``build_card``
assembles a card.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from .algorithms import algorithm_class
from .card_training import (
    CARD_MODEL_CONFIG,
    DittoTraining,
    FedRepTraining,
    LrSchedule,
    MaskSchedule,
    TrainingInfo,
    training_info,
)
from .checkpoint import ModelSpec
from .errors import ConfigError
from .federation import FederationConfig, model_id
from .modelgraph import Layer, describe_layers

if TYPE_CHECKING:  # the card's classes import without torch; a card is built from a model made elsewhere
    from .models import BlockModel

__all__ = [
    "CARD_FORMAT",
    "TRAINING_RUNTIMES",
    "TRAINING_SIGNATURE",
    "BlockInfo",
    "DittoTraining",
    "FedRepTraining",
    "InputInfo",
    "Layer",
    "LrSchedule",
    "MaskSchedule",
    "ModelCard",
    "Normalisation",
    "ProgramInfo",
    "TensorInfo",
    "TrainingInfo",
    "build_card",
    "card_sections",
    "card_wire",
    "dataset_normalisation",
    "describe_blocks",
    "describe_layers",
    "describe_tensors",
    "own_images_normalisation",
    "training_info",
]

CARD_FORMAT: Literal["pfl-edge-model-card/1"] = "pfl-edge-model-card/1"
# every training program's, whatever its runtime (ExecuTorch or ONNX Runtime): weights in, loss and gradients out
TRAINING_SIGNATURE = "forward(x, y, weight, *params) -> (loss, *grads)"
# the runtimes a training program is exported for (ProgramInfo.runtime of kind training): a device whose training
# backend is one of these trains with the card's program; the server exports them, the device runs them
TRAINING_RUNTIMES = ("executorch", "onnxruntime")

_FROZEN = CARD_MODEL_CONFIG  # tolerant of added fields, strict on values (pfl_edge.card_training)


class Normalisation(BaseModel):
    """How a raw sample becomes the model's input: ``x = (raw * scale - mean[c]) / std[c]`` per channel ``c``.

    ``statistics``: ``fixed`` (``mean`` and ``std`` are constants, given here), ``own_data`` (``mean`` and ``std``
    are computed per channel over the device's own images after scaling, ``std`` with Bessel's correction and
    floored at ``std_floor``; the lists here are empty) or ``none`` (the samples are already model inputs:
    ``scale`` 1, ``mean`` 0, ``std`` 1)."""

    model_config = _FROZEN

    statistics: Literal["fixed", "own_data", "none"] = Field(
        description="fixed: mean and std are the constants given; own_data: the device computes them per channel over "
                    "all its own images after scaling (lists empty here); none: samples already are inputs")
    scale: float = Field(description="multiplies the raw value first (1/255 for 8-bit pixels; 1 for none)")
    mean: list[float] = Field(description="per channel, subtracted after scaling (one per channel; empty for own_data)")
    std: list[float] = Field(description="per channel, divides after subtracting the mean (one per channel; empty for "
                                         "own_data)")
    std_floor: float | None = Field(default=None, description="own_data: the computed std (Bessel's correction, n - 1, "
                                                              "over every pixel of the channel) is at least this; else "
                                                              "null")
    description: str = Field(default="", description="the same rule in words, for people")


class InputInfo(BaseModel):
    """One sample as the model takes it, and how raw data becomes that (docs/model.md "Input")."""

    model_config = _FROZEN

    shape: list[int] = Field(description="one sample, [C, H, W]; a batch is [B, C, H, W]")
    dtype: Literal["f32"] = Field(default="f32", description="IEEE-754 binary32")
    layout: Literal["NCHW"] = Field(default="NCHW", description="row-major: W fastest, then H, then C, then the batch")
    normalisation: Normalisation = Field(description="for samples of the federation's data set")
    own_images: Normalisation = Field(description="for a user's own labelled images: converted to grey (L, C = 1) or "
                                                  "RGB (C = 3), resized to H x W, then this")


class TensorInfo(BaseModel):
    """One tensor of the model's state dict (the order of ``tensors`` is the order of payloads)."""

    model_config = _FROZEN

    name: str = Field(description="state-dict key, as in payloads and programs")
    shape: list[int] = Field(description="dimensions, outermost first; elements row-major")
    block: str = Field(description="name of the block (BlockInfo) the tensor belongs to")
    dtype: Literal["f32"] = Field(default="f32", description="IEEE-754 binary32, little-endian in bytes")
    kind: Literal["parameter", "buffer"] = Field(
        default="parameter", description="parameter: trained (and, in DisPFL, masked); buffer: state not trained")


class BlockInfo(BaseModel):
    """One block of the model, in model order; K_P counts personal blocks from the end."""

    model_config = _FROZEN

    name: str = Field(description="the block's name")
    tensors: list[str] = Field(description="state-dict keys of its tensors")
    personal: bool = Field(description="for this card's profile (K_P): kept on the device, never sent")


class ProgramInfo(BaseModel):
    """An exported program the device runs (docs/model.md "Programs"): download it by ``file`` and check its size
    and SHA-256 before loading it."""

    model_config = _FROZEN

    file: str = Field(description="file name, ^[a-z0-9][a-z0-9._-]{0,199}\\.(onnx|pte)$; also its name on the device")
    kind: Literal["inference", "training"] = Field(
        description="inference (ONNX) or training (a gradient program: ONNX or ExecuTorch, by runtime)")
    runtime: Literal["onnxruntime", "executorch"] = Field(description="the runtime that runs it")
    mode: Literal["fedper", "personal", "dispfl"] | None = Field(
        default=None, description="training: which tensors it trains (fedper: all; personal: the last kp blocks; "
                                  "dispfl: all, masked by the device); null for inference")
    sha256: str = Field(description="SHA-256 of the bytes, 64 lowercase hex")
    bytes: int = Field(description="size in bytes")
    url: str = Field(description="/v1/federations/{fed}/programs/{file}: GET it with the same bearer token")
    details: dict[str, Any] = Field(default_factory=dict, description="the program's interface: inputs, outputs, "
                                                                      "weights or trainable and frozen keys, shapes")


class ModelCard(BaseModel):
    """A federation's model for one device profile (``GET /v1/federations/{fed}/model``, docs/model.md): its
    input and normalisation, its forward pass as data, its blocks and tensors, what the device keeps personal, how
    it trains and the programs that run it."""

    model_config = _FROZEN

    format: Literal["pfl-edge-model-card/1"] = Field(default=CARD_FORMAT, description="a device refuses another value")
    model_id: str = Field(description="the id every payload header carries: model/num_classes/CxS/baseK, e.g. "
                                      "cnn/10/1x28/deep0; a device checks it equals its own")
    model: str = Field(description="registry name: cnn, resnet18-gn, mobilenet-v1")
    federation: str = Field(description="the federation's id")
    profile: str = Field(description="the device profile the card is for")
    algorithm: str = Field(description="an algorithm that runs on devices (pfl-edge list)")
    num_classes: int = Field(description="length of the logits vector; labels are 0 .. num_classes - 1")
    input: InputInfo = Field(description="one sample's shape, dtype, layout and normalisation")
    layers: list[Layer] = Field(description="the forward pass, traced from the real model, in execution order")
    blocks: list[BlockInfo] = Field(description="the model's blocks in model order")
    tensors: list[TensorInfo] = Field(description="every state-dict tensor in state-dict order (payloads' order)")
    base_keys: list[str] = Field(description="the tensors this device sends and receives (FedPer, FedAvg: its base; "
                                             "DisPFL: every tensor)")
    personal_keys: list[str] = Field(description="the tensors that never leave the device (the last kp blocks; empty "
                                                 "for FedAvg and DisPFL)")
    kp: int = Field(description="K_P: personal blocks, counted from the output end (0 for FedAvg and DisPFL)")
    density: float = Field(description="DisPFL: the fraction of weights the device's mask keeps, its capacity (ERK per "
                                       "tensor, docs/algorithms.md); 1.0 for the other algorithms")
    training: TrainingInfo = Field(description="local training of a round")
    programs: list[ProgramInfo] = Field(description="the programs for this profile: ONNX inference always, the "
                                                    "training programs of the runtime the device trains with "
                                                    "(onnxruntime or executorch) where it trains with a program")


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


# fields of the card's training section that a device of protocol version 1 does not know: left off its card
# (always for those added after version 1; while null for those of the card's own first releases, which a card of
# then refused even as null)
_TRAINING_SINCE_V2 = ("fedrep",)
_TRAINING_LATER = ("mask_schedule", "ditto")


def card_wire(card: ModelCard, protocol: int) -> dict[str, Any]:
    """The card as JSON for a device answered in ``protocol`` (docs/protocol.md, "Versions")."""
    out = card.model_dump(mode="json")
    if protocol < 2:
        tr = out["training"]
        for k in _TRAINING_SINCE_V2:
            tr.pop(k, None)
        for k in _TRAINING_LATER:
            if tr.get(k) is None:
                tr.pop(k, None)
    return out


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
        density=algorithm_class(cfg.algorithm).mask_density(density), training=training_info(cfg),
        programs=list(programs),
        **card_sections(model, shape, personal, layers=layers))
