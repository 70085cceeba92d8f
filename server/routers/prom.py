"""``GET /metrics``: the server's counters in Prometheus' text exposition format 0.0.4, written here by hand.

Per federation, from the database (they survive restarts): rounds closed, current round and state, updates
accepted, update bytes received, bytes devices report downloading, devices enrolled and online; the blob store's
blobs and bytes. From this process (``server.services.telemetry``; zero after a restart): HTTP request latency
by route template and method, requests by status class, and body bytes received and sent by route.

Auth: ``Authorization: Bearer`` with the admin token or the read-only ``metrics_token`` (``PFL_METRICS_TOKEN``),
which opens this endpoint only. docs/dashboard.md lists every metric and a scrape configuration.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from ..deps import MetricsDep, Token
from ..errors import Unauthorized
from ..services.metrics import FederationCounters, Metrics
from ..services.telemetry import BUCKETS_S, RouteStats, telemetry_of
from ..states import RoundState

__all__ = ["CONTENT_TYPE", "exposition", "router"]

router = APIRouter(tags=["ops"])

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def metrics_reader(request: Request, tok: Token) -> None:
    """The admin token or the metrics token, compared in constant time; anything else is 401."""
    if tok is None:
        raise Unauthorized("missing bearer token: /metrics needs the metrics token (PFL_METRICS_TOKEN) or the "
                           "admin token")
    given = tok.credentials.encode()
    st = request.app.state
    mt = st.pfl.settings.metrics_token
    for secret in (st.admin_token, mt.get_secret_value() if mt is not None else ""):
        if secret and hmac.compare_digest(given, secret.encode()):
            return
    raise Unauthorized("this token may not read /metrics: use the metrics token (PFL_METRICS_TOKEN) or the "
                       "admin token")


MetricsReader = Annotated[None, Depends(metrics_reader)]


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text format 0.0.4"}})
def prometheus(request: Request, _reader: MetricsReader, metrics: MetricsDep) -> Response:
    return Response(exposition(metrics, telemetry_of(request.app).snapshot()), media_type=CONTENT_TYPE)


def _esc(v: str) -> str:
    """A label value as the format wants it: backslash, double quote and newline escaped."""
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**kv: str) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in kv.items()) + "}" if kv else ""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


class _Doc:
    """Lines of one exposition; each family's HELP and TYPE come once, before its samples."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str, samples: Iterable[tuple[str, float]]) -> None:
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        self.lines += [f"{name}{labels} {_num(v)}" for labels, v in samples]


def exposition(metrics: Metrics, http: dict[tuple[str, str], RouteStats]) -> str:
    """The whole text of one scrape."""
    doc = _Doc()
    _federations(doc, metrics.counters())
    n, size = metrics.blob_store()
    doc.family("pfl_blob_store_blobs", "gauge", "Blobs in the blob store.", [("", n)])
    doc.family("pfl_blob_store_bytes", "gauge", "Bytes of the blobs in the blob store.", [("", size)])
    _http(doc, http)
    return "\n".join(doc.lines) + "\n"


def _federations(doc: _Doc, feds: list[FederationCounters]) -> None:
    def each(attr: str) -> list[tuple[str, float]]:
        return [(_labels(federation=f.federation), getattr(f, attr)) for f in feds]

    doc.family("pfl_rounds_closed_total", "counter", "Rounds closed (aggregated) per federation.",
               each("rounds_closed"))
    doc.family("pfl_round_current", "gauge", "The federation's current round (0: enrolment).", each("round"))
    doc.family("pfl_round_state", "gauge", "1 for the current round's state, 0 for the others.",
               [(_labels(federation=f.federation, state=s.value), int(f.state == s.value))
                for f in feds for s in RoundState])
    doc.family("pfl_updates_accepted_total", "counter", "Updates accepted (the updates ledger).",
               each("updates_accepted"))
    doc.family("pfl_update_bytes_received_total", "counter",
               "Distinct blob bytes the federation's devices uploaded.", each("bytes_received"))
    doc.family("pfl_update_bytes_down_reported_total", "counter",
               "Bytes the federation's devices report downloading, summed over their updates.",
               each("bytes_down_reported"))
    doc.family("pfl_devices_enrolled", "gauge", "Devices enrolled and not revoked.", each("devices_enrolled"))
    doc.family("pfl_devices_online", "gauge", "Devices online by their MQTT status (not revoked).",
               each("devices_online"))


def _http(doc: _Doc, http: dict[tuple[str, str], RouteStats]) -> None:
    name = "pfl_http_request_duration_seconds"
    doc.lines += [f"# HELP {name} HTTP request latency, from the request to the end of its response, by route "
                  "template and method (since this process started).", f"# TYPE {name} histogram"]
    for (route, method), st in http.items():
        cum = 0
        for bound, n in zip((*BUCKETS_S, float("inf")), st.buckets, strict=True):
            cum += n  # the format's buckets are cumulative: requests that took at most ``le`` seconds
            le = "+Inf" if bound == float("inf") else repr(bound)
            doc.lines.append(f"{name}_bucket{_labels(route=route, method=method, le=le)} {cum}")
        lab = _labels(route=route, method=method)
        doc.lines += [f"{name}_sum{lab} {st.sum_s!r}", f"{name}_count{lab} {st.count}"]
    doc.family("pfl_http_requests_total", "counter", "HTTP requests by route template, method and status class.",
               [(_labels(route=r, method=m, code=c), n) for (r, m), st in http.items()
                for c, n in sorted(st.codes.items())])
    doc.family("pfl_http_received_bytes_total", "counter",
               "Request body bytes received, by route template and method.",
               [(_labels(route=r, method=m), st.bytes_in) for (r, m), st in http.items()])
    doc.family("pfl_http_sent_bytes_total", "counter", "Response body bytes sent, by route template and method.",
               [(_labels(route=r, method=m), st.bytes_out) for (r, m), st in http.items()])
