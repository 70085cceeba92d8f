"""Do cheap requests stay cheap while the server works? A server (subprocess; SQLite, or PostgreSQL with
``--database postgresql``) with a FedPer federation of 1,000 virtual devices: they enrol over HTTP, then all
upload at once (real codec payloads of the demo's cnn base: PUT the blob, POST the update; no training, no
MQTT), and the round closes (the streaming average of 1,000 updates). Meanwhile a separate prober process asks
``GET /healthz`` and ``GET /v1/federations/{fed}`` (with a device's token) back to back, each on its own
connection, and records every latency. Reported: p50/p99/max of each probe while idle, while the uploads arrive
and while the round aggregates (target: p99 < 100 ms), the uploads' own latencies, the server's peak resident
memory. ``--server-root`` runs the server of another checkout (a ``git worktree``) for a side-by-side figure.

    .venv/bin/python bench/responsiveness.py [--devices 1000] [--server-root /tmp/old] [--out ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import secrets
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from fleet_load import FED, Calls, Fleet, call, make_payloads, percentiles
from fleet_setup import ENROL_SECRET, RssSampler, config_for, raise_nofile, server

from pfl_edge.protocol import API_PREFIX


def _probe_loop(url: str, path: str, token: str, stop: Any, out: Any, pause_s: float) -> None:
    with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {token}"}) as c:
        while not stop.is_set():
            t0, p0 = time.time(), time.perf_counter()
            try:
                ok = c.get(path).status_code == 200
            except httpx.HTTPError:
                ok = False
            out.append((t0, time.perf_counter() - p0, ok))
            time.sleep(pause_s)


def prober(url: str, token: str, stop: Any, conn: Any, pause_s: float) -> None:
    """In its own process: both probes in threads until ``stop``; sends {probe: [(start, latency, ok)]}."""
    res: dict[str, list[tuple[float, float, bool]]] = {"healthz": [], "federation": []}
    ts = [threading.Thread(target=_probe_loop, args=(url, p, token, stop, res[k], pause_s))
          for k, p in (("healthz", "/healthz"), ("federation", f"{API_PREFIX}/federations/{FED}"))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    conn.send(res)


STATES = ("open", "collecting", "closing", "published", "finished")


async def _wait_state(client: httpx.AsyncClient, admin: dict[str, str], want: tuple[int, str],
                      timeout: float) -> dict[str, Any]:
    """Polls (every 0.1 s) until the federation is at or past round ``want[0]`` in state ``want[1]``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info: dict[str, Any] = (await client.get(f"{API_PREFIX}/federations/{FED}", headers=admin)).json()
        if (info["round"], STATES.index(info["state"])) >= (want[0], STATES.index(want[1])):
            return info
        await asyncio.sleep(0.1)
    raise TimeoutError(f"federation not at {want} within {timeout} s")


async def run(url: str, admin_token: str, args: argparse.Namespace, calls: Calls, rss: RssSampler) -> dict[str, Any]:
    payloads = make_payloads(config_for(args.devices, 1), args.variants)
    fleet = Fleet(payloads, 1, calls)
    admin = {"Authorization": f"Bearer {admin_token}"}
    limits = httpx.Limits(max_connections=args.devices, max_keepalive_connections=args.devices)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600, connect=60)) as client:
        (await client.post(f"{API_PREFIX}/federations", headers=admin, json={
            "id": FED, "enrol_secret": ENROL_SECRET, "config": config_for(args.devices, 2), "quorum": 1.0,
            "deadline_s": 1800.0})).raise_for_status()
        gate = asyncio.Semaphore(args.enrol_concurrency)

        async def enrol(i: int) -> Any:
            async with gate:
                return await fleet.enrol(client, i)

        t0 = time.perf_counter()
        enrs = await asyncio.gather(*(enrol(i) for i in range(args.devices)))
        enrol_s = time.perf_counter() - t0
        await _wait_state(client, admin, (1, "collecting"), 120)
        ctx = multiprocessing.get_context("spawn")
        stop, (rx, tx) = ctx.Event(), ctx.Pipe(duplex=False)
        probe = ctx.Process(target=prober, args=(url, enrs[0].token, stop, tx, args.pause_s))
        probe.start()
        if args.client_nice:  # the devices' load generator yields the CPU to the server and the prober: on a
            os.nice(args.client_nice)  # real fleet the devices are other machines
        await asyncio.sleep(args.idle_s)
        async def upload(e: Any) -> float:
            auth = {"Authorization": f"Bearer {e.token}"}
            payload, digest = payloads[1][e.index % args.variants]
            await call(client, calls, "put_blob", "PUT", f"{API_PREFIX}/blobs/{digest}", content=payload,
                       headers={**auth, "Content-Type": "application/octet-stream"})
            await call(client, calls, "post_update", "POST", f"{API_PREFIX}/rounds/1/updates",
                       json={"digest": digest, "n_samples": 4}, headers=auth)
            return time.time()

        rss_before = rss.current_mb("server")
        up0 = time.time()
        ends = await asyncio.gather(*(upload(e) for e in enrs), return_exceptions=True)
        up1 = max((x for x in ends if isinstance(x, float)), default=time.time())
        await _wait_state(client, admin, (1, "published"), 600)
        closed = time.time()  # seen closed: within 0.1 s plus one request after it closed
        summary = (await client.get(f"{API_PREFIX}/federations/{FED}/metrics", headers=admin)).json()
        await asyncio.sleep(args.idle_s)
        stop.set()
        samples = await asyncio.to_thread(rx.recv)
        probe.join(30)
    r1 = {k: v for k, v in next(r for r in summary["rounds"] if r["round"] == 1).items() if k != "devices"}
    mem = {ph: max((mb for t, mb in rss.timeline if lo <= t <= hi), default=None)
           for ph, lo, hi in (("uploads", up0, up1), ("aggregating", up1, closed))}
    return {"enrol_s": enrol_s, "enrolments_per_s": args.devices / enrol_s, "uploads_s": up1 - up0,
            "server_peak_rss_mb_by_phase": mem,
            "aggregating_s": closed - up1, "round": r1, "phases": _phases(samples, up0, up1, closed),
            "upload_failures": sum(isinstance(x, BaseException) for x in ends),
            "server_rss_before_uploads_mb": rss_before}


