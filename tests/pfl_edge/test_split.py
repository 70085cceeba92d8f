import pytest
import torch

from pfl_edge.errors import ConfigError
from pfl_edge.models import get_model
from pfl_edge.split import split_keys, take


def test_kp_counts_trailing_blocks() -> None:
    model = get_model("cnn", num_classes=10, in_channels=1)
    s = split_keys(model, 2)
    assert s.personal_blocks == ("fc2", "head")
    assert set(s.personal) == {"fc2.0.weight", "fc2.0.bias", "head.weight", "head.bias"}
    assert set(s.base) | set(s.personal) == set(model.state_dict())
    assert not set(s.base) & set(s.personal)


def test_kp_zero_is_everything_shared() -> None:
    model = get_model("resnet18-gn", num_classes=10, in_channels=3, image_size=32)
    s = split_keys(model, 0)
    assert s.personal == () and s.base == tuple(model.state_dict())


def test_kp_all_is_everything_personal() -> None:
    model = get_model("cnn", num_classes=10, in_channels=1)
    s = split_keys(model, len(model.block_names))
    assert s.base == ()


def test_buffers_belong_to_their_block_and_can_stay_local() -> None:
    model = get_model("mobilenet-v1", num_classes=10, in_channels=3, image_size=32, norm="batch", width_mult=0.25)
    buffers = {k for k, _ in model.named_buffers()}
    s = split_keys(model, 1)
    # buffers of base blocks are averaged like weights (they are in the base) ...
    assert {k for k in buffers if not k.startswith("head.")} <= set(s.base)
    # ... unless they are kept local (FedBN-style)
    local = split_keys(model, 1, local_norm_stats=True)
    assert buffers <= set(local.personal)
    assert not buffers & set(local.base)


def test_bad_kp() -> None:
    model = get_model("cnn", num_classes=10, in_channels=1)
    with pytest.raises(ConfigError, match="kp must be between 0 and 5"):
        split_keys(model, 6)


def test_take_missing_key() -> None:
    with pytest.raises(ConfigError, match="no tensor 'b'"):
        take({"a": torch.zeros(1)}, ["a", "b"])
