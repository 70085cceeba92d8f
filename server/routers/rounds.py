"""A round's traffic from devices: updates (one per device and round) and metrics (an upsert)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from pydantic import BaseModel

from pfl_edge.protocol import MAX_ROUND, MetricsReport, UpdateAccepted, UpdateRequest

from ..deps import DeviceAuth, MetricsDep, UpdatesDep

__all__ = ["MetricsStored", "router"]

router = APIRouter(prefix="/rounds", tags=["rounds"])

RoundNo = Annotated[int, Path(ge=0, le=MAX_ROUND, description="the round")]


class MetricsStored(BaseModel):
    round: int
    device_id: str


@router.post("/{t}/updates", response_model=UpdateAccepted)
def post_update(t: RoundNo, body: UpdateRequest, dev: DeviceAuth, updates: UpdatesDep) -> UpdateAccepted:
    return updates.submit(dev, t, body)


@router.post("/{t}/metrics", response_model=MetricsStored)
def post_metrics(t: RoundNo, body: MetricsReport, dev: DeviceAuth, metrics: MetricsDep) -> MetricsStored:
    metrics.report(dev, t, body)
    return MetricsStored(round=t, device_id=dev.id)
