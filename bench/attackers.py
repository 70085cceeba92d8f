"""Accuracy and round time of a running federation with and without a hostile device (issue 33): a real server
(``edge_runtime.fleet.start_server``, embedded broker, SQLite) and five device processes on Fashion-MNIST
(pathological:2, 200 training samples a slot), one federation at a time, as tests/integration/test_hostile_devices.py
runs them. Each honest device is ``pfl-edge client --training-backend torch --threads 1``; the attacker (slot 4,
named "attacker") is the same agent with one function monkeypatched. Scenarios:

* ``fedper-honest``: 5 honest devices (FedPer's baseline);
* ``fedper-4honest``: slots 0-3 only (``min_devices`` 4, slot 4 empty): the control, what the honest four reach when
  the fifth slot contributes nothing (a perfect defence's result);
* ``fedper-flip``: 4 honest + 1 attacker that sends ``start - 1000 * (trained - start)`` for the base it received
  (its step sign-flipped and scaled by 1000) and claims ``n_samples = 2**31 - 1`` in every update (the server is
  to count its slot's dealt share and clip its step to 3x the round's median update norm);
* ``dispfl-honest``: 5 honest devices (DisPFL's baseline, density 0.5, full topology);
* ``dispfl-4honest``: the control, slots 0-3 only;
* ``dispfl-pm20``: 4 honest + 1 attacker whose kept weights are +-20 (on its own masks: well formed, finite);
* ``dispfl-1e30``: the same with +-1e30;
* ``dispfl-1e30-late``: ``dispfl-1e30`` with the attacker enrolling after the honest devices' initial models.

In the attacked scenarios the attacker starts first and the honest devices once the server holds its enrolment
(DisPFL: and its initial model, the round-0 update every DisPFL device sends before round 1), so that runs do not
depend on who wins the race to enrol: with fewer than 3 other uploads there is no norm bound to judge its initial
model by, so it is accepted and the attack plays out in rounds 1.. . ``dispfl-1e30-late`` is the other order: its
initial model is refused against the honest ones, the agent exits on the 422, and enrolment (which waits for every
slot's initial model, with no deadline) never ends; recorded as "stuck-in-enrolment" ``--stuck-s`` after the
attacker exited.

Every federation: quorum 0.8 (a round closes on 4 of 5 updates, so a refused attacker does not hold it to its
deadline), deadline 300 s, lr 0.05, 6 rounds (``--quick``: 2). Recorded per scenario: per round the mean accuracy of
the honest devices (and of slots 0-3 alone: the same four devices in baseline and attack), the round's wall time
(server: opened -> closed), its updates, whether it closed at its deadline; from ``/devices`` the attacker's
``refused`` count and each honest device's ``dropped`` count; from the device logs any Traceback, skipped round or
neighbour left out; for FedPer, from the server's database and blobs (hard-linked aside while the run goes on, as
the server collects old rounds' blobs), every update's norm from the round's start model and counted samples, and
the step the server published (``base - start``) against the sample-weighted mean of the honest updates of the same
close (norm ratio and cosine). A scenario still running after
``--timeout-s`` is stopped and recorded as unfinished. Progress on stderr; the table on stdout; results in
bench/results/attackers.json (``--quick``: attackers_quick.json) and a plot beside it.

    .venv/bin/python bench/attackers.py [--quick] [--scenarios fedper-honest,fedper-flip,...] [--timeout-s 900]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(REPO / "tests" / "integration"))

from fedkit import BASE  # the integration tests' small federation config  # noqa: E402
from machine import cpu_model  # noqa: E402

from edge_runtime.fleet import Federation, start_server  # noqa: E402
from pfl_edge.protocol import API_PREFIX, quorum_updates  # noqa: E402

HONEST_SLOTS = 4  # slots 0-3 are honest in every scenario; slot 4 is the attacker, or a fifth honest device
ATTACKER_NAME = "attacker"
CLAIMED_SAMPLES = 2**31 - 1

# The attacker: the device agent (what ``pfl-edge client`` runs) with one thing monkeypatched.
#   values V: DisPFL's upload is its own masks with every kept weight +-V (the integration test's attacker)
#   flip S:   FedPer's upload is start - S * (trained - start), start = the base it received for the round; and
#             every UpdateRequest it posts claims n_samples 2**31 - 1
ATTACKER = """
import dataclasses
import logging
import sys

