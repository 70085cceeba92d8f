"""What the server knows about a federation's model: its spec and id, every tensor's shape, which tensors a
device of a given K_P sends (its base), and the initial model. Built once per config and cached: the server
builds the model's skeleton and deals the data set from its labels alone (``input_spec``: the partition decides
the number of classes, exactly as every device's dealing does; a federation whose devices bring their own data is
not dealt, its data set names only the model's input); it never loads an image."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from pfl_edge.algorithms import Algorithm, get_algorithm
from pfl_edge.checkpoint import ModelSpec, build_model
from pfl_edge.data import Partition
from pfl_edge.errors import ConfigError
from pfl_edge.federation import (
    FederationConfig,
    check_device_config,
    deal_labels,
    init_state,
    input_spec,
    model_id,
)
from pfl_edge.models import BlockModel

__all__ = ["FedModel", "fed_model"]


@dataclass(eq=False)
class FedModel:
    cfg: FederationConfig
    spec: ModelSpec
    model: BlockModel
    model_id: str
    shapes: dict[str, tuple[int, ...]]
    largest_share: int  # the most training samples the federation's deal gives one client (input_spec)
    shares: tuple[int, ...] = ()  # each slot's training samples as dealt; () where devices bring their own data
    deal: Partition | None = None  # the deal itself (each slot's indices: GET /v1/devices/me/share); None: own data
    _algos: dict[int, Algorithm] = field(default_factory=dict)

    def algorithm(self, kp: int | None = None) -> Algorithm:
        """The federation's algorithm, for devices with ``kp`` personal blocks (default: the config's)."""
        k = self.cfg.kp if kp is None else kp
        if k not in self._algos:
            self._algos[k] = get_algorithm(self.cfg, self.model, k)
        return self._algos[k]

    @property
    def num_blocks(self) -> int:
        return len(self.model.block_names)

    def base_keys(self, kp: int) -> tuple[str, ...]:
        """What a device with ``kp`` personal blocks sends and receives (``Algorithm.upload_keys``)."""
        return self.algorithm(kp).upload_keys()

    def expected(self, kp: int) -> dict[str, tuple[int, ...]]:
        return {k: self.shapes[k] for k in self.base_keys(kp)}

    def secure_size(self) -> int:
        """Under secure aggregation, the masked vector's length: the float coordinates of the base a device of
        the config's K_P sends (``pfl_edge.secagg.aggregate.float_keys``)."""
        from pfl_edge.secagg.aggregate import float_keys

        state = self.model.state_dict()
        return sum(state[k].numel() for k in float_keys({k: state[k] for k in self.base_keys(self.cfg.kp)}))

    def init_state(self) -> dict[str, Tensor]:
        return init_state(self.cfg, self.spec)


_CACHE: dict[str, FedModel] = {}
_LOCK = threading.Lock()


def fed_model(config: dict[str, Any]) -> FedModel:
    """The federation's model for ``config`` (FederationConfig keys); ConfigError/DataError with a clear message when
    the config cannot run on devices."""
    key = json.dumps(config, sort_keys=True, default=str)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            return hit
        try:
            cfg = FederationConfig.from_dict(dict(config))
        except TypeError as e:  # e.g. a list where a table was expected
            raise ConfigError(f"invalid config: {e}") from e
        check_device_config(cfg)
        if cfg.own_data:
            spec, largest = input_spec(cfg)
            shares: tuple[int, ...] = ()
            part = None
        else:  # the deal the simulator and every device make: each slot's share is known here, from labels alone
            part, spec = deal_labels(cfg)
            shares = tuple(len(c.train_idx) for c in part.clients)
            largest = max(shares)
        model = build_model(spec)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        fm = FedModel(cfg, spec, model, model_id(spec), shapes, largest, shares, part)
        fm.base_keys(cfg.kp)  # a kp the model cannot split is an error now, not at the first upload
        _CACHE[key] = fm
        return fm
