"""The HTTP API of ``pfl_edge.protocol``, one router per area; ``api`` gathers those under ``/v1``. Beside it, at
the root: ``/healthz`` (health), ``/metrics`` (prom, Prometheus) and ``/dashboard`` (the operator's page)."""

from fastapi import APIRouter

from pfl_edge.protocol import API_PREFIX

from . import blobs, broker_hook, dashboard, devices, federations, health, models, prom, rounds, secagg, spec

__all__ = ["api", "blobs", "broker_hook", "dashboard", "devices", "federations", "health", "models", "prom", "rounds",
           "secagg", "spec"]

api = APIRouter(prefix=API_PREFIX)
for _area in (federations, devices, blobs, rounds, secagg, spec, models, broker_hook):
    api.include_router(_area.router)
