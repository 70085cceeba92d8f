"""JSON Schemas (draft 2020-12) of every protocol message, generated from the pydantic models of
:mod:`pfl_edge.protocol`, so a device team that does not read Python has a machine-checkable definition.

One function makes them (:func:`schemas`); ``python -m pfl_edge.schemas --out docs/schemas`` writes them as
``<Name>.json`` plus ``index.json``, and the server serves the same ones at ``GET /v1/schemas`` and
``GET /v1/schemas/<Name>.json`` (``server.routers.spec``). A test holds the committed files to what this module
makes now, so they cannot drift from the models.

Each schema is self-contained (nested messages sit in its ``$defs``) and its ``$id`` is relative
(``Task.json``): it resolves to the file beside it, or to the server's URL it was fetched from. JSON Schema has
no "finite" keyword: a float that must be finite is bounded (at most ``1.7976931348623157e308``), which a NaN
or an Infinity fails in any validator; a standard JSON parser refuses ``NaN`` and ``Infinity`` tokens anyway.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from . import protocol
from .secagg import wire

__all__ = ["DIALECT", "MESSAGES", "index", "main", "message_types", "schema", "schemas", "write"]

DIALECT = "https://json-schema.org/draft/2020-12/schema"

#: every message that travels, by schema name (the model's class name)
MESSAGES: tuple[type[BaseModel], ...] = (
    protocol.FederationCreate, protocol.FederationInfo, protocol.AggregationSettings,
    protocol.EnrolRequest, protocol.Platform, protocol.KeyProof, protocol.Enrolment, protocol.TokenRotation,
    protocol.TokenIssued, protocol.BrokerInfo,
    protocol.Task, protocol.Neighbour, protocol.RoundAnnouncement, protocol.DeviceStatus,
    protocol.BlobStored, protocol.UpdateRequest, protocol.UpdateAccepted,
    protocol.MetricsReport, protocol.MetricsStored, protocol.ErrorBody, protocol.ValidationIssue,
    # secure aggregation's steps (pfl_edge.secagg.wire: no cryptography imported)
    wire.SecAggStep, wire.SecAggParams, wire.SecAggNeighbour, wire.SecAggSealed, wire.SecAggKeys,
    wire.SecAggShares, wire.SecAggShare, wire.SecAggUnmask, wire.SecAggComplaint,
)

# Messages defined in modules of their own, included when the module exists (imported lazily: pfl_edge.schemas
# must not fail, nor pull in more, because one of them is absent or heavy).
_OPTIONAL = (("pfl_edge.modelcard", "ModelCard"), ("pfl_edge.fleet", "FederationMetrics"),
             ("pfl_edge.fleet", "DeviceEntry"), ("pfl_edge.fleet", "ClassCosts"), ("pfl_edge.data_share", "DataShare"))


def message_types() -> dict[str, type[BaseModel]]:
    """Schema name -> model, in a stable order: the protocol's messages, then the optional ones present."""
    out = {m.__name__: m for m in MESSAGES}
    for module, name in _OPTIONAL:
        try:
            model = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        out[name] = model
    return out


def schema(model: type[BaseModel], *, strict: bool = True) -> dict[str, Any]:
    """``model``'s JSON Schema as it arrives in a body (validation mode): ``$schema``, ``$id``, title,
    description (its docstring) and every field's description. ``strict``: a missing description is an error
    (the protocol's own messages); else it is marked as missing, for a message whose module has yet to say."""
    body = model.model_json_schema(mode="validation")
    undescribed = [k for k, v in body.get("properties", {}).items() if not v.get("description")]
    if strict and (undescribed or not body.get("description")):
        raise ValueError(f"{model.__name__}: no docstring, or fields without a description: {undescribed}")
    body.setdefault("description", f"{model.__name__} (undescribed in its module)")
    return {"$schema": DIALECT, "$id": f"{model.__name__}.json", **body}


def schemas() -> dict[str, dict[str, Any]]:
    """Every message's schema by name."""
    return {name: schema(m, strict=m in MESSAGES) for name, m in message_types().items()}


def index(base: str = "") -> dict[str, Any]:
    """The list of schemas: each name, its URL (``base`` + ``<Name>.json``) and its one-line description."""
    items = []
    for name, s in schemas().items():
        first = str(s["description"]).strip().split("\n\n")[0].replace("\n", " ")
        items.append({"name": name, "url": f"{base}{name}.json", "description": first})
    return {"protocol": protocol.PROTOCOL_VERSION, "dialect": DIALECT, "schemas": items}


def dumps(doc: dict[str, Any]) -> str:
    """The one serialisation used for files and comparisons: sorted keys, two-space indent, final newline."""
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write(out: Path) -> list[Path]:
    """Write every schema and ``index.json`` into ``out``, removing the files of messages its previous index
    listed that no longer exist (nothing else there is touched); the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    docs = {f"{name}.json": s for name, s in schemas().items()}
    docs["index.json"] = index()
    for stale in _previous(out / "index.json") - set(docs):
        (out / stale).unlink(missing_ok=True)
    written = []
    for fname, doc in docs.items():
        path = out / fname
        path.write_text(dumps(doc), encoding="utf-8")
        written.append(path)
    return written


def _previous(path: Path) -> set[str]:
    """File names an earlier ``index.json`` listed (none if there is none, or it is not ours)."""
    try:
        items = json.loads(path.read_text(encoding="utf-8")).get("schemas", [])
        return {Path(str(i["url"])).name for i in items if isinstance(i, dict) and "url" in i}
    except (OSError, ValueError, AttributeError):
        return set()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pfl_edge.schemas", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("docs/schemas"), help="folder to write into")
    args = p.parse_args(argv)
    paths = write(args.out)
    print(f"wrote {len(paths)} files to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
