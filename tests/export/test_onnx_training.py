"""The ONNX training program (``export.lower_onnx_training``): its convolution backward held to autograd's in
float64 case by case (``export.conv_backward``), and every shipped model's program, run by ONNX Runtime, against
autograd within docs/model.md's bounds (``export.worker.check_training``), its interface as the card describes it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import onnx
import pytest
import torch
import torch.nn.functional as F

from device_profiles import get_profile
from export import lower_onnx_training, prepare
from export.conv_backward import convolution_backward
from export.worker import check_training, run_training_program
from pfl_edge.checkpoint import ModelSpec
from pfl_edge.modelcard import TRAINING_SIGNATURE

aten = torch.ops.aten


# (cin, cout, kernel, stride, padding, dilation, groups, size): pointwise, dense stride 1 and 2, an input size the
# stride does not divide, dilation, a padding beyond the kernel's reach (the transposed path), depthwise 1 and 2
CASES = [(6, 5, 1, 1, 0, 1, 1, 7), (3, 4, 3, 1, 1, 1, 1, 8), (3, 4, 5, 2, 2, 1, 1, 9), (4, 6, 3, 2, 1, 1, 1, 10),
         (2, 3, 3, 1, 1, 2, 1, 9), (2, 3, 3, 1, 3, 1, 1, 6), (5, 5, 3, 1, 1, 1, 5, 8), (6, 6, 3, 2, 1, 1, 6, 9),
         (4, 4, 3, 2, 1, 1, 4, 8)]


@pytest.mark.parametrize(("cin", "cout", "k", "s", "p", "d", "g", "size"), CASES)
def test_convolution_backward_equals_autograds_in_float64(cin: int, cout: int, k: int, s: int, p: int, d: int,
                                                          g: int, size: int) -> None:
    gen = torch.Generator().manual_seed(cin * 100 + k * 10 + s)
    x = torch.randn(3, cin, size, size + 1, generator=gen, dtype=torch.float64)
    w = torch.randn(cout, cin // g, k, k, generator=gen, dtype=torch.float64)
    out = F.conv2d(x, w, None, s, p, d, g)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    args = (grad, x, w, [cout], [s, s], [p, p], [d, d], False, [0, 0], g, [True, True, True])
    want = aten.convolution_backward.default(*args)
    got = convolution_backward(*args)
    assert got is not NotImplemented
    for name, a, b in zip(("input", "weight", "bias"), got, want, strict=True):
        assert a.shape == b.shape, name
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-10), (name, float((a - b).abs().max()))
    # only what is asked for is computed (the first layer's input needs no gradient)
    part = convolution_backward(*args[:-1], [False, True, False])
    assert part[0] is None and part[2] is None and torch.allclose(part[1], want[1], rtol=1e-10, atol=1e-10)


def test_what_it_does_not_cover_is_left_to_the_tracer() -> None:
    x, w = torch.randn(1, 4, 6, 6), torch.randn(4, 2, 3, 3)  # groups 2 with 2 channels a group
    grad = torch.randn(1, 4, 4, 4)
    args = (grad, x, w, [4], [1, 1], [0, 0], [1, 1], False, [0, 0], 2, [True, True, True])
    assert convolution_backward(*args) is NotImplemented
    assert convolution_backward(*args[:7], True, *args[8:]) is NotImplemented  # transposed


# the larger two in the slow tier (10-20 s each on a loaded 2-core machine); CI runs both tiers
MODELS = [("cnn", 1, 28), pytest.param("resnet18-gn", 3, 16, marks=pytest.mark.slow),
          pytest.param("mobilenet-v1", 1, 28, marks=pytest.mark.slow)]


@pytest.mark.parametrize(("model", "channels", "size"), MODELS)
def test_every_model_trains_with_onnx_runtime_as_autograd_does(model: str, channels: int, size: int) -> None:
    prep = prepare(get_profile("raspberry-pi-4"), spec=ModelSpec(model, 10, channels, size), seed=3)
    t0 = time.monotonic()
    low = lower_onnx_training(prep, mode="fedper", batch_size=4)
    took = time.monotonic() - t0
    d = low.details
    assert low.format == "onnx" and d["runtime"] == "onnxruntime" and d["signature"] == TRAINING_SIGNATURE
    keys = [k for k, _ in prep.model.named_parameters()]
    assert d["inputs"] == ["x", "y", "weight", *keys] and d["trainable"] == keys and d["frozen"] == []
    assert d["outputs"] == ["loss", *(f"grad:{k}" for k in keys)]
    proto = onnx.load_from_string(low.program)
    assert proto.opset_import[0].version == d["opset"] == 18
    assert not {i.name for i in proto.graph.initializer} & set(keys)  # every weight is fed, none baked in
    assert "ConvolutionBackward" not in d["operators"] and "Conv" in d["operators"]
    check_training(low.program, d, prep)  # loss and every gradient against autograd, a padded sample included
    print(f"{model}: ONNX training export {took:.1f} s, {len(low.program) / 1e3:.0f} kB, {len(d['operators'])} "
          "operator types")


def test_the_check_catches_gradients_that_are_not_autograds() -> None:
    """check_training is no formality: a program whose gradients come out in another order than its details say
    (each compared with another tensor's), or one run on a batch whose padding it counts, is refused."""
    prep = prepare(get_profile("raspberry-pi-4"), spec=ModelSpec("cnn", 10, 1, 28), seed=3)
    low = lower_onnx_training(prep, mode="fedper", batch_size=4)
    d = dict(low.details)
    swapped = list(d["trainable"])
    swapped[0], swapped[2] = swapped[2], swapped[0]  # conv1's weight and conv2's: other shapes, other values
    with pytest.raises(ValueError, match="differ"):
        check_training(low.program, {**d, "trainable": swapped}, prep)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 1, 28, 28, generator=gen), torch.randint(0, 10, (4,), generator=gen)
    params = dict(prep.model.named_parameters())
    w = torch.tensor([1.0, 1.0, 1.0, 0.0])
    padded = run_training_program(low.program, d, [x, y, w, *(params[k] for k in d["keys"])])
    counted = run_training_program(low.program, d, [x, y, torch.ones(4), *(params[k] for k in d["keys"])])
    assert not torch.allclose(padded[1], counted[1], atol=1e-4)  # the weight input is what drops a padded sample


