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

Replicas (issue 18): ``--replicas N`` runs N server processes on the PostgreSQL database behind HAProxy (devices
see the balancer); ``--broker rabbitmq --broker-nodes K`` a K-node RabbitMQ cluster that authenticates devices
through the servers' HTTP hook, devices spread over the nodes by a TCP balancer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import multiprocessing
import os
import platform
import resource
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
from fleet_setup import (
    ADMIN,
    ENROL_SECRET,
    RssSampler,
    config_for,
    mosquitto,
    postgres_db,
    raise_nofile,
    server,
    server_env,
)

from pfl_edge.codec import encode
from pfl_edge.protocol import API_PREFIX, Enrolment, Task, mqtt_client_id, round_topic, status_topic, task_topic
from pfl_edge.split import take
from server.fedmodel import fed_model

FED = "fleet"
NODES_ENV = "PFL_BENCH_MQTT_NODES"  # --mqtt-direct: the nodes' host:port, inherited by the client processes
RETRY_STATUS = {429, 502, 503, 504}  # 502/504: a balancer whose replica died under the call


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
            print(f"  [{time.strftime('%H:%M:%S')}] error: {kind}: {what}"[:300], flush=True)  # as it happens

    def export(self) -> dict[str, Any]:
        return {"lat": dict(self.lat), "retries": dict(self.retries), "why": {k: dict(v) for k, v in self.why.items()},
                "errors": dict(self.errors), "samples": self.samples}

    def merge(self, d: dict[str, Any]) -> None:
        for k, v in d["lat"].items():
            self.lat[k].extend(v)
        for k, n in d["retries"].items():
            self.retries[k] += n
        for k, why in d["why"].items():
            for w, n in why.items():
                self.why[k][w] += n
        for k, n in d["errors"].items():
            self.errors[k] += n
        self.samples.extend(d["samples"][: max(0, 20 - len(self.samples))])

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


Payloads = dict[int, list[tuple[bytes, str]]]


def make_payloads(cfg: dict[str, Any], variants: int) -> Payloads:
    """(payload, digest) of each variant for each round: the cnn base (K_P = 2) perturbed, its header naming the
    round, as a device uploads it."""
    rounds = cfg["rounds"]
    fm = fed_model(cfg)
    base = take(fm.init_state(), fm.base_keys(cfg["kp"]))
    g = torch.Generator().manual_seed(0)
    noise = [{k: 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else torch.zeros_like(v)
              for k, v in base.items()} for _ in range(variants)]
    out: Payloads = {}
    for t in range(1, rounds + 1):
        ps = [encode({k: v + n[k] for k, v in base.items()}, model_id=fm.model_id, round=t) for n in noise]
        out[t] = [(p, hashlib.sha256(p).hexdigest()) for p in ps]
    return out


