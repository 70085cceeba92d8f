"""DisPFL's mask schedule (``alpha0``, ``regrow``) is DisPFL's own options now; a config written when they were
flat keys (a TOML file, an earlier run's JSON, a federation stored by an earlier server) reads as it did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pfl_edge.algorithms import algorithm_class
from pfl_edge.config_migration import MOVED_TO_OPTIONS, migrate
from pfl_edge.errors import ConfigError
from pfl_edge.federation import FederationConfig, load_config_file

BASE: dict[str, Any] = dict(dataset="synthetic", partition="iid", clients=4, rounds=3, topology="random:2")


def _opts(cfg: FederationConfig) -> Any:
    return algorithm_class(cfg.algorithm).options_for(cfg)


def test_flat_keys_of_an_earlier_config_become_dispfls_options() -> None:
    flat = FederationConfig.from_dict({**BASE, "algorithm": "dispfl", "alpha0": 0.3, "regrow": "random"})
    given = FederationConfig.from_dict({**BASE, "algorithm": "dispfl", "options": {"alpha0": 0.3,
                                                                                  "regrow": "random"}})
    assert flat.options is not None and given.options is not None
    assert flat == given and flat.options == {"alpha0": 0.3, "regrow": "random", "topology": "random:2"}
    opts = _opts(flat)
    assert (opts.alpha0, opts.regrow, opts.neighbour_bound) == (0.3, "random", 10.0)
    # the card's schedule reads the options
    assert algorithm_class("dispfl").mask_schedule(flat) == {
        "alpha0": 0.3, "rounds": 3, "regrow": "random"}
    # beside another option of its own, and the same value twice is one value
    both = FederationConfig.from_dict({**BASE, "algorithm": "dispfl", "alpha0": 0.2,
                                       "options": {"neighbour_bound": 5, "alpha0": 0.2}})
    assert both.options == {"neighbour_bound": 5, "alpha0": 0.2, "topology": "random:2"}


def test_an_earlier_run_of_another_algorithm_reads_and_a_stray_value_is_refused(tmp_path: Path) -> None:
    # an earlier run's JSON recorded every field, these at their defaults, whatever its algorithm
    old = {"config": {**BASE, "algorithm": "fedper", "kp": 1, **MOVED_TO_OPTIONS, "options": None}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(old))
    cfg = FederationConfig.from_dict(load_config_file(path))
    assert cfg.algorithm == "fedper" and cfg.options is None
    # a flat key an algorithm never used, it ignored: a stored FedPer federation with a topology (or a budget
    # shared with DisPFL rows) means what it meant
    stored = FederationConfig.from_dict({**BASE, "algorithm": "fedper", "alpha0": 0.3, "topology": "ring"})
    assert stored.options is None and stored == FederationConfig.from_dict({"algorithm": "fedper", **{
        k: v for k, v in BASE.items() if k != "topology"}})
    # the topology moved too, to every decentralised algorithm's options
    for name in ("dispfl", "dpsgd", "dpsgd-ft"):
        cfg = FederationConfig.from_dict({**BASE, "algorithm": name})
        assert cfg.options == {"topology": "random:2"}
        assert algorithm_class(name).topology_spec(cfg) == "random:2"  # type: ignore[attr-defined]
    assert algorithm_class("dispfl").topology_spec(  # type: ignore[attr-defined]
        FederationConfig.from_dict({"algorithm": "dispfl", "clients": 4})) == "random:3"  # the default: min(10, N-1)
    with pytest.raises(ConfigError, match="given twice"):
        FederationConfig.from_dict({**BASE, "algorithm": "dispfl", "alpha0": 0.3, "options": {"alpha0": 0.4}})
    with pytest.raises(ConfigError, match="alpha0 must be"):
        FederationConfig.from_dict({**BASE, "algorithm": "dispfl", "alpha0": 1.5})
    with pytest.raises(ConfigError, match="regrow must be"):
        FederationConfig.from_dict({**BASE, "algorithm": "dispfl", "options": {"regrow": "sideways"}})
    with pytest.raises(TypeError):  # the constructor takes only today's fields: code says what it means
        FederationConfig(algorithm="dispfl", alpha0=0.3)  # type: ignore[call-arg]
    assert migrate({"algorithm": "dispfl"}) == {"algorithm": "dispfl"}  # nothing moved: nothing added


def test_a_federation_stored_with_flat_keys_serves_its_schedule() -> None:
    """The server reads a stored federation's config through ``from_dict`` (``server.fedmodel.fed_model``), so a
    federation created before the move keeps its schedule, and the devices' model card says it."""
    from server.fedmodel import fed_model

    stored = dict(algorithm="dispfl", densities=[0.5], topology="random:2", clients=4, rounds=3, dataset="synthetic",
                  partition="iid", samples_per_client=32, test_per_client=16, alpha0=0.25, regrow="random")
    fm = fed_model(stored)
    opts = fm.algorithm().options
    assert (opts.alpha0, opts.regrow) == (0.25, "random")