import torch

import edge_runtime.agent as agent_mod
from edge_runtime.agent import Agent, AgentConfig, install_signal_handlers
from pfl_edge.algorithms import central, dispfl
from pfl_edge.algorithms.base import Upload

MODE, VALUE = sys.argv[1], float(sys.argv[2])
log = logging.getLogger("attacker")

if MODE == "values":
    honest_upload = dispfl.DisPFL.device_upload

    def hostile(self, state):  # its own masks, every kept weight +-VALUE: well formed, finite, hostile
        up = honest_upload(self, state)
        g = torch.Generator().manual_seed(0)
        return Upload({k: torch.where(v != 0, VALUE * torch.sign(torch.randn(v.shape, generator=g)), v)
                       for k, v in up.tensors.items()}, up.masks)

    dispfl.DisPFL.device_upload = hostile
elif MODE == "flip":
    honest_round = central.FedPer.device_round

    def flipped(self, dev, state, received, t, **kw):  # trains honestly, sends its step sign-flipped, x VALUE
        out = honest_round(self, dev, state, received, t, **kw)
        if out.upload is None:
            return out
        start = received.base if received.base is not None else self.device_upload(state).tensors
        up = {k: start[k] - VALUE * (v - start[k]) for k, v in out.upload.tensors.items()}
        step = sum(float(((v - start[k]) ** 2).sum()) for k, v in out.upload.tensors.items()) ** 0.5
        log.warning("round %d: sending its step (norm %.4g) sign-flipped x%g, claiming %d samples", t, step,
                    VALUE, 2**31 - 1)
        return dataclasses.replace(out, upload=Upload(up, out.upload.masks))

    central.FedPer.device_round = flipped

    class Claimed(agent_mod.UpdateRequest):
        def __init__(self, **kw):
            super().__init__(**{**kw, "n_samples": 2**31 - 1})

    agent_mod.UpdateRequest = Claimed
else:
    raise SystemExit(f"unknown attack {MODE!r}")

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
cfg = AgentConfig(server=sys.argv[3], federation=sys.argv[4], enrol_secret=sys.argv[5], profile="phone-mid",
                  state_dir=sys.argv[6], name="attacker", partition_id=int(sys.argv[7]), threads=1,
                  training_backend="torch")
