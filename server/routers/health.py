"""``/healthz``: is the database reachable, is the MQTT link up (no authentication: it reveals nothing).

It is a liveness probe, so it must answer while the server works: it is ``async`` (no wait for a thread of the
request pool, which uploads and updates may fill), and the database is asked from a thread of its own, within
``DB_TIMEOUT_S`` (slower: reported as degraded, never a hung probe)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter, Request
from pydantic import BaseModel
from sqlalchemy import Engine, text

from pfl_edge.protocol import PROTOCOL_VERSION, PROTOCOL_VERSIONS

__all__ = ["DB_TIMEOUT_S", "Health", "router"]

router = APIRouter(tags=["ops"])

DB_TIMEOUT_S = 2.0
_probe = ThreadPoolExecutor(2, thread_name_prefix="pfl-healthz")


class Health(BaseModel):
    status: str
    protocol: int  # the newest protocol version it speaks
    protocols: list[int]  # every version it answers devices in (docs/protocol.md, "Versions")
    database: bool
    mqtt: bool


def _db_ok(engine: Engine) -> bool:
    try:
        with engine.connect() as c:
            c.execute(text("SELECT 1"))
        return True
    except Exception:  # any failure to reach it is "degraded", never a 500
        return False


@router.get("/healthz", response_model=Health)
async def healthz(request: Request) -> Health:
    st = request.app.state.pfl
    try:
        db_ok = await asyncio.wait_for(asyncio.wrap_future(_probe.submit(_db_ok, st.engine)), DB_TIMEOUT_S)
    except TimeoutError:
        db_ok = False
    return Health(status="ok" if db_ok else "degraded", protocol=PROTOCOL_VERSION,
                  protocols=list(PROTOCOL_VERSIONS), database=db_ok,
                  mqtt=st.link.connected)
