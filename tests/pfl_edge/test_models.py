import pytest
import torch
from torch import nn

from pfl_edge.errors import ConfigError, UnknownNameError
from pfl_edge.models import BlockModel, Flatten, get_model, linear_base_model, list_models, register_model


@pytest.mark.parametrize("name", ["cnn", "resnet18-gn", "mobilenet-v1"])
@pytest.mark.parametrize(("channels", "size"), [(1, 28), (3, 32)])
def test_every_model_builds_and_runs(name: str, channels: int, size: int) -> None:
    model = get_model(name, num_classes=7, in_channels=channels, image_size=size)
    out = model(torch.randn(3, channels, size, size))
    assert out.shape == (3, 7)
    owner = model.block_of()
    # every tensor belongs to exactly one named block
    assert set(owner) == set(model.state_dict())
    assert set(owner.values()) == set(model.block_names)


@pytest.mark.parametrize("name", ["cnn", "resnet18-gn", "mobilenet-v1"])
def test_no_pooling_layers_that_cannot_train_on_device(name: str) -> None:
    model = get_model(name, num_classes=10, in_channels=3, image_size=32)
    banned = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.BatchNorm2d)
    assert not [m for m in model.modules() if isinstance(m, banned)]


def test_unknown_model_lists_valid_names() -> None:
    with pytest.raises(UnknownNameError) as e:
        get_model("resnet-999", num_classes=10, in_channels=1)
    for name in list_models():
        assert name in str(e.value)


def test_register_user_model() -> None:
    @register_model("test-tiny")
    def tiny(*, num_classes: int, in_channels: int, image_size: int) -> BlockModel:
        return BlockModel([("body", Flatten()), ("head", nn.Linear(in_channels * image_size**2, num_classes))])

    assert "test-tiny" in list_models()
    m = get_model("test-tiny", num_classes=3, in_channels=1, image_size=4)
    assert m.block_names == ["body", "head"]
    with pytest.raises(ConfigError):
        register_model("test-tiny")(tiny)


def test_mobilenet_width_multiplier_shrinks_the_model() -> None:
    full = get_model("mobilenet-v1", num_classes=10, in_channels=3, image_size=32)
    quarter = get_model("mobilenet-v1", num_classes=10, in_channels=3, image_size=32, width_mult=0.25)
    n = sum(p.numel() for p in full.parameters())
    q = sum(p.numel() for p in quarter.parameters())
    assert q < n / 8


def test_unknown_model_option_is_an_error() -> None:
    with pytest.raises(ConfigError, match="unknown options"):
        get_model("cnn", num_classes=10, in_channels=1, depth=3)


def test_linear_base_keeps_personal_blocks_and_feeds_them() -> None:
    model = get_model("cnn", num_classes=10, in_channels=1)
    lin = linear_base_model(model, 2, in_channels=1, image_size=28)
    assert lin.block_names == ["base", "fc2", "head"]
    assert torch.equal(lin.state_dict()["head.weight"], model.state_dict()["head.weight"])
    assert lin(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    # K_P = 4 leaves conv2 personal: the linear base must produce a feature map
    lin4 = linear_base_model(model, 4, in_channels=1, image_size=28)
    assert lin4(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ConfigError):
        linear_base_model(model, 0, in_channels=1, image_size=28)
