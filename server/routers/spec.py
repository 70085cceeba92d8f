"""The protocol's JSON Schemas over HTTP (``pfl_edge.schemas``), generated in this process from the same models
the server validates with, so what it serves is always what it enforces. No authentication: the schemas are
public (docs/schemas holds the same files) and reveal nothing of any federation; a server with ``api_docs`` off
(the shipped compose files) answers 404, as it does for /docs and /openapi.json."""

from __future__ import annotations

import functools
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from pfl_edge import schemas
from pfl_edge.protocol import API_PREFIX, ErrorBody

from ..errors import NotFound

__all__ = ["router"]



def _published(request: Request) -> None:
    """The schemas are served where the server's ``api_docs`` setting is on (off in the shipped compose files)."""
    if not getattr(request.app.state, "api_docs", True):
        raise NotFound("this server does not publish its schemas (api_docs is off); docs/schemas holds them")


router = APIRouter(prefix="/schemas", tags=["spec"], dependencies=[Depends(_published)])


@functools.cache
def _all() -> dict[str, dict[str, Any]]:
    # made once per process: the models cannot change while it runs
    return schemas.schemas()


@router.get("")
def schema_index() -> dict[str, Any]:
    """Every message's schema: its name, its URL and what it is."""
    return schemas.index(f"{API_PREFIX}/schemas/")


@router.get("/{name}.json", response_class=JSONResponse, responses={
    200: {"description": "a JSON Schema, draft 2020-12", "content": {"application/schema+json": {
        "schema": {"type": "object"}}}},
    404: {"description": "no message of that name", "model": ErrorBody}})
def get_schema(name: str) -> JSONResponse:
    """One message's JSON Schema (draft 2020-12), e.g. ``Task.json``."""
    doc = _all().get(name)
    if doc is None:
        raise NotFound(f"no schema {name[:80]!r}; GET {API_PREFIX}/schemas lists them")
    return JSONResponse(doc, media_type="application/schema+json")
