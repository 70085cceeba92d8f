import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from device_profiles import get_profile
from edge_runtime import load_inference
from export import (
    ExportError,
    Packaged,
    Prepared,
    lower_executorch,
    lower_executorch_int8,
    package,
    prepare,
    verify_int8,
)
from pfl_edge.checkpoint import ModelSpec
from pfl_edge.data import Dataset, get_dataset
from pfl_edge.errors import ConfigError

FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
SPEC = ModelSpec("cnn", 10, 1, 28)


def _data() -> Dataset:
    # Fashion-MNIST where installed (make test installs it), else the synthetic set: either way a model trained
    # for a few hundred steps is far above chance, so accuracy and agreement are meaningful
    return get_dataset("fashion-mnist" if FMNIST.exists() else "synthetic")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ds = _data()
    prep = prepare(get_profile("phone-mid"), spec=SPEC, seed=0)
    model = prep.model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        idx = torch.randint(0, ds.train_x.shape[0], (64,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(ds.train_x[idx]), ds.train_y[idx]).backward()
        opt.step()
    model.eval()
    out = tmp_path_factory.mktemp("int8")
    calib = ds.train_x[:256]
    int8 = package(lower_executorch_int8(prep, calib), out)
    fp32 = package(lower_executorch(prep), out)
    return {"ds": ds, "prep": prep, "calib": calib, "int8": int8, "fp32": fp32, "out": out}


def test_int8_program_runs_at_batch_1_and_8_and_is_smaller(trained: dict[str, Any]) -> None:
    int8: Packaged = trained["int8"]
    fp32: Packaged = trained["fp32"]
    details = int8.lowered.details
    assert details["quantization"] == "int8 static per-channel" and details["calibration_samples"] == 256
    assert any("executorch_call_delegate" in op for op in details["operators"])  # XNNPACK took the graph
    # its own file: the float32 program beside it is not overwritten
    assert int8.path.name == "cnn-phone-mid-fresh-int8.pte" and fp32.path.name == "cnn-phone-mid-fresh.pte"
    runner = load_inference(int8.path, "executorch", 2)
    x = trained["ds"].test_x[:8]
    with torch.no_grad():
        ref = trained["prep"].model(x).numpy()
    for b in (1, 8):
        got = runner.run(x[:b].numpy())
        assert got.shape == (b, 10)
        # int8 logits are close to, not equal to, float32's: within a tenth of the logits' spread
        assert np.abs(got - ref[:b]).max() < 0.1 * (ref.max() - ref.min())
    # int8 weights: a quarter of the float32 bytes, plus the program's fixed overhead and the scales
    ratio = fp32.path.stat().st_size / int8.path.stat().st_size
    assert 3.0 < ratio < 4.2, ratio


def test_int8_accuracy_close_to_float32_and_recorded_in_manifest(trained: dict[str, Any]) -> None:
    ds: Dataset = trained["ds"]
    int8: Packaged = trained["int8"]
    report = verify_int8(int8, ds.test_x[:2000], ds.test_y[:2000])
    assert report["fp32_accuracy"] > 0.7  # trained: the comparison is not between two guessers
    assert report["accuracy_drop"] <= 0.02 and report["top1_agreement"] >= 0.95
    assert report["samples"] == 2000 and report["passed"]
    entries = {e["path"]: e for e in json.loads((trained["out"] / "manifest.json").read_text())}
    assert set(entries) == {"cnn-phone-mid-fresh-int8.pte", "cnn-phone-mid-fresh.pte"}
    entry = entries[int8.path.name]
    assert entry["bytes"] == int8.path.stat().st_size and entry["format"] == "executorch"
    assert entry["quantization"] == "int8 static per-channel" and entry["calibration_samples"] == 256
    assert entry["verify"]["int8_accuracy"] == report["int8_accuracy"]
    assert entry["verify"]["top1_agreement"] == report["top1_agreement"]
    assert entry["max_batch"] == 256 and entry["backend"] == "xnnpack"


def test_verify_int8_refuses_an_artefact_of_other_weights(trained: dict[str, Any]) -> None:
    ds: Dataset = trained["ds"]
    prep: Prepared = trained["prep"]
    fresh = prepare(prep.profile, spec=SPEC, seed=7)  # same architecture, untrained weights
    other = package(lower_executorch_int8(fresh, trained["calib"]), trained["out"] / "other")
    # the trained model's entry pointing at the untrained model's program: what a stale file would look like
    stale = Packaged(dataclasses.replace(other.lowered, prepared=trained["int8"].lowered.prepared), other.path,
                     other.entry)
    with pytest.raises(ExportError, match=r"accuracy .* drop of"):
        verify_int8(stale, ds.test_x[:1000], ds.test_y[:1000])
    # nothing recorded as passed for it
    assert "verify" not in json.loads((trained["out"] / "other" / "manifest.json").read_text())[0]


def test_verify_int8_catches_poor_calibration(trained: dict[str, Any]) -> None:
    ds: Dataset = trained["ds"]
    # calibrated on inputs 50x the real range: activation scales so coarse that the images collapse to a few
    # levels (on Fashion-MNIST: about 20 points of accuracy lost, two thirds agreement with float32)
    bad = package(lower_executorch_int8(trained["prep"], trained["calib"] * 50), trained["out"] / "bad")
    with pytest.raises(ExportError, match=r"drop of \d+\.\d+ points"):
        verify_int8(bad, ds.test_x[:1000], ds.test_y[:1000])
    # the agreement check stands on its own: with any accuracy drop allowed, disagreement still fails it
    with pytest.raises(ExportError, match=r"agrees with the float32 model on \d+\.\d+ %"):
        verify_int8(bad, ds.test_x[:1000], ds.test_y[:1000], max_acc_drop=1.0)


def test_int8_rejects_calibration_of_the_wrong_shape(trained: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="calibration inputs"):
        lower_executorch_int8(trained["prep"], torch.zeros(4, 3, 32, 32))
    with pytest.raises(ConfigError, match="at least one input"):
        lower_executorch_int8(trained["prep"], torch.zeros(0, 1, 28, 28))
    with pytest.raises(ConfigError, match="one label per input"):
        verify_int8(trained["int8"], trained["ds"].test_x[:4], trained["ds"].test_y[:3])


def test_int8_program_takes_every_batch_up_to_max_batch() -> None:
    # a stride-1 3x3 convolution is the pattern whose lowering used to narrow the batch range to [2, 15]
    # (mobilenet-v1, resnet18-gn): the program then refused batch 16 although exported for up to 256
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 28 * 28, 10)).eval()
    prep = Prepared(model, SPEC, get_profile("phone-low"), 1.0, None, "test", "tiny")
    lowered = lower_executorch_int8(prep, torch.randn(32, 1, 28, 28), max_batch=64)
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(lowered.program).load_method("forward")
    for b in (1, 16, 64):
        x = torch.randn(b, 1, 28, 28)
        out = method.execute([x])[0]
        assert out.shape == (b, 10)
        with torch.no_grad():
            assert (out.argmax(1) == model(x).argmax(1)).float().mean() > 0.8
