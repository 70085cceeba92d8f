"""The JavaScript device's training step (devices/js, issue 31) beside eager PyTorch and the Python torch-free device,
in one run on one machine, on the same number of threads each (one by default), checked to compute the same thing.

For each model: a fresh model (``export.prepare``, phone-high, seed 0), its ONNX training program
(``export.lower_onnx_training``, mode fedper, batch 32: what the server serves a device), one fixed batch. A step:

- eager: ``zero_grad``, forward, cross-entropy, backward, ``torch.optim.SGD.step`` (lr 0.01, momentum 0.9), on
  ``torch.set_num_threads(threads)``;
- python: the Python torch-free device's step, ``OnnxBackend.gradients`` (the program in an ONNX Runtime session,
  ``intra_op_num_threads=threads``) then ``ProgramSGD.step`` (``pfl_edge.sgd.SGD`` on numpy weights);
- js: the JavaScript device's step in a Node child (``devices/js/bin/bench_step.ts``): the same ``.onnx`` file opened
  by ``openTraining`` in onnxruntime-node (``intraOpNumThreads=threads``), ``batchGradients`` then the device's
  ``SGD.step`` (src/train.ts, src/sgd.ts). The child times each step itself (no pipe in the times).

First the same ``--check-steps`` steps from the same weights on the same batch on every side: max |diff| of the
weights after them, js against python and against eager (python against eager too). Then ``--warmup`` steps, then
``--rounds`` interleaved rounds (every side runs ``--steps / --rounds`` steps per round, the order rotated from
round to round), so that load on a shared machine hits all alike; median and p90 per side, ratios of medians. Per
side, CPU time of threads other than the one that steps (/proc; 0 when one thread does everything) and how many
cores other processes kept busy (/proc/stat). Also devices/js's installed size (node_modules; onnxruntime-node; its
linux-x64 binaries; the production dependencies alone) and one ``npm ci`` of its lock file into a temporary folder.

Needs devices/js built (``cd devices/js && npm ci && npx tsc -p .``).

    OMP_NUM_THREADS=1 .venv/bin/python bench/train_step_js.py [--models cnn,mobilenet-v1] [--threads 1]
                                       [--steps 30] [--rounds 6] [--out bench/results/train_step_js.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from machine import cpu_model

from device_profiles import get_profile
from edge_runtime.training import OnnxBackend
from export import lower_onnx_training, prepare
from pfl_edge.checkpoint import ModelSpec
from pfl_edge.sgd import TrainConfig
from pfl_edge.table import format_table

ROOT = Path(__file__).resolve().parent.parent
JS = ROOT / "devices" / "js"
SHAPES = {"cnn": (1, 28), "mobilenet-v1": (3, 32)}
SIDES = ("eager", "python", "js", "python call", "js call")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int | str) -> dict[int, float]:
    """CPU seconds (user + system) each thread of process ``pid`` has used so far, by thread id."""
    out: dict[int, float] = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[int(t)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy so far (all cores, /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(a) for a in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / CLK_TCK


def du(path: Path) -> int:
    return int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


def sizes() -> dict[str, Any]:
    """devices/js's installed size, and what a linux-x64 device needs of it."""
    nm = JS / "node_modules"
    ort_node = nm / "onnxruntime-node"
    napi = ort_node / "bin" / "napi-v6"
    platforms = {f"{p.parent.name}-{p.name}": du(p) for p in sorted(napi.glob("*/*")) if p.is_dir()}
    others = sum(v for k, v in platforms.items() if k != "linux-x64")
    listed = subprocess.run(["npm", "ls", "--omit=dev", "--all", "--parseable"], cwd=JS, capture_output=True,
                            text=True).stdout.split()
    prod = [Path(p) for p in listed if Path(p).resolve() != JS.resolve()]
    prod_bytes = sum(du(p) for p in prod if not any(q != p and q in p.parents for q in prod))  # nested: once
    return {
        "node_modules_bytes": du(nm), "onnxruntime_node_bytes": du(ort_node),
        "onnxruntime_common_bytes": du(nm / "onnxruntime-common"),
        "onnxruntime_node_binaries_bytes": platforms,
        "onnxruntime_node_linux_x64_only_bytes": du(ort_node) - others,
        "node_modules_linux_x64_only_bytes": du(nm) - others,
        "production_packages": len(prod), "production_bytes": prod_bytes,
        "production_linux_x64_only_bytes": prod_bytes - others,
        "typescript_bytes": du(nm / "typescript") if (nm / "typescript").exists() else 0,
    }


