"""Refusals of the HTTP API, each with its typed status. The app turns every one into ``{"detail": "..."}``
with that status (401s also carry ``WWW-Authenticate: Bearer``). A broken invariant of the server itself is
``pfl_edge.errors.InternalError`` instead: a bug, answered 500."""

from __future__ import annotations

import math
from http import HTTPStatus
from typing import ClassVar

from pfl_edge.errors import PflEdgeError

__all__ = [
    "ApiError",
    "Conflict",
    "Forbidden",
    "NotFound",
    "TooLarge",
    "TooManyRequests",
    "Unauthorized",
    "Unprocessable",
    "Unspoken",
]


class ApiError(PflEdgeError):
    """A refusal: ``detail`` says what was wrong and what is valid; ``status`` is its HTTP status."""

    status: ClassVar[HTTPStatus] = HTTPStatus.BAD_REQUEST

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    @property
    def headers(self) -> dict[str, str] | None:
        return None


class Unauthorized(ApiError):
    """No credentials, or credentials nobody issued."""

    status = HTTPStatus.UNAUTHORIZED

    @property
    def headers(self) -> dict[str, str] | None:
        return {"WWW-Authenticate": "Bearer"}


class Forbidden(ApiError):
    """Known credentials that do not grant this (a wrong enrol secret, another federation's data)."""

    status = HTTPStatus.FORBIDDEN


class NotFound(ApiError):
    status = HTTPStatus.NOT_FOUND


class Conflict(ApiError):
    """Valid, but not now: a stale or future round, a full or finished federation, a different second update."""

    status = HTTPStatus.CONFLICT


class TooLarge(ApiError):
    status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE


class TooManyRequests(ApiError):
    """Over a rate limit or a quota; ``retry_after`` (seconds, rounded up) goes out as ``Retry-After``."""

    status = HTTPStatus.TOO_MANY_REQUESTS

    def __init__(self, detail: str, retry_after: float | None = None) -> None:
        super().__init__(detail)
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str] | None:
        return None if self.retry_after is None else {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


class Unprocessable(ApiError):
    """Well-formed HTTP whose content is refused (a payload that does not decode, a slot out of range)."""

    status = HTTPStatus.UNPROCESSABLE_ENTITY


class Unspoken(ApiError):
    """A device that speaks no protocol version this server answers in (docs/protocol.md, "Versions"): 426, the
    detail naming both sides' versions; the device (or the server) must be updated, no retry helps."""

    status = HTTPStatus.UPGRADE_REQUIRED
