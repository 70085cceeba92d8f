"""A secure round's steps (``pfl_edge.secagg.wire``; docs/protocol.md, "Secure aggregation"): where the round
stands for the calling device, and its keys, sealed shares and revealed shares. The masked input itself is the
round's update (``POST /v1/rounds/{t}/updates``)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Path

from pfl_edge.protocol import MAX_ROUND
from pfl_edge.secagg.wire import SecAggComplaint, SecAggKeys, SecAggShares, SecAggStep, SecAggUnmask

from ..coordinator import Coordinator
from ..deps import DeviceAuth, coordinator
from .rounds import writes

__all__ = ["router"]

router = APIRouter(prefix="/rounds", tags=["secure aggregation"])

RoundNo = Annotated[int, Path(ge=1, le=MAX_ROUND, description="the round")]
Coord = Annotated[Coordinator, Depends(coordinator)]


@router.get("/{t}/secagg", response_model=SecAggStep)
def secagg_state(t: RoundNo, dev: DeviceAuth, coord: Coord) -> SecAggStep:
    """Round ``t``'s secure aggregation as the calling device needs it now."""
    return coord.secure.state(dev, t)


@router.post("/{t}/secagg/keys", response_model=SecAggStep)
async def secagg_keys(t: RoundNo, body: SecAggKeys, dev: DeviceAuth, coord: Coord) -> SecAggStep:
    return await asyncio.wrap_future(writes.submit(coord.secure.post, dev, t, body))


@router.post("/{t}/secagg/shares", response_model=SecAggStep)
async def secagg_shares(t: RoundNo, body: SecAggShares, dev: DeviceAuth, coord: Coord) -> SecAggStep:
    return await asyncio.wrap_future(writes.submit(coord.secure.post, dev, t, body))


@router.post("/{t}/secagg/complaint", response_model=SecAggStep)
async def secagg_complaint(t: RoundNo, body: SecAggComplaint, dev: DeviceAuth, coord: Coord) -> SecAggStep:
    """The pairs of ``accused`` did not open for this device or held other shares than committed: the server
    judges (``pfl_edge.secagg.verify.judge``) and names who is out of the round (422 if it is this device)."""
    return await asyncio.wrap_future(writes.submit(coord.secure.post, dev, t, body))


@router.post("/{t}/secagg/unmask", response_model=SecAggStep)
async def secagg_unmask(t: RoundNo, body: SecAggUnmask, dev: DeviceAuth, coord: Coord) -> SecAggStep:
    return await asyncio.wrap_future(writes.submit(coord.secure.post, dev, t, body))
