"""Federations: creation (admin), and what the admin or a federation's devices may read of it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from pfl_edge.protocol import FederationCreate, FederationInfo

from ..deps import AdminAuth, Enrol, FederationReader, MetricsDep

__all__ = ["router"]

router = APIRouter(prefix="/federations", tags=["federations"])


@router.post("", response_model=FederationInfo, status_code=201)
def create_federation(body: FederationCreate, _admin: AdminAuth, enrol: Enrol) -> FederationInfo:
    return enrol.create_federation(body)


@router.get("/{fed}", response_model=FederationInfo)
def get_federation(fed: str, _reader: FederationReader, enrol: Enrol) -> FederationInfo:
    return enrol.federation_info(fed)


@router.get("/{fed}/metrics")
def get_metrics(fed: str, _reader: FederationReader, metrics: MetricsDep) -> dict[str, Any]:
    """Every round: per-device metrics and a summary (mean accuracy, updates, wall time of the round)."""
    return metrics.summary(fed)


@router.get("/{fed}/devices")
def get_devices(fed: str, _reader: FederationReader, metrics: MetricsDep) -> list[dict[str, Any]]:
    """Enrolled devices: profile, index, density, K_P, online, last round, bytes."""
    return metrics.devices(fed)
