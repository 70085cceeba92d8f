"""Hostile input at the edge of the HTTP API, refused before FastAPI parses anything and without a token.

- :class:`InputLimits` (pure ASGI middleware): a request's headers are bounded (count and bytes: 431), and its
  body by its route's limit (:data:`BODY_LIMITS`; 413), by ``Content-Length`` at once and while streaming for a
  chunked body; a JSON body must be standard JSON (422): no ``NaN``/``Infinity`` (Python's ``json`` accepts them,
  then answering would fail), no number that is not finite as a float (``1e400``), no integer of more than
  :data:`MAX_INT_DIGITS` digits, no nesting deeper than Python's parser takes; and it must arrive within
  :data:`BODY_TIMEOUT_S` (408), so a body trickling in byte by byte does not hold a connection for ever. The
  blob PUT streams under its own ``max_blob_bytes`` limit (``server.routers.blobs``) and is passed through here.
- :func:`install` registers it with the exception handlers: a request that fails validation is answered 422 with
  each error's location, message and type, truncated, never its input (a 422 used to echo the whole body); an
  unexpected error is a JSON 500 without a traceback (the log has it).

Under uvicorn's h11 protocol (the only one installed: no httptools), the request line and headers together are
also bounded by h11's ``max_incomplete_event_size`` (16 KiB by default) before this middleware sees them.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from http import HTTPStatus
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from pfl_edge.errors import PflEdgeError
from pfl_edge.protocol import API_PREFIX

__all__ = ["BODY_LIMITS", "JSON_BODY_LIMIT", "MAX_HEADERS", "MAX_HEADER_BYTES", "MAX_INT_DIGITS", "InputLimits",
           "install"]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON_BODY_LIMIT = 64 << 10  # enrolment, updates, metrics: a few hundred bytes in practice
# (method, path pattern) -> the most body bytes (None: the route streams and limits its own body); first match
BODY_LIMITS: tuple[tuple[str, re.Pattern[str], int | None], ...] = (
    ("POST", re.compile(rf"^{API_PREFIX}/federations/?$"), 1 << 20),  # a federation's config (admin)
    ("PUT", re.compile(rf"^{API_PREFIX}/blobs/[^/]*$"), None),  # max_blob_bytes, streamed by the route
    ("POST", re.compile(rf"^{API_PREFIX}/broker/hook/"), 4 << 10),  # a broker's question: a few names
    # a secure round's sealed pairs with their commitments, revealed shares or a complaint: at most about 520
    # bytes per neighbour, at most 10,000 neighbours
    ("POST", re.compile(rf"^{API_PREFIX}/rounds/[0-9]+/secagg/(shares|unmask|complaint)$"), 6 << 20),
)
# routes only the admin may call, whose bodies are large: the token is checked before the body is read (a stranger's
# megabyte of JSON was read and parsed first, 1.2 s of the event loop's CPU each)
ADMIN_FIRST: tuple[tuple[str, re.Pattern[str]], ...] = (("POST", re.compile(rf"^{API_PREFIX}/federations/?$")),)
# routes only an enrolled device may call, whose bodies are large (a secure round's shares: up to 6 MiB): the
# device's token is checked before the body is read (a stranger's 4 MiB of JSON was parsed first: 637 ms of the
# event loop's CPU each, issue 48)
DEVICE_FIRST: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("POST", re.compile(rf"^{API_PREFIX}/rounds/[0-9]+/secagg/(shares|unmask|complaint)$")),)
# a body over this is checked (parsed) here in a worker thread, not on the event loop that serves every other call
# (the route's own parse, FastAPI's, still runs on the loop: only a device with a token gets that far)
PARSE_ON_LOOP = 64 << 10
MAX_HEADERS = 64
MAX_HEADER_BYTES = 16 << 10
BODY_TIMEOUT_S = 30.0  # a JSON body trickling in slower than this holds its connection no longer
MAX_INT_DIGITS = 40  # beyond any count, seed or id; Python itself refuses 4,300 only after the work
_MAX_ERRORS = 16  # validation errors listed in a 422
_MAX_TEXT = 200  # characters of one error's message or location part


class _NotStandardJson(ValueError):
    pass


def _constant(name: str) -> Any:
    raise _NotStandardJson(f"{name} is not a JSON number; send finite numbers only")


def _finite(text: str) -> float:
    x = float(text)
    if x in (float("inf"), float("-inf")):
        raise _NotStandardJson(f"number {text[:40]} is too large (not finite as a float)")
    return x


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _NotStandardJson(f"integer of {len(text)} digits; at most {MAX_INT_DIGITS}")
    return int(text)


def json_problem(body: bytes) -> str | None:
    """Why ``body`` is not standard JSON of bounded numbers and depth (or not JSON at all), or None."""
    try:
        json.loads(body, parse_constant=_constant, parse_float=_finite, parse_int=_int)
    except _NotStandardJson as e:
        return str(e)
    except RecursionError:
        return "JSON nested too deeply"
    except ValueError as e:  # not JSON, not UTF-8
        return f"request body is not valid JSON: {str(e)[:_MAX_TEXT]}"
    return None


def _refusal(status: HTTPStatus, detail: str) -> tuple[Message, Message]:
    body = json.dumps({"detail": detail}).encode()
    start = {"type": "http.response.start", "status": int(status),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]}
    return start, {"type": "http.response.body", "body": body, "more_body": False}


class InputLimits:
    """Bounds on a request's headers and body, checked before the app sees them (see the module)."""

    def __init__(self, app: ASGIApp, limits: tuple[tuple[str, re.Pattern[str], int | None], ...] = BODY_LIMITS,
                 default: int = JSON_BODY_LIMIT, body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.app = app
        self.limits = limits
        self.default = default
        self.body_timeout_s = body_timeout_s

    def limit_for(self, method: str, path: str) -> int | None:
        for m, pattern, limit in self.limits:
            if m == method and pattern.match(path):
                return limit
        return self.default

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        if len(headers) > MAX_HEADERS or sum(len(k) + len(v) for k, v in headers) > MAX_HEADER_BYTES:
            await self._refuse(send, HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                               f"request headers over the limit of {MAX_HEADERS} fields or {MAX_HEADER_BYTES} bytes")
            return
        if any(m == scope["method"] and p.match(scope["path"]) for m, p in ADMIN_FIRST) and not _admin(scope, headers):
            await self._refuse(send, HTTPStatus.UNAUTHORIZED, "this call needs the admin token (Authorization: Bearer)")
            return
        if any(m == scope["method"] and p.match(scope["path"]) for m, p in DEVICE_FIRST) \
                and not await _device(scope, headers):
            await self._refuse(send, HTTPStatus.UNAUTHORIZED, "this call needs a device token (Authorization: Bearer)")
            return
        limit = self.limit_for(scope["method"], scope["path"])
        if limit is None:
            await self.app(scope, receive, send)
            return
        hdr = dict(headers)
        declared = hdr.get(b"content-length")
        if declared is not None and (not declared.isdigit() or len(declared) > 20):
            await self._refuse(send, HTTPStatus.BAD_REQUEST, "Content-Length is not a number of bytes")
            return
        if declared is not None and int(declared) > limit:
            await self._refuse(send, HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                               f"request body of {int(declared)} bytes is over this route's limit of {limit} bytes")
            return
        try:
            with anyio.fail_after(self.body_timeout_s):
                body = await self._read(receive, limit)
        except TimeoutError:
            await self._refuse(send, HTTPStatus.REQUEST_TIMEOUT,
                               f"request body not complete within {self.body_timeout_s:g} s")
            return
        if body is None:
            await self._refuse(send, HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                               f"request body is over this route's limit of {limit} bytes")
            return
        problem = None
        if body and _is_json(hdr.get(b"content-type")):
            # a large body's check runs in a worker thread: parsing megabytes must not stall the event loop
            problem = json_problem(body) if len(body) <= PARSE_ON_LOOP else await anyio.to_thread.run_sync(
                json_problem, body)
        if problem is not None:
            await self._refuse(send, HTTPStatus.UNPROCESSABLE_ENTITY, problem)
            return
        await self.app(scope, _replay(body, receive), send)

    @staticmethod
    async def _read(receive: Receive, limit: int) -> bytes | None:
        """The whole body, or None as soon as it is over ``limit`` (or the client has gone)."""
        buf = bytearray()
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # http.disconnect: nobody to answer
                return None
            buf += msg.get("body", b"")
            if len(buf) > limit:
                return None
            if not msg.get("more_body", False):
                return bytes(buf)

    @staticmethod
    async def _refuse(send: Send, status: HTTPStatus, detail: str) -> None:
        start, body = _refusal(status, detail)
        await send(start)
        await send(body)


def _admin(scope: Scope, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the request carries the app's admin token (``app.state.admin_token``; none set: nobody is admin)."""
    app = scope.get("app")
    want = getattr(getattr(app, "state", None), "admin_token", "") if app is not None else ""
    got = next((v for k, v in headers if k == b"authorization"), b"")
    if not want or not got.startswith(b"Bearer "):
        return False
    return hmac.compare_digest(got[7:].strip(), str(want).encode())


async def _device(scope: Scope, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the request carries a live device's token (the enrolment service's own check, in a worker thread:
    it reads the database). The route checks it again, with its federation and round."""
    app = scope.get("app")
    pfl = getattr(getattr(app, "state", None), "pfl", None) if app is not None else None
    got = next((v for k, v in headers if k == b"authorization"), b"")
    if pfl is None or not got.startswith(b"Bearer "):
        return False
    token = got[7:].strip().decode("latin-1")
    try:
        await anyio.to_thread.run_sync(pfl.coordinator.enrolment.authenticate, token)
    except PflEdgeError:  # Unauthorized: unknown, revoked or expired
        return False
    return True


def _is_json(content_type: bytes | None) -> bool:
    """What FastAPI parses as JSON: no content type, ``application/json`` or ``application/*+json``."""
    if not content_type:
        return True
    kind = content_type.split(b";")[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # http.disconnect, when the client goes

    return replay


def _short(x: object) -> str | int:
    return x if isinstance(x, int) else str(x)[:_MAX_TEXT]


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    detail: list[dict[str, Any]] = [
        {"loc": [_short(p) for p in e.get("loc", ())][:8], "msg": str(e.get("msg", ""))[:_MAX_TEXT],
         "type": str(e.get("type", ""))[:_MAX_TEXT]}
        for e in errors[:_MAX_ERRORS]]
    if len(errors) > _MAX_ERRORS:
        detail.append({"loc": [], "msg": f"and {len(errors) - _MAX_ERRORS} more errors", "type": "truncated"})
    return JSONResponse({"detail": detail}, status_code=int(HTTPStatus.UNPROCESSABLE_ENTITY))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc, exc_info=exc)
    return JSONResponse({"detail": "internal server error (a bug: the server's log has the details)"},
                        status_code=int(HTTPStatus.INTERNAL_SERVER_ERROR))


def install(app: FastAPI) -> None:
    """Add the limits and the handlers to ``app`` (``server.app.create_app`` does), and say in its OpenAPI what
    a 422 holds: a list of errors (validation) or one message (a refusal of the content, ``server.errors``)."""
    app.add_middleware(InputLimits)  # a plain ASGI class
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)
    openapi = app.openapi

    def documented() -> dict[str, Any]:
        spec = openapi()
        shape = spec.get("components", {}).get("schemas", {}).get("HTTPValidationError", {}).get("properties", {})
        if "detail" in shape:
            shape["detail"] = {"title": "Detail", "anyOf": [
                {"type": "string"}, {"type": "array", "items": {"$ref": "#/components/schemas/ValidationError"}}]}
        return spec

    app.openapi = documented  # type: ignore[method-assign]
