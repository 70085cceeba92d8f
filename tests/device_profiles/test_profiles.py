import math
from pathlib import Path

import pytest
import torch
from torch import nn

from device_profiles import (
    Profile,
    check,
    get_fleet,
    get_profile,
    list_fleets,
    list_profiles,
    load_dir,
)
from pfl_edge.cli import main
from pfl_edge.errors import ConfigError, UnknownNameError
from pfl_edge.models import BlockModel, Flatten, get_model

REAL = {"jetson-orin-nano", "jetson-nano", "raspberry-pi-4", "raspberry-pi-5", "phone-high", "phone-mid", "phone-low"}


def test_the_real_classes_and_fleets_load() -> None:
    assert set(list_profiles()) >= REAL
    assert {"mixed", "dispfl-capacity"} <= set(list_fleets())
    orin = get_profile("jetson-orin-nano")
    assert (orin.cores, orin.ram_mb, orin.architecture) == (6, 8192, "aarch64")
    assert get_profile("phone-low").inference_runtime == "executorch"


def test_dispfl_capacity_fleet_is_five_equal_groups() -> None:
    fleet = get_fleet("dispfl-capacity")
    assert fleet.densities() == (0.2, 0.4, 0.6, 0.8, 1.0)
    devices = fleet.assign(100)
    assert [p.density for p in devices[:5]] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert all(sum(p.density == d for p in devices) == 20 for d in (0.2, 0.4, 0.6, 0.8, 1.0))


def test_mixed_fleet_deals_by_weight() -> None:
    devices = get_fleet("mixed").assign(18)
    assert sum(p.name == "phone-low" for p in devices) == 4  # weight 2 of 9, twice round
    assert sum(p.name == "jetson-orin-nano" for p in devices) == 2


def test_unknown_names_list_the_valid_ones() -> None:
    with pytest.raises(UnknownNameError) as e:
        get_profile("iphone-99")
    assert all(n in str(e.value) for n in list_profiles())
    with pytest.raises(UnknownNameError, match="dispfl-capacity"):
        get_fleet("nope")


def _fields(**kw: object) -> dict:
    base = dict(name="x", description="", device_class="board", architecture="aarch64", soc="s", ram_mb=1024,
                ram_budget_mb=512, cores=4, threads=2, inference_runtime="onnxruntime", training_backend="torch",
                density=0.5, kp=2, batch_size=8, train_memory_mb=256)
    return {**base, **kw}


@pytest.mark.parametrize("kw,match", [
    (dict(density=0.0), "density"), (dict(density=1.5), "density"), (dict(threads=8), "threads"),
    (dict(inference_runtime="tflite"), "inference_runtime"), (dict(training_backend="jax"), "training_backend"),
    (dict(train_memory_mb=600), "train_memory_mb"), (dict(batch_size=0), "batch_size"), (dict(kp=-1), "kp"),
])
def test_profile_validation(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Profile(**_fields(**kw))


def test_user_profiles_and_fleets_from_a_folder(tmp_path: Path) -> None:
    (tmp_path / "profiles").mkdir()
    (tmp_path / "fleets").mkdir()
    lines = [f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in _fields(name="my-board").items()]
    (tmp_path / "profiles" / "my-board.toml").write_text("\n".join(lines).replace("'", '"') + "\n")
    (tmp_path / "fleets" / "mine.toml").write_text(
        'name = "mine"\n[[members]]\nprofile = "my-board"\nweight = 3\n[[members]]\nprofile = "phone-low"\n')
    load_dir(tmp_path)
    assert get_profile("my-board").batch_size == 8
    assert get_fleet("mine").densities() == (0.5, 0.5, 0.5, 0.2)
    (tmp_path / "fleets" / "mine.toml").write_text('name = "bad"\n[[members]]\nprofile = "ghost"\n')
    with pytest.raises(UnknownNameError, match="ghost"):
        load_dir(tmp_path)
    (tmp_path / "profiles" / "my-board.toml").write_text('name = "broken"\n')
    with pytest.raises(ConfigError, match="missing fields"):
        load_dir(tmp_path)


def test_check_counts_by_hand() -> None:
    # a 2-block model: 10 -> 20 linear (220 params) and 20 -> 5 (105); leaf outputs per sample: Flatten 10,
    # Linear 20, Linear 5
    model = BlockModel([("body", nn.Sequential(Flatten(), nn.Linear(10, 20))), ("head", nn.Linear(20, 5))])
    prof = Profile(**_fields(density=1.0, batch_size=4))
    fit = check(prof, model, (10,))
    mb = 1024 * 1024
    assert fit.params == fit.active_params == 325
    assert fit.weights_mb == pytest.approx(4 * 325 / mb)
    assert fit.activations_mb == pytest.approx(4 * 4 * (10 + 20 + 5) / mb)
    assert fit.train_mb == pytest.approx(fit.weights_mb * 3 + fit.activations_mb)
    assert fit.ok


def test_check_at_lower_density_and_a_model_that_does_not_fit() -> None:
    model = get_model("resnet18-gn", num_classes=10, in_channels=3, image_size=32)
    dense = check(get_profile("jetson-orin-nano"), model, (3, 32, 32))
    sparse = check(get_profile("jetson-orin-nano"), model, (3, 32, 32), density=0.2)
    assert dense.active_params == dense.params == sum(p.numel() for p in model.parameters())
    assert sparse.active_params == pytest.approx(0.2 * dense.params, rel=0.01)
    # values + one mask bit per element of the sparse tensors, against 4 bytes per element dense
    assert sparse.weights_mb < 0.3 * dense.weights_mb
    low = check(get_profile("phone-low"), model, (3, 32, 32))
    assert not low.fits_training and low.reasons()
    assert math.isclose(low.gradients_mb, dense.gradients_mb)


def test_cli_fleet_sets_densities_and_check_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    out = tmp_path / "r.json"
    assert main(["simulate", "--algorithm", "dispfl", "--fleet", "dispfl-capacity", "--dataset", "synthetic",
                 "--clients", "5", "--rounds", "1", "--samples-per-client", "40", "--local-epochs", "1",
                 "--topology", "random:2", "--out", str(out), "--no-progress"]) == 0
    r = json.loads(out.read_text())
    assert r["config"]["densities"] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert r["rounds"][0]["client_density"] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0], abs=2e-3)
    capsys.readouterr()
    assert main(["check", "--model", "resnet18-gn", "--dataset", "synthetic"]) == 0
    text = capsys.readouterr().out
    assert "phone-low" in text and "NO: training needs" in text
    torch.manual_seed(0)
