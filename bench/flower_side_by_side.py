"""pfl-edge's simulator against Flower's simulation engine and against the ceiling (plain PyTorch in two
single-thread processes), side by side in one run: seconds per round, peak memory, accuracy.

Workloads (Fashion-MNIST, ``pathological:4``, the ``cnn``, batch 32, SGD lr 0.01 momentum 0.9, seed 0, every
client trains and then evaluates its deployed model on its own test split in every round):

* **W1**: 10 clients x 6,000 samples, FedPer (K_P = 2: the last two blocks personal, never averaged), 2 local
  epochs, 5 rounds;
* **W2**: 100 clients x 200 samples, FedAvg, 1 epoch, 3 rounds;
* **W3**: 1,000 clients x 60 samples, FedAvg, 1 epoch, 3 rounds.

Systems, run one after another for each workload, each in its own process tree:

* **pfl-edge**: ``pfl_edge.sim.simulate(SimConfig(...), progress=False)`` with ``workers=2`` in a child process
  of this venv; its per-round ``wall_s``.
* **flower**: ``bench/flower_app.py`` in a venv of its own (``.bench-venvs/flower/`` at the repo root, made by
  this script when missing; Flower is never a dependency of pfl-edge): ``flwr.simulation.run_simulation`` with a
  ServerApp running the FedAvg strategy (every node trains and evaluates each round) and a ClientApp whose train
  and evaluate run the textbook PyTorch loop over pfl_edge's deal of the data, on Ray with 2 actors of 1 CPU each
  (``torch.set_num_threads(1)`` in the clients). FedPer: clients keep their personal blocks in ``context.state``
  and send only the base. The venv reaches the repo through ``PYTHONPATH``, so the clients use pfl_edge's exact
  model, partition and split. Each round is timed on the server, from ``configure_train`` to the end of
  ``aggregate_evaluate`` (round 1 includes starting Ray's actors and their loading of the data set).
* **ceiling**: the same textbook loop in two single-thread processes of this venv, half the clients each, no
  federation machinery; the parent averages the bases between training and evaluation (FedAvg / FedPer as
  above, so accuracy is comparable). A round's time is the slower process's train + evaluate time (averaging,
  the file hand-over and the parent's work are left out).

Memory: peak PSS (MiB) summed over the process tree of the system under test, sampled every 0.2 s from
``/proc/PID/smaps_rollup``: every descendant of the launched process(es), plus for Flower the processes started
after the launch whose command line holds the run's Ray temp dir (its session dir lies under it), and ``ray::``
processes started after the launch whose ``RAY_RAYLET_PID`` is one of those.

Reported per workload and system: s/round as the mean over rounds 2+ (the steady state) and over all rounds,
round 1 alone, peak PSS, mean client accuracy after the last round. Ratios: Flower s / pfl-edge s (how many times
faster pfl-edge is), Flower PSS / pfl-edge PSS, and the fraction of the ceiling pfl-edge reaches
(ceiling s / pfl-edge s; 1.0 = as fast as the plain loop). Results: ``bench/results/flower_side_by_side.json``
and a Markdown table on stdout; progress on stderr.

The Flower venv: ``python -m venv .bench-venvs/flower``, then ``pip install torch==2.13.0`` and ``pip install
"flwr[simulation]>=1.42,<1.43" numpy safetensors pydantic tqdm`` (the newest 1.x if no 1.42 release can be
installed; the JSON says which). Here pip's configuration resolves ``torch==2.13.0`` to a local CPU wheel;
elsewhere, to get the CPU build rather than the CUDA one from PyPI, pass ``--torch-index-url
https://download.pytorch.org/whl/cpu`` (that is ``pip install --index-url ...`` for torch alone). A finished
install is recorded in ``.bench-venvs/flower/installed.json``; delete the folder to reinstall.

    .venv/bin/python bench/flower_side_by_side.py [--workloads W1,W2,W3] [--systems pfl-edge,flower,ceiling]
        [--rounds N] [--quick] [--torch-index-url URL]

``--quick``: tiny workloads (W1 4 clients x 200 samples, 1 epoch; W2 10 x 40; W3 20 x 20; 2 rounds each) as a
smoke test, written to ``bench/out/tmp/flower_side_by_side_quick.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from machine import cpu_model

HERE = Path(__file__).resolve()
BENCH = HERE.parent
REPO = HERE.parents[1]
FLOWER_VENV = REPO / ".bench-venvs" / "flower"
FLOWER_PINNED = "flwr[simulation]>=1.42,<1.43"
FLOWER_FALLBACK = "flwr[simulation]>=1,<2"
FLOWER_EXTRAS = ["numpy", "safetensors", "pydantic", "tqdm"]  # what pfl_edge.federation / models / data import
TORCH = "torch==2.13.0"

# SimConfig keywords shared by every workload (pfl_edge's defaults, spelled out)
COMMON: dict[str, Any] = {"dataset": "fashion-mnist", "model": "cnn", "partition": "pathological:4", "lr": 0.01,
                          "momentum": 0.9, "batch_size": 32, "seed": 0}
WORKLOADS: dict[str, dict[str, Any]] = {
    "W1": {"algorithm": "fedper", "kp": 2, "clients": 10, "samples_per_client": 6000, "local_epochs": 2,
           "rounds": 5},
    "W2": {"algorithm": "fedavg", "clients": 100, "samples_per_client": 200, "local_epochs": 1, "rounds": 3},
    "W3": {"algorithm": "fedavg", "clients": 1000, "samples_per_client": 60, "local_epochs": 1, "rounds": 3},
    # pfl-edge alone (Flower has no DisPFL): the issue's "DisPFL with 1,000 clients at density 0.5 runs here"
    "D1": {"algorithm": "dispfl", "clients": 1000, "samples_per_client": 60, "local_epochs": 1, "rounds": 2,
           "density": 0.5},
}
ONLY: dict[str, tuple[str, ...]] = {"D1": ("pfl-edge",)}  # workloads that only some systems run
QUICK: dict[str, dict[str, Any]] = {
    "W1": {"clients": 4, "samples_per_client": 200, "local_epochs": 1, "rounds": 2},
    "W2": {"clients": 10, "samples_per_client": 40, "rounds": 2},
    "W3": {"clients": 20, "samples_per_client": 20, "rounds": 2},
    "D1": {"clients": 20, "samples_per_client": 20, "rounds": 2},
}
SYSTEMS = ("pfl-edge", "flower", "ceiling")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def workload_config(name: str, quick: bool, rounds: int | None) -> dict[str, Any]:
    """The workload's SimConfig keywords."""
    cfg = {**COMMON, **WORKLOADS[name], **(QUICK[name] if quick else {})}
    if rounds is not None:
        cfg["rounds"] = rounds
    return cfg


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(BENCH)])
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------------ memory: peak PSS

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in clock ticks since boot) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[1]), int(rest[19])
    except (OSError, IndexError, ValueError):
        return None