agent = Agent(cfg)
install_signal_handlers(agent)
sys.exit(agent.run())
"""


@dataclass(frozen=True)
class Scenario:
    name: str
    algorithm: str
    attack: str | None = None  # None (5 honest devices), "flip" (FedPer) or "values" (DisPFL)
    value: float = 0.0
    what: str = ""
    # "first": the attacker starts alone and the honest devices once the server holds its enrolment (and, for
    # DisPFL, its initial model: accepted, as nothing else is there to bound it); "late": the honest devices first,
    # the attacker once the server holds their 4 initial models (its own is then judged against them)
    order: str = "first"
    devices: int = 5  # processes; 4: slot 4 stays empty (the control: what leaving the attacker out would give)
    aggregation: dict[str, Any] | None = None  # FederationCreate.aggregation (None: the server's default rule)


SCENARIOS = {s.name: s for s in (
    Scenario("fedper-honest", "fedper", what="5 honest"),
    Scenario("fedper-4honest", "fedper", what="4 honest, slot 4 empty (min_devices 4)", devices=4),
    Scenario("fedper-flip", "fedper", "flip", 1000.0, "4 honest + step sign-flipped x1000, n_samples 2^31-1"),
    Scenario("fedper-flip-nm1", "fedper", "flip", 1000.0, "as fedper-flip, each update clipped to 1x the others' "
             "median norm", aggregation={"norm_multiple": 1.0}),
    Scenario("fedper-flip-trimmed", "fedper", "flip", 1000.0, "as fedper-flip, trimmed mean (0.2)",
             aggregation={"rule": "trimmed-mean"}),
    Scenario("fedper-flip-median", "fedper", "flip", 1000.0, "as fedper-flip, coordinate median",
             aggregation={"rule": "median"}),
    Scenario("fedper-honest-nm1", "fedper", what="5 honest, clipped to 1x the others' median norm",
             aggregation={"norm_multiple": 1.0}),
    Scenario("fedper-honest-trimmed", "fedper", what="5 honest, trimmed mean (0.2)",
             aggregation={"rule": "trimmed-mean"}),
    Scenario("dispfl-honest", "dispfl", what="5 honest"),
    Scenario("dispfl-4honest", "dispfl", what="4 honest, slot 4 empty (min_devices 4)", devices=4),
    Scenario("dispfl-pm20", "dispfl", "values", 20.0, "4 honest + kept weights +-20"),
    Scenario("dispfl-1e30", "dispfl", "values", 1e30, "4 honest + kept weights +-1e30"),
    Scenario("dispfl-1e30-late", "dispfl", "values", 1e30, "as dispfl-1e30, the attacker enrolling last", "late"),
)}


@dataclass(frozen=True)
class Settings:
    rounds_fedper: int = 6
    rounds_dispfl: int = 6
    deadline_s: float = 300.0
    quorum: float = 0.8
    timeout_s: float = 900.0
    stuck_s: float = 90.0
    workdir: str = ""
    keep: bool = True

    def config(self, algorithm: str) -> dict[str, Any]:
        cfg: dict[str, Any] = {**BASE, "algorithm": algorithm, "dataset": "fashion-mnist", "clients": 5,
                               "rounds": self.rounds_fedper if algorithm == "fedper" else self.rounds_dispfl,
                               "samples_per_client": 200, "lr": 0.05}
        if algorithm == "dispfl":
            cfg.update(density=0.5, topology="full")
        return cfg


def say(msg: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def start_attacker(fed: Federation, root: Path, sc: Scenario, slot: int) -> subprocess.Popen[bytes]:
    state = root / "devices" / ATTACKER_NAME
    state.mkdir(parents=True, exist_ok=True)
    log = open(root / "devices" / f"{ATTACKER_NAME}.log", "ab")  # noqa: SIM115 (the child owns it)
    return subprocess.Popen([sys.executable, "-c", ATTACKER, str(sc.attack), repr(sc.value), fed.url, fed.fed,
                             fed.secret, str(state), str(slot)], stdout=log, stderr=subprocess.STDOUT,
                            env=child_env(), cwd=REPO)


def wait_for(fed: Federation, sc: Scenario, what: str, ready: Callable[[list[dict[str, Any]]], bool],
             procs: list[subprocess.Popen[bytes]], timeout_s: float) -> bool:
    """Poll ``/devices`` until ``ready`` holds of it (True), or one of ``procs`` exits or the time runs out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if ready(fed.get(f"{API_PREFIX}/federations/{fed.fed}/devices")):
            say(f"{sc.name}: {what} after {time.monotonic() - t0:.0f} s")
            return True
        if any(p.poll() is not None for p in procs):
            say(f"{sc.name}: a process exited before {what}")
            return False
        time.sleep(0.5)
    say(f"{sc.name}: no {what} within {timeout_s:.0f} s; going on")
    return False


HEX64 = re.compile(r"^[0-9a-f]{64}$")


def keep_blobs(root: Path) -> None:
    """Hard-link every blob of the server's store into ``root/blobs-kept`` (the server collects old rounds' blobs;
    a link keeps the file for the step analysis after the run)."""
    kept = root / "blobs-kept"
    kept.mkdir(exist_ok=True)
    for p in (root / "server" / "blobs").glob("??/*"):
        if HEX64.match(p.name) and not (kept / p.name).exists():
            with contextlib.suppress(OSError):  # collected meanwhile
                os.link(p, kept / p.name)


