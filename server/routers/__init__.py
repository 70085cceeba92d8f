"""The HTTP API of ``pfl_edge.protocol``, one router per area; ``api`` gathers those under ``/v1``."""

from fastapi import APIRouter

from pfl_edge.protocol import API_PREFIX

from . import blobs, devices, federations, health, rounds, spec

__all__ = ["api", "blobs", "devices", "federations", "health", "rounds", "spec"]

api = APIRouter(prefix=API_PREFIX)
for _area in (federations, devices, blobs, rounds, spec):
    api.include_router(_area.router)
