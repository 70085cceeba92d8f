"""What the routers depend on, injected with FastAPI's ``Depends``: the app's services, and who is calling.

Every call but enrolment and ``/healthz`` carries ``Authorization: Bearer <token>``: a device token, or the admin
token (federation creation, revocation, rotation; it may also read everything). ``AdminAuth`` yields the admin
principal, ``DeviceAuth`` the calling device, ``FederationReader`` either of them for the federation in the path
and ``BlobReader`` either of them for a blob.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .coordinator import Coordinator
from .db import Device
from .errors import Forbidden, Unauthorized
from .services import BlobAccess, EnrolmentService, Metrics, Updates

__all__ = [
    "Admin",
    "AdminAuth",
    "BlobReader",
    "Blobs",
    "DeviceAuth",
    "Enrol",
    "FederationReader",
    "MetricsDep",
    "UpdatesDep",
    "admin_principal",
    "coordinator",
]

_bearer = HTTPBearer(auto_error=False, description="a device token (from enrolment) or the admin token")
Token = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


@dataclass(frozen=True)
class Admin:
    """The operator, authenticated by the admin token."""

    name: str = "admin"


# Dependencies that only read app state are ``async def``: FastAPI runs a plain ``def`` dependency in its thread
# pool, and every such hop costs a thread switch on each request (on a loaded 2-core device-and-server host that
# adds up, BENCHMARKS.md). Those that touch the database (device authentication) stay ``def``.
async def coordinator(request: Request) -> Coordinator:
    coord: Coordinator = request.app.state.pfl.coordinator
    return coord


Coord = Annotated[Coordinator, Depends(coordinator)]


async def _enrolment(coord: Coord) -> EnrolmentService:
    return coord.enrolment


async def _blobs(coord: Coord) -> BlobAccess:
    return coord.blob_access


async def _updates(coord: Coord) -> Updates:
    return coord.updates


async def _metrics(coord: Coord) -> Metrics:
    return coord.metrics


Enrol = Annotated[EnrolmentService, Depends(_enrolment)]
Blobs = Annotated[BlobAccess, Depends(_blobs)]
UpdatesDep = Annotated[Updates, Depends(_updates)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]


async def admin_principal(request: Request, tok: Token) -> Admin | None:
    """The admin, if the bearer token is the admin token (compared in constant time); else None."""
    admin = request.app.state.admin_token
    if tok is None or not admin or not hmac.compare_digest(tok.credentials.encode(), admin.encode()):
        return None
    return Admin()


MaybeAdmin = Annotated[Admin | None, Depends(admin_principal)]


def require_admin(tok: Token, admin: MaybeAdmin, enrol: Enrol) -> Admin:
    """The admin; 401 without a token or with one nobody holds, 403 with a device's own token: a device reads a 401
    as its token having expired and enrols again (docs/protocol.md, "Errors"), so a device that asks the admin's
    routes (the metrics, the devices listing, which were a device's to read before version 2) is told it may not,
    not sent round a re-enrolment loop."""
    if tok is None:
        raise Unauthorized("missing bearer token: this call (creating a federation, revoking a device, rotating "
                           "a token or secret) needs the admin token")
    if admin is None:
        try:
            enrol.authenticate(tok.credentials)
        except Unauthorized:
            raise Unauthorized("this call needs the admin token (PFL_ADMIN_TOKEN)") from None
        raise Forbidden("this call is the admin's (PFL_ADMIN_TOKEN); a device token may not make it")
    return admin


def current_device(tok: Token, enrol: Enrol) -> Device:
    return enrol.authenticate(tok.credentials if tok else None)


def federation_reader(fed: str, admin: MaybeAdmin, tok: Token, enrol: Enrol) -> Admin | Device:
    """The admin, or a device of federation ``fed`` (the path's)."""
    if admin is not None:
        return admin
    dev = current_device(tok, enrol)
    if dev.federation != fed:
        raise Forbidden(f"this device belongs to federation {dev.federation!r}, not {fed!r}")
    return dev


def blob_reader(admin: MaybeAdmin, tok: Token, enrol: Enrol) -> Admin | Device:
    """The admin (reads every blob), or a device (its federation's blobs it may read)."""
    return admin if admin is not None else current_device(tok, enrol)


AdminAuth = Annotated[Admin, Depends(require_admin)]
DeviceAuth = Annotated[Device, Depends(current_device)]
FederationReader = Annotated[Admin | Device, Depends(federation_reader)]
BlobReader = Annotated[Admin | Device, Depends(blob_reader)]