def test_personal_program_differentiates_the_personal_blocks_only() -> None:
    prep = prepare(get_profile("raspberry-pi-4"), spec=ModelSpec("cnn", 10, 1, 28), seed=3)
    low = lower_onnx_training(prep, mode="personal", batch_size=4, kp=2)
    d = low.details
    assert d["trainable"] == ["fc2.0.weight", "fc2.0.bias", "head.weight", "head.bias"]
    assert d["frozen"][:2] == ["conv1.0.weight", "conv1.0.bias"]
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 1, 28, 28, generator=gen), torch.randint(0, 10, (4,), generator=gen)
    params = dict(prep.model.named_parameters())
    out = run_training_program(low.program, d, [x, y, torch.ones(4), *(params[k] for k in d["keys"])])
    prep.model.zero_grad()
    F.cross_entropy(prep.model(x), y).backward()
    assert len(out) == 1 + 4
    for k, g in zip(d["trainable"], out[1:], strict=True):
        ref = params[k].grad
        assert ref is not None and torch.allclose(g, ref, atol=1e-6, rtol=1e-4), k


def test_cli_exports_and_verifies_an_onnx_training_program(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """pfl-edge export --format onnx-training: the program beside its manifest entry, its SGD steps checked against
    eager PyTorch through the device's OnnxBackend (edge_runtime.verify_training), as a device would load it."""
    from edge_runtime.training import OnnxBackend
    from pfl_edge.cli import main

    assert main(["export", "--profile", "phone-mid", "--format", "onnx-training", "--mode", "personal",
                 "--out", str(tmp_path)]) == 0
    assert "against eager PyTorch" in capsys.readouterr().out
    entry = json.loads((tmp_path / "manifest.json").read_text())[0]
    assert entry["path"].endswith("-train-personal-kp2.onnx") and entry["verify"]["passed"]
    assert entry["runtime"] == "onnxruntime" and entry["frozen"]
    backend = OnnxBackend.from_file(tmp_path / entry["path"])
    assert backend.trainable == entry["trainable"]
