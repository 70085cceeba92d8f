"""A convolution's backward as plain convolutions and matrix products, for the ONNX training program.

``torch.onnx.export`` has no ONNX function for ``aten.convolution_backward`` (ONNX has no such operator), so the
ONNX training export (``export.training.lower_onnx_training``) traces the joint graph with this decomposition in
the table. Each gradient becomes operators every ONNX runtime has, chosen for ONNX Runtime's CPU kernels
(``bench/train_step.py`` measures the result):

- bias: ``grad.sum((0, 2, 3))``.
- input, stride 1: a convolution of ``grad`` with the flipped kernel (channels swapped; depthwise keeps its
  groups), padded ``dilation * (k - 1) - padding``; a pointwise (1x1) convolution is that with no flip. Strided:
  ``ConvTranspose`` with the forward's attributes and the output padding that restores the input's size.
- weight, pointwise: one matrix product, ``grad (Cout, N*H*W) @ x (Cin, N*H*W).T``.
- weight, ``groups == 1``: a convolution of the input (channels and batch swapped: ``(Cin, N, H, W)``) with
  the gradient (``(Cout, N, Ho, Wo)``) as its kernel, the forward's stride and dilation swapped; the batch is
  the reduction dimension, so the sum over samples happens inside the convolution.
- weight, depthwise (one input channel per group, as many outputs as inputs): the same with ``groups = C``,
  each group's kernel a channel's gradient over the batch (``(C, N, Ho, Wo)``) and its input that channel of
  every sample, so the sum over samples is again inside the convolution (one group per channel; a group per
  channel and sample, as ``torch.nn.grad.conv2d_weight`` does, was measured 3-5x slower in ONNX Runtime).
- any other grouping or a transposed convolution: not decomposed (the export then fails, naming the operator).

Every result is the same function as autograd's, summed in another order: tests/export/test_conv_backward.py
holds each case to autograd's in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["CONV_BACKWARD_DECOMPOSITIONS", "convolution_backward"]

aten = torch.ops.aten


def _grad_input(grad: Tensor, x: Tensor, weight: Tensor, stride: Sequence[int], padding: Sequence[int],
                dilation: Sequence[int], groups: int) -> Tensor:
    cout, cin_g, kh, kw = weight.shape
    cin = x.shape[1]
    depthwise = groups == cin and cin_g == 1 and cout == cin
    if list(stride) == [1, 1] and (groups == 1 or depthwise):
        flipped = weight if kh == kw == 1 else weight.flip([2, 3])
        kernel = flipped.transpose(0, 1) if groups == 1 else flipped
        pad = [dilation[0] * (kh - 1) - padding[0], dilation[1] * (kw - 1) - padding[1]]
        if min(pad) >= 0:
            return aten.convolution(grad, kernel, None, [1, 1], pad, list(dilation), False, [0, 0], groups)
    h, w = x.shape[2], x.shape[3]
    ho, wo = grad.shape[2], grad.shape[3]
    out_pad = [h - ((ho - 1) * stride[0] - 2 * padding[0] + dilation[0] * (kh - 1) + 1),
               w - ((wo - 1) * stride[1] - 2 * padding[1] + dilation[1] * (kw - 1) + 1)]
    return aten.convolution(grad, weight, None, list(stride), list(padding), list(dilation), True, out_pad, groups)


def _grad_weight(grad: Tensor, x: Tensor, weight: Tensor, stride: Sequence[int], padding: Sequence[int],
                 dilation: Sequence[int], groups: int) -> Tensor | None:
    n, cin, h, w = x.shape
    cout, cin_g, kh, kw = weight.shape
    ho, wo = grad.shape[2], grad.shape[3]
    if groups == 1 and kh == kw == 1 and list(stride) == [1, 1] and list(padding) == [0, 0]:
        g2 = grad.transpose(0, 1).reshape(cout, n * ho * wo)
        x2 = x.transpose(0, 1).reshape(cin, n * h * w)
        return aten.mm(g2, x2.t()).reshape(cout, cin, 1, 1)
    if groups == 1:
        gw = aten.convolution(x.transpose(0, 1), grad.transpose(0, 1), None, list(dilation), list(padding),
                              list(stride), False, [0, 0], 1)
        return gw.transpose(0, 1)[:, :, :kh, :kw]
    if cin_g == 1 and cout == cin == groups:
        xt = x.transpose(0, 1).reshape(1, cin * n, h, w)
        gw = aten.convolution(xt, grad.transpose(0, 1), None, list(dilation), list(padding), list(stride), False,
                              [0, 0], cin)
        return gw.reshape(cout, 1, gw.shape[2], gw.shape[3])[:, :, :kh, :kw]
    return None


def convolution_backward(grad: Tensor, x: Tensor, weight: Tensor, bias_sizes: Any, stride: Sequence[int],
                         padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                         output_padding: Sequence[int], groups: int, output_mask: Sequence[bool]) -> Any:
    """``aten.convolution_backward`` of a 2-D, non-transposed convolution in the operators above;
    ``NotImplemented`` (the tracer then keeps the operator) for what it does not cover."""
    if transposed or x.dim() != 4:
        return NotImplemented
    gi = gw = gb = None
    if output_mask[1]:
        gw = _grad_weight(grad, x, weight, stride, padding, dilation, groups)
        if gw is None:
            return NotImplemented
    if output_mask[0]:
        gi = _grad_input(grad, x, weight, stride, padding, dilation, groups)
    if output_mask[2]:
        gb = grad.sum([0, 2, 3])
    return gi, gw, gb


CONV_BACKWARD_DECOMPOSITIONS = {aten.convolution_backward.default: convolution_backward}
