"""``/healthz``: is the database reachable, is the MQTT link up (no authentication: it reveals nothing)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel
from sqlalchemy import text

from pfl_edge.protocol import PROTOCOL_VERSION

__all__ = ["Health", "router"]

router = APIRouter(tags=["ops"])


class Health(BaseModel):
    status: str
    protocol: int
    database: bool
    mqtt: bool


@router.get("/healthz", response_model=Health)
def healthz(request: Request) -> Health:
    st = request.app.state.pfl
    try:
        with st.engine.connect() as c:
            c.execute(text("SELECT 1"))
        db_ok = True
    except Exception:  # any failure to reach it is "degraded", never a 500
        db_ok = False
    return Health(status="ok" if db_ok else "degraded", protocol=PROTOCOL_VERSION, database=db_ok,
                  mqtt=st.link.connected)
