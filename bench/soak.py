"""The soak: real federations (FedPer and DisPFL, the small cnn on Fashion-MNIST with few samples per device) run
for ``--minutes`` while faults are injected, then a ledger check proves that no accepted update was lost or
counted twice (``bench/soak_ledger.py``).

Network: the server, its broker (a private Mosquitto, or the server's embedded one) and a fault-injecting proxy
(``bench/fault_proxy.py``: added latency each way, a fraction of connections reset mid-transfer) live in one
network namespace; every device in its own, joined to the server's by a veth link with a ``tc tbf`` bandwidth
limit (``bench/netns.py``). Devices reach the server and the broker only through the proxy.

Faults (random, mean gap ``--fault-every``; or a fixed ``schedule``): ``device_kill`` (SIGKILL, restarted on the
same state dir 0.5-5 s later), ``server_kill`` (SIGKILL, restarted on the same data dir; with the embedded
broker this is also a broker kill), ``broker_kill`` (SIGKILL of Mosquitto, no persistence: its sessions and
retained messages are gone), ``partition`` (one device's link, or every link, down for ``--partition-s``),
``blackhole`` (the same, silent: links up, every packet dropped),
``throttle`` (one device's link at ``--throttle-rate`` for 30 s). Afterwards everything is healed, the
federations run ``settle_rounds`` more rounds, devices get SIGTERM, the server stops, and the check runs.

    sudo .venv/bin/python bench/soak.py --minutes 30 --out bench/results/soak.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from netns import Netns, unavailable_reason
from soak_ledger import check
from soak_procs import Procs

__all__ = ["SoakConfig", "main", "run_soak"]

KINDS = ("device_kill", "server_kill", "broker_kill", "partition", "blackhole", "throttle")


@dataclass(frozen=True)
class SoakConfig:
    minutes: float = 30.0
    devices: int = 3  # per federation
    algorithms: tuple[str, ...] = ("fedper", "dispfl")
    broker: str = "mosquitto"  # or "embedded" (inside the server: killed with it)
    database: str = "sqlite"  # or "postgresql" (the host's, on 127.0.0.1:5432, a fresh schema of database test)
    seed: int = 0
    latency_ms: float = 200.0  # added each way by the proxy
    cut: float = 0.05  # fraction of proxied connections reset mid-transfer
    rate: str = "20mbit"  # every device link, always
    throttle_rate: str = "4mbit"
    throttle_s: float = 30.0
    partition_s: float = 60.0
    fault_every_s: float = 20.0  # mean gap between random faults
    kinds: tuple[str, ...] = KINDS
    schedule: tuple[tuple[float, str], ...] = ()  # (seconds after round 1 opened, kind): replaces random faults
    deadline_s: float = 30.0  # a round closes after this with the updates it has
    samples: int = 64  # training samples per device
    settle_rounds: int = 2
    settle_timeout_s: float = 300.0
    out: str = "bench/results/soak.json"
    workdir: str = "/tmp/pflsoak"
    prefix: str = "pflsk"

    def fed_config(self, algorithm: str) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "algorithm": algorithm, "model": "cnn", "dataset": "fashion-mnist", "partition": "pathological:2",
            "clients": self.devices, "rounds": 5000, "local_epochs": 1, "batch_size": 16, "lr": 0.01,
            "momentum": 0.9, "kp": 2, "samples_per_client": self.samples, "test_per_client": self.samples,
            "seed": self.seed, "workers": 1}
        if algorithm == "dispfl":
            cfg.update(density=0.5, topology=f"random:{min(2, self.devices - 1)}")
        return cfg


@dataclass
class Soak:
    cfg: SoakConfig
    procs: Procs
    rng: random.Random
    t0: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    later: list[tuple[float, str, Callable[[], None]]] = field(default_factory=list)  # restarts, heals
    partitioned: set[int] = field(default_factory=set)
    silent: bool = False  # the partition in force is a blackhole (link up, every packet dropped)
    down: set[str] = field(default_factory=set)  # "server", "broker", "device:<k>"

    def note(self, kind: str, **what: Any) -> None:
        self.events.append({"t": round(time.monotonic() - self.t0, 2), "kind": kind, **what})

    def after(self, s: float, what: str, fn: Callable[[], None]) -> None:
        self.later.append((time.monotonic() + s, what, fn))

    # ------------------------------------------------------------------------------------------------ faults
    def inject(self, kind: str) -> None:
        p, rng = self.procs, self.rng
        target: Any = None
        if kind == "device_kill":
            up = [k for k in range(len(p.devices)) if f"device:{k}" not in self.down]
            if not up:
                return
            k = rng.choice(up)
            target = p.devices[k].state.name
            p.kill_device(k)
            self.down.add(f"device:{k}")
            self.after(rng.uniform(0.5, 5.0), f"device:{k}", lambda: self._restart_device(k))
        elif kind == "server_kill" or (kind == "broker_kill" and self.cfg.broker == "embedded"):
            if "server" in self.down:
                return
            p.kill_server()
            self.down.add("server")
            self.after(rng.uniform(0.5, 3.0), "server", self._restart_server)
        elif kind == "broker_kill":
            if "broker" in self.down:
                return
            p.kill_broker()
            self.down.add("broker")
            self.after(rng.uniform(0.5, 5.0), "broker", self._restart_broker)
        elif kind in ("partition", "blackhole"):
            if self.partitioned:
                return
            links = list(range(len(p.devices))) if rng.random() < 0.3 else [rng.randrange(len(p.devices))]
            for g in links:
                (p.net.partition if kind == "partition" else p.net.blackhole)(g)
            self.partitioned.update(links)
            self.silent = kind == "blackhole"
            target = [p.devices[g].state.name for g in links]
            self.after(self.cfg.partition_s, "heal", self._heal)
            kind = f"{kind}_{'all' if len(links) > 1 else 'one'}"
        elif kind == "throttle":
            free = [g for g in range(len(p.devices)) if g not in self.partitioned]  # a blackhole is a tbf too
            if not free:
                return
            g = rng.choice(free)
            target = p.devices[g].state.name
            p.net.set_rate(g, self.cfg.throttle_rate)
            self.after(self.cfg.throttle_s, "unthrottle", lambda: self._unthrottle(g))
        self.faults[kind] += 1
        self.note(kind, target=target)

    def _restart_device(self, k: int) -> None:
        self.procs.start_device(k)
        self.down.discard(f"device:{k}")

    def _restart_server(self) -> None:
        self.procs.start_server(wait=False)
        self.down.discard("server")

    def _restart_broker(self) -> None:
        self.procs.start_broker()
        self.down.discard("broker")

    def _heal(self) -> None:
        if self.partitioned:
            self.note("heal", target=sorted(self.procs.devices[g].state.name for g in self.partitioned))
        for g in self.partitioned:
            (self.procs.net.restore if self.silent else self.procs.net.heal)(g)
        self.partitioned.clear()

    def _unthrottle(self, g: int) -> None:
        if not (self.silent and g in self.partitioned):  # a blackhole's end restores the rate itself
            self.procs.net.set_rate(g, self.cfg.rate)

    def tick(self) -> None:
        """Run what is due; restart whatever died on its own (counted: a finding, not a fault)."""
        now = time.monotonic()
        due = [x for x in self.later if x[0] <= now]
        self.later = [x for x in self.later if x[0] > now]
        for _, _, fn in sorted(due, key=lambda x: x[0]):
            fn()
        for what, code in self.procs.unexpected_exits(self.down):
            self.faults["unexpected_exit"] += 1
            self.note("unexpected_exit", process=what, code=code, log_tail=self.procs.log_tail(what))

    def flush(self) -> None:
        """Everything pending now: heal, restore, restart."""
        for _, _, fn in sorted(self.later, key=lambda x: x[0]):
            fn()
        self.later.clear()


def _faults(soak: Soak, until: float) -> None:
    cfg, rng = soak.cfg, soak.rng
    plan = sorted(cfg.schedule)
    kinds = [k for k in cfg.kinds if k != "broker_kill" or cfg.broker != "embedded"] or ["device_kill"]
    next_at = soak.t0 + (plan[0][0] if plan else rng.expovariate(1 / cfg.fault_every_s))
    while time.monotonic() < until:
        soak.tick()
        if time.monotonic() >= next_at:
            if plan:
                soak.inject(plan.pop(0)[1])
                next_at = soak.t0 + plan[0][0] if plan else float("inf")
            else:
                soak.inject(rng.choice(kinds))
                next_at = time.monotonic() + rng.expovariate(1 / cfg.fault_every_s)
        time.sleep(0.2)
    soak.flush()


def _settle(soak: Soak, feds: list[str]) -> dict[str, Any]:
    """After the faults: every federation runs ``settle_rounds`` more rounds and closes one round with an update
    of every device (every device caught up), or the timeout passes."""
    p, cfg = soak.procs, soak.cfg
    start = {f: p.info(f)["round"] for f in feds}
    deadline = time.monotonic() + cfg.settle_timeout_s
    now = dict(start)
    full: dict[str, int | None] = {f: None for f in feds}
    while time.monotonic() < deadline:
        soak.tick()
        now = {f: p.info(f)["round"] for f in feds}
        full = {f: p.full_round_after(f, start[f]) for f in feds}
        if all(now[f] >= start[f] + cfg.settle_rounds and full[f] is not None for f in feds):
            break
        time.sleep(0.5)
    settled = all(now[f] >= start[f] + cfg.settle_rounds and full[f] is not None for f in feds)
    return {"settled": settled, "rounds_at_heal": start, "rounds_at_stop": now, "first_full_round": full}


def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    """Run the soak; the report (also written to ``cfg.out``)."""
    why = unavailable_reason()
    if why is not None:
        raise SystemExit(f"the soak needs network namespaces: {why}")
    net = Netns(prefix=cfg.prefix, devices=cfg.devices * len(cfg.algorithms), rate=cfg.rate)
    procs = Procs(cfg, net, Path(cfg.workdir))
    soak = Soak(cfg, procs, random.Random(cfg.seed))
    t_start = time.monotonic()
    try:
        net.create()
        procs.start_all()
        feds = [procs.create_federation(a) for a in cfg.algorithms]
        procs.start_devices()
        procs.wait_round(feds, 1, timeout_s=300)
        soak.t0 = time.monotonic()
        soak.note("round 1 open")
        _faults(soak, soak.t0 + 60 * cfg.minutes)
        soak.note("healed")
        settle = _settle(soak, feds)
        soak.note("settled" if settle["settled"] else "settle timeout")
        procs.stop_devices()
        procs.stop_server()
        proxy = procs.stop_proxy()
    finally:
        procs.close()
        net.close()
    try:
        ledger = check(procs.database_url, procs.blob_dir, procs.state_dirs())
    finally:
        procs.drop_database()
    report = _report(cfg, soak, settle, proxy, ledger, time.monotonic() - t_start)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return report


def _report(cfg: SoakConfig, soak: Soak, settle: dict[str, Any], proxy: dict[str, Any], ledger: dict[str, Any],
            wall_s: float) -> dict[str, Any]:
    cuts = sum(r.get("cut", 0) for r in proxy.values())
    faults = {**soak.faults, "connections_cut": cuts}
    closed = {f: r["closed"] for f, r in ledger["rounds"].items()}
    ok = (ledger["lost"] == 0 and ledger["double_counted"] == 0 and ledger["inconsistent_devices"] == 0)
    return {"ok": ok, "config": asdict(cfg), "wall_s": round(wall_s, 1), "faults": faults, "rounds_closed": closed,
            "updates_accepted": ledger["updates_on_server"], "lost": ledger["lost"],
            "double_counted": ledger["double_counted"], "inconsistent_devices": ledger["inconsistent_devices"],
            "settle": settle, "proxy": proxy, "ledger": ledger, "events": soak.events}


def main(argv: list[str] | None = None) -> int:
    d = SoakConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=d.minutes)
    p.add_argument("--devices", type=int, default=d.devices, help="per federation")
    p.add_argument("--algorithms", default=",".join(d.algorithms))
    p.add_argument("--broker", choices=["mosquitto", "embedded"], default=d.broker)
    p.add_argument("--database", choices=["sqlite", "postgresql"], default=d.database)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--latency-ms", type=float, default=d.latency_ms)
    p.add_argument("--cut", type=float, default=d.cut)
    p.add_argument("--rate", default=d.rate)
    p.add_argument("--partition-s", type=float, default=d.partition_s)
    p.add_argument("--fault-every", type=float, default=d.fault_every_s, help="mean seconds between faults")
    p.add_argument("--kinds", default=",".join(d.kinds))
    p.add_argument("--schedule", default="", help="fixed faults instead of random ones: 5:device_kill,20:server_kill")
    p.add_argument("--deadline-s", type=float, default=d.deadline_s)
    p.add_argument("--samples", type=int, default=d.samples)
    p.add_argument("--settle-rounds", type=int, default=d.settle_rounds)
    p.add_argument("--settle-timeout", type=float, default=d.settle_timeout_s)
    p.add_argument("--workdir", default=d.workdir)
    p.add_argument("--prefix", default=d.prefix, help="of namespace and link names (<= 6 characters)")
    p.add_argument("--out", default=d.out)
    a = p.parse_args(argv)
    schedule = tuple((float(t), k) for t, k in (x.split(":") for x in a.schedule.split(",") if x))
    cfg = replace(d, minutes=a.minutes, devices=a.devices, algorithms=tuple(a.algorithms.split(",")),
                  broker=a.broker, database=a.database, seed=a.seed, latency_ms=a.latency_ms, cut=a.cut, rate=a.rate,
                  partition_s=a.partition_s, fault_every_s=a.fault_every, kinds=tuple(a.kinds.split(",")),
                  schedule=schedule, deadline_s=a.deadline_s, samples=a.samples, settle_rounds=a.settle_rounds,
                  settle_timeout_s=a.settle_timeout,
                  workdir=a.workdir, prefix=a.prefix, out=a.out)
    report = run_soak(cfg)
    keys = ("ok", "wall_s", "faults", "rounds_closed", "updates_accepted", "lost", "double_counted",
            "inconsistent_devices")
    print(json.dumps({k: report[k] for k in keys}, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