def wait_end(fed: Federation, sc: Scenario, rounds: int, timeout_s: float, t0: float,
             attacker: subprocess.Popen[bytes] | None, stuck_s: float) -> str:
    """Poll until the federation has finished and every honest device has exited ("finished"), an honest device
    exits with an error ("crashed"), the federation is still enrolling ``stuck_s`` after the attacker exited
    ("stuck-in-enrolment": round 1 waits for every slot's initial model, with no deadline), or ``timeout_s``
    passes ("timeout")."""
    last = None
    attacker_gone: float | None = None
    while True:
        el = time.monotonic() - t0
        keep_blobs(fed.root)
        try:
            info = fed.info()
        except Exception as e:  # a server that stopped answering is a result too
            say(f"{sc.name}: status call failed: {e!r}")
            info = {"state": "?", "round": -1}
        now = (info["state"], info["round"])
        if now != last:
            say(f"{sc.name}: round {info['round']}/{rounds} {info['state']}  {el:.0f} s")
            last = now
        if info["state"] == "finished" and all(p.poll() is not None for p in fed.devices):
            return "finished"
        bad = [i for i, p in enumerate(fed.devices) if p.poll() not in (None, 0)]
        if bad:
            say(f"{sc.name}: honest device(s) {bad} exited with {[fed.devices[i].poll() for i in bad]}")
            return "crashed"
        if attacker is not None and attacker_gone is None and attacker.poll() is not None:
            attacker_gone = time.monotonic()
            say(f"{sc.name}: the attacker exited with {attacker.poll()} in round {info['round']}")
        if (attacker_gone is not None and info["round"] == 0 and info["state"] == "open"
                and time.monotonic() - attacker_gone > stuck_s):
            say(f"{sc.name}: still enrolling {stuck_s:.0f} s after the attacker exited; stopping it")
            return "stuck-in-enrolment"
        if el > timeout_s:
            say(f"{sc.name}: not finished after {timeout_s:.0f} s; stopping it")
            return "timeout"
        time.sleep(0.5)


def log_findings(path: Path) -> dict[str, Any]:
    text = path.read_text(errors="replace") if path.exists() else ""
    tb = text.count("Traceback")
    first_tb = None
    if tb:
        i = text.index("Traceback")
        first_tb = text[i:i + 1500]
    return {"tracebacks": tb, "first_traceback": first_tb,
            "skipped_rounds": len(re.findall(r"skipped \((?:diverged|bad_model)\)", text)),
            "left_out_lines": re.findall(r"round \d+: left out neighbour slot\(s\) \[[^\]]*\]", text),
            "closed_without_its_update": len(re.findall(r"closed without this device's update", text)),
            "errors": len(re.findall(r" ERROR ", text))}


def _size(a: dict[str, torch.Tensor]) -> float:
    return float(sum(float((v.double() ** 2).sum()) for v in a.values()) ** 0.5)


