"""FLOP counts as docs/algorithms.md defines them (DisPFL's accounting).

Per sample, forward: a convolution costs (2 * nnz(W) + C_out) * H_out * W_out where it has a bias and
2 * nnz(W) * H_out * W_out where it has none (the DisPFL reference's count: the bias adds C_out per output
position), a linear layer 2 * nnz(W) + nnz(b); norms, activations and pooling are not counted (docs/algorithms.md).
Training a sample costs 3 forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

__all__ = ["forward_flops", "layer_sizes", "module_outputs"]


def module_outputs(model: nn.Module, input_shape: tuple[int, ...],
                   pick: Callable[[str, nn.Module], bool]) -> dict[str, tuple[nn.Module, list[Tensor]]]:
    """One eval-mode forward pass of a zero sample; the outputs of every module ``pick`` selects, by name (a
    module called twice, like a shared ReLU, has two)."""
    found: dict[str, tuple[nn.Module, list[Tensor]]] = {}
    hooks = []
    for name, mod in model.named_modules():
        if pick(name, mod):
            def hook(m: nn.Module, inp: object, out: Tensor, name: str = name) -> None:
                found.setdefault(name, (m, []))[1].append(out)
            hooks.append(mod.register_forward_hook(hook))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(1, *input_shape))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return found


def layer_sizes(model: nn.Module, input_shape: tuple[int, ...]) -> dict[str, tuple[str, int]]:
    """For every conv / linear module: (kind, output positions per sample), found by one forward pass."""
    outs = module_outputs(model, input_shape, lambda _n, m: isinstance(m, nn.Conv2d | nn.Linear))
    return {name: ("conv" if isinstance(m, nn.Conv2d) else "linear",
                   int(out[0].shape[2] * out[0].shape[3]) if out[0].dim() == 4 else 1)
            for name, (m, out) in outs.items()}


def forward_flops(model: nn.Module, input_shape: tuple[int, ...], masks: Mapping[str, Tensor] | None = None,
                  sizes: dict[str, tuple[str, int]] | None = None) -> int:
    """Forward FLOPs for one sample, counting only the weights active in ``masks`` (dense if absent)."""
    sizes = sizes if sizes is not None else layer_sizes(model, input_shape)
    params = dict(model.named_parameters())
    total = 0
    for name, (kind, positions) in sizes.items():
        weight = params[f"{name}.weight"]
        # the bias adds C_out per output position to a convolution (only if it has one: the DisPFL reference's
        # count), nnz(b) to a linear layer
        has_bias = f"{name}.bias" in params
        extra = (weight.shape[0] if has_bias else 0) if kind == "conv" else _nnz(params, masks, f"{name}.bias")
        total += positions * (2 * _nnz(params, masks, f"{name}.weight") + extra)
    return total


def _nnz(params: Mapping[str, Tensor], masks: Mapping[str, Tensor] | None, key: str) -> int:
    if key not in params:
        return 0
    if masks is not None and key in masks:
        return int(masks[key].count_nonzero())
    return params[key].numel()
