"""``GET /metrics``: Prometheus' text format 0.0.4, written by prometheus_client and parsed here by a small,
strict parser of our own (independent of the library that writes it). The counters follow a real round (updates,
bytes and closes counted against what the test itself sent), the latency histogram is consistent, labels are
route templates, and only the admin or metrics token may read it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from server_testkit import FEDPER, Dev, bearer, create, fed_state, perturbed, wait_for

from pfl_edge.codec import encode
from pfl_edge.split import take
from server.app import create_app
from server.routers.prom import CONTENT_TYPE, exposition
from server.services.telemetry import BUCKETS_S, Telemetry
from server.settings import Settings

ADMIN = "admin-token-for-prometheus-tests"
SCRAPER = "metrics-token-for-prometheus-tests"

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)",?')

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> tuple[Samples, dict[str, str]]:
    """Samples keyed by (name, labels) and each family's TYPE; refuses what the format does not allow (a sample
    line that does not parse, a family typed twice, a sample repeated, a label value with a raw newline)."""
    samples: Samples = {}
    types: dict[str, str] = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert name not in types and kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            types[name] = kind
            continue
        if line.startswith("#") or not line:
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, _, body, value = m.groups()
        labels = frozenset((k, re.sub(r"\\(.)", lambda x: {"n": "\n"}.get(x[1], x[1]), v))
                           for k, v in _LABEL.findall(body or ""))
        assert (name, labels) not in samples, f"sample repeated: {line!r}"
        samples[(name, labels)] = float(value)
    return samples, types


def get(s: Samples, name: str, **labels: str) -> float:
    return s[(name, frozenset(labels.items()))]


def scrape(c: TestClient, token: str = SCRAPER) -> Samples:
    r = c.get("/metrics", headers=bearer(token))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == CONTENT_TYPE
    return parse(r.text)[0]


@pytest.fixture
def client(tmp_path: Path, broker_url: str) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'state.db'}",
                        broker_url=broker_url, admin_token=ADMIN, metrics_token=SCRAPER,  # type: ignore[arg-type]
                        tick_s=0.05, decode_processes=0)  # uploads checked inline: no process pool to start
    with TestClient(create_app(settings)) as c:
        yield c


def test_counters_follow_a_round(client: TestClient) -> None:
    create(client, ADMIN, "pm", {**FEDPER, "rounds": 2})
    devs = [Dev(client, "pm", index=i) for i in range(3)]
    wait_for(lambda: fed_state(client, ADMIN, "pm") == (1, "collecting"), what="round 1")
    before = scrape(client)
    fed = {"federation": "pm"}
    assert get(before, "pfl_rounds_closed_total", **fed) == 0 and get(before, "pfl_updates_accepted_total", **fed) == 0
    assert get(before, "pfl_round_current", **fed) == 1 and get(before, "pfl_devices_enrolled", **fed) == 3
    assert get(before, "pfl_round_state", state="collecting", **fed) == 1
    assert get(before, "pfl_round_state", state="open", **fed) == 0

    fm = devs[0].fm
    base = take(fm.init_state(), fm.base_keys(2))
    sent = 0
    for i, d in enumerate(devs):
        payload = encode(perturbed(base, i), model_id=fm.model_id, round=1)
        sent += len(payload)
        assert d.update(1, d.put(payload)).status_code == 200
    wait_for(lambda: fed_state(client, ADMIN, "pm") == (2, "collecting"), what="round 2")
    after = scrape(client)
    _dashboard_data(client, devs, [len(encode(perturbed(base, i), model_id=fm.model_id, round=1)) for i in range(3)])

    assert get(after, "pfl_rounds_closed_total", **fed) == 1
    assert get(after, "pfl_updates_accepted_total", **fed) == 3
    assert get(after, "pfl_round_current", **fed) == 2
    assert get(after, "pfl_update_bytes_received_total", **fed) == sent  # the bytes this test uploaded
    # the blob store's gauges against the files on disk
    blob_dir = client.app.state.pfl.settings.resolved_blob_dir  # type: ignore[attr-defined]
    files = [p for p in Path(blob_dir).rglob("*") if p.is_file()]
    assert get(after, "pfl_blob_store_blobs") == len(files)
    assert get(after, "pfl_blob_store_bytes") == sum(p.stat().st_size for p in files)

    # HTTP telemetry: route templates (never a digest), bodies counted, a consistent histogram
    put = {"route": "/v1/blobs/{sha256}", "method": "PUT"}
    assert get(after, "pfl_http_received_bytes_total", **put) == sent
    assert get(after, "pfl_http_requests_total", code="2xx", **put) == 3
    upd = {"route": "/v1/rounds/{t}/updates", "method": "POST"}
    n = get(after, "pfl_http_request_duration_seconds_count", **upd)
    assert n == 3
    cum = [get(after, "pfl_http_request_duration_seconds_bucket", le=le, **upd)
           for le in [repr(b) for b in BUCKETS_S] + ["+Inf"]]
    assert cum == sorted(cum) and cum[-1] == n
    assert get(after, "pfl_http_request_duration_seconds_sum", **upd) > 0
    routes = {dict(k[1]).get("route") for k in after if "route" in dict(k[1])}
    assert not any(re.search(r"[0-9a-f]{64}|/pm(/|$)", r or "") for r in routes), routes
    assert "/v1/federations/{fed}" in routes


def _dashboard_data(c: TestClient, devs: list[Dev], sizes: list[int]) -> None:
    """What the dashboard reads of the round just closed: its times, quorum, accuracy spread and bytes."""
    accs, ups = [0.5, 0.75, 0.625], [1000, 3000, 2000]
    for d, a, up in zip(devs, accs, ups, strict=True):
        r = c.post("/v1/rounds/1/metrics", headers=d.h,
                   json={"accuracy": a, "loss": 1.0, "n_test": 32, "bytes_up": up, "bytes_down": 2 * up})
        assert r.status_code == 200, r.text
    r1 = next(r for r in c.get("/v1/federations/pm/metrics", headers=bearer(ADMIN)).json()["rounds"]
              if r["round"] == 1)
    assert (r1["updates"], r1["active"], r1["quorum_updates"], r1["state"]) == (3, 3, 3, "published")
    assert r1["opened_at"] <= r1["closed_at"] < r1["deadline"]
    assert r1["wall_s"] == pytest.approx(r1["closed_at"] - r1["opened_at"])
    assert (r1["min_accuracy"], r1["median_accuracy"], r1["max_accuracy"]) == (0.5, 0.625, 0.75)
    assert r1["mean_accuracy"] == pytest.approx(sum(accs) / 3)
    assert (r1["bytes_up"], r1["bytes_down"]) == (sum(ups), 2 * sum(ups))
    listed = {d["device_id"]: d for d in c.get("/v1/federations/pm/devices", headers=bearer(ADMIN)).json()}
    assert [listed[d.id]["bytes_up"] for d in devs] == sizes  # each device's upload, byte for byte
    assert all(listed[d.id]["last_round"] == 1 and not listed[d.id]["revoked"] for d in devs)


def test_only_the_admin_or_metrics_token_reads_it(client: TestClient) -> None:
    create(client, ADMIN, "pa", FEDPER)
    dev = Dev(client, "pa")
    r = client.get("/metrics")
    assert r.status_code == 401 and r.headers.get("www-authenticate", "").lower().startswith("bearer")
    for tok in ("wrong", dev.e["token"], SCRAPER + "x"):
        assert client.get("/metrics", headers=bearer(tok)).status_code == 401, tok
    assert client.get("/metrics", headers=bearer(ADMIN)).status_code == 200
    assert client.get("/metrics", headers=bearer(SCRAPER)).status_code == 200
    # the metrics token opens /metrics and nothing else
    for path in ("/v1/federations", "/v1/federations/pa", "/v1/federations/pa/metrics"):
        assert client.get(path, headers=bearer(SCRAPER)).status_code == 401, path
    listed = client.get("/v1/federations", headers=bearer(ADMIN))
    assert listed.status_code == 200 and [f["id"] for f in listed.json()] == ["pa"]
    assert client.get("/v1/federations", headers=dev.h).status_code == 403  # a device lists no federations


def test_histogram_buckets_and_label_escaping() -> None:
    """Buckets by hand: each observation lands in the first bucket whose bound is >= its duration."""
    tel = Telemetry()
    durations = [0.0005, 0.001, 0.003, 0.2, 100.0]
    for d in durations:
        tel.observe('/odd"\\route\n', "GET", 200, d, 7, 11)
    tel.observe('/odd"\\route\n', "GET", 404, 0.01, 0, 5)

    text = exposition(_NoFederations(), tel.snapshot())  # type: ignore[arg-type]
    s, types = parse(text)
    assert types["pfl_http_request_duration_seconds"] == "histogram"
    lab = {"route": '/odd"\\route\n', "method": "GET"}
    all_d = [*durations, 0.01]
    for b in BUCKETS_S:
        assert get(s, "pfl_http_request_duration_seconds_bucket", le=repr(b), **lab) == sum(d <= b for d in all_d)
    assert get(s, "pfl_http_request_duration_seconds_bucket", le="+Inf", **lab) == 6
    assert get(s, "pfl_http_request_duration_seconds_sum", **lab) == pytest.approx(sum(all_d))
    assert get(s, "pfl_http_requests_total", code="2xx", **lab) == 5
    assert get(s, "pfl_http_requests_total", code="4xx", **lab) == 1
    assert get(s, "pfl_http_received_bytes_total", **lab) == 35 and get(s, "pfl_http_sent_bytes_total", **lab) == 60
    assert 'route="/odd\\"\\\\route\\n"' in text  # quote, backslash and newline escaped, as the format asks
    assert get(s, "pfl_blob_store_blobs") == 0 and types["pfl_rounds_closed_total"] == "counter"


class _NoFederations:
    def counters(self) -> list[object]:
        return []

    def all_classes(self) -> dict[str, list[object]]:
        return {}

    def blob_store(self) -> tuple[int, int]:
        return 0, 0