def server_steps(root: Path, fed_id: str, names: dict[str, str]) -> dict[str, Any]:
    """FedPer, from the server's SQLite database and blob dir: per round every update's norm from the round's
    start model (``delta_norm``, as the server computed it) and counted samples; the step the server published
    (its base minus the round's start), its norm, and beside it the honest step of the same round: the
    sample-weighted mean of the honest updates among those the close took (the first ``inputs`` accepted), what
    the server would have published without the attacker and without clipping. ``published_vs_honest_cos`` is
    the cosine between the two; None where a blob is gone."""
    from pfl_edge.codec import decode

    db = sqlite3.connect(root / "server" / "state.db")
    try:
        rounds = db.execute("select round, start_digest, base_digest, inputs from pfl_rounds where federation=? "
                            "order by round", (fed_id,)).fetchall()
        ups = db.execute("select round, device, n_samples, delta_norm, digest from pfl_updates where federation=? "
                         "order by round, id", (fed_id,)).fetchall()
    finally:
        db.close()
    def load(d: str | None) -> dict[str, torch.Tensor] | None:
        if not d:
            return None
        p = root / "blobs-kept" / d
        if not p.exists():
            p = root / "server" / "blobs" / d[:2] / d
        if not p.exists():
            return None
        return {k: torch.as_tensor(v).double() for k, v in decode(p.read_bytes(), max_bytes=1 << 30).tensors.items()}

    out = []
    for t, start_d, base_d, inputs in rounds:
        if t < 1:
            continue
        rows = [(names.get(dev, dev), n, dn, dg) for r, dev, n, dn, dg in ups if r == t]
        taken = rows[:inputs] if inputs is not None else rows
        upd = [{"device": dev, "n_samples": n, "delta_norm": dn, "in_close": i < len(taken)}
               for i, (dev, n, dn, _) in enumerate(rows)]
        norms = [u["delta_norm"] for u in upd if u["device"] != ATTACKER_NAME and u["delta_norm"] is not None]
        start, base = load(start_d), load(base_d)
        pub = {k: base[k] - start[k] for k in base} if start is not None and base is not None else None
        honest: dict[str, torch.Tensor] | None = None
        if start is not None:
            parts = [(load(dg), n) for dev, n, _, dg in taken if dev != ATTACKER_NAME]
            if parts and all(x is not None for x, _ in parts):
                total = sum(n for _, n in parts)
                keys = next(x for x, _ in parts if x is not None).keys()  # the base: what a device sends
                honest = {k: sum((x[k] - start[k]) * (n / total) for x, n in parts if x is not None) for k in keys}
        med = statistics.median(norms) if norms else None
        pn = _size(pub) if pub is not None else None
        hn = _size(honest) if honest is not None else None
        cos = None
        if pub is not None and honest is not None and pn and hn:
            cos = float(sum(float((pub[k] * honest[k]).sum()) for k in honest)) / (pn * hn)
        out.append({"round": t, "updates": upd, "attacker_in_close": any(
            u["device"] == ATTACKER_NAME and u["in_close"] for u in upd), "honest_median_norm": med,
            "published_step_norm": pn, "honest_mean_step_norm": hn,
            "published_over_honest_median": pn / med if pn is not None and med else None,
            "published_over_honest_step": pn / hn if pn is not None and hn else None,
            "published_vs_honest_cos": cos})
    return {"rounds": out}


def run_scenario(sc: Scenario, st: Settings, base_dir: Path) -> dict[str, Any]:
    cfg = st.config(sc.algorithm)
    rounds = int(cfg["rounds"])
    root = base_dir / sc.name
    if root.exists():
        shutil.rmtree(root)
    say(f"{sc.name}: {sc.algorithm}, {sc.what}, {rounds} rounds; run dir {root}")
    fed = start_server(root)
    attacker: subprocess.Popen[bytes] | None = None
    metrics: dict[str, Any] = {}
    devices: list[dict[str, Any]] = []
    t0 = time.monotonic()
    outcome = "error"
    initial = sc.algorithm == "dispfl"  # DisPFL: round 1 waits for every initial model

    def attacker_in(devs: list[dict[str, Any]]) -> bool:
        return any(d["name"] == ATTACKER_NAME and (not initial or d["last_round"] is not None) for d in devs)

    def honest_in(devs: list[dict[str, Any]]) -> bool:
        return sum(1 for d in devs if d["name"] != ATTACKER_NAME
                   and (not initial or d["last_round"] is not None)) >= HONEST_SLOTS

    try:
        fed.create("attackers", cfg, deadline_s=st.deadline_s, quorum=st.quorum,
                   **({"min_devices": sc.devices} if sc.devices < 5 else {}),
                   **({"aggregation": sc.aggregation} if sc.aggregation else {}))
        t0 = time.monotonic()
        if sc.attack and sc.order == "first":
            attacker = start_attacker(fed, root, sc, HONEST_SLOTS)
            wait_for(fed, sc, "the attacker's enrolment" + (" and initial model" if initial else ""), attacker_in,
                     [attacker], 300.0)
        for i in range(HONEST_SLOTS if sc.attack else sc.devices):
            fed.start_device(i, "phone-mid", threads=1, extra=["--training-backend", "torch"])
        if sc.attack and sc.order == "late":
            wait_for(fed, sc, "the honest devices' enrolments" + (" and initial models" if initial else ""),
                     honest_in, fed.devices, 300.0)
            attacker = start_attacker(fed, root, sc, HONEST_SLOTS)
        outcome = wait_end(fed, sc, rounds, st.timeout_s, t0, attacker, st.stuck_s)
        if attacker is not None and outcome == "finished":
            try:
                attacker.wait(30)  # it exits on its own once the federation finishes
            except subprocess.TimeoutExpired:
                say(f"{sc.name}: the attacker had not exited 30 s after the end; stopping it")
        keep_blobs(root)
        metrics = fed.get(f"{API_PREFIX}/federations/{fed.fed}/metrics")
        devices = fed.get(f"{API_PREFIX}/federations/{fed.fed}/devices")
    finally:
        took = time.monotonic() - t0
        honest_codes = [p.poll() for p in fed.devices]
        attacker_code = attacker.poll() if attacker is not None else None
        if attacker is not None and attacker.poll() is None:
            attacker.terminate()
            try:
                attacker.wait(15)
            except subprocess.TimeoutExpired:
                attacker.kill()
        fed.close()
    res = summarise(sc, st, cfg, root, metrics, devices, outcome, took, honest_codes, attacker_code)
    say(f"{sc.name}: {outcome} in {took:.0f} s; honest acc (slots 0-3) per round "
        f"{[None if a is None else round(a, 3) for a in res['acc_slots_0_3']]}")
    return res


