"""docs/config.md, the federation config key by key, generated from the config's types.

Every key of ``pfl_edge.federation.FederationConfig`` and of its tables (``privacy``: ``PrivacyConfig``;
``secure_aggregation``: ``SecAggConfig``; ``options``: each algorithm's ``Options``), with its type and default
(the dataclass field's), the values it may hold (its ``Range`` in the field's metadata, its ``Literal``, or the
registry that names them) and its meaning (the field's ``doc``: ``pfl_edge.config_bounds.meta``). Nothing here
restates a key: a key, bound or meaning changes on its field, and ``python -m pfl_edge.config_reference`` writes
the page again; tests/pfl_edge/test_config_reference.py fails while the committed page differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from .algorithms.algorithm import algorithm_class, device_algorithms, list_algorithms
from .config_bounds import MAX_DEPTH, MAX_KEYS, Range
from .config_migration import MOVED_TO_OPTIONS
from .data import list_datasets, list_partitioners
from .federation import _MAX_TEXT, OWN_DATA, FederationConfig
from .privacy import PrivacyConfig
from .secagg_config import SecAggConfig

__all__ = ["Row", "main", "render", "rows"]

DOC = Path("docs/config.md")
HEADER = "| key | type | default | valid values | meaning |\n|---|---|---|---|---|"
OPTIONS_HEADER = ("| key | algorithms | type | default | valid values | meaning |\n"
                  "|---|---|---|---|---|---|")
TABLES = {"privacy": PrivacyConfig, "secure_aggregation": SecAggConfig}


@dataclasses.dataclass(frozen=True)
class Row:
    """One key of the reference, as it is printed."""

    key: str  # dotted for a table's: ``privacy.clip``
    type: str
    default: str
    valid: str
    meaning: str
    algorithms: tuple[str, ...] = ()  # an option's: the algorithms that take it


def _models() -> list[str]:
    from .models import list_models  # the model zoo registers its models with torch: imported here only

    return list(list_models())


def _algorithms() -> str:
    on_devices = set(device_algorithms())
    names = list_algorithms()
    return (f"{_codes(names)}; on devices: {_codes(n for n in names if n in on_devices)} "
            "([algorithms.md](algorithms.md))")


# what names a text key's valid values: the registries, asked when the page is written
NAMED: dict[str, Callable[[], str]] = {
    "algorithm": _algorithms,
    "model": lambda: _codes(_models()),
    "dataset": lambda: _codes(list_datasets()),
    "partition": lambda: (f"`NAME` or `NAME:ARG`, NAME one of {_codes(list_partitioners())}; "
                          f"or `{OWN_DATA}`"),
}


def _codes(names: typing.Iterable[object]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _type(hint: Any) -> str:
    """A key's type as a config's author writes it (TOML or JSON)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in args)
    if origin is Literal:
        return "text" if all(isinstance(a, str) for a in args) else "one of"
    if origin is tuple:
        return f"list of {_type(args[0])}s"
    if origin is dict:
        return "table"
    return {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "text"}.get(hint, str(hint))


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is dataclasses.MISSING:
        return "required"
    return f"`{json.dumps(f.default)}`"


def _valid(name: str, hint: Any, valid: Range | None) -> str:
    """The values a key may hold: its range, its literal's values, its registry's names, true or false."""
    if valid is not None:
        return f"each in {valid}" if _type(hint).startswith("list") else str(valid)
    if name in NAMED:
        return NAMED[name]()
    if name in TABLES or name == "options":
        return f"a table: [below](#{name})"
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    literal = next((a for a in [hint, *args] if typing.get_origin(a) is Literal), None)
    if literal is not None:
        return _codes(typing.get_args(literal))
    if hint is bool or bool in args:
        return "`true`, `false`"
    return "—"


def _row(prefix: str, f: dataclasses.Field[Any], hint: Any, algorithms: tuple[str, ...] = ()) -> Row:
    valid = f.metadata.get("range")
    key = prefix + f.name  # NAMED's and TABLES' keys are top-level ones: a table's key is dotted
    return Row(key, _type(hint), _default(f), _valid(key, hint, valid), str(f.metadata.get("doc", "")), algorithms)


def _rows_of(cls: type, prefix: str = "") -> list[Row]:
    hints = typing.get_type_hints(cls)
    return [_row(prefix, f, hints[f.name]) for f in dataclasses.fields(cls)]


