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


def test_the_kp_rule_is_one_rule_for_the_server_and_the_split() -> None:
    """``device_capacity`` (what the server gives an enrolling device) and ``split_kp`` (what the device's
    algorithm splits at) answer from the one rule, ``Algorithm.kp_for``: a profile's K_P where the algorithm keeps
    personal blocks, the config's for the linear-base control, 0 where nothing is personal, every block for
    local training."""
    from pfl_edge.algorithms import algorithm_class
    from pfl_edge.federation import FederationConfig, device_capacity

    want = {("fedper", "deep"): 1, ("fedper", "linear"): 2, ("fedrep", "deep"): 1, ("fedavg", "deep"): 0,
            ("dispfl", "deep"): 0, ("ditto", "deep"): 0}
    for (name, base), kp in want.items():
        cfg = FederationConfig(algorithm=name, kp=2, base=base)
        density = 0.5 if name == "dispfl" else 1.0  # only a masked algorithm trains below 1 (the card's density)
        assert device_capacity(cfg, 0, profile_density=0.5, profile_kp=1) == (density, kp), name
        assert device_capacity(cfg, 0) == (density if name == "dispfl" else 1.0, device_capacity(cfg, 0)[1]), name
        assert algorithm_class(name).split_kp(cfg, 4, 1) == kp, name
    cfg = FederationConfig(algorithm="local", kp=2)
    assert algorithm_class("local").split_kp(cfg, 4, 1) == 4  # every block stays
    assert algorithm_class("fedper").split_kp(FederationConfig(algorithm="fedper", kp=3), 4) == 3  # the config's
