"""ExecuTorch *training* programs: ``lower_executorch_training`` -> ``package`` (``edge_runtime.verify_training``
checks them).

A training program is a pure function: one forward and backward pass, **weights in, loss and gradients out**.

    forward(x, y, weight, *params) -> (loss, *grads)

- ``x`` (B, C, H, W), ``y`` (B,) int64 and ``weight`` (B,) float: the loss is
  ``sum(weight * ce) / max(sum(weight), 1)``. The batch dimension is fixed at the profile's batch size; a
  partial batch (the last of an epoch) is padded with weight-0 samples. Every model here normalises per sample
  (GroupNorm, never BatchNorm, which cannot be trained by ExecuTorch anyway), so padded samples do not touch the
  others' activations, and their weight-0 terms contribute exactly zero to every gradient: the gradient is the
  mean over the real samples, as eager PyTorch computes it on the short batch. One program serves every batch
  size up to B, with no second program for the remainder.
- ``*params``: every parameter, in state-dict order (``details["keys"]``); ``*grads``: the gradients of the
  trainable ones (``details["trainable"]``), in that order. The program holds no weight: a device swaps its own
  in at every call (a new base, the neighbours' average) without re-export, as with the ONNX program, and the
  optimiser step is the device's (``edge_runtime.training``: masking, clipping, weight decay, momentum).

How it is made: the model with its convolutions and linear layers as matrix products (``export.matmul_conv``),
its loss's gradient traced by ``torch.func.grad_and_value`` under ``make_fx`` into a graph of core ATen
operators (forward and backward), ``torch.export``-ed with every tensor a user input, then ``to_edge`` with the
XNNPACK partitioner (``delegate="xnnpack"``, the default: the matrix products, transposes, slices, concatenations
and element-wise operators it supports run in XNNPACK, the rest on the runtime's kernels) and ``to_executorch``.
A program whose parameters live inside it (``_export_forward_backward``, the training module's
``named_parameters``) could not be delegated: XNNPACK bakes the tensors it is given into its blob, and an
optimiser's in-place update would never reach them. With the weights as inputs nothing is baked.

Modes (which parameters the program differentiates):

- ``fedper``: every parameter (base and personal blocks; the base is what the device uploads).
- ``personal``: the parameters of the last ``kp`` blocks (``pfl_edge.split.split_keys``); the base is an input
  whose gradient is never computed, and backward stops at the first personal layer. FedPer-FT's first phase.
- ``dispfl``: every parameter; the graph is ``fedper``'s. The device passes its effective weights ``w * m``:
  the gradient of ``loss(w * m)`` with respect to ``w`` is ``m * dloss/dw_eff``, so the backend masks the
  gradient, steps, and re-applies the mask, exactly as ``pfl_edge.train`` does. The unmasked gradient the
  program returns is ``dloss/dw_eff`` at ``w_eff``, precisely DisPFL's regrowth screen
  (``pfl_edge.train.dense_gradients``). Masks change every round without a re-export; a ``mask`` given here
  only records the density in the details.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from pfl_edge.errors import ConfigError
from pfl_edge.modelcard import TRAINING_SIGNATURE
from pfl_edge.models import BlockModel
from pfl_edge.split import split_keys

from .matmul_conv import matmul_convs
from .stages import ExportError, Lowered, Prepared

__all__ = ["CONVOLUTIONS", "DELEGATES", "ONNX_TRAINING_OPSET", "TRAINING_MODES", "JointGraph",
           "joint_graph", "lower_executorch_training", "lower_onnx_training", "trainable_keys", "weighted_loss"]

TRAINING_MODES = ("fedper", "personal", "dispfl")
ONNX_TRAINING_OPSET = 18  # the dynamo exporter's; ONNX Runtime >= 1.14 (and its mobile and web builds) run it


def weighted_loss(logits: Tensor, y: Tensor, weight: Tensor) -> Tensor:
    """``sum(weight * ce) / max(sum(weight), 1)``: the same expression as pfl_edge.train's vmap engine, a mean
    over the weight-1 samples."""
    return (F.cross_entropy(logits, y, reduction="none") * weight).sum() / weight.sum().clamp_min(1.0)


def trainable_keys(model: nn.Module, mode: str, kp: int | None) -> list[str]:
    """The parameter names ``mode`` trains, in ``named_parameters`` order."""
    names = [k for k, _ in model.named_parameters()]
    if mode in ("fedper", "dispfl"):
        return names
    if mode == "personal":
        if kp is None or kp < 1:
            raise ConfigError(f"mode 'personal' needs kp >= 1 (the number of personal blocks), got {kp}")
        if not isinstance(model, BlockModel):
            raise ConfigError("mode 'personal' needs a BlockModel (blocks to count kp from)")
        personal = set(split_keys(model, kp).personal)
        return [k for k in names if k in personal]
    raise ConfigError(f"unknown training mode {mode!r}; valid: {', '.join(TRAINING_MODES)}")


CONVOLUTIONS = ("matmul", "native")  # how a training program computes convolutions (export.matmul_conv)
DELEGATES = ("xnnpack", "none")  # what runs the supported operators of a training program


@dataclasses.dataclass(frozen=True, eq=False)
class JointGraph:
    """A model's forward-and-backward graph, before lowering: what ``lower_executorch_training`` lowers and
    ``bench/train_ops.py`` times operator by operator. ``program`` is a ``torch.export.ExportedProgram`` whose
    inputs are all user inputs, ``example`` (x, y, weight, *params)."""

    program: Any
    example: tuple[Tensor, ...]
    trainable: list[str]
    frozen: list[str]
    keys: list[str]
    shapes: dict[str, list[int]]


class _Traced(nn.Module):
    def __init__(self, gm: nn.Module) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, *args: Tensor) -> Any:
        return self.gm(*args)


def joint_graph(prepared: Prepared, *, mode: str, batch_size: int, kp: int | None = None,
                mask: Mapping[str, Tensor] | None = None, convolutions: str = "matmul",
                decompositions: Mapping[Any, Any] | None = None) -> JointGraph:
    """The joint graph of ``lower_executorch_training`` (same arguments); ``decompositions``: more entries for
    the tracer's table (the ONNX program's convolution backward, ``export.conv_backward``)."""
    from torch.func import grad_and_value
    from torch.fx.experimental.proxy_tensor import make_fx

    if convolutions not in CONVOLUTIONS:
        raise ConfigError(f"unknown convolutions {convolutions!r}; valid: {', '.join(CONVOLUTIONS)}")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if mode != "personal" and kp is not None:
        raise ConfigError(f"kp applies to mode 'personal' only, not {mode!r}")
    if mask is not None and mode != "dispfl":
        raise ConfigError(f"a mask applies to mode 'dispfl' only, not {mode!r}")
    net = matmul_convs(prepared.model) if convolutions == "matmul" else copy.deepcopy(prepared.model)
    trainable = trainable_keys(net, mode, kp)
    if any(True for _ in net.buffers()):
        raise ExportError(f"{prepared.spec.model} has buffers (BatchNorm?): ExecuTorch cannot export BatchNorm in "
                          "training mode; use a GroupNorm model")
    named = dict(net.named_parameters())
    for k in mask or {}:
        if k not in named:
            raise ConfigError(f"mask for {k!r}, which is not a parameter")
    keys = list(named)
    frozen = [k for k in keys if k not in set(trainable)]
    where = [keys.index(k) for k in trainable]
    net.train()

    def step(x: Tensor, y: Tensor, weight: Tensor, *params: Tensor) -> tuple[Tensor, ...]:
        def loss_of(tr: list[Tensor]) -> Tensor:
            full = dict(zip(keys, params, strict=True)) | dict(zip(trainable, tr, strict=True))
            return weighted_loss(functional_call(net, full, (x,)), y, weight)

        grads, loss = grad_and_value(loss_of)([params[i] for i in where])
        return (loss, *grads)

    example = (torch.zeros(batch_size, *prepared.input_shape), torch.zeros(batch_size, dtype=torch.int64),
               torch.ones(batch_size), *(p.detach().clone() for p in named.values()))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            table = dict(torch._decomp.core_aten_decompositions()) | dict(decompositions or {})
            gm = make_fx(step, decomposition_table=table)(*example)
            ep = torch.export.export(_Traced(gm), example, strict=False)
    except Exception as e:  # tracing raises many kinds; say which model and why
        raise ExportError(f"ExecuTorch training export of {prepared.spec.model} ({mode}) failed: {e}") from e
    return JointGraph(ep, example, trainable, frozen, keys, {k: list(v.shape) for k, v in named.items()})


def lower_executorch_training(prepared: Prepared, *, mode: str, batch_size: int, kp: int | None = None,
                              mask: Mapping[str, Tensor] | None = None, convolutions: str = "matmul",
                              delegate: str = "xnnpack") -> Lowered:
    """An ExecuTorch training program for ``prepared.model`` (see the module docstring for its signature).

    The returned ``Lowered`` carries a copy of ``prepared`` whose tag names the mode (``fresh-train-fedper``,
    ``client003-train-personal-kp2``), so ``package`` writes it beside the inference ``.pte`` without a clash.
    ``details`` holds what a device needs to drive the program: ``kind``, ``mode``, ``batch_size``, ``inputs``,
    ``outputs``, ``trainable``, ``frozen``, ``keys`` (every state-dict key, in order), ``input_shape``.

    ``convolutions``: ``"matmul"`` (default) rewrites them into slices and matrix products
    (``export.matmul_conv``); ``"native"`` keeps ``aten.convolution``, which the runtime runs on portable loops
    (two orders of magnitude slower; kept to measure). ``delegate``: ``"xnnpack"`` (default) or ``"none"``
    (every operator on the runtime's own kernels)."""
    if delegate not in DELEGATES:
        raise ConfigError(f"unknown delegate {delegate!r}; valid: {', '.join(DELEGATES)}")
    joint = joint_graph(prepared, mode=mode, batch_size=batch_size, kp=kp, mask=mask, convolutions=convolutions)
    try:
        from executorch.exir import to_edge, to_edge_transform_and_lower

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if delegate == "xnnpack":
                from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

                edge = to_edge_transform_and_lower(joint.program, partitioner=[XnnpackPartitioner()])
            else:
                edge = to_edge(joint.program)
            # the edge-dialect operators left outside a delegate, read before to_executorch rewrites the graph
            ops = sorted({getattr(n.target, "__name__", str(n.target)) for n in edge.exported_program().graph.nodes
                          if n.op == "call_function"})
            program = edge.to_executorch().buffer
    except Exception as e:  # lowering raises many kinds; say which model and why
        raise ExportError(f"ExecuTorch training export of {prepared.spec.model} ({mode}) failed: {e}") from e
    tag = f"{prepared.tag}-train-{mode}" + (f"-kp{kp}" if mode == "personal" else "")
    details = _details(prepared, joint, mode, kp, batch_size) | {
        "operators": ops, "convolutions": convolutions, "delegate": delegate}
    if mask is not None:
        details["mask_density"] = float(sum(m.sum() for m in mask.values()) / sum(m.numel() for m in mask.values()))
    return Lowered(dataclasses.replace(prepared, tag=tag), "executorch", program, details)


def _details(prepared: Prepared, joint: JointGraph, mode: str, kp: int | None, batch_size: int) -> dict[str, Any]:
    """What a device needs to drive a training program of either runtime (docs/model.md)."""
    return {
        "kind": "training", "mode": mode, "kp": kp, "batch_size": batch_size,
        "inputs": ["x", "y", "weight", *joint.keys], "outputs": ["loss", *(f"grad:{k}" for k in joint.trainable)],
        "trainable": joint.trainable, "frozen": joint.frozen, "keys": joint.keys, "shapes": joint.shapes,
        "input_shape": list(prepared.input_shape), "loss": "sum(weight * cross_entropy) / max(sum(weight), 1)",
        "signature": TRAINING_SIGNATURE,
    }


def lower_onnx_training(prepared: Prepared, *, mode: str, batch_size: int, kp: int | None = None) -> Lowered:
    """The ONNX training program of ``prepared.model``: the same gradient program as
    ``lower_executorch_training``'s (signature, inputs, outputs and padding alike; the module docstring), as an
    ONNX graph that ONNX Runtime runs in an ordinary inference session, on any platform it ships for (Linux x86_64
    and aarch64 with Python 3.10+, Android, iOS, Node and React Native). No training API is involved: the graph
    is the traced forward and backward pass, every convolution's backward decomposed into plain convolutions and
    matrix products (``export.conv_backward``), native convolutions forward (ONNX Runtime's are optimised, unlike
    ExecuTorch's portable ones). Inputs are named ``x``, ``y``, ``weight`` and each parameter's state-dict key;
    outputs ``loss`` and ``grad:<key>`` per trainable key. The graph has no initialiser of the model's: every
    weight is fed. Exported with ``torch.onnx.export(dynamo=True)`` at ``ONNX_TRAINING_OPSET``; seconds for the
    built-in models, not minutes."""
    import onnx

    from .conv_backward import CONV_BACKWARD_DECOMPOSITIONS

    joint = joint_graph(prepared, mode=mode, batch_size=batch_size, kp=kp, convolutions="native",
                        decompositions=CONV_BACKWARD_DECOMPOSITIONS)
    names = ["x", "y", "weight", *joint.keys]
    outputs = ["loss", *(f"grad:{k}" for k in joint.trainable)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            onx = torch.onnx.export(joint.program, (), dynamo=True, input_names=names, output_names=outputs,
                                    opset_version=ONNX_TRAINING_OPSET, optimize=True, verbose=False)
        if onx is None:
            raise ExportError("the exporter returned no program")
        proto = onx.model_proto
        # the exporter's per-node debug metadata (fx node text, stack traces with this machine's paths) is 85 % of
        # mobilenet-v1's program and tells a device nothing
        for node in proto.graph.node:
            del node.metadata_props[:]
        del proto.metadata_props[:]
        onnx.checker.check_model(proto)
    except ExportError:
        raise
    except Exception as e:  # the exporter raises many kinds; say which model and why
        raise ExportError(f"ONNX training export of {prepared.spec.model} ({mode}) failed: {e}") from e
    got_in, got_out = [i.name for i in proto.graph.input], [o.name for o in proto.graph.output]
    if got_in != names or got_out != outputs:
        raise ExportError(f"the ONNX training program's inputs/outputs are not the signature's: {got_in[:4]}..., "
                          f"{got_out[:3]}...")
    baked = sorted(i.name for i in proto.graph.initializer if i.name in set(joint.keys))
    if baked:
        raise ExportError(f"the ONNX training program bakes {baked} in")
    tag = f"{prepared.tag}-train-{mode}" + (f"-kp{kp}" if mode == "personal" else "")
    details = _details(prepared, joint, mode, kp, batch_size) | {
        "runtime": "onnxruntime", "opset": ONNX_TRAINING_OPSET,
        "operators": sorted({n.op_type for n in proto.graph.node}), "convolutions": "native"}
    return Lowered(dataclasses.replace(prepared, tag=tag), "onnx", proto.SerializeToString(), details)
