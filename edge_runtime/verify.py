"""A training program checked against eager PyTorch: loss, gradients and a few SGD updates run through the
device's own program backend (``OnnxBackend`` or ``ExecuTorchBackend``, by the program's format) beside the same
steps in eager PyTorch. It lives with the runtime because the
check needs one (``export`` builds programs and never imports the runtime)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.stages import ExportError, Lowered, Packaged, Prepared, _update_manifest
from pfl_edge.errors import ConfigError, InternalError
from pfl_edge.train import TrainConfig

from .program_backends import ExecuTorchBackend, OnnxBackend, ProgramBackend

__all__ = ["TrainingVerified", "verify_training"]

@dataclass(frozen=True, eq=False)
class TrainingVerified:
    target: Lowered | Packaged
    grad_max_abs_err: float
    weight_max_abs_err: float
    loss_abs_err: float
    grad_atol: float
    weight_atol: float


def verify_training(target: Lowered | Packaged, *, mask: Mapping[str, Tensor] | None = None, lr: float = 0.05,
                    momentum: float = 0.9, weight_decay: float = 1e-3, steps: int = 2, grad_atol: float = 1e-5,
                    weight_atol: float = 1e-5, seed: int = 0) -> TrainingVerified:
    """Loss, gradients and ``steps`` SGD updates of the program (through ``edge_runtime``'s program backend,
    as a device runs it) against eager PyTorch, from the prepared model's weights on random data: a full batch,
    then a partial one (padded, weight 0). ``mask`` (dispfl) masks the weights, gradients and updates.

    Thresholds: ``grad_atol`` on every gradient element (seen: 1e-8 for the cnn), ``weight_atol`` on every weight
    after the steps; the loss within ``grad_atol`` too. Past them, raises ``ExportError``. A ``Packaged`` target
    gets the errors recorded in its manifest entry."""
    lowered = target.lowered if isinstance(target, Packaged) else target
    d = lowered.details
    if d.get("kind") != "training":
        raise ConfigError("verify_training needs a training program (lower_onnx_training, "
                          "lower_executorch_training)")
    prep = lowered.prepared
    batches = _random_batches(prep, int(d["batch_size"]), seed)
    masks = dict(mask or {})
    eager = _masked_copy(prep.model, masks)
    backend = (OnnxBackend if lowered.format == "onnx" else ExecuTorchBackend).open(lowered.program, d)
    backend.load({k: v.detach().clone() for k, v in eager.state_dict().items()})
    cfg = TrainConfig(lr=lr, momentum=momentum, weight_decay=weight_decay)
    grad_err, loss_err = _step_side_by_side(eager, backend, cfg, list(d["trainable"]), masks, batches, steps)
    state = backend.state()
    weight_err = max(float((state[k] - v.detach()).abs().max()) for k, v in eager.state_dict().items())
    name = target.path.name if isinstance(target, Packaged) else f"{prep.spec.model} training program"
    if grad_err > grad_atol or loss_err > grad_atol:
        raise ExportError(f"{name}: gradients differ from eager PyTorch by {grad_err:.3g} (loss by {loss_err:.3g}; "
                          f"atol {grad_atol})")
    if weight_err > weight_atol:
        raise ExportError(f"{name}: weights after {steps} SGD steps differ from eager PyTorch by {weight_err:.3g} "
                          f"(atol {weight_atol})")
    if isinstance(target, Packaged):
        target.entry["verify"] = {"grad_max_abs_err": grad_err, "weight_max_abs_err": weight_err,
                                  "loss_abs_err": loss_err, "steps": steps, "grad_atol": grad_atol,
                                  "weight_atol": weight_atol, "passed": True}
        _update_manifest(target.path.parent, target.entry)
    return TrainingVerified(target, grad_err, weight_err, loss_err, grad_atol, weight_atol)


def _random_batches(prep: Prepared, b: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """Random images and labels from ``seed``: a full batch of ``b``, then a partial one (the program pads it)."""
    gen = torch.Generator().manual_seed(seed)
    ncls = int(prep.spec.num_classes)
    batches = [(torch.randn(b, *prep.input_shape, generator=gen), torch.randint(0, ncls, (b,), generator=gen))]
    short = max(1, b - 3) if b > 1 else 1
    batches.append((torch.randn(short, *prep.input_shape, generator=gen),
                    torch.randint(0, ncls, (short,), generator=gen)))
    return batches


def _masked_copy(model: nn.Module, masks: Mapping[str, Tensor]) -> nn.Module:
    """A copy of ``model`` in training mode, its masked weights multiplied by their masks."""
    eager = copy.deepcopy(model).train()
    named = dict(eager.named_parameters())
    with torch.no_grad():
        for k, m in masks.items():
            named[k].mul_(m)
    return eager


def _step_side_by_side(eager: nn.Module, backend: ProgramBackend, cfg: TrainConfig, trainable: list[str],
                       masks: Mapping[str, Tensor], batches: list[tuple[Tensor, Tensor]],
                       steps: int) -> tuple[float, float]:
    """``steps`` SGD steps of ``trainable`` in eager PyTorch (``eager`` is updated in place) and in the program
    (through ``backend``), masked as DisPFL masks them; the largest gradient and loss differences seen."""
    named = dict(eager.named_parameters())
    sgd = backend.sgd(cfg, mask=masks)
    for p in eager.parameters():
        p.requires_grad_(False)
    params = [named[k] for k in trainable]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    grad_err, loss_err = 0.0, 0.0
    for i in range(steps):
        x, y = batches[i % len(batches)]
        got_loss, got = backend.gradients(x, y)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(eager(x), y)
        loss.backward()
        loss_err = max(loss_err, abs(loss.item() - got_loss))
        for k in trainable:
            g = named[k].grad
            if g is None:
                raise InternalError(f"eager PyTorch gave no gradient for trainable {k!r}")
            grad_err = max(grad_err, float((g - got[k]).abs().max()))
            if k in masks:
                g.mul_(masks[k])
        opt.step()
        with torch.no_grad():
            for k, m in masks.items():
                named[k].mul_(m)
        sgd.step(got)
    return grad_err, loss_err