class Fleet:
    """Devices of one client process; times are unix times (comparable across processes)."""

    def __init__(self, payloads: Payloads, rounds: int, calls: Calls,
                 drawn: dict[int, frozenset[int] | None] | None = None) -> None:
        self.rounds = rounds
        self.drawn = drawn or {}  # round -> the slots the server samples (None: all), as the agent asks
        self.sessions_of_drawn_only = False  # a device never drawn holds no MQTT session
        self.quiet_s = 300.0  # a waiting device asks for its task again after this long without a message
        self.calls = calls
        self.payloads = payloads
        self.payload_bytes = len(payloads[1][0][0])
        self.download = True  # each round's base, as a device fetches it before training
        self.enrolled: list[float] = []  # time each enrolment was answered
        self.sessions: list[MqttSession] = []
        self.done: dict[int, list[float]] = defaultdict(list)  # round -> times its updates were accepted
        self.tasks_at: dict[int, list[float]] = defaultdict(list)  # round -> times tasks arrived
        self.ledger: list[tuple[str, int, str]] = []  # (device, round, digest) the server said it holds
        self.stage: dict[int, str] = {}  # device -> where it is (enrol, session, rN:task, rN:send, done, failed ...)

    async def enrol(self, client: httpx.AsyncClient, i: int) -> Enrolment:
        body = {"federation": FED, "enrol_secret": ENROL_SECRET, "profile": "raspberry-pi-4", "name": f"v{i}",
                "index": i, "nonce": secrets.token_hex(16), "n_samples": 4}
        # a device keeps enrolling while the server says "try again" (503: a broker's provisioning was slow)
        r = await call(client, self.calls, "enrol", "POST", f"{API_PREFIX}/devices", json=body, attempts=30)
        self.enrolled.append(time.time())
        return Enrolment.model_validate_json(r.content)

    async def session(self, enr: Enrolment) -> MqttSession:
        u = urlsplit(enr.broker_url)
        status = json.dumps({"device_id": enr.device_id, "state": "offline"}).encode()
        host, port = u.hostname or "127.0.0.1", u.port or 1883
        nodes = os.environ.get(NODES_ENV)
        if nodes:  # --mqtt-direct: the devices spread over the nodes by index, as DNS round-robin would
            host, _, p = nodes.split(",")[enr.index % len(nodes.split(","))].rpartition(":")
            port = int(p)
        m = MqttSession(host, port, enr.mqtt_client_id or mqtt_client_id(enr.device_id), enr.mqtt_username,
                        enr.mqtt_password, will=(status_topic(FED, enr.device_id), status),
                        local_host=f"127.0.0.{2 + enr.index % 16}" if host.startswith("127.") else None)
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
        try:
            await self._device(client, i, gate)
            self.stage[i] = "done"
        except BaseException as e:
            self.stage[i] = f"failed at {self.stage.get(i)}: {type(e).__name__}: {e}"[:200]
            raise

    def progress(self) -> dict[str, Any]:
        """Where the devices are now (a run cut short still says which were late, and where)."""
        counts: dict[str, int] = defaultdict(int)
        for st in self.stage.values():
            counts[st if not st.startswith("failed") else st[:80]] += 1
        # the devices furthest behind, by round number ("r10" sorts before "r2" as text), then task before send
        behind = sorted((int(st[1:st.index(":")]), st.endswith(":send"), st, i)
                        for i, st in self.stage.items() if st.startswith("r"))
        return {"t": time.time(), "stages": dict(counts), "enrolled": len(self.enrolled),
                "done": {t: len(v) for t, v in self.done.items()}, "errors": dict(self.calls.errors),
                "retries": dict(self.calls.retries), "error_samples": self.calls.samples,
                "furthest_behind": [f"device {i}: {st}" for _, _, st, i in behind[:20]]}

    async def _device(self, client: httpx.AsyncClient, i: int, gate: asyncio.Semaphore) -> None:
        self.stage[i] = "enrol"
        async with gate:
            enr = await self.enrol(client, i)
        slot = enr.index  # the server's: where rounds sample, it draws a free slot itself (not the one asked)
        if self.sessions_of_drawn_only and all(
                d is not None and slot not in d for d in (self.drawn.get(t) for t in range(1, self.rounds + 1))):
            self.stage[i] = "asleep"
            return  # never drawn: enrolled, then asleep (no broker session), as a phone that checks in rarely
        self.stage[i] = "session"
        m = await self.session(enr)
        auth = {"Authorization": f"Bearer {enr.token}"}
        for t in range(1, self.rounds + 1):
            drawn = self.drawn.get(t)
            if drawn is not None and slot not in drawn:  # not drawn: nothing to ask or send this round
                continue
            self.stage[i] = f"r{t}:task"
            task, asked = await self.wait_task(m, t, client, auth)
            self.tasks_at[t].append(time.time())
            self.stage[i] = f"r{t}:send"
            async with gate:  # as an agent does: the server's word on its task before acting on it, then the base
                if not asked:  # a task from MQTT: asked once over HTTP (one from HTTP already is the server's word)
                    await call(client, self.calls, "get_task", "GET", f"{API_PREFIX}/rounds/current/task",
                               headers=auth)
                if task.base is not None and self.download:
                    await call(client, self.calls, "get_base", "GET", f"{API_PREFIX}/blobs/{task.base}", headers=auth,
                               discard=True)
                payload, digest = self.payloads[t][i % len(self.payloads[t])]
                await call(client, self.calls, "put_blob", "PUT", f"{API_PREFIX}/blobs/{digest}", content=payload,
                           headers={**auth, "Content-Type": "application/octet-stream"})
                await call(client, self.calls, "post_update", "POST", f"{API_PREFIX}/rounds/{t}/updates",
                           json={"digest": digest, "n_samples": 4}, headers=auth)
            self.ledger.append((enr.device_id, t, digest))  # accepted, now or by an earlier try
            self.done[t].append(time.time())

    async def wait_task(self, m: MqttSession, t: int, client: httpx.AsyncClient,
                        auth: dict[str, str]) -> tuple[Task, bool]:
        """The task of round ``t``: as the agent does, asked over HTTP once subscribed (a retained task may never
        come: RabbitMQ keeps them per node) and again at a round bell of round ``t`` or later, and whenever MQTT is
        quiet for ``quiet_s``; else from MQTT. (Before stop 27 it asked every 30 s of quiet, bells or not: with
        thousands of devices waiting through a long enrolment, a hundred requests a second the agent never makes.)"""
        ask = True
        while True:
            if ask:
                try:  # as the agent does: a call cut by a replica's death is asked again (the next bell, or quiet)
                    r = await client.get(f"{API_PREFIX}/rounds/current/task", headers=auth)
                except httpx.HTTPError as e:
                    self.calls.why["ask_task"][type(e).__name__] += 1
                    await asyncio.sleep(1.0)
                    continue
                if r.status_code == 200:
                    task = Task.model_validate_json(r.content)
                    if task.round == t and not task.final:
                        return task, True
            try:
                topic, payload = await asyncio.wait_for(m.messages.get(), self.quiet_s)
            except TimeoutError:
                ask = True
                continue
            if not topic:
                self.calls.error("mqtt_session", f"{m.client_id}: session ended before the task of round {t}")
                raise RuntimeError("session ended")
            if topic.endswith("/task"):
                task = Task.model_validate_json(payload)
                if task.round == t and not task.final:
                    return task, False
                ask = False
            else:  # the round's bell: ask once the announced round is ours
                try:
                    ask = int(json.loads(payload).get("round", 0)) >= t
                except (ValueError, AttributeError, TypeError):
                    ask = True


