"""Configs written before a key moved: an earlier TOML file, run JSON or stored federation still reads as it
did (``FederationConfig.from_dict`` migrates every table it is given)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from .algorithms.algorithm import algorithm_class
from .errors import ConfigError

__all__ = ["MOVED_TO_OPTIONS", "migrate"]

# keys that were flat fields of the config and are now an algorithm's options, with the value they had by
# default: an earlier config, run JSON or stored federation holds them for every algorithm
MOVED_TO_OPTIONS: dict[str, Any] = {"alpha0": 0.5, "regrow": "gradient", "topology": None}


def migrate(d: Mapping[str, Any]) -> dict[str, Any]:
    """``d`` with the keys of ``MOVED_TO_OPTIONS`` moved into its ``options`` where its algorithm has such an
    option, and dropped where it has none: as a flat key, an algorithm that did not use it ignored it, so an
    earlier config (a stored federation, a budget shared by several algorithms) means what it meant. A
    ConfigError where the options table gives the key another value."""
    out = dict(d)
    moved = {k: out.pop(k) for k in MOVED_TO_OPTIONS if k in out}
    if not moved:
        return out
    name = out.get("algorithm", "fedper")
    own = {f.name for f in fields(algorithm_class(name).Options)} if isinstance(name, str) else set()
    given = out.get("options")
    opts = dict(given) if isinstance(given, Mapping) else {} if given is None else None
    for k, v in moved.items():
        if k not in own:
            continue
        if opts is None:
            raise ConfigError("options must be a table of the algorithm's options")
        if k in opts and opts[k] != v:
            raise ConfigError(f"{k} is given twice, as {v!r:.40} and as options.{k} = {opts[k]!r:.40}")
        if v != MOVED_TO_OPTIONS[k] or k in opts:  # an old default stays a default: the options hold what was set
            opts[k] = v
    if opts:
        out["options"] = opts
    return out