def npm_ci() -> dict[str, Any]:
    """One ``npm ci`` of devices/js's lock file (and .npmrc) into a temporary folder: wall time, size."""
    cache = Path.home() / ".npm" / "_cacache"
    out: dict[str, Any] = {"npm": subprocess.run(["npm", "--version"], capture_output=True, text=True).stdout.strip(),
                           "npm_cache_bytes_before": du(cache) if cache.exists() else 0}
    with tempfile.TemporaryDirectory() as d:
        for f in ("package.json", "package-lock.json", ".npmrc"):
            shutil.copy(JS / f, d)
        t0 = time.perf_counter()
        r = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=d, capture_output=True, text=True)
        out |= {"wall_s": time.perf_counter() - t0, "rc": r.returncode, "stderr_tail": r.stderr[-500:]}
        if r.returncode == 0:
            out["node_modules_bytes"] = du(Path(d) / "node_modules")
    return out


class JsChild:
    """The JavaScript device's step in a Node process (dist/bin/bench_step.js)."""

    def __init__(self, folder: Path, threads: int) -> None:
        self.proc = subprocess.Popen(["node", str(JS / "dist" / "bin" / "bench_step.js"), "--dir", str(folder),
                                      "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.hello = self._read()
        if not self.hello.get("ready"):
            raise SystemExit(f"the JS step did not start: {self.hello}")

    def _read(self) -> dict[str, Any]:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        line = out.readline()
        if not line:
            raise SystemExit(f"the JS step ended (rc {self.proc.wait()})")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise SystemExit(f"the JS step: {reply['error']}")
        return reply

    def ask(self, cmd: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def write_inputs(folder: Path, low: Any, state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                 cfg: TrainConfig) -> None:
    """What the JS child loads: the program file, its details, the weights, the batch (raw little-endian)."""
    det = low.details
    (folder / "program.onnx").write_bytes(low.program)
    keep = ("batch_size", "inputs", "outputs", "keys", "trainable", "frozen", "shapes", "input_shape")
    meta = {"details": {k: det[k] for k in keep}, "n": len(x),
            "config": {"lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay,
                       "clip_norm": cfg.clip_norm, "clip_unmasked": cfg.clip_unmasked}}
    (folder / "meta.json").write_text(json.dumps(meta))
    flat = np.concatenate([state[k].numpy().astype("<f4").ravel() for k in det["keys"]])
    (folder / "weights.bin").write_bytes(flat.tobytes())
    (folder / "x.bin").write_bytes(x.numpy().astype("<f4").tobytes())
    (folder / "y.bin").write_bytes(y.numpy().astype("<i4").tobytes())


def unflatten(flat: np.ndarray, keys: list[str], shapes: dict[str, list[int]]) -> dict[str, np.ndarray]:
    out, off = {}, 0
    for k in keys:
        n = int(np.prod(shapes[k]))
        out[k] = flat[off:off + n].reshape(shapes[k])
        off += n
    return out


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return max(float(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)).max()) for k in a)


def measure(name: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    ch, size = SHAPES[name]
    threads = args.threads
    torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads
    prep = prepare(get_profile("phone-high"), spec=ModelSpec(name, 10, ch, size), seed=0)
    t0 = time.perf_counter()
    low = lower_onnx_training(prep, mode="fedper", batch_size=args.batch)
    export_s = time.perf_counter() - t0
    det = low.details
    keys: list[str] = list(det["keys"])
    state = {k: v.detach().clone() for k, v in prep.model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, ch, size, size, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    cfg = TrainConfig(lr=0.01, momentum=0.9, batch_size=args.batch)
    write_inputs(folder, low, state, x, y, cfg)

    before = set(os.listdir("/proc/self/task"))
    backend = OnnxBackend.from_lowered(low, threads=threads)  # the session and its first call
    ort_added = len(set(os.listdir("/proc/self/task")) - before)
    assert ort_added == threads - 1, f"ONNX Runtime on {threads} threads added {ort_added} threads"
    backend.load(state)
    sgd = backend.sgd(cfg)
    model = copy.deepcopy(prep.model).train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    js = JsChild(folder, threads)
    js_pid = js.proc.pid

    def eager(n: int) -> dict[str, list[float]]:
        ms = []
        for _ in range(n):
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            ms.append(1e3 * (time.perf_counter() - t))
        return {"ms": ms}

    def python(n: int) -> dict[str, list[float]]:
        ms, grad_ms, sgd_ms = [], [], []
        for _ in range(n):
            t = time.perf_counter()
            _, g = backend.gradients(x, y)
            t1 = time.perf_counter()
            sgd.step(g)
            t2 = time.perf_counter()
            ms.append(1e3 * (t2 - t))
            grad_ms.append(1e3 * (t1 - t))
            sgd_ms.append(1e3 * (t2 - t1))
        return {"ms": ms, "grad_ms": grad_ms, "sgd_ms": sgd_ms}

    def javascript(n: int) -> dict[str, list[float]]:
        r = js.ask(f"step {n}")
        return {k: r[k] for k in ("ms", "grad_ms", "sgd_ms")}

    feed = [x.numpy(), y.numpy().astype(np.int64), np.ones(args.batch, np.float32)]

    def python_call(n: int) -> dict[str, list[float]]:
        ms = []
        for _ in range(n):
            inputs = [*feed, *(backend._w[k] for k in keys)]  # the runtime's forward as the backend calls it
            t = time.perf_counter()
            backend._forward(inputs)
            ms.append(1e3 * (time.perf_counter() - t))
        return {"ms": ms}

    def js_call(n: int) -> dict[str, list[float]]:
        return {"ms": js.ask(f"call {n}")["ms"]}

    run = {"eager": eager, "python": python, "js": javascript, "python call": python_call, "js call": js_call}

    # the same k steps from the same weights on the same batch: the weights after them, side against side
    for s in ("eager", "python", "js"):
        run[s](args.check_steps)
    js.ask(f"dump {folder / 'after.bin'}")
    w_js = unflatten(np.fromfile(folder / "after.bin", dtype="<f4"), keys, det["shapes"])
    w_py = {k: np.asarray(v) for k, v in backend.state().items()}
    params = dict(model.named_parameters())
    w_eager = {k: params[k].detach().numpy() for k in keys}
    w0 = {k: state[k].numpy() for k in keys}
    check = {"steps": args.check_steps, "js_vs_python": max_diff(w_js, w_py), "js_vs_eager": max_diff(w_js, w_eager),
             "python_vs_eager": max_diff(w_py, w_eager), "moved_from_initial": max_diff(w_py, w0),
             "max_abs_weight": max(float(np.abs(v).max()) for v in w_py.values())}
    print(f"  {name}: after {args.check_steps} steps max |diff| js-python {check['js_vs_python']:.1e}, "
          f"js-eager {check['js_vs_eager']:.1e}, python-eager {check['python_vs_eager']:.1e} "
          f"(the weights moved by up to {check['moved_from_initial']:.1e})", flush=True)

    for fn in run.values():
        fn(args.warmup)
    per_round = max(1, args.steps // args.rounds)
    times: dict[str, dict[str, list[float]]] = {s: {} for s in SIDES}
    other_cpu = dict.fromkeys(SIDES, 0.0)  # CPU s of threads other than the stepping one, while that side ran
    own_tid = threading.get_native_id()
    order = list(SIDES)
    busy0, wall0 = machine_busy_s(), time.perf_counter()
    ours0 = sum(thread_cpu_s("self").values()) + sum(thread_cpu_s(js_pid).values())
    for i in range(args.rounds):
        for s in order[i % len(order):] + order[:i % len(order)]:
            pid, tid = (js_pid, js_pid) if s.startswith("js") else ("self", own_tid)
            c0 = thread_cpu_s(pid)
            got = run[s](per_round)
            c1 = thread_cpu_s(pid)
            other_cpu[s] += sum(v - c0.get(t, 0.0) for t, v in c1.items() if t != tid)
            for k, v in got.items():
                times[s].setdefault(k, []).extend(v)
    wall = time.perf_counter() - wall0
    ours = sum(thread_cpu_s("self").values()) + sum(thread_cpu_s(js_pid).values()) - ours0
    others_cores = (machine_busy_s() - busy0 - ours) / wall
    js_threads = len(os.listdir(f"/proc/{js_pid}/task"))
    js.close()

    med = {s: {k: statistics.median(v) for k, v in t.items()} for s, t in times.items()}
    p90 = {s: {k: float(np.percentile(v, 90)) for k, v in t.items()} for s, t in times.items()}
    row = {
        "model": name, "input": [ch, size, size], "batch": args.batch, "mode": "fedper",
        "params": sum(p.numel() for p in model.parameters()), "program_bytes": len(low.program),
        "export_s": export_s, "steps_per_side": per_round * args.rounds, "rounds": args.rounds,
        "threads": {"torch": torch.get_num_threads(), "onnxruntime_intra_op": threads,
                    "onnxruntime_node_intra_op": js.hello["threads"],
                    "onnxruntime_workers_added_in_python": ort_added, "node_process_threads": js_threads},
        "cpu_s_other_threads": other_cpu, "timed_s": wall, "other_processes_cores_busy": others_cores,
        "median_ms": med, "p90_ms": p90, "times_ms": times,
        "js_over_eager": med["js"]["ms"] / med["eager"]["ms"], "js_over_python": med["js"]["ms"] / med["python"]["ms"],
        "python_over_eager": med["python"]["ms"] / med["eager"]["ms"],
        "js_call_over_python_call": med["js call"]["ms"] / med["python call"]["ms"],
        "js_open_ms": js.hello["open_ms"], "check": check,
    }
    print(f"  {name}: eager {med['eager']['ms']:.1f} ms, python {med['python']['ms']:.1f} ms, js "
          f"{med['js']['ms']:.1f} ms: js/eager {row['js_over_eager']:.2f}x, js/python {row['js_over_python']:.2f}x; "
          f"others kept {others_cores:.2f} cores busy", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="cnn,mobilenet-v1", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--threads", type=int, default=1, help="every side's threads (torch; ONNX Runtime's intra-op)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per side")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds the timed steps are split into")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--no-npm-ci", action="store_true", help="skip timing one npm ci")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "train_step_js.json")
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    if set(models) - set(SHAPES):
        ap.error(f"unknown models {sorted(set(models) - set(SHAPES))}; valid: {', '.join(SHAPES)}")
    if not (JS / "dist" / "bin" / "bench_step.js").exists():
        raise SystemExit("build devices/js first: cd devices/js && npx tsc -p .")
    started = datetime.now(timezone.utc)
    load0 = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in models:
            print(f"{name}: exporting the ONNX training program", flush=True)
            folder = Path(d) / name
            folder.mkdir()
            rows.append(measure(name, args, folder))
    hello_versions = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    ort_node = json.loads((JS / "node_modules" / "onnxruntime-node" / "package.json").read_text())["version"]
    out = {
        "date": started.isoformat(timespec="seconds"),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([*(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS",) if k in os.environ),
                             "python", *sys.argv]),
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "arch": platform.machine(),
                    "python": platform.python_version()},
        "versions": {"torch": torch.__version__, "onnxruntime": ort.__version__, "numpy": np.__version__,
                     "node": hello_versions, "onnxruntime_node": ort_node},
        "load_average_1min": {"start": load0, "end": os.getloadavg()[0]},
        "args": vars(args) | {"out": str(args.out)},
        "results": rows,
        "size": sizes(),
        "npm_ci": None if args.no_npm_ci else npm_ci(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    table = [("model", "eager ms (p90)", "python ms (p90)", "js ms (p90)", "python grads / SGD ms", "js grads / SGD ms",
              "call python / js ms", "js/eager", "js/python", "max |diff| js-py / js-eager")]
    for r in rows:
        m, p = r["median_ms"], r["p90_ms"]
        table.append((r["model"], *(f"{m[s]['ms']:.1f} ({p[s]['ms']:.1f})" for s in ("eager", "python", "js")),
                      f"{m['python']['grad_ms']:.1f} / {m['python']['sgd_ms']:.1f}",
                      f"{m['js']['grad_ms']:.1f} / {m['js']['sgd_ms']:.1f}",
                      f"{m['python call']['ms']:.1f} / {m['js call']['ms']:.1f}", f"{r['js_over_eager']:.2f}x",
                      f"{r['js_over_python']:.2f}x",
                      f"{r['check']['js_vs_python']:.1e} / {r['check']['js_vs_eager']:.1e}"))
    print(format_table(table, rule=True))
    sz: dict[str, Any] = out["size"]  # type: ignore[assignment]
    print(f"node_modules {sz['node_modules_bytes'] / 1e6:.0f} MB (onnxruntime-node "
          f"{sz['onnxruntime_node_bytes'] / 1e6:.0f} MB; linux-x64 only "
          f"{sz['node_modules_linux_x64_only_bytes'] / 1e6:.0f} MB); results: {args.out}")


if __name__ == "__main__":
    main()