async def watch(client: httpx.AsyncClient, admin: dict[str, str], rounds: int, stop: asyncio.Event,
                log: list[dict[str, Any]], progress: Path | None = None) -> None:
    """The federation's round and state once a second (admin), each change logged with its time (and written to
    ``progress/rounds.json``: a run cut short keeps its round log)."""
    last: tuple[int, str] | None = None
    while not stop.is_set():
        try:
            r = await client.get(f"{API_PREFIX}/federations/{FED}", headers=admin, timeout=30)
            info = r.json()
            now = (info["round"], info["state"])
            if now != last:
                log.append({"t": time.time(), "round": now[0], "state": now[1], "devices": info["devices"]})
                print(f"  [{time.strftime('%H:%M:%S')}] round {now[0]} {now[1]} ({info['devices']} devices)",
                      flush=True)
                if progress is not None:
                    (progress / "rounds.json").write_text(json.dumps(log, indent=1))
                last = now
            if now[0] >= rounds and now[1] in ("published", "finished"):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


def write_progress(fleet: Fleet, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(fleet.progress(), indent=1))
    tmp.replace(path)  # a reader never sees half a file


async def report_progress(fleet: Fleet, path: Path, every_s: float = 30.0) -> None:
    """``fleet.progress()`` written to ``path`` every ``every_s``, until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        write_progress(fleet, path)


async def run_slice(url: str, rounds: int, payloads: Payloads, lo: int, hi: int, connections: int,
                    download: bool, drawn: dict[int, frozenset[int] | None], drawn_only: bool,
                    progress: Path | None = None) -> dict[str, Any]:
    """Devices ``lo``..``hi - 1`` in this process; what they measured (and, with ``progress``, where they are,
    written to ``progress/devices-LO.json`` every 30 s while they run)."""
    calls = Calls()
    (fleet := Fleet(payloads, rounds, calls, drawn)).download = download
    fleet.sessions_of_drawn_only = drawn_only
    k = max(1, connections // 50)  # pools of 50: httpcore's pool costs O(requests x connections) per response
    limits = httpx.Limits(max_connections=connections // k, max_keepalive_connections=connections // k)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(
            base_url=url, limits=limits, timeout=httpx.Timeout(900, connect=60))) for _ in range(k)]
        gate = asyncio.Semaphore(connections)
        where = None if progress is None else progress / f"devices-{lo}.json"
        reporter = None if where is None else asyncio.create_task(report_progress(fleet, where))
        results = await asyncio.gather(*(fleet.device(clients[i % k], i, gate) for i in range(lo, hi)),
                                       return_exceptions=True)
        if reporter is not None and where is not None:
            reporter.cancel()
            write_progress(fleet, where)  # the end state, however short the run
    for s in fleet.sessions:
        await s.close()
    failed = [r for r in results if isinstance(r, BaseException)]
    return {"calls": calls.export(), "enrolled": fleet.enrolled, "done": dict(fleet.done),
            "tasks_at": dict(fleet.tasks_at), "failures": len(failed), "ledger": fleet.ledger,
            "failure_samples": [repr(f)[:300] for f in failed[:5]], "payload_bytes": fleet.payload_bytes,
            "cpu_s": sum(resource.getrusage(resource.RUSAGE_SELF)[:2])}


def client_process(url: str, rounds: int, payloads: Payloads, lo: int, hi: int, connections: int, nice: int,
                   download: bool, drawn: dict[int, frozenset[int] | None], drawn_only: bool, q: Any,
                   progress: Path | None = None) -> None:
    raise_nofile()
    if nice:
        os.nice(nice)
    try:
        q.put(asyncio.run(run_slice(url, rounds, payloads, lo, hi, connections, download, drawn, drawn_only,
                                    progress)))
    except BaseException as e:
        q.put({"crashed": repr(e)[:500]})
        raise


async def kill_leaders(reps: Any, n: int, delay_s: float, log: list[dict[str, Any]], stop: asyncio.Event,
                       admin: dict[str, str], client: httpx.AsyncClient, *,
                       follower: bool = False) -> list[dict[str, Any]]:
    """In each of rounds 1..n, ``delay_s`` after it starts collecting: SIGKILL the federation's leader (uploads
    stream into it too: the balancer spreads them), time until another replica leads, restart the dead one.
    ``follower``: SIGKILL a replica that does not lead instead (uploads stream into it; the devices' calls in
    flight there fail and are retried through the balancer), and record that the leader stayed."""
    kills: list[dict[str, Any]] = []
    restarts = []
    for t in range(1, n + 1):
        while not stop.is_set():
            try:  # through the balancer: a 502 while a replica has just died is asked again
                info = (await client.get(f"{API_PREFIX}/federations/{FED}", headers=admin, timeout=30)).json()
            except (httpx.HTTPError, ValueError):
                await asyncio.sleep(0.2)
                continue
            if info["round"] > t or (info["round"] == t and info["state"] == "collecting"):
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(delay_s)
        leader, asked = None, time.time()
        while leader is None and time.time() - asked < 20:  # a busy replica may answer /metrics late
            leader = await asyncio.to_thread(reps.leader_of, FED)
        if leader is None:
            kills.append({"round": t, "error": "no replica said it led the federation (finished meanwhile?)"})
            continue
        if follower:
            victim = next(i for i in range(len(reps.servers)) if i != leader and reps.servers[i] is not None)
            reps.kill(victim)
            print(f"  round {t}: killed replica {victim} (leader {leader} kept)", flush=True)
            restarts.append(asyncio.create_task(asyncio.to_thread(reps.start, victim)))
            kills.append({"round": t, "killed": victim, "leader": leader, "follower": True,
                          "leader_after": await asyncio.to_thread(reps.leader_of, FED)})
            continue
        t0 = time.time()
        reps.kill(leader)
        new = None
        while new is None and time.time() - t0 < 120:
            new = await asyncio.to_thread(reps.leader_of, FED)
            if new is None:
                await asyncio.sleep(0.1)
        took = time.time() - t0
        print(f"  round {t}: killed leader {leader}; replica {new} leads after {took:.2f} s", flush=True)
        restarts.append(asyncio.create_task(asyncio.to_thread(reps.start, leader)))  # back, as a follower
        kills.append({"round": t, "killed": leader, "new_leader": new, "takeover_s": took})
    for r in restarts:
        await r
    return kills


async def run_fleet(url: str, admin_token: str, args: argparse.Namespace, calls: Calls,
                    reps: Any = None) -> dict[str, Any]:
    cfg = config_for(args.devices, args.rounds, own_data=args.own_data, participation=args.participation)
    payloads = make_payloads(cfg, args.variants)
    algo = fed_model(cfg).algorithm()
    drawn = {t: algo.sampled(t) for t in range(1, args.rounds + 1)}  # the server's draw, the same code
    admin = {"Authorization": f"Bearer {admin_token}"}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120)) as client:
        agg = {} if args.norm_multiple is None else {"aggregation": {"norm_multiple": args.norm_multiple}}
        r = await client.post(f"{API_PREFIX}/federations", headers=admin, json={
            "id": FED, "enrol_secret": ENROL_SECRET, "config": cfg, "quorum": 1.0, "deadline_s": args.deadline_s,
            **agg})
        r.raise_for_status()
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        n, k = args.devices, args.procs
        cuts = [n * j // k for j in range(k + 1)]
        t0 = time.time()
        procs = [ctx.Process(target=client_process, args=(url, args.rounds, payloads, cuts[j], cuts[j + 1],
                                                          max(1, args.connections // k), args.client_nice,
                                                          not args.no_download, drawn,
                                                          args.sessions == "drawn", q, args.progress))
                 for j in range(k)]
        for p in procs:
            p.start()
        log: list[dict[str, Any]] = []
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(client, admin, args.rounds, stop, log, args.progress))
        kills_n = args.kill_leader or args.kill_follower
        killer = (asyncio.create_task(kill_leaders(reps, kills_n, args.kill_delay_s, log, stop, admin, client,
                                                   follower=bool(args.kill_follower)))
                  if kills_n else None)
        parts = [await asyncio.to_thread(q.get) for _ in procs]
        with contextlib.suppress(TimeoutError):  # the last round closes after its last update
            await asyncio.wait_for(asyncio.shield(watcher), 300)
        stop.set()
        await watcher
        wall = time.time() - t0
        kills = await killer if killer is not None else []
        for p in procs:
            p.join(30)
        summary = (await client.get(f"{API_PREFIX}/federations/{FED}/metrics", headers=admin, timeout=300)).json()
    return {**_report(args, calls, parts, summary, log, t0, wall), "leader_kills": kills,
            "ledger": [e for p in parts for e in p.get("ledger", [])]}


def ledger_check(database_url: str, ledger: list[list[Any]]) -> dict[str, Any]:
    """The virtual devices' ledgers against the database (as the soak's check, bench/soak_ledger.py): every
    update a device was told the server holds has its row (else lost), no (round, device) has two rows (double
    counted), and every closed round's rows are what its close recorded taking."""
    from sqlalchemy import select, text

    from server.db import Round, Update, inputs_digest, make_engine
    from server.migrations import make_sessionmaker
    from server.settings import Settings

    engine = make_engine(Settings(database_url=database_url).resolved_database_url)
    try:
        with make_sessionmaker(engine)() as s:
            rows = list(s.execute(select(Update.device, Update.round, Update.digest).where(Update.federation == FED)))
            rounds = list(s.scalars(select(Round).where(Round.federation == FED)))
            size = (s.scalar(text("SELECT pg_database_size(current_database())"))
                    if engine.dialect.name == "postgresql" else None)
    finally:
        engine.dispose()
    have = {(d, t, g) for d, t, g in rows}
    per: dict[tuple[int, str], int] = defaultdict(int)
    for d, t, _ in rows:
        per[t, d] += 1
    mismatched = 0
    for r in rounds:
        if r.inputs is None:
            continue
        took = [(d, g) for d, t, g in rows if t == r.round]
        mismatched += int(len(took) != r.inputs or inputs_digest(took) != r.inputs_digest)
    return {"database_bytes": size, "ledger_entries": len(ledger), "rows": len(rows),
            "lost": sum(1 for e in ledger if tuple(e) not in have),
            "double_counted": sum(n - 1 for n in per.values() if n > 1),
            "unlogged": len(have - {tuple(e) for e in ledger}),
            "rounds_checked": sum(1 for r in rounds if r.inputs is not None), "inputs_mismatched": mismatched}


