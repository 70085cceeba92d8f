"""A config value against its declared type: what a TOML file or a network request holds is checked, and
converted where that is safe, before a frozen config accepts it (``pfl_edge.federation.FederationConfig``)."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

__all__ = ["coerce", "describe"]


def coerce(value: Any, hint: Any) -> tuple[bool, Any]:
    """Whether ``value`` has the type ``hint`` (unions, None, Literal, tuples of one type, tables of plain
    values, int, float, str, bool), and the value converted where it may be (an int for a float, a list for a
    tuple)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            ok, v = coerce(value, option)
            if ok:
                return True, v
        return False, value
    if hint is type(None):
        return value is None, value
    if origin is Literal:
        return value in typing.get_args(hint), value
    if origin is dict:  # a table of plain values (an algorithm's options)
        ok = isinstance(value, dict) and all(
            isinstance(k, str) and (v is None or isinstance(v, int | float | str | bool)) for k, v in value.items())
        return ok, value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            return False, value
        items = [coerce(v, typing.get_args(hint)[0]) for v in value]
        return all(ok for ok, _ in items), tuple(v for _, v in items)
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    return isinstance(value, hint), value


def describe(hint: Any) -> str:
    """``hint`` as a config's author reads it ("an integer or null")."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin is tuple:
        return f"a list of ({describe(typing.get_args(hint)[0])})"
    if origin is dict:
        return "a table of names to numbers, strings or booleans"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(hint, str(hint))
