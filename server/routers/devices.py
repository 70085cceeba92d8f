"""Enrolment: a device joins a federation with its secret (no token yet: the answer holds its token)."""

from __future__ import annotations

from fastapi import APIRouter

from pfl_edge.protocol import Enrolment, EnrolRequest

from ..deps import Enrol

__all__ = ["router"]

router = APIRouter(prefix="/devices", tags=["devices"])


@router.post("", response_model=Enrolment, status_code=201)
def enrol(body: EnrolRequest, enrol: Enrol) -> Enrolment:
    return enrol.enrol(body)
