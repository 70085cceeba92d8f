"""Running the server: ``serve()`` (the ``pfl-edge server`` command; uvicorn handles SIGINT/SIGTERM and runs the
app's shutdown: round worker, MQTT link, embedded broker, database) and ``main()`` (``python -m server.main``).
The launchers of whole test servers live in ``server.launch``; their names are re-exported here for callers that
import them from this module.
"""

from __future__ import annotations

import argparse
import os

import uvicorn

from .app import create_app
from .launch import BackgroundServer, SubprocessServer, start_background, start_subprocess, uvicorn_config
from .settings import Settings, load_settings

__all__ = ["BackgroundServer", "SubprocessServer", "main", "serve", "start_background", "start_subprocess"]


def serve(settings: Settings | None = None, host: str = "127.0.0.1", port: int = 8000, *,
          log_level: str = "info") -> None:
    """Run the server until SIGINT/SIGTERM, then shut down cleanly. Every file it writes (database, blobs, the
    broker's port and password files) is private to its user (umask 077)."""
    os.umask(0o077)
    import torch

    # the close's float64 sums are memory-bound: a second OpenMP thread only spins on a busy host (measured: 29-39 s
    # a close of 1,000 updates on 2 threads, 6 s on one), as in the decode workers (server.services.spool)
    torch.set_num_threads(1)
    settings = settings if settings is not None else load_settings()
    app = create_app(settings)
    uvicorn.Server(uvicorn_config(app, settings, host, port, log_level=log_level)).run()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m server.main", description="Run the pfl-edge server.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--settings", help="a .toml or .env file of settings (PFL_* variables override it)")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    serve(load_settings(a.settings), a.host, a.port, log_level=a.log_level)


if __name__ == "__main__":
    main()
