import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from device_profiles import get_profile
from edge_runtime import ExecuTorchBackend
from edge_runtime.verify import verify_training
from export import ExportError, Lowered, Prepared, lower_executorch_training, package, prepare
from pfl_edge.checkpoint import ModelSpec, build_model
from pfl_edge.errors import ConfigError
from pfl_edge.models import get_model
from pfl_edge.sparse import erk_densities, init_masks
from pfl_edge.split import split_keys
from pfl_edge.train import TrainConfig

SPEC = ModelSpec("cnn", 10, 1, 28)
B = 8


@pytest.fixture(scope="module")
def prep() -> Prepared:
    return prepare(get_profile("phone-mid"), spec=SPEC, seed=1)


@pytest.fixture(scope="module")
def fedper(prep: Prepared) -> Lowered:  # exported once for the module: a few seconds each
    return lower_executorch_training(prep, mode="fedper", batch_size=B)


@pytest.fixture(scope="module")
def personal(prep: Prepared) -> Lowered:
    return lower_executorch_training(prep, mode="personal", batch_size=B, kp=2)


def _masks(model: nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    shapes = {k: p.shape for k, p in model.named_parameters() if p.dim() > 1}
    return init_masks(shapes, erk_densities(shapes, 0.5), torch.Generator().manual_seed(seed))


def test_training_program_describes_itself_and_packages_beside_the_inference_one(
        tmp_path: Path, prep: Prepared, fedper: Lowered) -> None:
    d = fedper.details
    assert fedper.format == "executorch" and d["kind"] == "training" and d["mode"] == "fedper"
    assert d["trainable"] == [k for k, _ in prep.model.named_parameters()] and d["frozen"] == []
    # a gradient program: the batch and every weight in, the loss and every trainable tensor's gradient out
    assert d["batch_size"] == B and d["inputs"] == ["x", "y", "weight", *prep.model.state_dict()]
    assert d["outputs"] == ["loss", *(f"grad:{k}" for k in d["trainable"])]
    # XNNPACK runs what it supports (it can: no weight is baked into the program); the rest stays outside
    assert d["delegate"] == "xnnpack" and "executorch_call_delegate" in d["operators"]
    # the backward pass is in the graph, its convolutions as matrix products (export.matmul_conv), none left
    assert d["convolutions"] == "matmul"
    assert "aten.slice_scatter.default" in d["operators"]  # the backward of the convolutions' input windows
    assert not any("convolution" in op for op in d["operators"])
    assert len(fedper.program) < 400_000  # no weight inside (the cnn's are 1.6 MB)
    packaged = package(fedper, tmp_path)
    # the tag names the mode, so the file does not overwrite the inference .pte of the same model and profile
    inference_name = f"{prep.spec.model}-{prep.profile.name}-{prep.tag}.pte"
    assert packaged.path.name == "cnn-phone-mid-fresh-train-fedper.pte" != inference_name
    ver = verify_training(packaged)
    assert ver.grad_max_abs_err < 1e-6 and ver.weight_max_abs_err < 1e-6
    (entry,) = json.loads((tmp_path / "manifest.json").read_text())
    assert entry["kind"] == "training" and entry["verify"]["passed"] and entry["verify"]["steps"] == 2
    # a device loads it from the file and its manifest entry alone
    backend = ExecuTorchBackend.from_file(packaged.path)
    backend.load(prep.model.state_dict())
    assert all(torch.equal(v, prep.model.state_dict()[k]) for k, v in backend.state().items())


def test_personal_program_trains_only_the_last_kp_blocks(prep: Prepared, personal: Lowered) -> None:
    d = personal.details
    assert isinstance(prep.model, nn.Sequential)
    expected = list(split_keys(prep.model, 2).personal)  # type: ignore[arg-type]
    assert d["trainable"] == expected == ["fc2.0.weight", "fc2.0.bias", "head.weight", "head.bias"]
    assert d["inputs"][3:] == d["keys"] and "conv1.0.weight" in d["frozen"]
    assert d["outputs"] == ["loss", *(f"grad:{k}" for k in expected)]  # no gradient of the frozen base
    assert personal.prepared.tag == "fresh-train-personal-kp2"
    ver = verify_training(personal)
    assert ver.grad_max_abs_err < 1e-6 and ver.weight_max_abs_err < 1e-6


def test_dispfl_program_verifies_masked_steps_and_starts_from_masked_weights(prep: Prepared) -> None:
    masks = _masks(prep.model)
    low = lower_executorch_training(prep, mode="dispfl", batch_size=B, mask=masks)
    assert 0.45 < low.details["mask_density"] < 0.55 and low.prepared.tag == "fresh-train-dispfl"
    ver = verify_training(low, mask=masks, steps=3)
    assert ver.weight_max_abs_err < 1e-6
    # the prepared model is not touched by the export (it masked a copy)
    assert float(prep.model.get_parameter("fc1.1.weight").eq(0).float().mean()) < 0.01


def test_partial_batch_gradient_is_the_mean_over_the_real_samples(prep: Prepared, fedper: Lowered) -> None:
    backend = ExecuTorchBackend.from_lowered(fedper)
    backend.load(prep.model.state_dict())
    gen = torch.Generator().manual_seed(4)
    for n in (1, 5, B):
        x, y = torch.randn(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen)
        eager = copy.deepcopy(prep.model).train()
        loss = F.cross_entropy(eager(x), y)
        loss.backward()
        got_loss, grads = backend.gradients(x, y)
        assert abs(got_loss - loss.item()) < 1e-5
        for k, p in eager.named_parameters():
            assert p.grad is not None
            assert torch.allclose(grads[k], p.grad, atol=1e-6), (n, k)


def test_weights_swap_into_a_loaded_program_without_reexport(prep: Prepared, fedper: Lowered) -> None:
    backend = ExecuTorchBackend.from_lowered(fedper)  # loaded once, used for both rounds
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(B, 1, 28, 28, generator=gen), torch.randint(0, 10, (B,), generator=gen)
    for seed in (11, 12):  # weights A (e.g. a new base from the server), then B (the neighbours' average)
        torch.manual_seed(seed)
        eager = build_model(SPEC).train()
        start = {k: v.clone() for k, v in eager.state_dict().items()}
        backend.load(start)
        opt_et = backend.sgd(TrainConfig(lr=0.1, momentum=0.9, weight_decay=0.01))
        loss_et, grads = backend.gradients(x, y)
        opt_et.step(grads)
        opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        loss = F.cross_entropy(eager(x), y)
        loss.backward()
        opt.step()
        assert abs(loss_et - loss.item()) < 1e-5
        got = backend.state()
        for k, v in eager.state_dict().items():
            assert torch.allclose(got[k], v, atol=1e-6), (seed, k)
            assert not torch.equal(got[k], start[k])  # the step moved every tensor


def test_verify_training_rejects_a_program_that_computes_something_else(prep: Prepared, fedper: Lowered) -> None:
    # same parameters and shapes, another function (tanh for a ReLU): the program no longer matches the model
    other = copy.deepcopy(prep.model)
    fc2 = other.get_submodule("fc2")
    assert isinstance(fc2, nn.Sequential) and isinstance(fc2[1], nn.ReLU)
    fc2[1] = nn.Tanh()
    wrong = Lowered(dataclasses.replace(fedper.prepared, model=other), fedper.format, fedper.program, fedper.details)
    with pytest.raises(ExportError, match="gradients differ from eager PyTorch"):
        verify_training(wrong)


def test_bad_arguments(prep: Prepared) -> None:
    with pytest.raises(ConfigError, match="needs kp"):
        lower_executorch_training(prep, mode="personal", batch_size=B)
    with pytest.raises(ConfigError, match="unknown training mode"):
        lower_executorch_training(prep, mode="fedavg", batch_size=B)
    with pytest.raises(ConfigError, match="mask applies to mode 'dispfl' only"):
        lower_executorch_training(prep, mode="fedper", batch_size=B, mask=_masks(prep.model))
    with pytest.raises(ConfigError, match="batch_size"):
        lower_executorch_training(prep, mode="fedper", batch_size=0)


def test_batchnorm_models_are_refused_before_export(prep: Prepared) -> None:
    bn = get_model("resnet18-gn", num_classes=10, in_channels=1, image_size=28, width=8, norm="batch")
    bn_prep = dataclasses.replace(prep, model=bn)
    with pytest.raises(ExportError, match="BatchNorm"):
        lower_executorch_training(bn_prep, mode="fedper", batch_size=B)


def test_cli_exports_and_verifies_a_training_program(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pfl_edge.cli import main

    assert main(["export", "--profile", "phone-low", "--dataset", "synthetic", "--format", "executorch-training",
                 "--mode", "personal", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "training program (personal, batch" in out and "against eager PyTorch" in out
    entry = json.loads((tmp_path / "manifest.json").read_text())[0]
    assert entry["kind"] == "training" and entry["mode"] == "personal" and entry["verify"]["passed"]
    assert entry["batch_size"] == get_profile("phone-low").batch_size
