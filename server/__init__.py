"""The pfl-edge server: FastAPI coordination and aggregation, MQTT control plane, SQL state, blob store.

Entry points: :func:`server.app.create_app` (the app factory), :func:`server.main.serve` (the ``pfl-edge server``
command) and :func:`server.launch.start_background` (a whole server on a free port, for tests and demos).
Layout: ``states`` (the round state machine), ``services`` (enrolment, blob access, updates, metrics,
publishing, rounds, recovery), ``routers`` and ``deps`` (the HTTP API), ``db`` and ``migrations`` (the schema).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Settings", "create_app", "load_settings", "serve", "start_background", "start_subprocess"]

# imported on first use: ``python -m server.main`` must not find server.main already imported by its package
_HOME = {"Settings": "settings", "load_settings": "settings", "create_app": "app", "serve": "main",
         "start_background": "launch", "start_subprocess": "launch"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'server' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