def _report(args: argparse.Namespace, calls: Calls, parts: list[dict[str, Any]], summary: dict[str, Any],
            log: list[dict[str, Any]], t0: float, wall: float) -> dict[str, Any]:
    enrolled: list[float] = []
    done: dict[int, list[float]] = defaultdict(list)
    tasks_at: dict[int, list[float]] = defaultdict(list)
    crashed = [p["crashed"] for p in parts if "crashed" in p]
    for p in parts:
        if "crashed" in p:
            continue
        calls.merge(p["calls"])
        enrolled += p["enrolled"]
        for t, xs in p["done"].items():
            done[int(t)] += xs
        for t, xs in p["tasks_at"].items():
            tasks_at[int(t)] += xs
    rounds = []
    for row in summary["rounds"]:
        t = row["round"]
        if t < 1:
            continue
        span = (max(done[t]) - min(tasks_at[t])) if done[t] and tasks_at[t] else None
        rounds.append({"round": t, "state": row["state"], "updates": row["updates"], "active": row["active"],
                       "wall_s": row["wall_s"], "deadline_s": args.deadline_s,
                       "closed_within_deadline": row["wall_s"] is not None and row["wall_s"] <= args.deadline_s,
                       "updates_per_s": len(done[t]) / span if span else None,
                       "first_task_to_last_update_s": span})
    enrol_span = max(enrolled) - t0 if enrolled else None
    return {"wall_s": wall, "enrolled": len(enrolled), "t0": t0, "enrol_end": max(enrolled, default=t0),
            "enrolments_per_s": len(enrolled) / enrol_span if enrol_span else None,
            "payload_bytes": next((p["payload_bytes"] for p in parts if "payload_bytes" in p), None),
            "device_failures": sum(p.get("failures", 0) for p in parts) + len(crashed),
            "device_failure_samples": [s for p in parts for s in p.get("failure_samples", [])][:5] + crashed,
            "client_cpu_s": sum(p.get("cpu_s", 0.0) for p in parts),
            "rounds": rounds, "states": [{**e, "t": e["t"] - t0} for e in log]}


