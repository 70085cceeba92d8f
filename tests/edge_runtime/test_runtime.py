import json
from pathlib import Path

import numpy as np
import pytest
import torch

from device_profiles import get_profile
from edge_runtime import TorchTrainer, load_inference
from export import lower_executorch, lower_onnx, package, prepare
from pfl_edge.checkpoint import ModelSpec, build_model
from pfl_edge.cli import main
from pfl_edge.errors import ConfigError

SPEC = ModelSpec("cnn", 10, 1, 28)


@pytest.mark.parametrize(("runtime", "lower"), [("onnxruntime", lower_onnx), ("executorch", lower_executorch)])
def test_inference_backends_run_exported_models_like_eager(tmp_path: Path, runtime: str, lower: object) -> None:
    prep = prepare(get_profile("phone-mid"), spec=SPEC, seed=3)
    packaged = package(lower(prep), tmp_path)  # type: ignore[operator]
    backend = load_inference(packaged.path, runtime, threads=1)
    assert backend.name == runtime
    x = np.random.default_rng(0).standard_normal((5, 1, 28, 28)).astype(np.float32)
    with torch.no_grad():
        ref = prep.model(torch.from_numpy(x)).numpy()
    assert np.allclose(backend.run(x), ref, atol=1e-4)


def test_unknown_runtime() -> None:
    with pytest.raises(ConfigError, match="valid: executorch, onnxruntime"):
        load_inference("x.bin", "tflite", 1)


def test_torch_trainer_steps_reduce_the_loss() -> None:
    torch.manual_seed(0)
    trainer = TorchTrainer(build_model(SPEC), lr=0.05, threads=1)
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    losses = [trainer.step(x, y) for _ in range(25)]
    assert losses[-1] < 0.1 * losses[0]  # it memorises 16 samples


def test_profile_command_measures_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--profiles", "phone-low", "--repeats", "3", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "profile.json").read_text())
    assert "not on the device itself" in report["note"]
    (row,) = report["profiles"]
    assert row["profile"] == "phone-low" and row["artefact"].endswith(".pte")
    whats = [m["what"] for m in row["measurements"]]
    assert whats == ["inference b1", "inference b8", "train step", "train step eager"]
    train, eager = row["measurements"][2:]  # the program's step beside eager PyTorch's, and the ratio of the two
    assert train["backend"] == "executorch" and eager["backend"] != "executorch"
    assert row["program_over_eager"] == pytest.approx(train["median_ms"] / eager["median_ms"])
    for m in row["measurements"]:
        assert 0 < m["median_ms"] <= m["p95_ms"] and m["peak_rss_mb"] > 50
    assert (tmp_path / "profile.png").stat().st_size > 1000
    assert (tmp_path / "artefacts" / "manifest.json").exists()
    assert "phone-low" in capsys.readouterr().out
