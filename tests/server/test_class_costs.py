"""Issue 51, item 2: each device reports what its rounds cost (protocol 3: round wall time, transfer time, peak
memory, beside step time and bytes), and the operator sees them per device class (GET .../classes, /metrics, the
dashboard, pfl-edge profile --fleet). Held to hand-worked nearest-rank percentiles; real agents' reports too."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from server_testkit import FEDPER, Dev, app_with_federation, bearer

from edge_runtime.agent import Agent, AgentConfig
from edge_runtime.reports import post_metrics
from edge_runtime.state import Progress, RoundStats
from pfl_edge.cli import main
from pfl_edge.fleet import class_costs, nearest_rank
from server.launch import BackgroundServer, start_background
from server.settings import Settings

ADMIN = "admin-token-for-class-costs"


def test_nearest_rank_and_the_class_spread_by_hand() -> None:
    assert nearest_rank([], 0.5) is None
    assert nearest_rank([3.0], 0.95) == 3.0
    assert nearest_rank([5.0, 1.0, 4.0, 2.0, 3.0], 0.5) == 3.0  # ceil(2.5) = 3rd smallest
    assert nearest_rank([float(v) for v in range(1, 21)], 0.95) == 19.0  # ceil(19) = 19th
    assert nearest_rank([float(v) for v in range(1, 22)], 0.95) == 20.0  # ceil(19.95) = 20th
    profiles = {"a": "phone-low", "b": "phone-low", "c": "raspberry-pi-4", "d": "raspberry-pi-4", "e": "jetson-nano"}
    reports = [("a", {"step_ms": 10.0, "round_s": 2.0, "peak_rss_mb": 300.0, "bytes_up": 100, "bytes_down": 200}),
               ("a", {"step_ms": 30.0, "round_s": 4.0, "peak_rss_mb": 310.0, "bytes_up": 100, "bytes_down": 200}),
               ("b", {"step_ms": 20.0, "round_s": None, "peak_rss_mb": None, "bytes_up": 0, "bytes_down": 0}),
               ("c", {"step_ms": 5.0, "round_s": 1.0, "transfer_s": 0.25, "peak_rss_mb": 900.0, "bytes_up": 7,
                      "bytes_down": 9}),
               ("gone", {"step_ms": 1e9})]  # a device no longer listed: left out
    got = {c.profile: c for c in class_costs(profiles, reports)}
    assert list(got) == ["jetson-nano", "phone-low", "raspberry-pi-4"]
    low = got["phone-low"]
    assert (low.devices, low.reporting) == (2, 2)
    assert (low.step_ms.n, low.step_ms.p50, low.step_ms.p95) == (3, 20.0, 30.0)
    assert (low.round_s.n, low.round_s.p50, low.round_s.p95) == (2, 2.0, 4.0)
    assert (low.peak_rss_mb.p50, low.transfer_s.n) == (300.0, 0)
    assert (low.bytes_up.n, low.bytes_up.p50) == (3, 100.0)
    pi = got["raspberry-pi-4"]
    assert (pi.devices, pi.reporting, pi.transfer_s.p95, pi.peak_rss_mb.p95) == (2, 1, 0.25, 900.0)
    assert (got["jetson-nano"].reporting, got["jetson-nano"].step_ms.p50) == (0, None)


@pytest.fixture
def client(tmp_path: Path, broker_url: str) -> Iterator[TestClient]:
    yield from app_with_federation(tmp_path, broker_url, ADMIN)


def test_the_classes_route_and_prometheus_show_what_the_devices_report(client: TestClient) -> None:
    devs = [Dev(client, "f", profile=p, protocols=(1, 2, 3)) for p in ("phone-low", "raspberry-pi-4")]
    sent = [(12.0, 3.0, 0.5, 250.0), (40.0, 9.0, 0.75, 800.0)]
    for d, (step, wall, xfer, rss) in zip(devs, sent, strict=True):
        r = client.post("/v1/rounds/0/metrics", headers=d.h, json={
            "accuracy": 0.5, "loss": 1.0, "n_test": 8, "step_ms": step, "round_s": wall, "transfer_s": xfer,
            "peak_rss_mb": rss})
        assert r.status_code == 200, r.text
    assert client.get("/v1/federations/f/classes", headers=devs[0].h).status_code == 403  # the admin's
    got = {c["profile"]: c for c in client.get("/v1/federations/f/classes", headers=bearer(ADMIN)).json()}
    low, pi = got["phone-low"], got["raspberry-pi-4"]
    assert (low["devices"], low["reporting"]) == (1, 1)
    assert (low["step_ms"]["p50"], low["step_ms"]["p95"]) == (12.0, 12.0)
    assert (low["round_s"]["p50"], low["transfer_s"]["p95"], low["peak_rss_mb"]["p95"]) == (3.0, 0.5, 250.0)
    assert (pi["step_ms"]["p50"], pi["peak_rss_mb"]["p50"]) == (40.0, 800.0)
    text = client.get("/metrics", headers=bearer(ADMIN)).text
    for name, profile, q, want in (("pfl_class_step_ms", "phone-low", "0.95", 12.0),
                                   ("pfl_class_peak_rss_mb", "raspberry-pi-4", "0.5", 800.0),
                                   ("pfl_class_round_seconds", "phone-low", "0.5", 3.0),
                                   ("pfl_class_transfer_seconds", "raspberry-pi-4", "0.95", 0.75)):
        line = re.search(rf'^{name}{{federation="f",profile="{profile}",quantile="{q}"}} (\S+)$', text, re.M)
        assert line is not None and float(line.group(1)) == want, (name, profile, q)
    # a metrics report is still bounded: a negative, non-finite or absurd cost is refused, nothing kept
    for rss in (-1, 2**24 + 1, "nan"):
        bad = client.post("/v1/rounds/0/metrics", headers=devs[1].h, json={
            "accuracy": 0.5, "loss": 1.0, "n_test": 8, "peak_rss_mb": rss})
        assert bad.status_code == 422, rss
    assert client.post("/v1/rounds/0/metrics", headers=devs[1].h, json={
        "accuracy": 0.5, "loss": 1.0, "n_test": 8, "peak_rss_mb": 2**24}).status_code == 200  # the cap itself
    # a device answered in version 2 sends none of version 3's fields: a server of version 2 would refuse them
    old = Dev(client, "f", profile="phone-low")  # the third slot
    r = client.post("/v1/rounds/0/metrics", headers=old.h, json={
        "accuracy": 0.5, "loss": 1.0, "n_test": 8, "step_ms": 1.0, "round_s": 2.0})
    assert r.status_code == 422 and "round_s" in r.text and "version 2" in r.text
    assert client.post("/v1/rounds/0/metrics", headers=old.h, json={
        "accuracy": 0.5, "loss": 1.0, "n_test": 8, "step_ms": 1.0}).status_code == 200
    # revoking a device leaves its class's count, not its reports
    assert client.post(f"/v1/federations/f/devices/{devs[1].id}/revoke", headers=bearer(ADMIN)).status_code == 200
    pi_now = {c["profile"]: c for c in client.get("/v1/federations/f/classes", headers=bearer(ADMIN)).json()}
    assert pi_now["raspberry-pi-4"]["devices"] == 0 and pi_now["raspberry-pi-4"]["peak_rss_mb"]["p50"] == 2**24


class _Capture:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def call(self, method: str, path: str, json_body: dict[str, Any] | None = None, **_: Any) -> None:
        self.bodies.append(dict(json_body or {}))


def test_a_device_sends_its_costs_only_to_a_server_that_takes_them() -> None:
    prog = Progress(stats={"3": RoundStats(bytes_up=10, bytes_down=20, step_ms=5.0, train_s=1.0, round_s=2.5,
                                           transfer_s=0.5)})
    http = _Capture()
    m = {"round": 3, "accuracy": 0.5, "loss": 1.0, "n_test": 4}
    post_metrics(http, m, prog, lambda *_: None)  # type: ignore[arg-type]
    post_metrics(http, m, prog, lambda *_: None, costs=True)  # type: ignore[arg-type]
    old, new = http.bodies
    assert not {"round_s", "transfer_s", "peak_rss_mb"} & set(old)  # a server of version 2 would refuse them
    assert (new["round_s"], new["transfer_s"]) == (2.5, 0.5) and new["peak_rss_mb"] > 1  # this process's


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[BackgroundServer]:
    s = start_background(Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'state.db'}",
                                  admin_token=ADMIN, tick_s=0.05, export_on_create="none"))  # type: ignore[arg-type]
    yield s
    s.stop()


@pytest.mark.parametrize("speaks", [pytest.param((1, 2, 3), id="server-3"),
                                    pytest.param((1, 2), id="server-2", marks=pytest.mark.slow)])  # make test's time
def test_real_devices_report_their_rounds_costs_per_class(srv: BackgroundServer, tmp_path: Path,
                                                          speaks: tuple[int, ...],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """This release's agents against a server of version 3, and of version 2 (which refuses the costs: the agents
    send none and finish, their step times and bytes still shown)."""
    assert srv.app_state is not None
    srv.app_state.coordinator.enrolment.speaks = speaks
    config = {**FEDPER, "clients": 2, "rounds": 2}
    r = httpx.post(f"{srv.url}/v1/federations", headers=bearer(ADMIN), timeout=60,
                   json={"id": "c", "enrol_secret": "class-costs-secret-0123", "config": config})
    assert r.status_code == 201, r.text
    agents = [Agent(AgentConfig(server=srv.url, federation="c", enrol_secret="class-costs-secret-0123", profile=p,
                                state_dir=str(tmp_path / p), threads=1, training_backend="torch", patience_s=30))
              for p in ("phone-low", "raspberry-pi-4")]
    rcs: list[Any] = [None, None]

    def run(i: int) -> None:
        try:
            rcs[i] = agents[i].run()
        except BaseException as e:  # reported below
            rcs[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert rcs == [0, 0], rcs
    got = {c["profile"]: c for c in httpx.get(f"{srv.url}/v1/federations/c/classes", headers=bearer(ADMIN)).json()}
    for profile in ("phone-low", "raspberry-pi-4"):
        c = got[profile]
        assert c["reporting"] == 1, c
        assert c["step_ms"]["p50"] > 0 and c["bytes_up"]["p50"] > 0, c
        if speaks == (1, 2):
            assert c["round_s"]["n"] == c["transfer_s"]["n"] == c["peak_rss_mb"]["n"] == 0, c
            continue
        # rounds 1 and 2 each: a wall time that holds its transfers, and a peak memory of a process with torch
        assert c["round_s"]["n"] == 2 and 0 < c["round_s"]["p50"] <= c["round_s"]["p95"], c
        assert c["transfer_s"]["n"] == 2 and c["transfer_s"]["p95"] <= c["round_s"]["p95"], c
        assert c["peak_rss_mb"]["n"] == 2 and c["peak_rss_mb"]["p50"] > 50, c  # a process with torch
    if speaks == (1, 2):
        return
    # the same table from a terminal
    (tmp_path / "admin").write_text(ADMIN + "\n")
    assert main(["profile", "--fleet", srv.url, "--federation", "c", "--admin-token-file",
                 str(tmp_path / "admin")]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    for profile in ("phone-low", "raspberry-pi-4"):
        c = got[profile]
        assert f"{c['step_ms']['p50']:.1f} / {c['step_ms']['p95']:.1f}" in lines[profile], lines
        assert f"{c['peak_rss_mb']['p50']:.0f} / {c['peak_rss_mb']['p95']:.0f}" in lines[profile], lines
