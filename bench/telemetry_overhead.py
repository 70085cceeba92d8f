"""What the Prometheus latency middleware (``server.services.telemetry.HttpTelemetry``, installed by
``server.app.create_app``) costs, and what a ``GET /metrics`` scrape costs (issue 11).

1. The middleware alone, in this process: ``--asgi-calls`` requests straight into a minimal ASGI app, wrapped and
   not wrapped (no server, no socket), interleaved: microseconds per request.
2. Two real servers side by side (subprocesses of this script, uvicorn, SQLite, embedded broker): ``on`` is the
   server as shipped; ``off`` is the same code with ``server.app.install_telemetry`` replaced, before the app is
   built, by one that keeps an empty ``Telemetry`` for ``/metrics`` and adds no middleware (the server's code is
   not changed). ``--clients`` concurrent keep-alive connections (httpx, asyncio, this process) ask ``GET
   /healthz`` and ``GET /v1/federations/{fed}`` (a device's token: authentication and a database read) as fast
   as they are answered, for ``--trial-s`` per trial; trials interleave on/off (alternating which goes first) for
   ``--repeats`` repeats. Reported: requests/s and the server's CPU time per request (its process, from
   /proc, children excluded), each as off/on ratios per repeat and their median.
3. ``GET /metrics`` on the ``on`` server holding a federation of ``--devices`` enrolled devices (over HTTP) and
   ``--rounds`` closed rounds of update and metric rows (written straight into its SQLite database): wall time
   (median of ``--scrapes``), server CPU per scrape, and the scrape's size; at a 15 s scrape interval, the share
   of one core it takes.

    .venv/bin/python bench/telemetry_overhead.py [--repeats 10] [--trial-s 4] [--clients 4]
        [--out bench/results/telemetry_overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
FED = "tel"
SECRET = "telemetry-bench-secret"


# ------------------------------------------------------------------------------------ the servers (subprocesses)


def serve(telemetry: bool, port: int) -> None:
    """Run the server; without telemetry, ``install_telemetry`` keeps the counters object and adds no middleware."""
    sys.path.insert(0, str(REPO))
    import server.app as app_module
    from server.main import main as server_main
    from server.services.telemetry import Telemetry

    if not telemetry:
        def no_middleware(app: Any) -> Telemetry:
            app.state.telemetry = Telemetry()
            return app.state.telemetry

        app_module.install_telemetry = no_middleware
    server_main(["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"])


class Server:
    def __init__(self, telemetry: bool, data_dir: Path) -> None:
        from server.broker import free_port
        from server.launch import wait_healthy

        self.token = secrets.token_urlsafe(24)
        self.data_dir = data_dir
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PFL_DATA_DIR": str(data_dir), "PFL_ADMIN_TOKEN": self.token, "PFL_PUBLIC_URL": self.url,
               "PFL_ENROL_RATE_PER_ADDRESS": "1000000", "PFL_ENROL_BURST_PER_ADDRESS": "1000000",
               "PFL_ENROL_RATE_PER_FEDERATION": "1000000", "PFL_ENROL_BURST_PER_FEDERATION": "1000000",
               "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", "on" if telemetry else "off",
                                      "--port", str(port)], env=env)
        wait_healthy(self.url, 120, lambda: self.proc.poll() is None)
        self.ps = psutil.Process(self.proc.pid)

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system  # this process only: decode workers and export children are not in the path

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def setup(srv: Server, devices: int) -> list[dict[str, Any]]:
    """A federation that never starts a round (more clients than devices) and ``devices`` enrolled devices."""
    from edge_runtime.fleet import DemoConfig

    cfg = DemoConfig(devices=devices + 100, rounds=1000, partition="pathological:1", samples_per_client=4,
                     profile_capacity=False, dataset="synthetic", extra={"test_per_client": 1}).federation_config()
    admin = {"Authorization": f"Bearer {srv.token}"}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        c.post("/v1/federations", headers=admin,
               json={"id": FED, "enrol_secret": SECRET, "config": cfg}).raise_for_status()
        out = []
        for i in range(devices):
            r = c.post("/v1/devices", json={"federation": FED, "enrol_secret": SECRET, "profile": "raspberry-pi-4",
                                            "name": f"d{i}", "index": i, "nonce": secrets.token_hex(16),
                                            "n_samples": 4})
            r.raise_for_status()
            out.append(r.json())
    return out


# ------------------------------------------------------------------------------------------------- the load


async def load(url: str, path: str, token: str | None, clients: int, seconds: float) -> tuple[int, int, list[float]]:
    """``clients`` keep-alive connections asking ``path`` back to back for ``seconds``: (ok, failed, latencies)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    lat: list[float] = []
    counts = [0, 0]
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=30) as c:
        await asyncio.gather(*(c.get(path) for _ in range(clients)))  # open the connections first
        end = time.perf_counter() + seconds

        async def worker() -> None:
            while (t0 := time.perf_counter()) < end:
                try:
                    ok = (await c.get(path)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                lat.append(time.perf_counter() - t0)
                counts[0 if ok else 1] += 1

        await asyncio.gather(*(worker() for _ in range(clients)))
    return counts[0], counts[1], lat


def trial(srv: Server, path: str, token: str | None, args: argparse.Namespace) -> dict[str, Any]:
    cpu0, own0, t0 = srv.cpu_s(), time.process_time(), time.perf_counter()
    ok, failed, lat = asyncio.run(load(srv.url, path, token, args.clients, args.trial_s))
    wall, cpu, own = time.perf_counter() - t0, srv.cpu_s() - cpu0, time.process_time() - own0
    return {"requests": ok, "failed": failed, "rps": ok / wall, "server_cpu_ms_per_request": 1e3 * cpu / max(ok, 1),
            "client_cpu_ms_per_request": 1e3 * own / max(ok, 1),
            "p50_ms": 1e3 * statistics.median(lat), "p99_ms": 1e3 * sorted(lat)[int(0.99 * (len(lat) - 1))]}


def side_by_side(servers: dict[str, Server], token: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    paths = {"healthz": ("/healthz", False), "federation": (f"/v1/federations/{FED}", True)}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {p: {"on": [], "off": []} for p in paths}
    for path, auth in paths.values():  # warm-up: imports, caches, connection pools
        for v, srv in servers.items():
            asyncio.run(load(srv.url, path, token[v] if auth else None, args.clients, 1.0))
    for rep in range(args.repeats):
        order = ["on", "off"] if rep % 2 == 0 else ["off", "on"]
        for name, (path, auth) in paths.items():
            for v in order:
                r = trial(servers[v], path, token[v] if auth else None, args)
                runs[name][v].append(r)
                print(f"repeat {rep + 1} {name:10s} {v:3s}: {r['rps']:7.0f} req/s, "
                      f"{r['server_cpu_ms_per_request']:.3f} server CPU ms/req, p50 {r['p50_ms']:.1f} ms "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    out: dict[str, Any] = {}
    for name, by in runs.items():
        rps = [off["rps"] / on["rps"] for on, off in zip(by["on"], by["off"], strict=True)]
        cpu = [on["server_cpu_ms_per_request"] / off["server_cpu_ms_per_request"]
               for on, off in zip(by["on"], by["off"], strict=True)]
        out[name] = {"runs": by, "off_over_on_rps": rps, "median_off_over_on_rps": statistics.median(rps),
                     "on_over_off_cpu_per_request": cpu, "median_on_over_off_cpu": statistics.median(cpu),
                     "median_cpu_ms_per_request": {v: statistics.median(r["server_cpu_ms_per_request"] for r in rs)
                                                   for v, rs in by.items()}}
    return out


# ------------------------------------------------------------------------------------------ the middleware alone


def asgi_alone(calls: int, repeats: int) -> dict[str, Any]:
    """Per-request cost of HttpTelemetry around a trivial ASGI app (interleaved, best of ``repeats``)."""
    from server.services.telemetry import HttpTelemetry, Telemetry

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"ok":true}'})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(_msg: Any) -> None:
        return None

    # a matched route, as FastAPI leaves it: the middleware rebuilds the whole template from the path
    scope = {"type": "http", "method": "GET", "path": "/v1/federations/f1",
             "route": SimpleNamespace(path="/federations/{fed}")}
    wrapped = HttpTelemetry(app, Telemetry())

    async def run(target: Any) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            await target(scope, receive, send)
        return (time.perf_counter() - t0) / calls

    best = {"bare": float("inf"), "wrapped": float("inf")}
    for _ in range(repeats):
        best["bare"] = min(best["bare"], asyncio.run(run(app)))
        best["wrapped"] = min(best["wrapped"], asyncio.run(run(wrapped)))
    return {"calls": calls, "bare_us": 1e6 * best["bare"], "wrapped_us": 1e6 * best["wrapped"],
            "middleware_us": 1e6 * (best["wrapped"] - best["bare"])}


# ---------------------------------------------------------------------------------------------- /metrics itself


def fill_rounds(srv: Server, devices: list[dict[str, Any]], rounds: int) -> int:
    """``rounds`` closed rounds, each with an update and a metric row of every device, written straight into the
    server's SQLite database (what /metrics and the dashboard read; the round machine is not involved)."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from server.db import Metric, Round, Update

    engine = create_engine(f"sqlite:///{srv.data_dir / 'state.db'}", connect_args={"timeout": 30})
    t0 = time.time() - rounds * 60
    rows = 0
    with Session(engine) as s, s.begin():
        for t in range(1, rounds + 1):
            opened = t0 + 60 * t
            s.add(Round(federation=FED, round=t, state="finished", opened_at=opened, deadline=opened + 600,
                        closed_at=opened + 30, active=len(devices)))
            for d in devices:
                digest = secrets.token_hex(32)
                s.add(Update(federation=FED, round=t, device=d["device_id"], digest=digest, n_samples=4,
                             train_loss=0.5, train_s=1.0, bytes_down=1_814_870, accepted_at=opened + 20))
                s.add(Metric(federation=FED, round=t, device=d["device_id"], accuracy=0.8, loss=0.5, n_test=10,
                             bytes_up=1_814_870, bytes_down=1_814_870, step_ms=3.0, train_s=1.0))
                rows += 2
            rows += 1
    engine.dispose()
    return rows


def scrape_cost(srv: Server, scrapes: int) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {srv.token}"}
    walls, size = [], 0
    with httpx.Client(base_url=srv.url, headers=headers, timeout=60) as c:
        c.get("/metrics").raise_for_status()  # warm
        cpu0 = srv.cpu_s()  # over all scrapes: the process's CPU clock ticks in 10 ms
        for _ in range(scrapes):
            t0 = time.perf_counter()
            r = c.get("/metrics")
            walls.append(time.perf_counter() - t0)
            r.raise_for_status()
            size = len(r.content)
        cpu = (srv.cpu_s() - cpu0) / scrapes
        text = r.text
    return {"scrapes": scrapes, "p50_ms": 1e3 * statistics.median(walls), "max_ms": 1e3 * max(walls),
            "server_cpu_ms_mean": 1e3 * cpu, "bytes": size, "lines": text.count("\n"),
            "rounds_closed_line": next((ln for ln in text.splitlines() if ln.startswith("pfl_rounds_closed_total{")),
                                       None),
            "share_of_one_core_at_15s": cpu / 15.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--trial-s", type=float, default=4.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--asgi-calls", type=int, default=20_000)
    ap.add_argument("--devices", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--scrapes", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "telemetry_overhead.json")
    ap.add_argument("--serve", choices=["on", "off"], help=argparse.SUPPRESS)  # the server subprocesses
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve == "on", args.port)
        return
    load0 = os.getloadavg()
    alone = asgi_alone(args.asgi_calls, 5)
    print(f"middleware alone: {alone['middleware_us']:.1f} us per request "
          f"({alone['bare_us']:.1f} -> {alone['wrapped_us']:.1f})", flush=True)
    with tempfile.TemporaryDirectory(prefix="pfl-telemetry-") as tmp:
        servers = {v: Server(v == "on", Path(tmp) / v) for v in ("on", "off")}
        try:
            devs = {v: setup(srv, args.devices if v == "on" else 1) for v, srv in servers.items()}
            tokens = {v: d[0]["token"] for v, d in devs.items()}
            loads = side_by_side(servers, tokens, args)
            rows = fill_rounds(servers["on"], devs["on"], args.rounds)
            scrape = scrape_cost(servers["on"], args.scrapes) | {"devices": args.devices, "rounds": args.rounds,
                                                                 "rows_written": rows}
        finally:
            for srv in servers.values():
                srv.stop()
    res = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
           "load_average_before": load0, "load_average_after": os.getloadavg(), "clients": args.clients,
           "trial_s": args.trial_s, "repeats": args.repeats, "middleware_alone": alone, "http": loads,
           "metrics_scrape": scrape}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    for name, r in loads.items():
        print(f"{name:10s}: req/s off/on median {r['median_off_over_on_rps']:.3f} "
              f"({', '.join(f'{x:.3f}' for x in r['off_over_on_rps'])}); server CPU/request on/off median "
              f"{r['median_on_over_off_cpu']:.3f} ({r['median_cpu_ms_per_request']})")
    print(f"/metrics ({args.devices} devices, {args.rounds} rounds): p50 {scrape['p50_ms']:.1f} ms, server CPU "
          f"{scrape['server_cpu_ms_mean']:.1f} ms, {scrape['bytes']:,} B; at 15 s: "
          f"{100 * scrape['share_of_one_core_at_15s']:.3f} % of one core")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
