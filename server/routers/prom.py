"""``GET /metrics``: the server's counters in Prometheus' text exposition format 0.0.4, written by
``prometheus_client`` from one collector per app (its own ``CollectorRegistry``, never the process-global one:
two apps in one process, as in the tests, do not share or clash).

Per federation, from the database (they survive restarts, so they are read at each scrape rather than kept in
client-side counters): rounds closed, current round and state, updates accepted, update bytes received, bytes
devices report downloading, devices enrolled and online; the blob store's blobs and bytes. From this process
(``server.services.telemetry``; zero after a restart): HTTP request latency by route template and method,
requests by status class, and body bytes received and sent by route.

Auth: ``Authorization: Bearer`` with the admin token or the read-only ``metrics_token`` (``PFL_METRICS_TOKEN``),
which opens this endpoint only. docs/dashboard.md lists every metric and a scrape configuration.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from pfl_edge.fleet import ClassCosts

from ..deps import Token
from ..errors import Unauthorized
from ..services.metrics import FederationCounters, Metrics
from ..services.telemetry import BUCKETS_S, RouteStats, telemetry_of
from ..states import RoundState

__all__ = ["CONTENT_TYPE", "PflCollector", "exposition", "router"]

router = APIRouter(tags=["ops"])

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # text/plain; version=0.0.4; charset=utf-8


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
def prometheus(request: Request, _reader: MetricsReader) -> Response:
    return Response(generate_latest(_registry(request.app)), media_type=CONTENT_TYPE)


def _registry(app: Any) -> CollectorRegistry:
    reg = getattr(app.state, "prom_registry", None)
    if not isinstance(reg, CollectorRegistry):
        reg = CollectorRegistry(auto_describe=False)
        reg.register(PflCollector(lambda: app.state.pfl.coordinator.metrics,
                                  lambda: telemetry_of(app).snapshot(),
                                  lambda: app.state.pfl.coordinator.worker.led))
        app.state.prom_registry = reg
    return reg


class PflCollector(Collector):
    """Every family of one scrape, read when Prometheus asks: the database's counters through ``metrics()``, this
    process's HTTP telemetry through ``http()`` and the federations it leads through ``led()`` (replicas)."""

    def __init__(self, metrics: Callable[[], Metrics],
                 http: Callable[[], dict[tuple[str, str], RouteStats]],
                 led: Callable[[], set[str]] = set) -> None:
        self.metrics, self.http, self.led = metrics, http, led

    def collect(self) -> Iterator[Metric]:
        m = self.metrics()
        yield from _federations(m.counters())
        yield from _classes(m.all_classes())
        n, size = m.blob_store()
        yield _gauge("pfl_blob_store_blobs", "Blobs in the blob store.", [], [([], n)])
        yield _gauge("pfl_blob_store_bytes", "Bytes of the blobs in the blob store.", [], [([], size)])
        yield _gauge("pfl_federation_led", "1 for each unfinished federation whose rounds this server process runs "
                     "(its leader, where replicas share the database).", ["federation"],
                     [([f], 1) for f in sorted(self.led())])
        yield from _http(self.http())


