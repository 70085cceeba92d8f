"""A federation's config as it travels in protocol messages (``FederationCreate``, ``Enrolment``): bounded before
anything reads it. What its keys mean is ``pfl_edge.federation.FederationConfig``'s to check; this only keeps a
hostile body's config small and plain JSON.

And what each key of a config's dataclasses may hold, stated once, on the field: ``meta`` gives a field its
one-line meaning and, for a number, its ``Range``; ``check_fields`` holds a config's values to their declared types
and ranges, and docs/config.md prints both (``pfl_edge.config_reference``)."""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from pydantic import Field

from .errors import ConfigError
from .typecheck import coerce, describe

__all__ = ["Range", "bounded_config", "check_fields", "check_ranges", "check_table_keys", "config_field", "meta",
           "number"]

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


# ------------------------------------------------------------------------------------------- a key's values


def number(x: float) -> str:
    """A bound as a config's author reads it: integers with thousands separators, floats short (1e6, 0.01)."""
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:g}".replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


@dataclass(frozen=True)
class Range:
    """The numbers a config key may hold: [lo, hi], either end open; ``off``: 0 too (its "none" value, below the
    range). A tuple's every item is held to it."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    off: bool = False

    def holds(self, v: object) -> bool:
        if isinstance(v, bool) or not isinstance(v, int | float):
            return False
        if self.off and v == 0:
            return True
        if isinstance(v, float) and not math.isfinite(v):
            return False
        return (self.lo < v if self.lo_open else self.lo <= v) and (v < self.hi if self.hi_open else v <= self.hi)

    def __str__(self) -> str:
        text = (f"{'(' if self.lo_open else '['}{number(self.lo)}, {number(self.hi)}"
                f"{')' if self.hi_open else ']'}")
        return f"0 or {text}" if self.off else text

    def refusal(self, name: str, v: object) -> str:
        """Why ``v`` is not a valid ``name``."""
        if isinstance(v, bool) or not isinstance(v, int | float):
            what = f"a number in {self}"
        elif isinstance(v, float) and not math.isfinite(v):
            what = f"a finite number in {self}"
        elif v > self.hi or (self.hi_open and v == self.hi):
            what = f"{'below' if self.hi_open else 'at most'} {number(self.hi)}"
        else:
            what = f"in {self}"
        return f"{name} must be {what}, got {v!r:.40}"


def meta(doc: str, valid: Range | None = None) -> dict[str, Any]:
    """A config field's metadata: its meaning in one line (``doc``) and, for a number, the values it may hold."""
    return {"doc": doc} if valid is None else {"doc": doc, "range": valid}


_HINTS: dict[type, dict[str, Any]] = {}  # each config dataclass's resolved annotations


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def check_ranges(obj: Any, prefix: str = "") -> None:
    """ConfigError for the first field of ``obj`` (a config's dataclass) outside its metadata's ``Range`` (None
    is the type's to allow)."""
    for f in fields(obj):
        valid, v = f.metadata.get("range"), getattr(obj, f.name)
        if valid is None or v is None:
            continue
        for x in v if isinstance(v, tuple) else (v,):
            if not valid.holds(x):
                raise ConfigError(valid.refusal(prefix + f.name, x))


def check_fields(obj: Any, prefix: str = "") -> None:
    """ConfigError for the first field of ``obj`` whose value is not of its declared type (a ``Literal``'s values
    included; an int is a float), then ``check_ranges``."""
    hints = _hints(type(obj))
    for f in fields(obj):
        v = getattr(obj, f.name)
        if not coerce(v, hints[f.name])[0]:
            raise ConfigError(f"{prefix}{f.name} must be {_expected(hints[f.name], f.metadata.get('range'))}, "
                              f"got {v!r:.40}")
    check_ranges(obj, prefix)


def _expected(hint: Any, valid: Range | None) -> str:
    """A value of type ``hint`` within ``valid``, in words ("an integer in [2, 31] or null")."""
    if valid is None:
        return describe(hint)
    args = typing.get_args(hint)
    optional = type(None) in args
    kind = next(h for h in args if h is not type(None)) if optional else hint
    return f"{describe(kind)} in {valid}{' or null' if optional else ''}"
