"""FedRep's options as part of the federation config, and its round's two phases checked against the phases run
one by one (the equivalence of device and simulator is in tests/edge_runtime/test_device_round.py, across
processes, one device on the ONNX program, in tests/integration/test_federation.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from edge_runtime.data import load_local_data
from edge_runtime.trainer import DeviceTrainer, device_clients
from edge_runtime.training import TorchBackend
from pfl_edge.algorithms import get_algorithm, one_row
from pfl_edge.algorithms.central import with_base
from pfl_edge.algorithms.fedrep import FedRepOptions
from pfl_edge.errors import ConfigError
from pfl_edge.federation import FederationConfig, init_state
from pfl_edge.seeding import Stream
from pfl_edge.sim import SimConfig

QUICK: dict[str, Any] = dict(dataset="synthetic", partition="pathological:2", clients=2, rounds=2,
                             samples_per_client=48, test_per_client=16, local_epochs=1, batch_size=16, lr=0.05,
                             workers=1, seed=5, kp=2)


def test_options_are_checked_on_creation() -> None:
    assert FederationConfig(algorithm="fedrep", kp=1, options={"head_epochs": 3}).options == {"head_epochs": 3}
    for bad in ({"head_epochs": -1}, {"head_epochs": 1.5}, {"head_epochs": True}, {"head_epochs": 1001}):
        with pytest.raises(ConfigError, match="fedrep's head_epochs"):
            FederationConfig(algorithm="fedrep", kp=1, options=bad)
    with pytest.raises(ConfigError, match=r"no option 'lam'.*its options: head_epochs"):
        FederationConfig(algorithm="fedrep", kp=1, options={"lam": 1})
    with pytest.raises(ConfigError, match="kp >= 1"):
        FederationConfig(algorithm="fedrep", kp=0)
    with pytest.raises(ConfigError, match="base 'linear' is FedPer's control"):
        FederationConfig(algorithm="fedrep", kp=1, base="linear")


def _client(options: dict[str, int]) -> tuple:
    cfg = SimConfig(algorithm="fedrep", options=options, **QUICK)
    data = load_local_data(cfg, 0)
    algo = get_algorithm(cfg, data.model, cfg.kp)
    dev = device_clients(cfg, DeviceTrainer(data, TorchBackend(data.model)), 0)
    return cfg, data, algo, dev


def test_the_head_trains_first_with_the_base_frozen_then_the_base_with_the_head_frozen() -> None:
    cfg, data, algo, dev = _client({"head_epochs": 2})
    state = one_row(init_state(cfg, data.spec))
    personal = set(algo.split.personal)
    head = [k for k, _ in data.model.named_parameters() if k in personal]
    body = [k for k, _ in data.model.named_parameters() if k not in personal]
    assert head and body
    got = algo.local_round(dev, with_base(state, None, algo.split), 1)
    # the two phases one by one, from the same streams
    phase1 = dev.trainer.train(state, dev.slots, cfg.train_config(1, 2), dev.gens(Stream.PERSONAL, 1), trainable=head)
    phase2 = dev.trainer.train(phase1.stack, dev.slots, cfg.train_config(1), dev.gens(Stream.TRAIN, 1),
                               trainable=body)
    for k in body:  # phase 1 left the base as received
        assert torch.equal(phase1.stack[k], state[k]), k
    for k in head:  # phase 2 left the new head as phase 1 made it, and phase 1 moved it
        assert torch.equal(got.stack[k], phase1.stack[k]) and not torch.equal(got.stack[k], state[k]), k
    for k in body:
        assert torch.equal(got.stack[k], phase2.stack[k]) and not torch.equal(got.stack[k], state[k]), k
    assert int(got.steps[0]) == int(phase1.steps[0]) + int(phase2.steps[0]) == 3 * 48 // 16
    assert algo.train_epochs(True) == 3 and algo.train_epochs(False) == 0
    sent = algo.device_upload({k: v[0] for k, v in got.stack.items()}).tensors
    assert set(sent) == set(algo.split.base) and not set(sent) & personal


def test_without_head_epochs_the_head_stays_as_received() -> None:
    cfg, data, algo, dev = _client({"head_epochs": 0})
    state = one_row(init_state(cfg, data.spec))
    got = algo.local_round(dev, with_base(state, None, algo.split), 1)
    for k in algo.split.personal:
        assert torch.equal(got.stack[k], state[k]), k
    assert algo.train_epochs(True) == cfg.local_epochs and algo.options == FedRepOptions(head_epochs=0)
