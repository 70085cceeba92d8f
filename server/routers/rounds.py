"""A round's traffic from devices: updates (one per device and round) and metrics (an upsert)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

from fastapi import APIRouter, Depends, Path

from pfl_edge.protocol import MAX_ROUND, MetricsReport, MetricsStored, Task, UpdateAccepted, UpdateRequest

from ..coordinator import Coordinator
from ..deps import DeviceAuth, MetricsDep, UpdatesDep, coordinator
from ..errors import NotFound

__all__ = ["MetricsStored", "router", "writes"]

router = APIRouter(prefix="/rounds", tags=["rounds"])

RoundNo = Annotated[int, Path(ge=0, le=MAX_ROUND, description="the round")]


@router.get("/current/task", response_model=Task, responses={404: {"description": "no task for this device now"}})
def current_task(dev: DeviceAuth, coord: Annotated[Coordinator, Depends(coordinator)]) -> Task:
    """The calling device's task now, exactly as published over MQTT: a device acts on this, never on its
    broker's word alone (a retained or forged message there only rings the bell)."""
    task = coord.planner.current(dev)
    if task is None:
        raise NotFound("no task for this device now (between rounds, before round 1, or not in this round)")
    return task


# Updates and metrics run in threads of their own, not in the request thread pool: a round's worth of them
# arriving together (each waits for its decode check and for the write lock) must not leave cheap requests
# waiting for a thread (bench/responsiveness.py)
writes = ThreadPoolExecutor(16, thread_name_prefix="pfl-writes")


@router.post("/{t}/updates", response_model=UpdateAccepted)
async def post_update(t: RoundNo, body: UpdateRequest, dev: DeviceAuth, updates: UpdatesDep) -> UpdateAccepted:
    return await asyncio.wrap_future(writes.submit(updates.submit, dev, t, body))


@router.post("/{t}/metrics", response_model=MetricsStored)
async def post_metrics(t: RoundNo, body: MetricsReport, dev: DeviceAuth, metrics: MetricsDep) -> MetricsStored:
    await asyncio.wrap_future(writes.submit(metrics.report, dev, t, body))
    return MetricsStored(round=t, device_id=dev.id)
