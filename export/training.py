"""ExecuTorch *training* programs: ``lower_executorch_training`` -> ``package`` (``edge_runtime.verify_training``
checks them).

A training program computes one forward and backward pass and returns the loss; the runtime exposes the
gradients of its trainable parameters and those parameters themselves, in place (DESIGN.md, "On-device training
with ExecuTorch"): ``torch.export`` -> ``_export_forward_backward`` -> ``to_edge`` -> ``to_executorch``, no
XNNPACK delegate. The optimizer step is not in the program; the device runs it (``edge_runtime.training``).

Program signature (``details["inputs"]``): ``forward(x, y, weight, *frozen) -> (loss,)``

- ``x`` (B, C, H, W), ``y`` (B,) int64 and ``weight`` (B,) float: the loss is
  ``sum(weight * ce) / max(sum(weight), 1)``. The batch dimension is fixed at the profile's batch size; a
  partial batch (the last of an epoch) is padded with weight-0 samples. Every model here normalises per sample
  (GroupNorm, never BatchNorm, which cannot be trained by ExecuTorch anyway), so padded samples do not touch the
  others' activations, and their weight-0 terms contribute exactly zero to every gradient: the gradient is the
  mean over the real samples, as eager PyTorch computes it on the short batch (same value; the summation order
  inside a convolution may differ, within float rounding). One program serves every batch size up to B, with no
  second program for the remainder.
- ``*frozen``: the parameters that are *not* trainable in this mode, passed as inputs at every call. A frozen
  parameter left inside the program would be a constant baked into the ``.pte`` and could not be replaced, but
  FedPer-FT's first epoch trains the personal blocks on top of a base that changes every round. As inputs they are
  swapped for free; the program never computes their gradients, and backward stops at the first trainable layer.

Modes (which parameters the program trains):

- ``fedper``: every parameter (base and personal blocks; the base is what the device uploads).
- ``personal``: the parameters of the last ``kp`` blocks (``pfl_edge.split.split_keys``); the base is frozen.
- ``dispfl``: every parameter, and the program's parameters are the *effective* weights ``w_eff = w * m``.
  The mask never enters the program. Masked training with ``w`` held at ``w * m`` is the same thing as the
  simulator's: the gradient of ``loss(w * m)`` with respect to ``w`` is ``m * dloss/dw_eff``, so the backend masks
  the gradient, steps, and re-applies the mask, exactly as ``pfl_edge.train`` does. The unmasked gradient the
  program returns is ``dloss/dw_eff`` at ``w_eff``, which is precisely DisPFL's regrowth screen
  (``pfl_edge.train.dense_gradients``); a program that multiplied by the mask in its forward pass would hand
  back only the masked gradient, and could not serve the screen. And masks change every round (prune and
  regrow) without a re-export. The graph is the ``fedper`` one; the mode is recorded for the manifest, and a
  ``mask`` given here only sets the program's initial weights to ``w * m`` and its density.

Weights are swapped into a loaded program (a new base from the server, the neighbours' average) without
re-export: the runtime's parameter tensors alias the program's memory, and ``copy_`` into them is what the next
``forward_backward`` sees (tested).
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
from pfl_edge.models import BlockModel
from pfl_edge.split import split_keys

from .matmul_conv import matmul_convs
from .stages import ExportError, Lowered, Prepared

__all__ = ["CONVOLUTIONS", "TRAINING_MODES", "JointGraph", "TrainingWrapper", "joint_graph",
           "lower_executorch_training", "trainable_keys"]

TRAINING_MODES = ("fedper", "personal", "dispfl")
NET = "net"  # the wrapper's attribute holding the model: the runtime names parameters "net.<state-dict key>"


class TrainingWrapper(nn.Module):
    """The model plus its loss: ``forward(x, y, weight, *frozen)`` returns the weighted mean cross-entropy.
    ``frozen`` replaces the named parameters for this call (``functional_call``), so they are inputs, not
    constants."""

    def __init__(self, net: nn.Module, frozen: list[str]) -> None:
        super().__init__()
        self.net = net
        self.frozen = list(frozen)

    def forward(self, x: Tensor, y: Tensor, weight: Tensor, *frozen: Tensor) -> Tensor:
        logits = functional_call(self.net, dict(zip(self.frozen, frozen, strict=True)), (x,), strict=False)
        losses = F.cross_entropy(logits, y, reduction="none")
        # the same expression as pfl_edge.train's vmap engine: a mean over the weight-1 samples
        return (losses * weight).sum() / weight.sum().clamp_min(1.0)


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


@dataclasses.dataclass(frozen=True, eq=False)
class JointGraph:
    """A model's forward-and-backward graph (``torch.export``'s ``_export_forward_backward``), before lowering:
    what ``lower_executorch_training`` lowers and ``bench/train_ops.py`` times operator by operator."""

    program: Any  # torch.export.ExportedProgram
    example: tuple[Tensor, ...]  # (x, y, weight, *frozen)
    trainable: list[str]
    frozen: list[str]
    keys: list[str]
    shapes: dict[str, list[int]]


def joint_graph(prepared: Prepared, *, mode: str, batch_size: int, kp: int | None = None,
                mask: Mapping[str, Tensor] | None = None, convolutions: str = "matmul") -> JointGraph:
    """The joint graph of ``lower_executorch_training`` (same arguments)."""
    if convolutions not in CONVOLUTIONS:
        raise ConfigError(f"unknown convolutions {convolutions!r}; valid: {', '.join(CONVOLUTIONS)}")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if mode != "personal" and kp is not None:
        raise ConfigError(f"kp applies to mode 'personal' only, not {mode!r}")
    if mask is not None and mode != "dispfl":
        raise ConfigError(f"a mask applies to mode 'dispfl' only, not {mode!r}")
    # a copy: requires_grad and the masked weights change here, not on the caller's
    net = matmul_convs(prepared.model) if convolutions == "matmul" else copy.deepcopy(prepared.model)
    trainable = trainable_keys(net, mode, kp)
    named = dict(net.named_parameters())
    frozen = [k for k in named if k not in set(trainable)]
    if any(True for _ in net.buffers()):
        raise ExportError(f"{prepared.spec.model} has buffers (BatchNorm?): ExecuTorch cannot export BatchNorm in "
                          "training mode; use a GroupNorm model")
    with torch.no_grad():
        for k, m in (mask or {}).items():
            if k not in named:
                raise ConfigError(f"mask for {k!r}, which is not a parameter")
            named[k].mul_(m)
    for k, p in named.items():
        p.requires_grad_(k in set(trainable))
    net.train()
    x = torch.zeros(batch_size, *prepared.input_shape)
    y = torch.zeros(batch_size, dtype=torch.int64)
    w = torch.ones(batch_size)
    example = (x, y, w, *(named[k].detach().clone() for k in frozen))
    try:
        from torch.export.experimental import _export_forward_backward

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(TrainingWrapper(net, frozen), example, strict=True)
            ep = _export_forward_backward(ep)
    except Exception as e:  # export raises many kinds; say which model and why
        raise ExportError(f"ExecuTorch training export of {prepared.spec.model} ({mode}) failed: {e}") from e
    return JointGraph(ep, example, trainable, frozen, list(net.state_dict()),
                      {k: list(v.shape) for k, v in named.items()})


def lower_executorch_training(prepared: Prepared, *, mode: str, batch_size: int, kp: int | None = None,
                              mask: Mapping[str, Tensor] | None = None, convolutions: str = "matmul") -> Lowered:
    """An ExecuTorch training program for ``prepared.model`` (see the module docstring for its signature).

    The returned ``Lowered`` carries a copy of ``prepared`` whose tag names the mode (``fresh-train-fedper``,
    ``client003-train-personal-kp2``), so ``package`` writes it beside the inference ``.pte`` without a clash.
    ``details`` holds what a device needs to drive the program: ``kind``, ``mode``, ``batch_size``, ``inputs``,
    ``trainable``, ``frozen``, ``keys`` (every state-dict key, in order), ``input_shape``.

    ``convolutions``: ``"matmul"`` (default) rewrites them into slices and matrix products
    (``export.matmul_conv``), which the runtime runs on its optimized kernels; ``"native"`` keeps
    ``aten.convolution``, which it runs on portable loops (two orders of magnitude slower; kept to measure)."""
    joint = joint_graph(prepared, mode=mode, batch_size=batch_size, kp=kp, mask=mask, convolutions=convolutions)
    try:
        from executorch.exir import to_edge

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            edge = to_edge(joint.program)
            # the edge-dialect operators, read before to_executorch rewrites the graph into out-variants
            ops = sorted({getattr(n.target, "__name__", str(n.target)) for n in edge.exported_program().graph.nodes
                          if n.op == "call_function"})
            program = edge.to_executorch().buffer
    except Exception as e:  # lowering raises many kinds; say which model and why
        raise ExportError(f"ExecuTorch training export of {prepared.spec.model} ({mode}) failed: {e}") from e
    tag = f"{prepared.tag}-train-{mode}" + (f"-kp{kp}" if mode == "personal" else "")
    details: dict[str, Any] = {
        "kind": "training", "mode": mode, "kp": kp, "batch_size": batch_size,
        "inputs": ["x", "y", "weight", *joint.frozen], "trainable": joint.trainable, "frozen": joint.frozen,
        "keys": joint.keys, "shapes": joint.shapes, "input_shape": list(prepared.input_shape),
        "loss": "sum(weight * cross_entropy) / max(sum(weight), 1)", "operators": ops,
        "convolutions": convolutions,
    }
    if mask is not None:
        details["mask_density"] = float(sum(m.sum() for m in mask.values()) / sum(m.numel() for m in mask.values()))
    return Lowered(dataclasses.replace(prepared, tag=tag), "executorch", program, details)
