"""Ditto's options as part of the federation config, and its round's pieces (the equivalence of device and
simulator is in tests/edge_runtime/test_device_round.py, across processes in tests/integration)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pfl_edge.algorithms import get_algorithm
from pfl_edge.algorithms.ditto import DittoOptions, global_part, personal_part
from pfl_edge.cli.simulate import parse_options
from pfl_edge.errors import ConfigError
from pfl_edge.federation import FederationConfig, load_config_file
from pfl_edge.models import get_model


def test_options_are_the_algorithms_own_and_checked_on_creation() -> None:
    cfg = FederationConfig(algorithm="ditto", options={"lam": 2, "personal_epochs": 3})
    opts = get_algorithm(cfg, get_model("cnn", num_classes=10, in_channels=1)).options
    assert opts == DittoOptions(lam=2.0, personal_epochs=3) and isinstance(opts.lam, float)
    assert get_algorithm(FederationConfig(algorithm="ditto"),
                         get_model("cnn", num_classes=10, in_channels=1)).options == DittoOptions()
    with pytest.raises(ConfigError, match=r"no option .mu.*its options: lam, personal_epochs"):
        FederationConfig(algorithm="ditto", options={"mu": 0.1})
    with pytest.raises(ConfigError, match=r"'fedper' has no option 'lam'.*its options: none"):
        FederationConfig(algorithm="fedper", options={"lam": 0.1})
    for bad in ({"lam": -1}, {"lam": float("nan")}, {"lam": "big"}, {"lam": True}, {"personal_epochs": 0},
                {"personal_epochs": 1.5}):
        with pytest.raises(ConfigError, match="ditto's"):
            FederationConfig(algorithm="ditto", options=bad)
    with pytest.raises(ConfigError, match="options must be"):
        FederationConfig(algorithm="ditto", options={"lam": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="at most 64"):
        FederationConfig(algorithm="ditto", options={f"k{i}": 1 for i in range(65)})


def test_options_come_from_a_toml_table_a_flag_and_a_saved_run(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('algorithm = "ditto"\n[options]\nlam = 0.5\n')
    cfg = FederationConfig.from_dict(load_config_file(p))
    assert cfg.options == {"lam": 0.5}
    assert FederationConfig.from_dict(cfg.to_dict()) == cfg  # what a run's JSON records re-runs it
    assert parse_options(["lam=1", "personal_epochs=2", "name=x"]) == {"lam": 1, "personal_epochs": 2, "name": "x"}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_options(["lam"])


def test_a_client_state_holds_both_models_and_sends_only_the_global_one() -> None:
    from pfl_edge.algorithms import Clients

    cfg = FederationConfig(algorithm="ditto", clients=2)
    model = get_model("cnn", num_classes=10, in_channels=1)
    algo = get_algorithm(cfg, model)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cl = Clients(cfg, model, None, torch.arange(2), torch.tensor([5, 5]))  # type: ignore[arg-type]
    state = algo.init_clients(cl, init)
    assert set(global_part(state)) == set(init) == set(personal_part(state))
    one = {k: v[0] for k, v in state.items()}
    one["personal:" + next(iter(init))] += 1.0  # the personal model moved; what is sent is the global one
    sent = algo.device_upload(one).tensors
    assert set(sent) == set(init)
    assert all(torch.equal(sent[k], init[k]) for k in init)
    assert algo.train_epochs(True) == 2 * cfg.local_epochs and algo.train_epochs(False) == 0