def _phases(samples: dict[str, list[tuple[float, float, bool]]], up0: float, up1: float,
            closed: float) -> dict[str, Any]:
    """Each probe's latencies by phase: idle (before the uploads and after the close), uploads (first upload
    sent to last update accepted), aggregating (from then until the round is seen closed)."""
    out: dict[str, Any] = {}
    for name, rows in samples.items():
        ph: dict[str, list[float]] = {"idle": [], "uploads": [], "aggregating": []}
        failed = 0
        for t, lat, ok in rows:
            failed += not ok
            end = t + lat
            if end < up0 or t > closed:
                ph["idle"].append(lat)
            elif t <= up1:
                ph["uploads"].append(lat)
            else:
                ph["aggregating"].append(lat)
        busy = percentiles(ph["uploads"] + ph["aggregating"])
        out[name] = {k: percentiles(v) for k, v in ph.items()} | {"failed": failed, "busy": busy}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--variants", type=int, default=16, help="distinct payloads (1.8 MB each)")
    ap.add_argument("--enrol-concurrency", type=int, default=50)
    ap.add_argument("--idle-s", type=float, default=3.0, help="probing before the uploads and after the close")
    ap.add_argument("--pause-s", type=float, default=0.02, help="between a probe's answer and its next request")
    ap.add_argument("--database", default="sqlite", help="sqlite, postgresql (a fresh database), or a URL")
    ap.add_argument("--server-root", type=Path, help="run the server of this checkout (a git worktree)")
    ap.add_argument("--label", default="", help="a name for this run in the results")
    ap.add_argument("--client-nice", type=int, default=10, help="niceness of the uploading client (0: none)")
    ap.add_argument("--server-env", nargs="*", default=[], metavar="KEY=VALUE", help="more server environment")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "responsiveness.json")
    args = ap.parse_args()
    raise_nofile()
    calls = Calls()
    from contextlib import ExitStack

    from fleet_setup import postgres_db

    with tempfile.TemporaryDirectory(prefix="pfl-resp-") as tmp, ExitStack() as stack:
        db = (stack.enter_context(postgres_db()) if args.database == "postgresql"
              else None if args.database == "sqlite" else args.database)
        token = secrets.token_urlsafe(24)
        srv = server(Path(tmp) / "server", database_url=db, broker_url=None, admin_token=token, root=args.server_root,
                     extra=dict(kv.split("=", 1) for kv in args.server_env))
        stack.callback(srv.stop)
        with RssSampler({"server": srv.proc.pid}) as rss:
            res = asyncio.run(run(srv.url, token, args, calls, rss))
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "label": args.label, "server_env": args.server_env,
        "client_nice": args.client_nice,
        "server_root": str(args.server_root or Path(__file__).resolve().parent.parent),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load_average_after": os.getloadavg(), "devices": args.devices, "database": args.database,
        **res,
        "errors": sum(calls.errors.values()), "error_samples": calls.samples, "calls": calls.summary(),
        "server_peak_rss_mb": rss.peak_main_mb["server"], "server_peak_rss_with_children_mb": rss.peak_mb["server"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for name, ph in res["phases"].items():
        print(name, {k: (v["n"], v["p50_ms"] and round(v["p50_ms"], 1), v["p99_ms"] and round(v["p99_ms"], 1))
                     for k, v in ph.items() if isinstance(v, dict)}, "failed", ph["failed"])
    print(json.dumps({k: v for k, v in result.items() if k not in ("phases", "calls")}, indent=1))
    print(json.dumps(result["calls"], indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
