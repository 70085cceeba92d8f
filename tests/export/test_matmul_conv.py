"""The training export's matrix-product convolutions compute nn.Conv2d / nn.Linear, value and gradient (float64,
against torch's own convolution as the independent reference)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from export import MatmulConv2d, matmul_convs
from export.matmul_conv import MatmulLinear
from pfl_edge.checkpoint import ModelSpec, build_model

CASES = [  # (cin, cout, kernel, stride, padding, groups, bias)
    (1, 8, 5, 2, 2, 1, True),  # the cnn's conv1
    (4, 6, 3, 1, 1, 1, False),
    (3, 5, 3, 2, 0, 1, True),  # no padding, stride 2
    (6, 4, 1, 1, 0, 1, False),  # pointwise
    (2, 3, (3, 5), (1, 2), (1, 2), 1, True),  # rectangular
]


@pytest.mark.parametrize("cin,cout,k,s,p,g,bias", CASES)
def test_matmul_conv_equals_conv2d_in_value_and_gradient(cin: int, cout: int, k: int, s: int, p: int, g: int,
                                                         bias: bool) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, k, stride=s, padding=p, groups=g, bias=bias).double()
    fast = MatmulConv2d(conv)
    assert fast.weight is conv.weight  # the same parameter: state-dict keys and optimiser state carry over
    x = torch.randn(3, cin, 9, 11, dtype=torch.float64, requires_grad=True)
    ref = conv(x)
    out = fast(x)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    gout = torch.randn_like(ref)
    g_ref = torch.autograd.grad(ref, [x, *conv.parameters()], gout)
    g_fast = torch.autograd.grad(out, [x, *conv.parameters()], gout)
    for a, b in zip(g_fast, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_matmul_linear_equals_linear() -> None:
    torch.manual_seed(1)
    lin = nn.Linear(7, 4).double()
    fast = MatmulLinear(lin)
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(fast(x), lin(x), rtol=1e-12, atol=1e-12)
    g = torch.randn(5, 4, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(fast(x), [x, lin.weight, lin.bias], g),
                    torch.autograd.grad(lin(x), [x, lin.weight, lin.bias], g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_unsupported_convolutions_are_left_alone() -> None:
    # dilated, grouped and depthwise (measured faster on the runtime's own convolution) stay nn.Conv2d
    dilated = nn.Sequential(nn.Conv2d(2, 4, 3, dilation=2), nn.Conv2d(4, 4, 3, groups=2),
                            nn.Conv2d(4, 4, 3, groups=4))
    out = matmul_convs(dilated)
    assert all(isinstance(m, nn.Conv2d) for m in out)
    with pytest.raises(ValueError, match="cannot express"):
        MatmulConv2d(dilated[0])


@pytest.mark.parametrize("name,ch,size", [("cnn", 1, 28), ("mobilenet-v1", 3, 16), ("resnet18-gn", 3, 16)])
def test_every_model_rewrites_to_the_same_function(name: str, ch: int, size: int) -> None:
    torch.manual_seed(2)
    model = build_model(ModelSpec(name, 10, ch, size)).double()
    fast = matmul_convs(model)
    assert list(fast.state_dict()) == list(model.state_dict())
    left = [m for m in fast.modules() if isinstance(m, nn.Conv2d | nn.Linear)]
    assert all(isinstance(m, nn.Conv2d) and m.groups > 1 for m in left)  # all but the depthwise ones rewritten
    assert any(isinstance(m, MatmulConv2d) for m in fast.modules())
    x = torch.randn(2, ch, size, size, dtype=torch.float64)
    torch.testing.assert_close(fast(x), model(x), rtol=1e-10, atol=1e-10)
