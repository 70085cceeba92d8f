"""Enrolment: a device joins a federation with its secret (no token yet: the answer holds its token); a device
rotates its own token before it expires."""

from __future__ import annotations

from fastapi import APIRouter, Request

from pfl_edge.data_share import DataShare, data_share
from pfl_edge.protocol import BrokerInfo, Enrolment, EnrolRequest, TokenIssued, TokenRotation

from ..deps import Coord, DeviceAuth, Enrol
from ..errors import Conflict

__all__ = ["TokenIssued", "router"]

router = APIRouter(prefix="/devices", tags=["devices"])


# absent fields stay absent: a device of an earlier release refuses a field it does not know, even a null one
@router.post("", response_model=Enrolment, status_code=201, response_model_exclude_none=True)
async def enrol(body: EnrolRequest, enrol: Enrol, request: Request) -> Enrolment:
    """Rate-limited per client address and per federation (429 with Retry-After); a wrong secret and an unknown
    federation get the same 403. ``async``: the secret's scrypt runs on the enrolment gate's own threads and the
    database work in the threadpool, so guesses never hold the threads that device calls are served on."""
    return await enrol.enrol_async(body, address=request.client.host if request.client else "")


@router.post("/me/token", response_model=TokenIssued)
def rotate_own_token(dev: DeviceAuth, enrol: Enrol, body: TokenRotation | None = None) -> TokenIssued:
    """A fresh token for the calling device; its current one is dead once this answers. The device saves the
    new one before it uses it (a device that lost it enrols again with its nonce). Rotations never reach past
    ``device_token_max_lifetime_s`` after the device last enrolled with the secret: then 401 (it must enrol again).
    A device that enrolled with a key sends its proof (``TokenRotation``); without it, 401."""
    token, expires = enrol.rotate_token(dev.id, own=True, proof=None if body is None else body.proof)
    return TokenIssued(device_id=dev.id, token=token, expires=expires)


@router.get("/me/broker", response_model=BrokerInfo, response_model_exclude_none=True)
def current_broker(dev: DeviceAuth, enrol: Enrol) -> BrokerInfo:
    """The MQTT broker as devices reach it now (it may have moved since this device enrolled); where the broker
    checks tokens (``jwt`` mode), a fresh one as its MQTT password (a revoked device never gets here: 401)."""
    token = enrol.mqtt_token(dev.id) if enrol.mqtt_token is not None else None
    return BrokerInfo(broker_url=enrol.device_broker_url, mqtt_password=token)


@router.get("/me/share", response_model=DataShare)
def own_share(dev: DeviceAuth, coord: Coord) -> DataShare:
    """The calling device's share of its federation's dealt data set (``pfl_edge.data_share``): for a device that
    cannot deal it itself (``dirichlet``, ``dirichlet-client``: numpy's gamma sampler). 409 where the devices bring
    their own data (``partition: "device"``): nothing is dealt."""
    with coord.store.read() as s:
        fm = coord.store.model(coord.store.federation(s, dev.federation))
    if fm.deal is None:
        raise Conflict(f"federation {dev.federation!r} deals no data: its devices bring their own (partition "
                       "'device'); start the device with its own images")
    return data_share(dev.federation, fm.cfg.dataset, fm.cfg.partition, fm.deal, dev.slot)
