"""``GET /dashboard``: the operator's page (static HTML, JavaScript and CSS from ``server/dashboard/``).

The files hold no data and need no token: the page's script asks the JSON API (``/v1/federations...``) with the
bearer token the operator pastes or passes in the URL fragment (``#token=...``, which browsers never send to the
server). Only the files present in the package at start are served, by exact name: a request names a key of
:data:`FILES`, never a path, so nothing outside the directory can be reached. Every answer carries a strict
Content-Security-Policy (scripts, styles and connections from this origin only; no inline code, no frames).
"""

from __future__ import annotations

import re
from pathlib import Path

from fastapi import APIRouter, Response

from ..errors import NotFound

__all__ = ["CSP", "DIR", "FILES", "router"]

router = APIRouter(tags=["dashboard"], include_in_schema=False)

DIR = Path(__file__).resolve().parent.parent / "dashboard"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}\.(html|js|css|svg)$")
# name -> (bytes, content type), read once: the files are part of the installed package and do not change
FILES: dict[str, tuple[bytes, str]] = {
    p.name: (p.read_bytes(), _TYPES[p.suffix]) for p in sorted(DIR.glob("*")) if p.is_file() and _NAME.match(p.name)
}
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
            "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


def _serve(name: str) -> Response:
    hit = FILES.get(name)
    if hit is None:
        raise NotFound(f"no dashboard file {name[:80]!r}; the dashboard is at /dashboard")
    body, ctype = hit
    return Response(body, media_type=ctype, headers=_HEADERS)


@router.get("/dashboard")
async def dashboard() -> Response:
    return _serve("index.html")


@router.get("/dashboard/{name}")
async def dashboard_file(name: str) -> Response:
    return _serve(name)
