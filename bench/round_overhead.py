"""Round overhead of the real system: the `pfl-edge demo` federation (server + embedded MQTT broker + device
processes over loopback), per round its wall time (server: round opened -> closed) against the slowest device's
own compute in that round.

Runs the demo's defaults (6 devices of fleet 'mixed', 10 rounds, Fashion-MNIST pathological:2, cnn) for FedPer and
DisPFL, exactly as `pfl-edge demo` launches them (`edge_runtime.fleet.start_server` / `Federation`), and records:

* from the server: round opened/closed and every update's acceptance time (its SQLite database), per-device
  ``train_s``, ``bytes_up``, ``bytes_down`` (``GET /v1/federations/demo/metrics``);
* from each device's log (``-v``: one timestamped line per HTTP response): when its downloads, its metrics
  reports, its upload and its update post completed;
* from each device's state dir: when it wrote ``model.safetensors`` (its state after the round's
  ``device_round``, written before the upload is encoded; the file's mtime, polled every 50 ms so that each
  round's write is seen);
* CPU seconds (utime + stime from /proc/PID/stat, sampled every 50 ms) of the server process (which also runs the
  broker) and of every device process, per round window: how busy the 2 cores were.

"Compute" of a device in round t. FedPer: ``train_s`` (what the device reports: time in its trainer, i.e. local
training, and FedPer-FT's fine-tuning where there is one) plus the evaluation in round t's window: a FedPer
device takes the new base and evaluates round t-1's model on it before it trains round t. That evaluation is
``eval_s`` = (model saved) - (base downloaded) - ``train_s``: everything between the base download and the
state write that is not training (taking the base, the evaluation, writing the state; with the agent of commit
976e24b and before, also its metrics POST, which that agent sent before training; the current agent posts the
metrics of round t-1 after its round-t update). DisPFL: ``train_s`` only; its neighbourhood averaging,
evaluation, mask update (one dense-gradient batch) and encoding are reported as "post-train device work"
(``post_train_s``; not separable from the logs). ``device_work_s`` (base/neighbour downloads done -> update
accepted) is everything the device does in the round once its inputs are in; "system overhead" relates the round
to the busiest device's. Runs against whichever tree is first on sys.path (and launches server and devices from
it); the agents of 976e24b and after are both parsed. Writes bench/results/round_overhead.json.

    .venv/bin/python bench/round_overhead.py [--algorithms fedper,dispfl] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sqlite3
import statistics
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from device_profiles import get_fleet
from edge_runtime.fleet import DemoConfig, start_server
from pfl_edge.protocol import API_PREFIX

CORES = os.cpu_count() or 1
TICK = os.sysconf("SC_CLK_TCK")
LOG_RE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) httpx INFO HTTP Request: (\w+) (\S+) ")


def machine() -> str:
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {CORES} CPUs, Python {platform.python_version()}, torch {torch.__version__}"


# ------------------------------------------------------------------------------------------------ CPU sampling

def _cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14 and 15 of stat)
    except (OSError, IndexError, ValueError):
        return None


class CpuSampler:
    """(time, CPU seconds) of each watched pid, and every new mtime of each watched file, every ``period`` s, in a
    thread."""

    def __init__(self, period: float = 0.05) -> None:
        self.period = period
        self.pids: dict[str, int] = {}
        self.samples: dict[str, list[tuple[float, float]]] = {}
        self.files: dict[str, Path] = {}
        self.mtimes: dict[str, list[float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, name: str, pid: int) -> None:
        self.pids[name] = pid
        self.samples.setdefault(name, [])

    def watch_file(self, name: str, path: Path) -> None:
        self.files[name] = path
        self.mtimes.setdefault(name, [])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            for name, pid in list(self.pids.items()):
                c = _cpu_s(pid)
                if c is not None:
                    self.samples[name].append((now, c))
            for name, path in list(self.files.items()):
                try:
                    m = path.stat().st_mtime
                except OSError:
                    continue
                seen = self.mtimes[name]
                if not seen or seen[-1] != m:
                    seen.append(m)
            self._stop.wait(self.period)

    def cpu_between(self, name: str, a: float, b: float) -> float:
        """CPU seconds the process used in [a, b] (linear between samples; 0 outside its life)."""
        pts = self.samples.get(name, [])
        if not pts:
            return 0.0
        return _interp(pts, b) - _interp(pts, a)


def _interp(pts: list[tuple[float, float]], x: float) -> float:
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    lo, hi = 0, len(pts) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pts[mid][0] <= x:
            lo = mid
        else:
            hi = mid
    (t0, c0), (t1, c1) = pts[lo], pts[hi]
    return c0 + (c1 - c0) * (x - t0) / (t1 - t0) if t1 > t0 else c1


# ------------------------------------------------------------------------------------------------------ running

def lo_tx_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    return 0


def run_federation(cfg: DemoConfig, root: Path) -> dict[str, Any]:
    """The demo federation to its end (as run_demo launches it), with CPU sampling; raw records."""
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    profiles = get_fleet(cfg.fleet).assign(cfg.devices)
    fed = start_server(root, broker_url=cfg.broker_url, database_url=cfg.database_url)
    sampler = CpuSampler()
    sampler.watch("server", fed.server.pid)
    lo0 = lo_tx_bytes()
    t0 = time.time()
    try:
        fed.create("demo", cfg.federation_config(), profile_capacity=cfg.profile_capacity, deadline_s=cfg.deadline_s)
        sampler.start()
        for i, prof in enumerate(profiles):
            fed.start_device(i, prof.name, extra=[] if cfg.training_backend is None
                             else ["--training-backend", cfg.training_backend])
            sampler.watch(f"device-{i:02d}", fed.devices[i].pid)
            sampler.watch_file(f"device-{i:02d}", root / "devices" / f"device-{i:02d}" / "model.safetensors")
        children = {"server": import_root(fed.server.pid),
                    **{f"device-{i:02d}": import_root(p.pid) for i, p in enumerate(fed.devices)}}
        deadline = time.monotonic() + cfg.timeout_s
        while True:  # what run_demo's loop does, without the table: one status call a second
            info = fed.info()
            if info["state"] == "finished" and all(p.poll() is not None for p in fed.devices):
                break
            dead = [i for i, p in enumerate(fed.devices) if p.poll() not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"federation did not finish (dead devices {dead}); see {root}")
            time.sleep(1.0)
        metrics = fed.get(f"{API_PREFIX}/federations/demo/metrics")
        devices = fed.get(f"{API_PREFIX}/federations/demo/devices")
    finally:
        sampler.stop()
        fed.close()
    total_s = time.time() - t0
    lo_bytes = lo_tx_bytes() - lo0
    db = sqlite3.connect(root / "server" / "state.db")
    rounds = {r: {"opened_at": o, "closed_at": c, "active": a} for r, o, c, a in
              db.execute("select round, opened_at, closed_at, active from pfl_rounds where federation='demo'")}
    updates = [dict(zip(("id", "round", "device", "digest", "n_samples", "train_s", "bytes_down", "accepted_at",
                         "size"), row, strict=True)) for row in db.execute(
        "select u.id, u.round, u.device, u.digest, u.n_samples, u.train_s, u.bytes_down, u.accepted_at, b.size "
        "from pfl_updates u join pfl_blobs b on b.digest = u.digest where u.federation='demo' order by u.id")]
    db.close()
    names = {d["device_id"]: d["name"] for d in devices}
    logs = {name: parse_log(root / "devices" / f"{name}.log") for name in names.values()}
    return {"metrics": metrics, "devices": devices, "rounds": rounds, "updates": updates, "logs": logs,
            "names": names, "sampler": sampler, "total_s": total_s, "lo_tx_bytes": lo_bytes, "children": children}


def import_root(pid: int) -> str | None:
    """Where a ``python -m pfl_edge`` child imports pfl_edge from: its working directory (sys.path[0] under -m),
    else the first PYTHONPATH entry that holds it (else the installed package, reported as None)."""
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    path = [cwd, *env.get(b"PYTHONPATH", b"").decode().split(os.pathsep)]
    return next((str(Path(p).resolve()) for p in path if p and (Path(p) / "pfl_edge" / "__init__.py").exists()),
                None)


def parse_log(path: Path) -> list[tuple[float, str, str]]:
    """(completion time, method, path) of every HTTP request the device made, in order."""
    out = []
    for line in path.read_text().splitlines():
        m = LOG_RE.match(line)
        if m:
            ts = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((ts, m.group(2), m.group(3).split(API_PREFIX, 1)[-1]))
    return out


def device_rounds(log: list[tuple[float, str, str]]) -> dict[int, dict[str, Any]]:
    """Per round, the device's HTTP events of that round: everything after its previous update post (and the
    metrics posts right after it) up to this round's update post. Metrics posts that follow an update post
    directly are that round's ``metrics_after`` (DisPFL: round t's; the current agent's FedPer: round t-1's);
    ``metrics`` are those posted before the update (the agent of 976e24b and before: FedPer's of round t-1)."""
    out: dict[int, dict[str, Any]] = {}
    seg: list[tuple[float, str, str]] = []
    for ev in log:
        if ev[1] == "POST" and "/metrics" in ev[2] and out and not seg:
            out[max(out)].setdefault("metrics_after", []).append(ev[0])
            continue
        seg.append(ev)
        m = re.match(r"/rounds/(\d+)/updates", ev[2]) if ev[1] == "POST" else None
        if m:
            t = int(m.group(1))
            gets = [e[0] for e in seg if e[1] == "GET" and e[2].startswith("/blobs/")]
            mets = [e[0] for e in seg if e[1] == "POST" and "/metrics" in e[2]]
            puts = [e[0] for e in seg if e[1] == "PUT"]
            out[t] = {"gets": gets, "metrics": mets, "put": puts[-1] if puts else None, "post": ev[0]}
            seg = []
    return out


# ----------------------------------------------------------------------------------------------------- analysis

def analyse(raw: dict[str, Any], algorithm: str) -> dict[str, Any]:
    metrics = {r["round"]: r for r in raw["metrics"]["rounds"]}
    names = raw["names"]
    logs = {name: device_rounds(ev) for name, ev in raw["logs"].items()}
    sampler: CpuSampler = raw["sampler"]
    accepted = {(u["round"], names[u["device"]]): u["accepted_at"] for u in raw["updates"]}
    rows = []
    for t in sorted(r for r in raw["rounds"] if r >= 1):
        rnd = raw["rounds"][t]
        opened, closed = rnd["opened_at"], rnd["closed_at"]
        wall = closed - opened
        devs = []
        for dev_id, m in metrics[t]["devices"].items():
            name = names[dev_id]
            ev = logs[name].get(t)
            if ev is None or m.get("train_s") is None:
                continue
            train = m["train_s"]
            ev = {**ev, "gets": [g for g in ev["gets"] if g >= opened - 1e-3]}  # not the enrolment's download
            first_get = ev["gets"][0] if ev["gets"] else None
            last_get = ev["gets"][-1] if ev["gets"] else None
            start = last_get if last_get is not None else opened
            end = ev["put"] or ev["post"]
            # the state write of this round: after its inputs are in, before its upload
            saved = max((x for x in sampler.mtimes.get(name, []) if start < x <= end), default=None)
            eval_s = 0.0
            eval_log_s = None
            if algorithm != "dispfl":
                if ev["metrics"]:  # the agent of 976e24b: the metrics post of round t-1 before training
                    eval_log_s = ev["metrics"][-1] - start
                if saved is not None:
                    eval_s = max(0.0, saved - start - train)  # base taken, round t-1 evaluated, state written
                elif eval_log_s is not None:
                    eval_s = eval_log_s
            compute = train + eval_s
            devs.append({
                "device": name,
                "train_s": train,
                "eval_s": eval_s,
                "eval_log_s": eval_log_s,  # the previous script's FedPer evaluation (old agent only)
                "compute_s": compute,
                # opened -> its (first) download done: task prepared, MQTT delivery, first GET
                "start_lag_s": None if first_get is None else first_get - opened,
                "download_s": None if first_get is None else last_get - first_get,  # DisPFL: the other GETs
                # after the compute: FedPer encode + save + PUT + POST; DisPFL also averaging, evaluation and
                # mask update
                "post_train_s": ev["post"] - start - compute,
                "saved_after_s": None if saved is None else saved - start,
                # state written -> upload PUT done (encode, the agent's writes, PUT; the current agent also writes
                # what it deploys, as the DisPFL agent of 976e24b did)
                "upload_s": None if saved is None or ev["put"] is None else ev["put"] - saved,
                "post_s": None if ev["put"] is None else ev["post"] - ev["put"],  # the update POST
                # everything the device does once its inputs are downloaded, up to its update accepted
                "device_work_s": None if last_get is None else ev["post"] - last_get,
                "accepted_at": accepted.get((t, name)),
                "cpu_s": sampler.cpu_between(name, opened, closed),
            })
        slowest = max(devs, key=lambda d: d["compute_s"])
        busiest = max(devs, key=lambda d: d["device_work_s"] or 0)
        last = max(devs, key=lambda d: d["accepted_at"] or 0)
        server_cpu = sampler.cpu_between("server", opened, closed)
        dev_cpu = sum(d["cpu_s"] for d in devs)
        rows.append({
            "round": t,
            "wall_s": wall,
            "slowest_device": slowest["device"],
            "slowest_train_s": slowest["train_s"],
            "slowest_eval_s": slowest["eval_s"],
            "slowest_eval_log_s": slowest["eval_log_s"],
            "slowest_compute_s": slowest["compute_s"],
            "overhead_s": wall - slowest["compute_s"],
            "overhead_pct": 100 * (wall - slowest["compute_s"]) / slowest["compute_s"],
            "slowest_device_work_s": busiest["device_work_s"],
            "system_overhead_pct": 100 * (wall - busiest["device_work_s"]) / busiest["device_work_s"],
            "last_device": last["device"],
            "last": {k: last[k] for k in ("train_s", "eval_s", "start_lag_s", "download_s", "post_train_s",
                                           "upload_s", "post_s", "device_work_s")},
            # the last update accepted -> round closed: the server's close (FedPer: average, encode, store)
            "close_s": closed - max(d["accepted_at"] for d in devs),
            "server_cpu_s": server_cpu,
            "devices_cpu_s": dev_cpu,
            "cpu_utilisation": (server_cpu + dev_cpu) / (CORES * wall),
            "sum_compute_s": sum(d["compute_s"] for d in devs),
            "devices": devs,
        })
    steady = [r for r in rows if r["round"] >= 2] or rows  # round 1 also waits for devices to start up
    return {"rounds": rows,
            "median_overhead_pct": statistics.median(r["overhead_pct"] for r in rows),
            "median_overhead_pct_rounds_2_on": statistics.median(r["overhead_pct"] for r in steady),
            "median_system_overhead_pct_rounds_2_on": statistics.median(r["system_overhead_pct"] for r in steady),
            "median_wall_s_rounds_2_on": statistics.median(r["wall_s"] for r in steady),
            "median_overhead_s": statistics.median(r["overhead_s"] for r in rows),
            "median_wall_s": statistics.median(r["wall_s"] for r in rows),
            "median_cpu_utilisation": statistics.median(r["cpu_utilisation"] for r in rows),
            "median_close_s": statistics.median(r["close_s"] for r in rows),
            "median_start_lag_s": statistics.median(r["last"]["start_lag_s"] for r in rows),
            "median_post_train_s": statistics.median(r["last"]["post_train_s"] for r in rows),
            "total_s": raw["total_s"]}


def solo_compute(cfg: DemoConfig) -> list[dict[str, Any]]:
    """Each device's compute of one round measured alone in this process (1 thread, as a device runs): local
    training, evaluation, and for DisPFL the mask update and the payload encoding. The round a fleet of real
    devices (one per machine) would see, with no system cost, is the slowest of these."""
    try:
        from pfl_edge import algorithms  # noqa: F401
    except ImportError:  # the tree of commit 976e24b and before: the devices' rounds in pfl_edge.local
        return _solo_compute_local(cfg)
    from edge_runtime.data import load_local_data
    from edge_runtime.trainer import DeviceTrainer, device_clients
    from edge_runtime.training import TorchBackend
    from pfl_edge.algorithms import central, dispfl, get_algorithm, one_row
    from pfl_edge.codec import encode
    from pfl_edge.federation import FederationConfig, init_state
    from pfl_edge.train import unstack

    torch.set_num_threads(1)
    fed = FederationConfig.from_dict(cfg.federation_config())
    profiles = get_fleet(cfg.fleet).assign(cfg.devices)
    out = []
    for i in [0, *range(cfg.devices)]:  # device 0 twice: the first run warms up
        data = load_local_data(fed, i)
        dev = device_clients(fed, DeviceTrainer(data, TorchBackend(data.model)), i)
        algo = get_algorithm(fed, data.model, profiles[i].kp)
        state = algo.device_init(dev, init_state(fed, data.spec), profiles[i].density)
        row: dict[str, Any] = {"device": f"device-{i:02d}", "profile": profiles[i].name}
        t0 = time.perf_counter()
        if isinstance(algo, dispfl.DisPFL):
            st = dispfl.unpack(state)
            start = dispfl.start_models(st.weights, st.support, torch.ones(1, 1), st.masks)
            trained = dispfl.train_round(dev, start, st.masks, 2).stack
        else:
            trained = central.train_round(dev, one_row(state), 2).stack
        row["train_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        dev.trainer.evaluate(trained, dev.slots)
        row["eval_s"] = time.perf_counter() - t0
        if isinstance(algo, dispfl.DisPFL):
            t0 = time.perf_counter()
            dispfl.update_masks(dev, trained, st.masks, 2)
            encode(unstack(trained, 0), model_id="m", round=2, masks=dispfl.sent_masks(unstack(st.masks, 0)))
            row["mask_update_encode_s"] = time.perf_counter() - t0
        row["compute_s"] = row["train_s"] + row["eval_s"]
        row["device_work_s"] = row["compute_s"] + row.get("mask_update_encode_s", 0.0)
        out.append(row)
    return out[1:]


def _solo_compute_local(cfg: DemoConfig) -> list[dict[str, Any]]:
    """``solo_compute`` on the API of commit 976e24b (``pfl_edge.local``), as that commit's script measured it."""
    from pfl_edge.sim.config import SimConfig  # type: ignore[import-not-found]

    from pfl_edge import local  # type: ignore[attr-defined]

    torch.set_num_threads(1)
    sim = SimConfig.from_dict(cfg.federation_config())
    profiles = get_fleet(cfg.fleet).assign(cfg.devices)
    out = []
    for i in [0, *range(cfg.devices)]:  # device 0 twice: the first run warms up
        data = local.load_local_data(sim, i)
        init = local.init_state(sim, data.spec)
        row: dict[str, Any] = {"device": f"device-{i:02d}", "profile": profiles[i].name}
        masks = None
        if cfg.algorithm == "dispfl":
            init, masks = local.dispfl_init(data, sim, i, profiles[i].density, init)
        t0 = time.perf_counter()
        trained, _, _ = local.train_local(data, init, sim, 2, i, masks=masks)
        row["train_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        local.evaluate_local(data, trained)
        row["eval_s"] = time.perf_counter() - t0
        if masks is not None:
            t0 = time.perf_counter()
            w, m = local.dispfl_update_mask(data, trained, masks, sim, 2, i)
            local.dispfl_payload(w, m, data.spec, 2)
            row["mask_update_encode_s"] = time.perf_counter() - t0
        row["compute_s"] = row["train_s"] + row["eval_s"]
        row["device_work_s"] = row["compute_s"] + row.get("mask_update_encode_s", 0.0)
        out.append(row)
    return out[1:]


def code_info() -> dict[str, Any]:
    """Which tree this process runs (and so launches: the children inherit its PYTHONPATH and working dir)."""
    import pfl_edge
    import server

    root = Path(pfl_edge.__file__).resolve().parents[1]
    rev = os.popen(f"git -C {root} rev-parse --short HEAD 2>/dev/null").read().strip()
    dirty = os.popen(f"git -C {root} status --porcelain --untracked-files=no 2>/dev/null").read().strip()
    return {"root": str(root), "rev": rev + (" + uncommitted changes" if dirty else ""),
            "pfl_edge": pfl_edge.__file__, "server": server.__file__}


def print_rows(algo: str, res: dict[str, Any]) -> None:
    print(f"\n{algo}: round  wall s  slowest compute s (train+eval)  overhead %  close s  start lag s  "
          f"post-train s  CPU util")
    for r in res["rounds"]:
        print(f"{r['round']:>5} {r['wall_s']:>7.2f} {r['slowest_compute_s']:>8.2f} ({r['slowest_train_s']:.2f}+"
              f"{r['slowest_eval_s']:.2f}) {r['overhead_pct']:>8.1f} {r['close_s']:>8.3f} "
              f"{r['last']['start_lag_s']:>8.3f} {r['last']['post_train_s']:>8.3f} {r['cpu_utilisation']:>7.2f}")
    print(f"median overhead {res['median_overhead_pct']:.1f} % ({res['median_overhead_s']:.2f} s of "
          f"{res['median_wall_s']:.2f} s); rounds 2+: {res['median_overhead_pct_rounds_2_on']:.1f} %, system only "
          f"(beyond all device work) {res['median_system_overhead_pct_rounds_2_on']:.1f} %", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithms", default="fedper,dispfl")
    ap.add_argument("--devices", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="3 rounds: a smoke run")
    ap.add_argument("--training-backend", default="torch", choices=["torch", "profile"],
                    help="as pfl-edge demo: torch (its default) or each device's profile's backend")
    ap.add_argument("--runs", type=Path, default=Path("runs/bench-round-overhead"), help="run folders")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "round_overhead.json")
    args = ap.parse_args()
    rounds = 3 if args.quick else args.rounds
    result: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_average_start": os.getloadavg(),
        "code": code_info(),
        "compute": "FedPer: train_s + eval_s, eval_s = (model.safetensors written) - (base downloaded) - train_s "
                   "(the evaluation of round t-1 on the new base, in round t's window; with the agent of 976e24b "
                   "also its metrics POST); DisPFL: train_s",
        "runs": {},
    }
    for algo in args.algorithms.split(","):
        cfg = DemoConfig(devices=args.devices, rounds=rounds, algorithm=algo, out=str(args.runs / algo), live=False,
                         training_backend=None if args.training_backend == "profile" else args.training_backend)
        raw = run_federation(cfg, args.runs / algo)
        res = analyse(raw, algo)
        print_rows(algo, res)
        solo = solo_compute(cfg)
        steady = [r for r in res["rounds"] if r["round"] >= 2] or res["rounds"]
        fed_train = {d["device"]: statistics.median(x["train_s"] for r in steady for x in r["devices"]
                                                    if x["device"] == d["device"]) for d in solo}
        res["solo"] = {
            "devices": solo,
            "slowest_compute_s": max(d["compute_s"] for d in solo),
            "slowest_device_work_s": max(d["device_work_s"] for d in solo),
            "sum_device_work_s": sum(d["device_work_s"] for d in solo),
            # CPU-bound floor of a round here: every device's work shared over the cores
            "cpu_floor_s": sum(d["device_work_s"] for d in solo) / CORES,
            # how much the federation's train_s is stretched by sharing the cores
            "train_stretch": statistics.median(fed_train[d["device"]] / d["train_s"] for d in solo),
        }
        print(f"alone: slowest compute {res['solo']['slowest_compute_s']:.2f} s, slowest device work "
              f"{res['solo']['slowest_device_work_s']:.2f} s, CPU floor on {CORES} cores "
              f"{res['solo']['cpu_floor_s']:.2f} s; train_s stretched x{res['solo']['train_stretch']:.2f} "
              f"in the federation", flush=True)
        stray = {k: v for k, v in raw["children"].items() if v != result["code"]["root"]}
        if stray:
            raise RuntimeError(f"children import another tree than {result['code']['root']}: {stray}")
        result["runs"][algo] = {
            "config": cfg.federation_config(),
            "children_import_root": raw["children"],
            "training_backend": args.training_backend,
            "profiles": [p.name for p in get_fleet(cfg.fleet).assign(cfg.devices)],
            "lo_tx_bytes": raw["lo_tx_bytes"],
            "metrics": raw["metrics"],
            "updates": raw["updates"],
            "names": raw["names"],
            **res,
        }
    result["load_average_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