def _extra(args: argparse.Namespace) -> dict[str, str]:
    """Server settings the arguments choose."""
    return {"PFL_PARTIAL_SUMS": "true"} if args.partial_sums else {}


def hook_calls(urls: list[str], token: str) -> int | None:
    """The broker's questions to the servers' hook, summed over the replicas (their /metrics, by route)."""
    total = 0
    for url in urls:
        try:
            text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=60).text
        except httpx.HTTPError:
            return None
        total += sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                     if line.startswith("pfl_http_request_duration_seconds_count{") and "/broker/hook" in line)
    return total


def _servers(args: argparse.Namespace, stack: ExitStack, tmp: Path, db: str | None,
             token: str) -> tuple[str, dict[str, int], Any]:
    """Start the broker and the server(s) the arguments ask for; (the URL devices use, the pids to sample)."""
    from server.balancer import start_haproxy, start_replicas
    from server.broker import free_port
    from server.rabbitmq import TokenKeys, start_cluster
    from server.services.broker_tokens import BrokerTokens

    pids: dict[str, int] = {}
    if args.broker == "rabbitmq":
        if args.replicas < 1 or db is None:
            raise SystemExit("--broker rabbitmq needs --replicas >= 1 and PostgreSQL (the hook is behind HAProxy)")
        hook = secrets.token_urlsafe(24)
        lb_port = free_port()
        # --broker-auth jwt: the nodes check the devices' tokens alone, the hook a second backend (its calls counted)
        keys = tmp / "broker-keys"
        tokens = (TokenKeys("pfl", BrokerTokens(keys).public_keys()) if args.broker_auth == "jwt" else None)
        cluster = start_cluster(tmp / "rabbitmq", args.broker_nodes,
                                f"http://127.0.0.1:{lb_port}/v1/broker/hook/{hook}", tokens=tokens,
                                hook_cache_s=args.hook_cache_s if args.broker_auth == "hook" else None)
        stack.callback(cluster.stop)
        mqtt_lb = free_port()
        addrs = [u.removeprefix("mqtt://") for u in cluster.mqtt_urls]
        # one HAProxy holds two descriptors per device: past the process's file limit it cannot front the fleet
        if not args.mqtt_direct and 2 * args.devices + 512 > resource.getrlimit(resource.RLIMIT_NOFILE)[1]:
            print(f"--mqtt-direct: {args.devices} devices need {2 * args.devices + 512} files in one HAProxy, "
                  f"above this machine's limit", flush=True)
            args.mqtt_direct = True
        if args.mqtt_direct:
            os.environ[NODES_ENV] = ",".join(addrs)
        else:
            lb = start_haproxy(tmp / "mqtt-lb", mqtt_lb, addrs, mode="tcp", maxconn=args.devices + 512)
            stack.callback(lb.stop)
        pids.update({f"broker{i}": p.pid for i, p in enumerate(cluster.procs)})
        env = server_env(tmp / "server", database_url=db, broker_url=None, admin_token=token, extra={
            **_extra(args), "PFL_BROKER_URL": cluster.mqtt_urls[0], "PFL_BROKER_HOOK_TOKEN": hook,
            "PFL_MQTT_USERNAME": ADMIN[0], "PFL_MQTT_PASSWORD": ADMIN[1],
            "PFL_PUBLIC_BROKER_URL": f"mqtt://127.0.0.1:{mqtt_lb}",
            **({"PFL_BROKER_TOKENS": "true", "PFL_BROKER_TOKEN_KEYS": str(keys)} if tokens is not None else {})})
        reps = start_replicas(tmp / "replicas", args.replicas, env, port=lb_port)
    else:
        broker_url, broker_pid = (stack.enter_context(mosquitto(tmp / "mosquitto"))
                                  if args.broker == "mosquitto" else (None, None))
        if broker_pid:
            pids["broker"] = broker_pid
        if args.replicas < 1:
            srv = server(tmp / "server", database_url=db, broker_url=broker_url, admin_token=token,
                         extra=_extra(args))
            stack.callback(srv.stop)
            pids["server"] = srv.proc.pid
            print(f"server {srv.url}, broker {broker_url or 'embedded'}, database {args.database}", flush=True)
            return srv.url, pids, None
        if db is None or broker_url is None:
            raise SystemExit("--replicas needs PostgreSQL and an external broker")
        reps = start_replicas(tmp / "replicas", args.replicas,
                              server_env(tmp / "server", database_url=db, broker_url=broker_url, admin_token=token,
                                         extra=_extra(args)))
    stack.callback(reps.stop)
    for i, r in enumerate(reps.servers):
        assert r is not None
        pids["server" if i == 0 else f"server{i}"] = r.proc.pid
    print(f"{args.replicas} replicas behind {reps.url}, broker {args.broker}, database {args.database}", flush=True)
    return reps.url, pids, reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--deadline-s", type=float, default=1800.0, help="each round's deadline")
    ap.add_argument("--variants", type=int, default=16, help="distinct payloads per round (disk: 1.8 MB each)")
    ap.add_argument("--connections", type=int, default=1000, help="HTTP connections (and calls in flight) at most")
    ap.add_argument("--database", default="postgresql", help="postgresql (a fresh database), sqlite, or a URL")
    ap.add_argument("--broker", default="mosquitto", choices=["mosquitto", "embedded", "rabbitmq"])
    ap.add_argument("--broker-nodes", type=int, default=2, help="--broker rabbitmq: the cluster's nodes")
    ap.add_argument("--broker-auth", default="hook", choices=["hook", "jwt"],
                    help="--broker rabbitmq: the nodes ask the servers' hook, or check the devices' tokens alone")
    ap.add_argument("--mqtt-direct", action="store_true",
                    help="--broker rabbitmq: devices connect to node (index mod nodes), no TCP balancer (automatic "
                         "where one HAProxy would need more files than the process may open)")
    ap.add_argument("--hook-cache-s", type=float, default=None,
                    help="--broker-auth hook: each node caches the hook's answers this long (auth_backend_cache)")
    ap.add_argument("--kill-leader", type=int, default=0, metavar="N",
                    help="SIGKILL the federation's leader in rounds 1..N (needs --replicas >= 2), restart it")
    ap.add_argument("--kill-follower", type=int, default=0, metavar="N",
                    help="SIGKILL a replica that does not lead in rounds 1..N while uploads stream in, restart it")
    ap.add_argument("--partial-sums", action="store_true", help="the servers fold partial sums (PFL_PARTIAL_SUMS)")
    ap.add_argument("--norm-multiple", type=float, default=None,
                    help="the federation's aggregation norm_multiple (unset: the server's default)")
    ap.add_argument("--kill-delay-s", type=float, default=3.0, help="how long into a round's collecting")
    ap.add_argument("--replicas", type=int, default=0,
                    help="N >= 1: N server processes behind HAProxy (PostgreSQL); 0: one server, no balancer")
    ap.add_argument("--procs", type=int, default=2, help="client processes the devices are spread over")
    ap.add_argument("--no-download", action="store_true", help="devices skip the GET of their task's base")
    ap.add_argument("--own-data", action="store_true",
                    help="devices bring their own data (partition 'device'): nothing dealt, up to 100,000 devices")
    ap.add_argument("--participation", type=float, default=1.0, help="the fraction the server samples per round")
    ap.add_argument("--sessions", choices=["all", "drawn"], default="all",
                    help="drawn: only devices drawn in some round hold an MQTT session (a process may hold at most "
                         "RLIMIT_NOFILE sockets: 20,000 here, so 100,000 connected devices need another machine)")
    ap.add_argument("--client-nice", type=int, default=0, help="niceness of the devices' processes")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    nofile = raise_nofile()
    out = args.out or Path(__file__).parent / "results" / f"fleet_load_{args.devices}.json"
    # where the run is, while it runs (the round log, each client process's devices by stage): read it when a run
    # is cut short, as its JSON is written only at the end
    args.progress = out.with_name(out.stem + ".progress")
    args.progress.mkdir(parents=True, exist_ok=True)
    calls = Calls()
    with tempfile.TemporaryDirectory(prefix="pfl-fleet-") as tmp, ExitStack() as stack:
        db = (stack.enter_context(postgres_db()) if args.database == "postgresql"
              else None if args.database == "sqlite" else args.database)
        token = secrets.token_urlsafe(24)
        url, pids, reps = _servers(args, stack, Path(tmp), db, token)
        with RssSampler(pids) as rss:
            cpu0 = {k: rss.cpu_s(k) for k in pids}
            res = asyncio.run(run_fleet(url, token, args, calls, reps))
            cpu: dict[str, float | None] = {f"{k}_cpu_s": rss.cpu_s(k) - cpu0[k] for k in pids}
        if reps is not None:
            res["broker_hook_calls"] = hook_calls([r.url for r in reps.servers if r is not None], token)
        enrol_cpu = rss.cpu_between(res["t0"], res["enrol_end"])
        cpu["server_cpu_ms_per_enrolment"] = enrol_cpu and 1e3 * enrol_cpu / max(1, res["enrolled"])
        entries = res.pop("ledger")
        if db is not None:  # before the database is dropped
            res["ledger_check"] = ledger_check(db, entries)
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "load_average_after": os.getloadavg(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "args": {k: str(v) for k, v in vars(args).items()}, "nofile": nofile, **res, **cpu,
        "errors": sum(calls.errors.values()), "error_samples": calls.samples,
        "calls": calls.summary(), "server_peak_rss_mb": rss.peak_main_mb.get("server"),
        "server_peak_rss_with_children_mb": rss.peak_mb.get("server"),
        "broker_peak_rss_mb": rss.peak_mb.get("broker"),
        "peak_rss_mb_by_process": dict(rss.peak_mb),  # each replica and broker node, with its children
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("states", "calls")}, indent=1))
    print(json.dumps(result["calls"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
