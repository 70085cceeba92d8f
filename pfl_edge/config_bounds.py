"""A federation's config as it travels in protocol messages (``FederationCreate``, ``Enrolment``): bounded before
anything reads it. What its keys mean is ``pfl_edge.federation.FederationConfig``'s to check; this only keeps a
hostile body's config small and plain JSON."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from pydantic import Field

from .errors import ConfigError

__all__ = ["bounded_config", "check_table_keys", "config_field"]

MAX_KEYS, MAX_DEPTH, MAX_TEXT = 64, 4, 4_096
KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")


def config_field(description: str) -> Any:
    """A config's field, its bounds stated in its JSON Schema too (``bounded_config`` checks them all)."""
    return Field(description=description, json_schema_extra={
        "maxProperties": MAX_KEYS, "propertyNames": {"pattern": KEY_RE.pattern}})


def bounded_config(max_items: int) -> Callable[[dict[str, object]], dict[str, object]]:
    """The check of a config as it travels: at most 64 keys named like identifiers, values nested at most 4 deep,
    strings of at most 4,096 characters, lists of at most ``max_items`` items, finite numbers."""

    def check(v: dict[str, object]) -> dict[str, object]:
        if len(v) > MAX_KEYS:
            raise ValueError(f"config has {len(v)} keys; at most {MAX_KEYS}")
        for key in v:
            if not KEY_RE.match(key):
                raise ValueError(f"config key {key!r:.80} is not a name (letters, digits, _ and -; at most 64)")
        _check_json(v, MAX_DEPTH, max_items)
        return v

    return check


def _check_json(x: object, depth: int, max_items: int) -> None:
    if isinstance(x, str):
        if len(x) > MAX_TEXT:
            raise ValueError(f"config holds a string of {len(x)} characters; at most {MAX_TEXT}")
    elif isinstance(x, float):
        if not math.isfinite(x):
            raise ValueError("config holds NaN or Infinity; numbers must be finite")
    elif isinstance(x, list | tuple | dict):
        if depth <= 0:
            raise ValueError(f"config is nested more than {MAX_DEPTH} levels deep")
        if len(x) > max_items:
            raise ValueError(f"config holds a collection of {len(x)} items; at most {max_items}")
        for item in x.values() if isinstance(x, dict) else x:
            _check_json(item, depth - 1, max_items)
    elif not (x is None or isinstance(x, bool | int)):
        raise ValueError(f"config holds a {type(x).__name__}; only JSON values are allowed")


def check_table_keys(cls: type, table: Mapping[str, Any], name: str) -> None:
    """ConfigError naming the keys of ``table`` that ``cls`` (a config table's dataclass) has no field for."""
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"{name} has no key {', '.join(map(repr, unknown))}; its keys: {', '.join(known)}")
