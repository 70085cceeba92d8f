"""A fleet of lightweight virtual devices against one server: real enrolment over HTTP, a real MQTT session per
device with its own credentials from its Enrolment answer (``bench/fleet_mqtt.py``), real codec payloads of the
demo's cnn base (``encode(take(state, base), model_id, round=t)``), no training. PostgreSQL (a fresh database on
the system server) and a private Mosquitto with the dynamic-security plugin on loopback, the server as a
subprocess. Each device: enrol, connect and subscribe (its task topic and the round topic), publish its retained
status, then per round wait for its task over MQTT, download the base it names, upload its payload and post the
update. Calls are retried on connection errors and 429/503 (counted as retries); a call that still fails is an
error. Reported: enrolments/s, updates/s, p50/p99 of each call, each round's wall time against its deadline, peak
resident memory of the server (with its decode processes) and of the broker, errors.

    .venv/bin/python bench/fleet_load.py --devices 1000 [--rounds 2] [--database sqlite] [--broker embedded]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import secrets
import tempfile
import time
from collections import defaultdict
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import torch
from fleet_mqtt import MqttSession
from fleet_setup import ENROL_SECRET, RssSampler, config_for, mosquitto, postgres_db, raise_nofile, server

from pfl_edge.codec import encode
from pfl_edge.protocol import API_PREFIX, Enrolment, Task, mqtt_client_id, round_topic, status_topic, task_topic
from pfl_edge.split import take
from server.fedmodel import fed_model

FED = "fleet"
RETRY_STATUS = {429, 503}


def percentiles(xs: list[float]) -> dict[str, float | int | None]:
    if not xs:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    s = sorted(xs)
    return {"n": len(s), "p50_ms": 1e3 * s[len(s) // 2], "p99_ms": 1e3 * s[min(len(s) - 1, int(0.99 * len(s)))],
            "max_ms": 1e3 * s[-1]}


class Calls:
    """Latency of each successful call by kind; retries and final errors by kind (with a few messages)."""

    def __init__(self) -> None:
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.retries: dict[str, int] = defaultdict(int)
        self.why: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # kind -> reason -> retries
        self.errors: dict[str, int] = defaultdict(int)
        self.samples: list[str] = []

    def error(self, kind: str, what: str) -> None:
        self.errors[kind] += 1
        if len(self.samples) < 20:
            self.samples.append(f"{kind}: {what}"[:300])

    def summary(self) -> dict[str, Any]:
        return {k: {**percentiles(self.lat.get(k, [])), "retries": self.retries.get(k, 0),
                    "retry_reasons": dict(self.why.get(k, {})), "errors": self.errors.get(k, 0)}
                for k in sorted(set(self.lat) | set(self.errors))}


async def call(client: httpx.AsyncClient, calls: Calls, kind: str, method: str, url: str, *,
               ok: tuple[int, ...] = (200, 201), attempts: int = 8, discard: bool = False,
               **kw: Any) -> httpx.Response:
    """One HTTP call, retried on connection errors and 429/503 (idempotent here: enrolment by its nonce, blobs
    by their digest, updates by device and round); raises after ``attempts``."""
    last = ""
    for i in range(attempts):
        t0 = time.perf_counter()
        try:
            if discard:  # a download: read and drop it (a device would write it to its disk)
                async with client.stream(method, url, **kw) as r:
                    async for _ in r.aiter_raw():
                        pass
            else:
                r = await client.request(method, url, **kw)
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
            calls.why[kind][type(e).__name__] += 1
        else:
            if r.status_code in ok:
                calls.lat[kind].append(time.perf_counter() - t0)
                return r
            last = f"HTTP {r.status_code}: {'' if discard else r.text[:200]}"
            if r.status_code not in RETRY_STATUS:
                break
            calls.why[kind][f"HTTP {r.status_code}"] += 1
        calls.retries[kind] += 1
        await asyncio.sleep(min(5.0, 0.2 * 2**i))
    calls.error(kind, last)
    raise RuntimeError(f"{kind} failed: {last}")


class Fleet:
    def __init__(self, url: str, devices: int, rounds: int, variants: int, calls: Calls) -> None:
        self.url = url
        self.devices = devices
        self.rounds = rounds
        self.calls = calls
        cfg = config_for(devices, rounds)
        fm = fed_model(cfg)
        init = fm.init_state()
        base = take(init, fm.base_keys(cfg["kp"]))
        g = torch.Generator().manual_seed(0)
        noise = [{k: 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else torch.zeros_like(v)
                  for k, v in base.items()} for _ in range(variants)]
        # payloads[t][v]: variant v of round t (the header names the round)
        self.payloads = {t: [encode({k: v + n[k] for k, v in base.items()}, model_id=fm.model_id, round=t)
                             for n in noise] for t in range(1, rounds + 1)}
        self.digests = {t: [hashlib.sha256(p).hexdigest() for p in ps] for t, ps in self.payloads.items()}
        self.payload_bytes = len(self.payloads[1][0])
        self.enrolled: list[float] = []  # time each enrolment was answered
        self.sessions: list[MqttSession] = []
        self.done: dict[int, list[float]] = defaultdict(list)  # round -> times its updates were accepted
        self.tasks_at: dict[int, list[float]] = defaultdict(list)  # round -> times tasks arrived

    async def enrol(self, client: httpx.AsyncClient, i: int) -> Enrolment:
        body = {"federation": FED, "enrol_secret": ENROL_SECRET, "profile": "raspberry-pi-4", "name": f"v{i}",
                "index": i, "nonce": secrets.token_hex(16), "n_samples": 4}
        r = await call(client, self.calls, "enrol", "POST", f"{API_PREFIX}/devices", json=body)
        self.enrolled.append(time.perf_counter())
        return Enrolment.model_validate_json(r.content)

    async def session(self, enr: Enrolment) -> MqttSession:
        u = urlsplit(enr.broker_url)
        status = json.dumps({"device_id": enr.device_id, "state": "offline"}).encode()
        m = MqttSession(u.hostname or "127.0.0.1", u.port or 1883, mqtt_client_id(enr.device_id), enr.mqtt_username,
                        enr.mqtt_password, will=(status_topic(FED, enr.device_id), status))
        t0 = time.perf_counter()
        for attempt in range(6):
            try:
                await m.connect()
                await m.subscribe([task_topic(FED, enr.device_id), round_topic(FED)])
                break
            except (OSError, RuntimeError, TimeoutError) as e:
                await m.close()
                self.calls.retries["mqtt_connect"] += 1
                if attempt == 5:
                    self.calls.error("mqtt_connect", f"{type(e).__name__}: {e}")
                    raise
                await asyncio.sleep(0.5 * 2**attempt)
        self.calls.lat["mqtt_connect"].append(time.perf_counter() - t0)
        online = json.dumps({"device_id": enr.device_id, "state": "online"}).encode()
        await m.publish(status_topic(FED, enr.device_id), online, retain=True)
        self.sessions.append(m)
        return m

    async def device(self, client: httpx.AsyncClient, i: int, gate: asyncio.Semaphore) -> None:
        async with gate:
            enr = await self.enrol(client, i)
        m = await self.session(enr)
        auth = {"Authorization": f"Bearer {enr.token}"}
        for t in range(1, self.rounds + 1):
            task = await self.wait_task(m, t)
            self.tasks_at[t].append(time.perf_counter())
            async with gate:  # as an agent does: the server's word on its task before acting on it, then the base
                await call(client, self.calls, "get_task", "GET", f"{API_PREFIX}/rounds/current/task", headers=auth)
                if task.base is not None:
                    await call(client, self.calls, "get_base", "GET", f"{API_PREFIX}/blobs/{task.base}", headers=auth,
                               discard=True)
                v = i % len(self.payloads[t])
                payload, digest = self.payloads[t][v], self.digests[t][v]
                await call(client, self.calls, "put_blob", "PUT", f"{API_PREFIX}/blobs/{digest}", content=payload,
                           headers={**auth, "Content-Type": "application/octet-stream"})
                await call(client, self.calls, "post_update", "POST", f"{API_PREFIX}/rounds/{t}/updates",
                           json={"digest": digest, "n_samples": 4}, headers=auth)
            self.done[t].append(time.perf_counter())

    async def wait_task(self, m: MqttSession, t: int) -> Task:
        while True:
            topic, payload = await m.messages.get()
            if not topic:
                self.calls.error("mqtt_session", f"{m.client_id}: session ended before the task of round {t}")
                raise RuntimeError("session ended")
            if topic.endswith("/task"):
                task = Task.model_validate_json(payload)
                if task.round == t and not task.final:
                    return task


async def watch(client: httpx.AsyncClient, admin: dict[str, str], rounds: int, stop: asyncio.Event,
                log: list[dict[str, Any]]) -> None:
    """The federation's round and state once a second (admin), each change logged with its time."""
    last: tuple[int, str] | None = None
    while not stop.is_set():
        try:
            r = await client.get(f"{API_PREFIX}/federations/{FED}", headers=admin, timeout=30)
            info = r.json()
            now = (info["round"], info["state"])
            if now != last:
                log.append({"t": time.perf_counter(), "round": now[0], "state": now[1], "devices": info["devices"]})
                print(f"  [{time.strftime('%H:%M:%S')}] round {now[0]} {now[1]} ({info['devices']} devices)",
                      flush=True)
                last = now
            if now[0] >= rounds and now[1] in ("published", "finished"):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def run_fleet(url: str, admin_token: str, args: argparse.Namespace, calls: Calls) -> dict[str, Any]:
    fleet = Fleet(url, args.devices, args.rounds, args.variants, calls)
    admin = {"Authorization": f"Bearer {admin_token}"}
    limits = httpx.Limits(max_connections=args.connections, max_keepalive_connections=args.connections)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600, connect=60)) as client:
        r = await client.post(f"{API_PREFIX}/federations", headers=admin, json={
            "id": FED, "enrol_secret": ENROL_SECRET, "config": config_for(args.devices, args.rounds),
            "quorum": 1.0, "deadline_s": args.deadline_s})
        r.raise_for_status()
        gate = asyncio.Semaphore(args.connections)
        log: list[dict[str, Any]] = []
        stop = asyncio.Event()
        t0 = time.perf_counter()
        watcher = asyncio.create_task(watch(client, admin, args.rounds, stop, log))
        results = await asyncio.gather(*(fleet.device(client, i, gate) for i in range(args.devices)),
                                       return_exceptions=True)
        with contextlib.suppress(TimeoutError):  # the last round closes after its last update
            await asyncio.wait_for(asyncio.shield(watcher), 300)
        stop.set()
        await watcher
        wall = time.perf_counter() - t0
        summary = (await client.get(f"{API_PREFIX}/federations/{FED}/metrics", headers=admin, timeout=120)).json()
    for s in fleet.sessions:
        await s.close()
    failed = [r for r in results if isinstance(r, BaseException)]
    rounds = []
    for row in summary["rounds"]:
        t = row["round"]
        if t < 1:
            continue
        done, tasks = fleet.done.get(t, []), fleet.tasks_at.get(t, [])
        span = (max(done) - min(tasks)) if done and tasks else None
        rounds.append({"round": t, "state": row["state"], "updates": row["updates"], "active": row["active"],
                       "wall_s": row["wall_s"], "deadline_s": args.deadline_s,
                       "closed_within_deadline": row["wall_s"] is not None and row["wall_s"] <= args.deadline_s,
                       "updates_per_s": len(done) / span if span else None,
                       "first_task_to_last_update_s": span})
    enrol_span = max(fleet.enrolled) - t0 if fleet.enrolled else None
    return {"wall_s": wall, "enrolled": len(fleet.enrolled),
            "enrolments_per_s": len(fleet.enrolled) / enrol_span if enrol_span else None,
            "payload_bytes": fleet.payload_bytes, "device_failures": len(failed),
            "device_failure_samples": [repr(f)[:300] for f in failed[:5]], "rounds": rounds, "states": [
                {**e, "t": e["t"] - t0} for e in log]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--deadline-s", type=float, default=1800.0, help="each round's deadline")
    ap.add_argument("--variants", type=int, default=16, help="distinct payloads per round (disk: 1.8 MB each)")
    ap.add_argument("--connections", type=int, default=1000, help="HTTP connections (and calls in flight) at most")
    ap.add_argument("--database", default="postgresql", help="postgresql (a fresh database), sqlite, or a URL")
    ap.add_argument("--broker", default="mosquitto", choices=["mosquitto", "embedded"])
    ap.add_argument("--client-nice", type=int, default=10, help="niceness of the devices' process (0: none)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    nofile = raise_nofile()
    out = args.out or Path(__file__).parent / "results" / f"fleet_load_{args.devices}.json"
    calls = Calls()
    with tempfile.TemporaryDirectory(prefix="pfl-fleet-") as tmp, ExitStack() as stack:
        db = (stack.enter_context(postgres_db()) if args.database == "postgresql"
              else None if args.database == "sqlite" else args.database)
        broker_url, broker_pid = (stack.enter_context(mosquitto(Path(tmp) / "mosquitto"))
                                  if args.broker == "mosquitto" else (None, None))
        token = secrets.token_urlsafe(24)
        srv = server(Path(tmp) / "server", database_url=db, broker_url=broker_url, admin_token=token)
        stack.callback(srv.stop)
        pids = {"server": srv.proc.pid, **({"broker": broker_pid} if broker_pid else {})}
        print(f"server {srv.url} (pid {srv.proc.pid}), broker {broker_url or 'embedded'}, database "
              f"{args.database}; {args.devices} devices, {args.rounds} rounds", flush=True)
        if args.client_nice:  # the devices yield the CPU to the server and broker: on a real fleet they are
            os.nice(args.client_nice)  # other machines
        with RssSampler(pids) as rss:
            res = asyncio.run(run_fleet(srv.url, token, args, calls))
    errors = sum(calls.errors.values())
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load_average_after": os.getloadavg(), "nofile": nofile,
        "devices": args.devices, "database": args.database, "broker": args.broker, "variants": args.variants,
        "connections": args.connections, "client_nice": args.client_nice, **res, "errors": errors,
        "error_samples": calls.samples,
        "calls": calls.summary(), "server_peak_rss_mb": rss.peak_main_mb.get("server"),
        "server_peak_rss_with_children_mb": rss.peak_mb.get("server"),
        "broker_peak_rss_mb": rss.peak_mb.get("broker"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("states", "calls")}, indent=1))
    print(json.dumps(result["calls"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
