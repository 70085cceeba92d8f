"""Convolutions as matrix products, for training programs.

ExecuTorch's pip runtime runs ``aten.convolution`` and ``aten.convolution_backward`` on its portable (reference)
kernels: a plain loop nest, about 125x slower than eager PyTorch for the cnn's second convolution on one thread
(BENCHMARKS.md, "Where a training step's time goes"). Its matrix product (``aten.bmm``) is the optimized
library's, about as fast as eager's. So the training export rewrites every ``nn.Conv2d`` into the same function
built from slices and one matrix product (im2col without an ``im2col`` kernel, which the runtime lacks):

- ``groups == 1``: the input, channels first (``C, B, H, W``), is cut into ``kH * kW`` strided slices, one per
  kernel offset, stacked into the column matrix ``(C * kH * kW, B * Ho * Wo)``; the output is
  ``W.reshape(Cout, C * kH * kW) @ cols``. Its backward is two matrix products and ``slice_scatter`` s.
- depthwise convolutions (``groups > 1``) stay ``aten.convolution``: written as a sum over kernel offsets of
  strided slices times per-channel weights they were measured 1.2-2.2x *slower* than the runtime's portable
  convolution (its backward is nine full-size ``slice_scatter`` s and adds a layer), and they add nodes that make
  the export minutes longer. They are what is left of mobilenet-v1's gap to eager (BENCHMARKS.md).
- zero padding is a concatenation with zeros, not ``F.pad``: the backward of a pad is a pad with negative
  amounts, which the runtime's ``constant_pad_nd`` refuses.

The rewritten module holds the very same ``weight`` and ``bias`` parameters, so the state-dict keys, the program's
parameter names and the gradients are those of the original model; only the summation order differs (tested
against ``nn.Conv2d`` and autograd in float64, ``tests/export/test_matmul_conv.py``). Dilated and grouped
convolutions are left as ``nn.Conv2d``.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

__all__ = ["MatmulConv2d", "MatmulLinear", "matmul_convs"]


class MatmulConv2d(nn.Module):
    """``nn.Conv2d`` (zero padding, dilation 1, groups 1) through slices and a matrix product."""

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        if not supported(conv):
            raise ValueError(f"MatmulConv2d cannot express {conv}")
        self.weight = conv.weight
        self.bias = conv.bias
        self.kernel = (int(conv.kernel_size[0]), int(conv.kernel_size[1]))
        self.stride = (int(conv.stride[0]), int(conv.stride[1]))
        pad = conv.padding  # a tuple: supported() refused "same" / "valid"
        self.padding = (int(pad[0]), int(pad[1]))

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        (kh, kw), (sh, sw), (ph, pw) = self.kernel, self.stride, self.padding
        ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
        if pw:
            z = x.new_zeros(b, c, h, pw)
            x = torch.cat([z, x, z], 3)
        if ph:
            z = x.new_zeros(b, c, ph, w + 2 * pw)
            x = torch.cat([z, x, z], 2)
        cout = self.weight.shape[0]

        def window(t: Tensor, i: int, j: int) -> Tensor:  # the inputs kernel offset (i, j) sees, (.., ho, wo)
            return t[:, :, i: i + sh * (ho - 1) + 1: sh, j: j + sw * (wo - 1) + 1: sw]

        xt = x.permute(1, 0, 2, 3)  # C, B, H, W: the columns of one channel are contiguous per offset
        if kh == kw == 1:
            cols = window(xt, 0, 0).reshape(c, b * ho * wo)
        else:
            # cat of unsqueezed windows, not stack: the backward of a cat is slices (XNNPACK runs them), that of a
            # stack selects (which it does not)
            cols = torch.cat([window(xt, i, j).unsqueeze(1) for i in range(kh) for j in range(kw)], 1)
            cols = cols.reshape(c * kh * kw, b * ho * wo)
        # bmm, not mm: the runtime's bmm is the optimized library's (mm measured 1.9x slower than eager)
        prod = torch.bmm(self.weight.reshape(1, cout, c * kh * kw), cols[None])[0]
        out = prod.reshape(cout, b, ho, wo).permute(1, 0, 2, 3)
        if self.bias is not None:
            out = out + self.bias.reshape(1, cout, 1, 1)
        return out


class MatmulLinear(nn.Module):
    """``nn.Linear`` as ``bmm``: the joint graph of ``nn.Linear`` is ``addmm`` and ``mm``, which the runtime runs on
    portable loops (fc1 of the cnn, 3136 -> 128 at batch 32: 26 ms against ~0.5 ms eager); ``bmm`` is optimized."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        out = torch.bmm(x.reshape(1, -1, x.shape[-1]), self.weight.t()[None])[0]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.weight.shape[0])


def supported(conv: nn.Conv2d) -> bool:
    pad = conv.padding
    return (not isinstance(pad, str) and conv.padding_mode == "zeros" and tuple(conv.dilation) == (1, 1)
            and conv.groups == 1)


def matmul_convs(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every supported ``nn.Conv2d`` replaced by a ``MatmulConv2d`` and every
    ``nn.Linear`` by a ``MatmulLinear``, holding the copy's parameters (the original is untouched; state-dict keys
    are unchanged)."""
    out = copy.deepcopy(model)

    def swap(m: nn.Module) -> None:
        for name, child in list(m.named_children()):
            if isinstance(child, nn.Conv2d) and supported(child):
                setattr(m, name, MatmulConv2d(child))
            elif isinstance(child, nn.Linear):
                setattr(m, name, MatmulLinear(child))
            else:
                swap(child)

    swap(out)
    return out