def read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


class PssSampler(threading.Thread):
    """Every ``interval`` s, the summed PSS of the system under test: the descendants of ``roots`` (a process
    once seen stays counted while it lives, even if reparented) and, with a ``marker``, processes started since
    the launch whose command line holds it, and ``ray::`` processes whose ``RAY_RAYLET_PID`` is counted."""

    def __init__(self, roots: list[int], marker: str | None = None, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.roots = list(roots)
        self.marker = marker
        self.interval = interval
        self.since = min((s[1] for r in roots if (s := proc_stat(r)) is not None), default=0)
        self.members: dict[int, int] = {}  # pid -> start ticks (so a reused pid is not counted)
        self.checked: dict[int, int] = {}  # pid -> start ticks of processes looked at and left out
        self.peak_kib = 0
        self.peak_procs = 0
        self.samples = 0
        self._done = threading.Event()

    def add_roots(self, pids: list[int]) -> None:
        self.roots.extend(pids)

    def sample(self) -> None:
        procs: dict[int, tuple[int, int]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = proc_stat(int(name))
                if st is not None:
                    procs[int(name)] = st
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        live = {p for p, s in self.members.items() if p in procs and procs[p][1] == s}
        live.update(r for r in self.roots if r in procs)
        if self.marker is not None:
            for pid, (_, start) in procs.items():
                if pid in live or start < self.since or self.checked.get(pid) == start:
                    continue
                cmd = read_text(f"/proc/{pid}/cmdline")
                if self.marker in cmd:
                    live.add(pid)
                elif cmd.startswith("ray::"):
                    env = read_text(f"/proc/{pid}/environ").split()
                    raylet = next((e.split("=", 1)[1] for e in env if e.startswith("RAY_RAYLET_PID=")), "")
                    if raylet.isdigit() and int(raylet) in live | set(self.members):
                        live.add(pid)
                    else:
                        self.checked[pid] = start
                else:
                    self.checked[pid] = start
        stack = list(live)
        while stack:
            for c in children.get(stack.pop(), []):
                if c not in live:
                    live.add(c)
                    stack.append(c)
        self.members = {p: procs[p][1] for p in live}
        total = sum(pss_kib(p) for p in live)
        self.samples += 1
        if total > self.peak_kib:
            self.peak_kib, self.peak_procs = total, len(live)

    def run(self) -> None:
        while not self._done.is_set():
            self.sample()
            self._done.wait(self.interval)

    def stop(self) -> dict[str, Any]:
        self._done.set()
        self.join()
        return {"peak_pss_mib": self.peak_kib / 1024, "processes_at_peak": self.peak_procs,
                "pss_samples": self.samples}


# ------------------------------------------------------------------------------------------ the Flower venv

def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_flower_venv(venv: Path, torch_index_url: str | None) -> dict[str, Any]:
    """The Flower venv, made and installed if missing (or if an install did not finish); what it holds."""
    marker = venv / "installed.json"
    if marker.exists():
        return dict(json.loads(marker.read_text()))
    py = venv_python(venv)
    if not py.exists():
        log(f"creating the Flower venv {venv}")
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install"]
    log(f"installing {TORCH} into {venv}")
    subprocess.run([*pip, TORCH, *(["--index-url", torch_index_url] if torch_index_url else [])], check=True,
                   stdout=sys.stderr)
    requirement = ""
    for req in (FLOWER_PINNED, FLOWER_FALLBACK):
        log(f"installing {req} into {venv}")
        if subprocess.run([*pip, req, *FLOWER_EXTRAS], stdout=sys.stderr).returncode == 0:
            requirement = req
            break
        log(f"could not install {req}")
    if not requirement:
        raise SystemExit(f"could not install Flower into {venv}")
    out = subprocess.run([str(py), "-c", "import json, sys; from importlib.metadata import version; print(json."
                          "dumps({'python': sys.version.split()[0], **{p: version(p) for p in ('flwr', 'ray', "
                          "'torch', 'numpy')}}))"], capture_output=True, text=True, check=True)
    info = {"requirement": requirement, "pinned_1_42": requirement == FLOWER_PINNED,
            "torch_requirement": TORCH, "torch_index_url": torch_index_url, "versions": json.loads(out.stdout),
            "installed": datetime.now(UTC).isoformat(timespec="seconds")}
    marker.write_text(json.dumps(info, indent=1))
    return info


# ------------------------------------------------------------------------------------------ the three systems

def wait_proc(proc: subprocess.Popen[Any], timeout: float, what: str, logfile: Path | None = None) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{what} ran past {timeout:.0f} s") from None
    if rc != 0:
        tail = logfile.read_text()[-4000:] if logfile is not None and logfile.exists() else ""
        raise RuntimeError(f"{what} exited with {rc}\n{tail}")


def run_pfl_edge(config: dict[str, Any], tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    out, logfile = tmp / "pfl_edge.json", tmp / "pfl_edge.log"
    code = ("import json, sys; from pfl_edge.sim import SimConfig, simulate; "
            "res = simulate(SimConfig.from_dict(json.loads(sys.argv[1])), progress=False); "
            "open(sys.argv[2], 'w').write(json.dumps(res, default=str))")
    cfg = {**config, "workers": args.workers}
    with open(logfile, "w") as lf:
        proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(cfg), str(out)], cwd=REPO, env=child_env(),
                                stdout=lf, stderr=subprocess.STDOUT)
        sampler = PssSampler([proc.pid])
        sampler.start()
        try:
            wait_proc(proc, args.timeout, "pfl-edge", logfile)
        finally:
            mem = sampler.stop()
    res = json.loads(out.read_text())
    meta = res["meta"]
    return {"rounds": [{"round": r["round"], "wall_s": r["wall_s"], "mean_acc": r["mean_acc"]} for r in res["rounds"]],
            "final_client_acc": res["final"]["client_acc"], **mem, "setup_s": meta["setup_s"],
            "total_s": meta["total_s"], "workers": meta["workers"], "threads": meta["threads"],
            "engine": res["config"].get("engine"), "torch": meta["torch"]}


def kill_leftovers(marker: str) -> list[int]:
    """Processes of this run (their command line holds its Ray temp dir) still alive after Flower exited."""
    mine = os.getpid()
    found = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != mine
             and marker in read_text(f"/proc/{p}/cmdline")]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if sig == signal.SIGTERM and found:
            time.sleep(2)
    return found


