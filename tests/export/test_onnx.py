import hashlib
import json
from pathlib import Path

import pytest
import torch

from device_profiles import get_profile
from export import ExportError, lower_executorch, lower_onnx, package, prepare, verify
from pfl_edge.checkpoint import ModelSpec
from pfl_edge.cli import main
from pfl_edge.sim import SimConfig, simulate


@pytest.mark.parametrize(("model", "channels", "size"), [("cnn", 1, 28), ("mobilenet-v1", 3, 32),
                                                         ("resnet18-gn", 3, 32)])
def test_every_model_exports_to_onnx_and_matches_eager(tmp_path: Path, model: str, channels: int,
                                                       size: int) -> None:
    prep = prepare(get_profile("raspberry-pi-5"), spec=ModelSpec(model, 10, channels, size))
    lowered = lower_onnx(prep)
    assert lowered.details["opset"] == 17 and "Conv" in lowered.details["operators"]
    # the on-device trainability rules hold in the graph too: no pooling operators
    assert not {"MaxPool", "AveragePool", "GlobalAveragePool"} & set(lowered.details["operators"])
    packaged = package(lowered, tmp_path)
    ver = verify(packaged, real=torch.randn(5, channels, size, size))
    assert ver.max_abs_err < 1e-4
    entry = json.loads((tmp_path / "manifest.json").read_text())[0]
    assert entry["sha256"] == hashlib.sha256(packaged.path.read_bytes()).hexdigest()
    assert entry["bytes"] == packaged.path.stat().st_size
    assert entry["verify"]["passed"] and entry["profile"] == "raspberry-pi-5" and entry["density"] == 1.0


@pytest.mark.parametrize(("model", "channels", "size"), [("cnn", 1, 28), ("mobilenet-v1", 3, 32)])
def test_executorch_inference_program_matches_eager(tmp_path: Path, model: str, channels: int, size: int) -> None:
    prep = prepare(get_profile("phone-high"), spec=ModelSpec(model, 10, channels, size, "deep", 0),
                   seed=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on a one-core device, or after a trainer set it: the case that narrowed batches
    try:
        lowered = lower_executorch(prep)
    finally:
        torch.set_num_threads(threads)
    assert lowered.details["backend"] == "xnnpack"
    assert any("executorch_call_delegate" in op for op in lowered.details["operators"])  # XNNPACK took the graph
    packaged = package(lowered, tmp_path)
    assert packaged.path.suffix == ".pte"
    ver = verify(packaged, real=torch.randn(3, channels, size, size))
    assert ver.max_abs_err < 1e-4
    assert json.loads((tmp_path / "manifest.json").read_text())[0]["format"] == "executorch"
    # the whole declared batch range runs (XNNPACK's layout pass once narrowed it to [2, 15] for mobilenet-v1)
    from edge_runtime import load_inference

    x = torch.randn(64, channels, size, size)
    with torch.no_grad():
        ref = prep.model(x).numpy()
    got = load_inference(packaged.path, "executorch", 1).run(x.numpy())
    assert abs(got - ref).max() < 1e-4


def test_checkpoint_from_the_simulator_exports_with_its_round_and_density(tmp_path: Path) -> None:
    cfg = SimConfig(algorithm="dispfl", dataset="synthetic", partition="iid", clients=3, rounds=1,
                    samples_per_client=40, local_epochs=1, options={"topology": "random:2"}, density=0.5, workers=1)
    simulate(cfg, save_dir=tmp_path / "ck", progress=False)
    prep = prepare(get_profile("phone-mid"), checkpoint=tmp_path / "ck" / "client_002.safetensors")
    assert prep.round == 1 and prep.tag == "client002"
    assert 0.45 < prep.density < 0.6  # the sparse model's zeros travel into the artefact
    packaged = package(lower_onnx(prep), tmp_path / "art")
    verify(packaged, real=torch.randn(4, 1, 28, 28))
    # a second export lands beside the first in one manifest
    fresh = package(lower_onnx(prepare(get_profile("phone-mid"), spec=ModelSpec("cnn", 10, 1, 28))), tmp_path / "art")
    entries = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert [e["path"] for e in entries] == [packaged.path.name, fresh.path.name]
    assert entries[0]["round"] == 1 and entries[1]["source"] == "fresh (untrained)"


def test_verify_catches_an_artefact_that_differs(tmp_path: Path) -> None:
    prep = prepare(get_profile("phone-low"), spec=ModelSpec("cnn", 10, 1, 28))
    packaged = package(lower_onnx(prep), tmp_path)
    with torch.no_grad():
        prep.model.get_submodule("head").bias.add_(0.5)  # eager model changes after export
    with pytest.raises(ExportError, match="differs from eager PyTorch"):
        verify(packaged)


def test_base_only_checkpoint_and_corrupt_manifest_are_refused(tmp_path: Path) -> None:
    simulate(SimConfig(algorithm="fedper", dataset="synthetic", clients=2, rounds=1, samples_per_client=30,
                       local_epochs=1, workers=1), save_dir=tmp_path / "ck", progress=False)
    with pytest.raises(ExportError, match="personal blocks"):
        prepare(get_profile("phone-low"), checkpoint=tmp_path / "ck" / "base.safetensors")
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "manifest.json").write_text("{not json")
    prep = prepare(get_profile("phone-low"), checkpoint=tmp_path / "ck" / "client_000.safetensors")
    with pytest.raises(ExportError, match="not valid JSON"):
        package(lower_onnx(prep), tmp_path / "art")


def test_cli_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "--profile", "jetson-nano", "--dataset", "synthetic", "--format", "onnx",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fresh, untrained" in out and "verified on random b1, random b8, real" in out
    assert (tmp_path / "cnn-jetson-nano-fresh.onnx").exists()
    assert main(["export", "--profile", "toaster", "--out", str(tmp_path)]) == 2
    assert "valid profiles" in capsys.readouterr().err
