"""``pfl-edge server``: the coordination and aggregation server."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def _cmd_server(args: argparse.Namespace) -> int:
    from server.main import serve
    from server.settings import load_settings

    overrides: dict[str, Any] = {}
    for key in ("data_dir", "broker_url", "database_url", "admin_token_file", "tls_cert", "tls_key"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    serve(load_settings(args.settings, **overrides), host=args.host, port=args.port)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("server", help="the coordination and aggregation server (FastAPI)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--settings", type=Path, help="settings file (.env or TOML); PFL_* environment variables win")
    p.add_argument("--data-dir", type=Path, help="where SQLite and the blobs live (default ./pfl-server-data)")
    p.add_argument("--broker-url", help="embedded (default) or mqtt://host:port")
    p.add_argument("--database-url", help="default: SQLite in the data dir; postgresql+psycopg://... for PostgreSQL")
    p.add_argument("--admin-token-file", type=Path,
                   help="the admin token, read from this file (or PFL_ADMIN_TOKEN; default: generated and printed)")
    p.add_argument("--tls-cert", type=Path, help="serve HTTPS with this certificate (PEM; with --tls-key)")
    p.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    p.set_defaults(func=_cmd_server)
