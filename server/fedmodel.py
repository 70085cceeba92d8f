"""What the server knows about a federation's model: its spec and id, every tensor's shape, which tensors a
device of a given K_P sends (its base), and the initial model. Built once per config and cached: the server
builds the model's skeleton and reads the data set only to learn its shape (the partition decides the number
of classes, exactly as ``pfl_edge.local.load_local_data`` does)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from pfl_edge.checkpoint import ModelSpec, build_model
from pfl_edge.errors import ConfigError
from pfl_edge.local import check_device_config, device_split, init_state, model_id
from pfl_edge.models import BlockModel
from pfl_edge.sim.config import DECENTRAL, SimConfig
from pfl_edge.sim.simulator import deal

__all__ = ["FedModel", "fed_model"]


@dataclass(eq=False)
class FedModel:
    cfg: SimConfig
    spec: ModelSpec
    model: BlockModel
    model_id: str
    shapes: dict[str, tuple[int, ...]]
    _bases: dict[int, tuple[str, ...]] = field(default_factory=dict)

    @property
    def decentral(self) -> bool:
        return self.cfg.algorithm in DECENTRAL

    @property
    def num_blocks(self) -> int:
        return len(self.model.block_names)

    def base_keys(self, kp: int) -> tuple[str, ...]:
        """What a device with ``kp`` personal blocks sends and receives (FedPer); every tensor for DisPFL."""
        if self.decentral:
            return tuple(self.shapes)
        if kp not in self._bases:
            self._bases[kp] = device_split(self.model, self.cfg, kp).base
        return self._bases[kp]

    def expected(self, kp: int) -> dict[str, tuple[int, ...]]:
        return {k: self.shapes[k] for k in self.base_keys(kp)}

    def init_state(self) -> dict[str, Tensor]:
        return init_state(self.cfg, self.spec)


_CACHE: dict[str, FedModel] = {}
_LOCK = threading.Lock()


def fed_model(config: dict[str, Any]) -> FedModel:
    """The federation's model for ``config`` (SimConfig keys); ConfigError/DataError with a clear message when
    the config cannot run on devices."""
    key = json.dumps(config, sort_keys=True, default=str)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            return hit
        try:
            cfg = SimConfig.from_dict(dict(config))
        except TypeError as e:  # e.g. a list where a table was expected
            raise ConfigError(f"invalid config: {e}") from e
        check_device_config(cfg)
        _, _, spec = deal(cfg)
        model = build_model(spec)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        fm = FedModel(cfg, spec, model, model_id(spec), shapes)
        if not fm.decentral:
            fm.base_keys(cfg.kp)  # a kp the model cannot split is an error now, not at the first upload
        _CACHE[key] = fm
        return fm
