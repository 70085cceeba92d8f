"""Federations: creation (admin), and what the admin or a federation's devices may read of it."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from pfl_edge.fleet import ClassCosts, DeviceEntry, FederationMetrics
from pfl_edge.protocol import MIN_ENROL_SECRET, FederationCreate, FederationInfo, TokenIssued

from ..deps import AdminAuth, Coord, Enrol, FederationReader, MetricsDep
from .models import artefacts, creation_keys

__all__ = ["router"]

router = APIRouter(prefix="/federations", tags=["federations"])


@router.post("", response_model=FederationInfo, status_code=201)
def create_federation(body: FederationCreate, _admin: AdminAuth, enrol: Enrol, coord: Coord,
                      request: Request) -> FederationInfo:
    info = enrol.create_federation(body)
    # its programs are exported now, ONNX first, so that the first model card does not wait for them
    scope = request.app.state.pfl.settings.export_on_create
    if scope != "none":
        with coord.store.read() as s:
            fm = coord.store.model(coord.store.federation(s, body.id))
        artefacts(request).prefetch(creation_keys(fm, profile_capacity=body.profile_capacity, scope=scope))
    return info


@router.get("", response_model=list[FederationInfo])
def list_federations(_admin: AdminAuth, enrol: Enrol, metrics: MetricsDep) -> list[FederationInfo]:
    """Every federation, oldest first (admin): what the dashboard's federation picker lists."""
    return [enrol.federation_info(f) for f in metrics.federation_ids()]


@router.get("/{fed}", response_model=FederationInfo)
def get_federation(fed: str, _reader: FederationReader, enrol: Enrol) -> FederationInfo:
    return enrol.federation_info(fed)


# The admin's alone: a device needs nothing of its peers but what its task names (DisPFL: each in-neighbour's
# slot, id and blob digest), never their names, profiles, liveness, traffic or accuracy.
@router.get("/{fed}/metrics", response_model=FederationMetrics)
def get_metrics(fed: str, _admin: AdminAuth, metrics: MetricsDep) -> FederationMetrics:
    """Every round: per-device metrics and a summary (mean accuracy, updates, wall time of the round)."""
    return FederationMetrics.model_validate(metrics.summary(fed))


@router.get("/{fed}/devices", response_model=list[DeviceEntry])
def get_devices(fed: str, _admin: AdminAuth, metrics: MetricsDep) -> list[DeviceEntry]:
    """Enrolled devices: profile, index, density, K_P, online, last round, bytes, refused and dropped updates."""
    return [DeviceEntry.model_validate(d) for d in metrics.devices(fed)]


@router.get("/{fed}/classes", response_model=list[ClassCosts])
def get_classes(fed: str, _admin: AdminAuth, metrics: MetricsDep) -> list[ClassCosts]:
    """Per device class: the p50/p95 of what its devices report their rounds cost (step time, round wall time,
    transfer time, peak memory, bytes), from the devices themselves (protocol 3)."""
    return metrics.classes(fed)


class EnrolSecret(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enrol_secret: str = Field(min_length=MIN_ENROL_SECRET, max_length=256)


class Revoked(BaseModel):
    device_id: str
    revoked_at: float


@router.post("/{fed}/enrol-secret", status_code=204)
def rotate_enrol_secret(fed: str, body: EnrolSecret, _admin: AdminAuth, enrol: Enrol) -> None:
    """A new enrolment secret (admin): the old one is refused from now on; enrolled devices keep their tokens."""
    enrol.set_enrol_secret(fed, body.enrol_secret)


@router.post("/{fed}/devices/{dev}/revoke", response_model=Revoked)
def revoke_device(fed: str, dev: str, _admin: AdminAuth, enrol: Enrol) -> Revoked:
    """Revoke a device (admin): its token is refused at once, it loses its broker access and takes no part in
    later rounds; it cannot enrol again with its nonce (rotate the enrolment secret too if it knew it)."""
    return Revoked(device_id=dev, revoked_at=enrol.revoke(fed, dev))


@router.post("/{fed}/devices/{dev}/token", response_model=TokenIssued)
def rotate_device_token(fed: str, dev: str, _admin: AdminAuth, enrol: Enrol) -> TokenIssued:
    """A new token for a device (admin), e.g. one whose token leaked: the old one is dead at once."""
    enrol.device_of(fed, dev)
    token, expires = enrol.rotate_token(dev)
    return TokenIssued(device_id=dev, token=token, expires=expires)
