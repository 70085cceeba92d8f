"""The forward pass of a model as data: the model card's ``layers`` (``Layer``, docs/model.md "Layers"), made by
tracing the real ``nn.Module`` with torch.fx and running it on one zero sample to learn every output shape
(:func:`describe_layers`). Part of the card's wire format (pfl_edge.modelcard re-exports it)."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import ConfigError

if TYPE_CHECKING:  # torch and the models are imported where a model is traced: Layer imports without torch
    import torch
    from torch import fx, nn

__all__ = ["Layer", "LayerType", "describe_layers"]

LayerType = Literal["conv2d", "linear", "groupnorm", "batchnorm", "relu", "flatten", "mean", "add", "reshape",
                    "maxpool", "avgpool", "identity"]


class Layer(BaseModel):
    """One operation of the forward pass, in execution order. ``inputs`` names earlier layers (or ``input``, the
    model's input); the last layer's output is the logits ``[num_classes]``. Only the fields of the layer's
    ``type`` are set, the others are null (docs/model.md "Layers" says what each type computes)."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # as the card's other parts (pfl_edge.card_training)

    name: str = Field(description="unique name of this layer; later layers name it in their inputs")
    type: LayerType = Field(description="the operation: conv2d, linear, groupnorm, batchnorm, relu, flatten, mean, "
                                        "add, reshape, maxpool, avgpool or identity")
    inputs: list[str] = Field(description="names of the earlier layers whose outputs this one takes, in order; "
                                          "\"input\" is the model's input (add: two inputs, summed)")
    output_shape: list[int] = Field(description="shape of one sample's output, without the batch dimension ([C, H, W] "
                                                "or [features])")
    module: str | None = Field(default=None, description="the module's path in the model: the prefix of its state-dict "
                                                         "keys (null for a function such as relu or add)")
    weight: str | None = Field(default=None, description="state-dict key of the weight (conv2d: [out, in/groups, kH, "
                                                         "kW]; linear: [out, in]; groupnorm: gamma [C]); null if none")
    bias: str | None = Field(default=None, description="state-dict key of the bias ([out]; groupnorm: beta [C]); null "
                                                       "if none")
    in_channels: int | None = Field(default=None, description="conv2d: input channels")
    out_channels: int | None = Field(default=None, description="conv2d: output channels")
    in_features: int | None = Field(default=None, description="linear: input features")
    out_features: int | None = Field(default=None, description="linear: output features; y = W x + b")
    kernel: list[int] | None = Field(
        default=None, description="conv2d, maxpool, avgpool: kernel size, two integers, [height, width]")
    stride: list[int] | None = Field(
        default=None, description="conv2d, maxpool, avgpool: stride, two integers, [height, width]")
    padding: list[int] | None = Field(
        default=None, description="conv2d, maxpool, avgpool: [pH, pW], zero padding of pH rows at top and bottom and "
                                  "pW columns left and right")
    dilation: list[int] | None = Field(
        default=None, description="conv2d, maxpool: dilation, two integers, [height, width]")
    groups: int | None = Field(default=None, description="conv2d: channel groups (1: a plain convolution; = "
                                                         "in_channels: depthwise)")
    num_groups: int | None = Field(default=None, description="groupnorm: groups of consecutive channels, each "
                                                             "normalised over its channels x H x W by its mean and "
                                                             "biased variance")
    num_channels: int | None = Field(default=None, description="groupnorm, batchnorm: channels C")
    eps: float | None = Field(default=None, description="groupnorm, batchnorm: added to the variance before the square "
                                                        "root: (v - mean) / sqrt(var + eps)")
    dims: list[int] | None = Field(default=None, description="mean: the dimensions averaged, of the batched NCHW "
                                                             "tensor, and removed (no keepdim): [2, 3] is global "
                                                             "average pooling, [B, C, H, W] -> [B, C]")
    order: Literal["NCHW"] | None = Field(
        default=None, description="flatten: \"NCHW\", row-major over C, then H, then W (index c*H*W + h*W + w)")
    shape: list[int] | None = Field(default=None, description="reshape: the per-sample target shape, filled row-major")


# ------------------------------------------------------------------------------------------- tracing


@functools.cache
def _tracer() -> type[fx.Tracer]:
    """torch.fx's tracer, keeping the models' own flatten, mean and linear base whole (made on first use)."""
    from torch import fx

    from .models import Flatten, LinearBase, SpatialMean

    class _Tracer(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, Flatten | SpatialMean | LinearBase) or super().is_leaf_module(m, qualname)

    return _Tracer


def describe_layers(model: nn.Module, input_shape: Sequence[int]) -> list[Layer]:
    """The forward pass of ``model`` as data, traced (torch.fx) and shape-propagated on one sample."""
    import torch
    from torch import fx

    graph = _tracer()().trace(model)
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
    import torch

    from .models import LinearBase

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


@functools.cache
def _simple() -> dict[type[nn.Module], Callable[[nn.Module], dict[str, Any]]]:
    """Each plain module type's layer fields (made on first use)."""
    from torch import nn

    from .models import Flatten, SpatialMean

    return {
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
    from torch import nn

    describe = _simple().get(type(m))
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