def exposition(metrics: Metrics, http: dict[tuple[str, str], RouteStats]) -> str:
    """The whole text of one scrape (what ``GET /metrics`` answers, for these inputs)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(PflCollector(lambda: metrics, lambda: http))
    return generate_latest(reg).decode()


Rows = list[tuple[list[str], float]]


def _gauge(name: str, help_: str, labels: list[str], rows: Rows) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, help_, labels=labels)
    for values, v in rows:
        g.add_metric(values, v)
    return g


def _counter(name: str, help_: str, labels: list[str], rows: Rows) -> CounterMetricFamily:
    c = CounterMetricFamily(name, help_, labels=labels)
    for values, v in rows:
        c.add_metric(values, v)
    return c


# per device class, what its devices report their rounds cost (pfl_edge.fleet.class_costs): name, figure, help
_CLASS_FIGURES = (("pfl_class_step_ms", "step_ms", "ms per training step"),
                  ("pfl_class_round_seconds", "round_s", "wall seconds of a round, task to update accepted"),
                  ("pfl_class_transfer_seconds", "transfer_s", "seconds of a round moving payloads"),
                  ("pfl_class_peak_rss_mb", "peak_rss_mb", "peak resident memory, MiB"))


def _classes(per_fed: dict[str, list[ClassCosts]]) -> Iterator[Metric]:
    labels = ["federation", "profile", "quantile"]
    for name, figure, what in _CLASS_FIGURES:
        rows: Rows = []
        for fed, classes in sorted(per_fed.items()):
            for c in classes:
                spread = getattr(c, figure)
                rows += [([fed, c.profile, q], v) for q, v in (("0.5", spread.p50), ("0.95", spread.p95))
                         if v is not None]
        yield _gauge(name, f"Per device class, {what}, as its devices report it (nearest-rank quantiles over "
                     "their rounds).", labels, rows)


def _federations(feds: list[FederationCounters]) -> Iterator[Metric]:
    def each(attr: str) -> Rows:
        return [([f.federation], getattr(f, attr)) for f in feds]

    fed = ["federation"]
    yield _counter("pfl_rounds_closed_total", "Rounds closed (aggregated) per federation.", fed,
                   each("rounds_closed"))
    yield _gauge("pfl_round_current", "The federation's current round (0: enrolment).", fed, each("round"))
    yield _gauge("pfl_round_state", "1 for the current round's state, 0 for the others.", ["federation", "state"],
                 [([f.federation, s.value], int(f.state == s.value)) for f in feds for s in RoundState])
    yield _counter("pfl_updates_accepted_total", "Updates accepted (the updates ledger).", fed,
                   each("updates_accepted"))
    yield _counter("pfl_update_bytes_received_total", "Distinct blob bytes the federation's devices uploaded.",
                   fed, each("bytes_received"))
    yield _counter("pfl_update_bytes_down_reported_total",
                   "Bytes the federation's devices report downloading, summed over their updates.", fed,
                   each("bytes_down_reported"))
    yield _gauge("pfl_devices_enrolled", "Devices enrolled and not revoked.", fed, each("devices_enrolled"))
    yield _gauge("pfl_devices_online", "Devices online by their MQTT status (not revoked).", fed,
                 each("devices_online"))
    yield _counter("pfl_updates_refused_total", "Uploads the server refused (payload, mask or norm bound).", fed,
                   each("updates_refused"))
    yield _counter("pfl_neighbours_dropped_total", "Neighbours' models the federation's DisPFL devices report "
                   "leaving out of their averages (non-finite, or past the neighbour bound).", fed,
                   each("neighbours_dropped"))
    dev = ["federation", "device"]  # only devices with any: an honest fleet adds no series
    yield _counter("pfl_device_updates_refused_total", "Uploads of this device the server refused.", dev,
                   [([f.federation, d], r) for f in feds for d, r, _ in f.offenders if r])
    yield _counter("pfl_device_neighbours_dropped_total", "Neighbours' models this device left out.", dev,
                   [([f.federation, d], x) for f in feds for d, _, x in f.offenders if x])


def _http(http: dict[tuple[str, str], RouteStats]) -> Iterator[Metric]:
    rm = ["route", "method"]
    h = HistogramMetricFamily("pfl_http_request_duration_seconds", "HTTP request latency, from the request to "
                              "the end of its response, by route template and method (since this process "
                              "started).", labels=rm)
    for (route, method), st in http.items():
        cum, buckets = 0, []
        for bound, n in zip((*BUCKETS_S, float("inf")), st.buckets, strict=True):
            cum += n  # the format's buckets are cumulative: requests that took at most ``le`` seconds
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cum))
        h.add_metric([route, method], buckets, st.sum_s)
    yield h
    yield _counter("pfl_http_requests_total", "HTTP requests by route template, method and status class.",
                   ["route", "method", "code"],
                   [([r, m, c], n) for (r, m), st in http.items() for c, n in sorted(st.codes.items())])
    yield _counter("pfl_http_received_bytes_total", "Request body bytes received, by route template and method.",
                   rm, [([r, m], st.bytes_in) for (r, m), st in http.items()])
    yield _counter("pfl_http_sent_bytes_total", "Response body bytes sent, by route template and method.", rm,
                   [([r, m], st.bytes_out) for (r, m), st in http.items()])