def summarise(sc: Scenario, st: Settings, cfg: dict[str, Any], root: Path, metrics: dict[str, Any],
              devices: list[dict[str, Any]], outcome: str, took: float, honest_codes: list[int | None],
              attacker_code: int | None) -> dict[str, Any]:
    names = {d["device_id"]: d["name"] for d in devices}
    slot = {d["device_id"]: d["index"] for d in devices}
    honest = {d for d, n in names.items() if n != ATTACKER_NAME}
    first4 = {d for d in honest if slot[d] < HONEST_SLOTS}
    per_round = []
    for r in metrics.get("rounds", []):
        if r["round"] < 1:
            continue
        devs: dict[str, dict[str, Any]] = r.get("devices", {})

        def mean(ids: set[str], devs: dict[str, dict[str, Any]] = devs) -> float | None:
            accs = [devs[d]["accuracy"] for d in ids if d in devs and devs[d].get("accuracy") is not None]
            return sum(accs) / len(accs) if accs else None

        opened, closed, deadline = r.get("opened_at"), r.get("closed_at"), r.get("deadline")
        wall = closed - opened if opened is not None and closed is not None else None
        at_deadline = closed is not None and deadline is not None and closed >= deadline - 1.0
        att = [devs[d]["accuracy"] for d in devs if names.get(d) == ATTACKER_NAME]
        per_round.append({
            "round": r["round"], "state": r.get("state"), "updates": r.get("updates"), "active": r.get("active"),
            "quorum_updates": r.get("quorum_updates") if r.get("active") is None
            else quorum_updates(st.quorum, int(r["active"])),
            "wall_s": wall, "closed_at_deadline": at_deadline,
            "honest_mean_acc": mean(honest), "acc_slots_0_3": mean(first4),
            "honest_reporting": sum(1 for d in honest if d in devs),
            "attacker_acc": att[0] if att else None,
            "dropped": {names.get(d, d): m.get("dropped") for d, m in devs.items() if m.get("dropped")},
        })
    walls = [p["wall_s"] for p in per_round if p["wall_s"] is not None]
    closed = [r for r in metrics.get("rounds", []) if r["round"] >= 1 and r.get("closed_at") is not None]
    logs = {f"device-{i:02d}": log_findings(root / "devices" / f"device-{i:02d}.log")
            for i in range(len(honest_codes))}
    if sc.attack:
        logs[ATTACKER_NAME] = log_findings(root / "devices" / f"{ATTACKER_NAME}.log")
    res: dict[str, Any] = {
        "scenario": sc.name, "algorithm": sc.algorithm, "attack": sc.attack, "value": sc.value, "what": sc.what,
        "order": sc.order, "processes": sc.devices,
        "config": cfg, "deadline_s": st.deadline_s, "quorum": st.quorum, "outcome": outcome,
        "wall_s": round(took, 1), "rounds_closed": sum(1 for p in per_round if p["wall_s"] is not None),
        "mean_round_s": statistics.mean(walls) if walls else None,
        "median_round_s": statistics.median(walls) if walls else None,
        # round 1 holds each device's first download, data load and warm-up as well
        "mean_round_s_from_2": statistics.mean(walls[1:]) if len(walls) > 1 else None,
        "rounds_span_s": (max(r["closed_at"] for r in closed) - min(r["opened_at"] for r in closed)
                          if closed else None),
        "rounds_at_deadline": [p["round"] for p in per_round if p["closed_at_deadline"]],
        "acc_slots_0_3": [p["acc_slots_0_3"] for p in per_round],
        "honest_mean_acc": [p["honest_mean_acc"] for p in per_round],
        "rounds": per_round,
        "devices": [{k: d.get(k) for k in ("name", "index", "refused", "dropped", "last_round", "bytes_up",
                                           "bytes_down")} for d in devices],
        "attacker_refused": next((d["refused"] for d in devices if d["name"] == ATTACKER_NAME), None),
        "honest_refused": {d["name"]: d["refused"] for d in devices if d["name"] != ATTACKER_NAME},
        "honest_dropped": {d["name"]: d["dropped"] for d in devices if d["name"] != ATTACKER_NAME},
        "exit_codes": {**{f"device-{i:02d}": c for i, c in enumerate(honest_codes)},
                       **({ATTACKER_NAME: attacker_code} if sc.attack else {})},
        "logs": logs, "run_dir": str(root),
    }
    if sc.algorithm == "fedper" and (root / "server" / "state.db").exists():
        try:
            res["steps"] = server_steps(root, "attackers", names)
        except Exception as e:  # the step sizes are extra: never lose the run for them
            res["steps"] = {"error": repr(e)}
    return res


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[dict[str, Any]]) -> str:
    base = {r["algorithm"]: r for r in results if r["attack"] is None and r.get("processes", 5) == 5}
    n = max((len(r["acc_slots_0_3"]) for r in results), default=0)
    head = ["scenario", "outcome", *[f"r{i + 1}" for i in range(n)], "mean", "r1 s", "r2.. s", "x base", "at ddl",
            "att refused", "att exit", "dropped", "honest tb"]
    rows = [head]
    for r in results:
        accs = r["acc_slots_0_3"]
        good = [a for a in accs if a is not None]
        b = base.get(r["algorithm"])
        key = "mean_round_s_from_2"
        ratio = (r[key] / b[key] if b is not None and b is not r and r.get(key) and b.get(key) else None)
        r1 = next((p["wall_s"] for p in r["rounds"] if p["round"] == 1), None)
        tbs = sum(v["tracebacks"] for k, v in r["logs"].items() if k != ATTACKER_NAME)
        att_exit = r.get("exit_codes", {}).get(ATTACKER_NAME, "-")
        rows.append([r["scenario"], r["outcome"], *[fmt(a) for a in accs], *["" for _ in range(n - len(accs))],
                     fmt(sum(good) / len(good) if good else None), fmt(r1, ".1f"),
                     fmt(r.get(key), ".2f"), fmt(ratio, ".2f"),
                     ",".join(map(str, r["rounds_at_deadline"])) or "-",
                     "-" if r["attacker_refused"] is None else str(r["attacker_refused"]), str(att_exit),
                     str(sum(r["honest_dropped"].values())), str(tbs)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    out = "\n".join(lines)
    out += ("\n(accuracy: mean of slots 0-3, the honest devices present in every scenario; r1 s: round 1's wall "
            "time (first downloads and warm-up too); r2.. s: mean wall time of rounds 2..; x base: that over the same "
            "algorithm's 5-honest run's)")
    steps = [r for r in results if isinstance(r.get("steps"), dict) and r["steps"].get("rounds")]
    for r in steps:
        rs = r["steps"]["rounds"]
        out += (f"\n{r['scenario']} per round: published step / honest mean step of the same close (norms): "
                + " ".join(fmt(x["published_over_honest_step"], ".2f") for x in rs)
                + "; cosine: " + " ".join(fmt(x["published_vs_honest_cos"], ".2f") for x in rs)
                + "; attacker in the close: " + " ".join("y" if x["attacker_in_close"] else "n" for x in rs))
    return out


def plot(results: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    algos = sorted({r["algorithm"] for r in results})
    fig, axes = plt.subplots(1, len(algos), figsize=(5.5 * len(algos), 4), squeeze=False)
    for ax, algo in zip(axes[0], algos, strict=True):
        for r in results:
            if r["algorithm"] != algo:
                continue
            xs = [p["round"] for p in r["rounds"] if p["acc_slots_0_3"] is not None]
            ys = [p["acc_slots_0_3"] for p in r["rounds"] if p["acc_slots_0_3"] is not None]
            ax.plot(xs, ys, marker="o", label=f"{r['scenario']} ({r['outcome']})")
        ax.set_title(f"{algo}: mean accuracy of slots 0-3")
        ax.set_xlabel("round")
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_info() -> dict[str, Any]:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(), "loadavg": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 rounds each (a smoke run)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: " + ", ".join(SCENARIOS))
    p.add_argument("--rounds-fedper", type=int, default=None, help="default 6 (--quick: 2)")
    p.add_argument("--rounds-dispfl", type=int, default=None, help="default 6 (--quick: 2)")
    p.add_argument("--deadline-s", type=float, default=300.0)
    p.add_argument("--quorum", type=float, default=0.8)
    p.add_argument("--timeout-s", type=float, default=900.0, help="per scenario")
    p.add_argument("--stuck-s", type=float, default=90.0,
                   help="a federation still enrolling this long after the attacker exited is stopped")
    p.add_argument("--workdir", default="", help="run dirs (server and device logs) go here; default a temp dir")
    p.add_argument("--out", default="", help="default bench/results/attackers.json (--quick: attackers_quick.json)")
    a = p.parse_args(argv)
    names = [s for s in a.scenarios.split(",") if s]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; known: {list(SCENARIOS)}")
    r_default = 2 if a.quick else 6
    st = Settings(rounds_fedper=a.rounds_fedper or r_default, rounds_dispfl=a.rounds_dispfl or r_default,
                  deadline_s=a.deadline_s, quorum=a.quorum, timeout_s=a.timeout_s, stuck_s=a.stuck_s,
                  workdir=a.workdir)
    out = Path(a.out) if a.out else REPO / "bench" / "results" / ("attackers_quick.json" if a.quick
                                                                   else "attackers.json")
    base_dir = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="pfl-attackers-"))
    base_dir.mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC)
    mach = machine_info()
    results: list[dict[str, Any]] = []
    report: dict[str, Any] = {}
    for name in names:
        try:
            results.append(run_scenario(SCENARIOS[name], st, base_dir))
        except Exception as e:  # recorded; the other scenarios still run
            say(f"{name}: failed: {e!r}")
            results.append({"scenario": name, "algorithm": SCENARIOS[name].algorithm,
                            "attack": SCENARIOS[name].attack, "processes": SCENARIOS[name].devices,
                            "outcome": f"error: {e!r}", "acc_slots_0_3": [],
                            "honest_mean_acc": [], "rounds": [], "mean_round_s": None, "rounds_at_deadline": [],
                            "attacker_refused": None, "honest_dropped": {}, "logs": {}})
        args = argv if argv is not None else sys.argv[1:]
        report = {"command": " ".join([".venv/bin/python", "bench/attackers.py", *args]),
                  "date": started.isoformat(timespec="seconds"), "finished_at": datetime.now(UTC).isoformat(
                      timespec="seconds"), "machine": {**mach, "loadavg_end": os.getloadavg()},
                  "threads": {"device_threads": 1, "OMP_NUM_THREADS": 1, "MKL_NUM_THREADS": 1,
                              "server_OMP_NUM_THREADS": 1, "note": "each device process runs --threads 1 (torch "
                              "intra-op threads) with OMP_NUM_THREADS=1; the server process too has OMP 1"},
                  "settings": asdict(st), "scenarios": results}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str))  # after each scenario: a partial run is kept
    print(table(results))
    plot(results, out.with_suffix(".png"))
    say(f"wrote {out} (and {out.with_suffix('.png').name}); run dirs under {base_dir}")
    return 0 if all(r["outcome"] == "finished" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