def run_flower(config: dict[str, Any], tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    out, logfile = tmp / "flower.json", tmp / "flower.log"
    ray_dir = tmp / "ray"
    workload = {"config": config, "timeout": args.timeout}
    cmd = [str(venv_python(args.flower_venv)), str(BENCH / "flower_app.py"), "--workload", json.dumps(workload),
           "--out", str(out), "--ray-temp-dir", str(ray_dir), "--num-cpus", str(args.workers),
           "--client-cpus", "1"]
    env = child_env(FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0")
    with open(logfile, "w") as lf:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=lf, stderr=subprocess.STDOUT)
        sampler = PssSampler([proc.pid], marker=str(ray_dir))
        sampler.start()
        try:
            wait_proc(proc, args.timeout, "flower", logfile)
        finally:
            mem = sampler.stop()
            left = kill_leftovers(str(ray_dir))
    res = json.loads(out.read_text())
    return {"rounds": [{k: r[k] for k in ("round", "wall_s", "train_s", "eval_s", "mean_acc")}
                       for r in res["rounds"]],
            "final_client_acc": res["rounds"][-1]["client_acc"], **mem, "setup_s": res["setup_s"],
            "total_s": res["total_s"], "versions": res["versions"], "backend_config": res["backend_config"],
            "leftover_processes_killed": len(left)}


class CeilingChild:
    def __init__(self, config: dict[str, Any], lo: int, hi: int, tmp: Path) -> None:
        cmd = [sys.executable, str(HERE), "--child", "ceiling", "--config", json.dumps(config),
               "--clients-range", f"{lo}:{hi}", "--tmp", str(tmp)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"ceiling child exited (rc {self.proc.wait()})")
        return dict(json.loads(line))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_ceiling(config: dict[str, Any], tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    n = int(config["clients"])
    if n < 2:
        raise SystemExit("the ceiling needs at least 2 clients (one half per process)")
    t0 = time.perf_counter()
    kids = [CeilingChild(config, 0, n // 2, tmp), CeilingChild(config, n // 2, n, tmp)]
    sampler = PssSampler([k.proc.pid for k in kids])
    sampler.start()
    rounds: list[dict[str, Any]] = []
    try:
        ready = [k.read() for k in kids]
        setup_s = time.perf_counter() - t0
        base_path = "-"  # round 1: every child starts from the federation's initial state
        for t in range(1, int(config["rounds"]) + 1):
            for k in kids:
                k.send(f"train {t} {base_path}")
            trained = [k.read() for k in kids]
            sums = [torch.load(r["sum_path"]) for r in trained]
            total = sum(r["n"] for r in trained)
            base = {key: (sum(s[key] for s in sums) / total).to(torch.float32) for key in sums[0]}
            base_path = str(tmp / f"base_{t}.pt")
            torch.save(base, base_path)
            for k in kids:
                k.send(f"eval {t} {base_path}")
            evaluated = [k.read() for k in kids]
            acc = [a for r in evaluated for a in r["acc"]]
            per_child = [tr["train_s"] + ev["eval_s"] for tr, ev in zip(trained, evaluated, strict=True)]
            rounds.append({"round": t, "wall_s": max(per_child), "child_s": per_child,
                           "train_s": [r["train_s"] for r in trained], "eval_s": [r["eval_s"] for r in evaluated],
                           "mean_acc": sum(acc) / len(acc), "client_acc": acc})
            log(f"    ceiling round {t}: {max(per_child):.2f} s, acc {rounds[-1]['mean_acc']:.3f}")
    finally:
        for k in kids:
            k.close()
        mem = sampler.stop()
    return {"rounds": [{k: v for k, v in r.items() if k != "client_acc"} for r in rounds],
            "final_client_acc": rounds[-1]["client_acc"], **mem, "setup_s": setup_s,
            "total_s": time.perf_counter() - t0, "threads": [r["threads"] for r in ready],
            "torch": ready[0]["torch"]}


def child_ceiling(args: argparse.Namespace) -> None:
    """Half of the clients, the textbook loop, one thread. Per round: "train T BASE" (BASE: a file of the base,
    or "-" for the initial state) answered with the time, the sample count and a file of sum_j n_j base_j
    (float64); "eval T BASE" answered with the time and every client's accuracy."""
    import torch

    torch.set_num_threads(1)
    import flower_app  # bench/, first on sys.path

    config = json.loads(args.config)
    s = flower_app.setup(config)
    cfg = s.cfg
    lo, hi = (int(v) for v in args.clients_range.split(":"))
    clients = list(range(lo, hi))
    train = {i: s.train_data(i) for i in clients}
    test = {i: s.test_data(i) for i in clients}
    personal = {i: s.personal_init() for i in clients}
    init_base = {k: s.init[k] for k in s.split.base}
    print(json.dumps({"ready": True, "threads": torch.get_num_threads(), "torch": torch.__version__}), flush=True)
    for line in sys.stdin:
        parts = line.split()
        if len(parts) != 3:
            break
        cmd, t, path = parts[0], int(parts[1]), parts[2]
        base = init_base if path == "-" else torch.load(path)
        if cmd == "train":
            start = time.perf_counter()
            states: list[tuple[dict[str, torch.Tensor], int]] = []
            for i in clients:
                s.model.load_state_dict({**base, **personal[i]})
                x, y = train[i]
                flower_app.train_client(s.model, x, y, epochs=cfg.local_epochs, batch_size=cfg.batch_size,
                                        lr=cfg.lr, momentum=cfg.momentum, gen=flower_app.generator(cfg.seed, t, i))
                state = s.model.state_dict()
                personal[i] = {k: state[k].clone() for k in s.split.personal}
                states.append(({k: state[k].clone() for k in s.split.base}, len(x)))
            train_s = time.perf_counter() - start
            # the weighted sum for the parent's average: federation work, not timed
            acc_sum = {k: sum(st[k].double() * n for st, n in states) for k in s.split.base}
            out = Path(args.tmp) / f"sum_{lo}_{t}.pt"
            torch.save(acc_sum, out)
            print(json.dumps({"train_s": train_s, "n": sum(n for _, n in states), "sum_path": str(out)}), flush=True)
        elif cmd == "eval":
            start = time.perf_counter()
            accs = []
            for i in clients:
                s.model.load_state_dict({**base, **personal[i]})
                accs.append(flower_app.evaluate_client(s.model, *test[i])[0])
            print(json.dumps({"eval_s": time.perf_counter() - start, "acc": accs}), flush=True)


RUNNERS = {"pfl-edge": run_pfl_edge, "flower": run_flower, "ceiling": run_ceiling}


# ------------------------------------------------------------------------------------------ summary and table

def summarise(run: dict[str, Any]) -> dict[str, Any]:
    walls = [r["wall_s"] for r in run["rounds"]]
    return {
        "s_per_round_after_first": statistics.mean(walls[1:]) if len(walls) > 1 else None,
        "s_per_round_all": statistics.mean(walls),
        "first_round_s": walls[0],
        "peak_pss_mib": run["peak_pss_mib"],
        "accuracy": statistics.mean(run["final_client_acc"]),
    }


def steady_s(summary: dict[str, Any]) -> float:
    v = summary["s_per_round_after_first"]
    return float(v if v is not None else summary["s_per_round_all"])


def ratios(by_system: dict[str, dict[str, Any]]) -> dict[str, float]:
    s = {k: v["summary"] for k, v in by_system.items() if "summary" in v}
    out: dict[str, float] = {}
    if "pfl-edge" in s and "flower" in s:
        out["flower_s / pfl_edge_s"] = steady_s(s["flower"]) / steady_s(s["pfl-edge"])
        out["flower_pss / pfl_edge_pss"] = s["flower"]["peak_pss_mib"] / s["pfl-edge"]["peak_pss_mib"]
    if "pfl-edge" in s and "ceiling" in s:
        out["fraction_of_ceiling"] = steady_s(s["ceiling"]) / steady_s(s["pfl-edge"])
    return out


def fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def table(results: dict[str, dict[str, Any]], configs: dict[str, dict[str, Any]]) -> str:
    lines = ["| workload | system | s/round (rounds 2+) | s/round (all) | round 1 s | peak PSS MiB | accuracy |",
             "|---|---|---|---|---|---|---|"]
    for w, by_system in results.items():
        c = configs[w]
        desc = f"{w}: {c['clients']} x {c['samples_per_client']}, {c['algorithm']}, {c['local_epochs']} ep, " \
               f"{c['rounds']} rd"
        for system, run in by_system.items():
            if "summary" not in run:
                err = " ".join(str(run.get("error", "?")).replace("|", "/").split())[:80]
                lines.append(f"| {desc} | {system} | failed: {err} | | | | |")
                continue
            s = run["summary"]
            lines.append(f"| {desc} | {system} | {fmt(s['s_per_round_after_first'], '.2f')} | "
                         f"{s['s_per_round_all']:.2f} | {s['first_round_s']:.2f} | {s['peak_pss_mib']:,.0f} | "
                         f"{s['accuracy']:.3f} |")
    lines += ["", "| workload | Flower s / pfl-edge s | Flower PSS / pfl-edge PSS | fraction of the ceiling "
              "(ceiling s / pfl-edge s) |", "|---|---|---|---|"]
    for w, by_system in results.items():
        r = ratios(by_system)
        lines.append(f"| {w} | {fmt(r.get('flower_s / pfl_edge_s'), '.2f')} | "
                     f"{fmt(r.get('flower_pss / pfl_edge_pss'), '.2f')} | {fmt(r.get('fraction_of_ceiling'), '.2f')} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main

def mem_total_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            return int(next(ln for ln in f if ln.startswith("MemTotal:")).split()[1]) / 2**20
    except (OSError, StopIteration, ValueError):
        return 0.0


def git_rev() -> str:
    r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return r.stdout.strip() + (" + uncommitted changes" if dirty else "")


def write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description="pfl-edge's simulator, Flower's simulation engine and plain PyTorch "
                                 "(the ceiling) side by side on workloads W1-W3: s/round, peak PSS, accuracy")
    ap.add_argument("--child", choices=["ceiling"], help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--clients-range", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    ap.add_argument("--workloads", default="W1,W2,W3", help="comma-separated, of W1, W2, W3")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of " + ", ".join(SYSTEMS))
    ap.add_argument("--rounds", type=int, help="override every workload's rounds")
    ap.add_argument("--quick", action="store_true", help="tiny workloads, a smoke test")
    ap.add_argument("--workers", type=int, default=2, help="pfl-edge's training processes and Ray's CPUs (one "
                    "actor of 1 CPU each); the ceiling always runs 2 processes")
    ap.add_argument("--timeout", type=float, default=4 * 3600, help="seconds allowed to one system's run")
    ap.add_argument("--flower-venv", type=Path, default=FLOWER_VENV)
    ap.add_argument("--torch-index-url", help="pip index for torch in the Flower venv (elsewhere: "
                    "https://download.pytorch.org/whl/cpu for the CPU build)")
    ap.add_argument("--out", type=Path, help="default bench/results/flower_side_by_side.json "
                    "(--quick: bench/out/tmp/flower_side_by_side_quick.json)")
    args = ap.parse_args()
    if args.child == "ceiling":
        return child_ceiling(args)

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; valid: {', '.join(WORKLOADS)}")
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"unknown system {s!r}; valid: {', '.join(SYSTEMS)}")
    out = args.out or (REPO / "bench" / "out" / "tmp" / "flower_side_by_side_quick.json" if args.quick
                       else BENCH / "results" / "flower_side_by_side.json")
    flower_info = ensure_flower_venv(args.flower_venv, args.torch_index_url) if "flower" in systems else None

    import torch

    load_start = os.getloadavg()
    if load_start[0] > 0.5 * (os.cpu_count() or 1):
        log(f"warning: load average {load_start[0]:.2f} on {os.cpu_count()} CPUs: other work is running, times "
            "will be noisy")
    configs = {w: workload_config(w, args.quick, args.rounds) for w in workloads}
    results: dict[str, dict[str, Any]] = {}
    result: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs, {mem_total_gib():.0f} GiB, {platform.node()}",
        "quick": args.quick,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "pfl_edge": git_rev(),
                     "flower_venv": flower_info},
        "args": {k: str(v) for k, v in vars(args).items() if k not in ("child", "config", "clients_range", "tmp")},
        "load_average_start": load_start,
        "workloads": configs,
        "timed": {
            "pfl-edge": f"simulate()'s wall_s per round (train + aggregate + evaluate every client), "
                        f"workers={args.workers}",
            "flower": f"server side, configure_train to the end of aggregate_evaluate, per round; Ray, "
                      f"{args.workers} actors of 1 CPU; round 1 includes starting the actors and their loading of "
                      "the data set",
            "ceiling": "per round, the slower of two single-thread processes' train + evaluate time for its half "
                       "of the clients (the averaging between them not timed)",
            "peak_pss_mib": "peak over 0.2 s samples of the PSS summed over the system's process tree",
        },
        "results": results,
        "ratios": {},
    }
    for w in workloads:
        results[w] = {}
        for system in systems:
            if system not in ONLY.get(w, SYSTEMS):
                continue
            c = configs[w]
            log(f"{w} {system}: {c['clients']} clients x {c['samples_per_client']}, {c['algorithm']}, "
                f"{c['local_epochs']} epoch(s), {c['rounds']} rounds")
            tmp = Path(tempfile.mkdtemp(prefix="pflfw-", dir="/tmp"))  # short: Ray's socket paths live under it
            before = os.getloadavg()
            t0 = time.time()
            try:
                run = RUNNERS[system](configs[w], tmp, args)
                run["summary"] = summarise(run)
                s = run["summary"]
                log(f"  {w} {system}: {fmt(s['s_per_round_after_first'], '.2f')} s/round (rounds 2+), "
                    f"{s['s_per_round_all']:.2f} s/round (all), peak PSS {s['peak_pss_mib']:.0f} MiB, "
                    f"accuracy {s['accuracy']:.3f}")
            except (RuntimeError, OSError, ValueError, KeyError) as e:
                log(f"  {w} {system} failed: {e}")
                run = {"error": str(e)[-2000:]}
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            run.update(load_average_before=before, load_average_after=os.getloadavg(), started=t0,
                       elapsed_s=time.time() - t0)
            results[w][system] = run
            write(out, result)  # after every run: a long benchmark keeps what it has measured
        result["ratios"][w] = ratios(results[w])
    result["load_average_end"] = os.getloadavg()
    write(out, result)
    print(table(results, configs))
    print(f"\nwrote {out}")
    if any("error" in r for by in results.values() for r in by.values()):
        log("some runs failed (see the table and the JSON)")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