def option_rows() -> list[Row]:
    """Each algorithm option once, with the algorithms that take it (an option a class inherits is one key)."""
    takers: dict[dataclasses.Field[Any], list[str]] = {}
    owner: dict[dataclasses.Field[Any], type] = {}
    for name in list_algorithms():
        cls = algorithm_class(name).Options
        for f in dataclasses.fields(cls):
            takers.setdefault(f, []).append(name)
            owner.setdefault(f, cls)
    return [_row("options.", f, typing.get_type_hints(owner[f])[f.name], tuple(algos))
            for f, algos in takers.items()]


def rows() -> list[Row]:
    """Every key of the config, its tables' and its options', in the page's order."""
    out = _rows_of(FederationConfig)
    for name, cls in TABLES.items():
        out += _rows_of(cls, f"{name}.")
    return out + option_rows()


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _line(r: Row) -> str:
    cells = [f"`{r.key}`", *([_codes(r.algorithms)] if r.algorithms else []), r.type, r.default, r.valid, r.meaning]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _moved() -> list[str]:
    """The keys that moved into an algorithm's options, and how an earlier config's are read."""
    lines = ["| earlier key | read as | its default then |", "|---|---|---|"]
    for key, old in MOVED_TO_OPTIONS.items():
        takers = [n for n in list_algorithms()
                  if key in {f.name for f in dataclasses.fields(algorithm_class(n).Options)}]
        lines.append(f"| `{key}` | `options.{key}` for {_codes(takers)}; dropped for the others | "
                     f"`{json.dumps(old)}` |")
    return lines


INTRO = f"""\
# The federation config, key by key

<!-- Generated by `python -m pfl_edge.config_reference` from the config's types (pfl_edge/config_reference.py):
edit a key's field (its type, default, `meta` doc and `Range`), not this page. -->

A federation's config is `pfl_edge.federation.FederationConfig`. The simulator reads it from a TOML file, an
earlier run's JSON (`pfl-edge simulate --config`) or its flags; the server from `FederationCreate.config`; every
device gets it whole, each key with its value or default, in its `Enrolment` and `FederationInfo`
([protocol.md](protocol.md)). A value outside what a key's row allows is refused with a message naming the
key.

- A key left out takes its default. `null` (JSON) is valid only where the type says "or null".
- A number's valid values: `[a, b]` includes both ends, `(a, b)` neither; "0 or [a, b]": 0 (none) too. An
  integer key takes only integers; a number key takes integers too.
- Text: at most {_MAX_TEXT:,} characters. In a message the config holds at most {MAX_KEYS} keys, nested at most
  {MAX_DEPTH} deep (`pfl_edge.config_bounds`).
- Rules that tie keys together (an algorithm's own, such as FedRep's `kp` >= 1; a sampled federation's; a
  privacy or secure-aggregation table's with the rest) are the config's checks too; their messages say what to
  change.
"""


def render() -> str:
    """docs/config.md's text."""
    rs = rows()
    top = [r for r in rs if "." not in r.key]
    parts = [INTRO, f"{len(rs)} keys: {len(top)} of the config, "
             + ", ".join(f"{sum(r.key.startswith(t + '.') for r in rs)} of `{t}`" for t in (*TABLES, "options"))
             + ".\n", "## Keys\n", HEADER, *(_line(r) for r in top), ""]
    for name, cls in TABLES.items():
        parts += [f"## {name}\n", f"A `[{name}]` table in TOML, an object in JSON: `{cls.__module__}."
                  f"{cls.__name__}`.\n", HEADER, *(_line(r) for r in rs if r.key.startswith(name + ".")), ""]
    options = [r for r in rs if r.key.startswith("options.")]
    none = [n for n in list_algorithms() if not dataclasses.fields(algorithm_class(n).Options)]
    parts += ["## options\n", "The algorithm's own options: an `[options]` table in TOML, an object in JSON, "
              "`--option KEY=VALUE` on the command line; each algorithm's `Options` dataclass. An option the "
              f"algorithm does not take is refused. Without options: {_codes(none)}.\n", OPTIONS_HEADER,
              *(_line(r) for r in options), "", "## Keys that moved\n",
              "A config written before these were options (a TOML file, a run's JSON, a stored federation) is read "
              "as it was meant (`pfl_edge.config_migration`):\n", *_moved(), ""]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pfl_edge.config_reference", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DOC, help="the file to write (default: docs/config.md)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file differs")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out} is {'current' if same else 'stale: run python -m pfl_edge.config_reference'}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out}: {len(rows())} keys")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
