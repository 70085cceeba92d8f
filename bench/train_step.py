"""One SGD training step three ways, side by side in one process: eager PyTorch, the ONNX training program on ONNX
Runtime and the ExecuTorch training program, on the same number of threads each (one by default), checked.

For each model: a fresh model (speed does not depend on the weights' values), its two whole-model gradient programs
(``forward(x, y, weight, *params) -> (loss, *grads)``, mode fedper, a fixed batch: ``export.lower_onnx_training``
and ``export.lower_executorch_training``, XNNPACK) and the same model in eager PyTorch. A step is what a device runs
per batch:

- eager: ``zero_grad``, forward, cross-entropy, backward, ``torch.optim.SGD.step`` (momentum 0.9);
- onnxruntime: ``OnnxBackend.gradients`` (the program in an ONNX Runtime inference session) plus its SGD step
  (``ProgramSGD``: pfl_edge.sgd.SGD on the device's numpy weights);
- executorch: ``ExecuTorchBackend.gradients`` (the pip runtime) plus the same SGD step.

The two parts of a program's step are timed separately, and the program call alone (the runtime's ``forward`` on
ready numpy arrays: no conversion, no padding) once more in the same loop. ``--baseline`` also times the
ExecuTorch program as it was before issue 16 (``aten.convolution`` on portable kernels, no delegate: seconds a
step). Interleaved: each repeat runs every side once, the order rotated from repeat to repeat, so that load on a
shared machine hits all alike; medians and p95.

Threads, asserted for each ``--threads`` value N (default 1; ``--threads 1,2`` measures both with one export):
``torch.get_num_threads() == N``; ExecuTorch's pool (``_threadpool_get_thread_count()``) is N after the program is
loaded; creating the ONNX Runtime session (and its first call) adds exactly N - 1 threads to the process (its
intra-op pool's workers; the caller is the N-th; inter-op 1). The threads ExecuTorch's load and first call add are
recorded, not asserted: with N > 1 they include torch's OpenMP workers, as the pip runtime's pybinding copies its
inputs with ATen. During the timed loop each thread's CPU time is read from /proc/self/task, and what threads other
than the caller spent is reported per side (0 when one thread runs everything), beside how many cores other
processes kept busy meanwhile (/proc/stat): on a shared 2-core machine N = 2 means waiting for a busy core.

Also: the export time and size of each program, and each program's gradient difference from eager on the first
batch (a check that they compute the same thing), beside eager float32's own difference from float64.
``--profile-onnx`` runs the ONNX program a few more times in a profiling session afterwards and reports where its
time goes per operator type. Writes bench/results/train_step.json and prints a table.

    OMP_NUM_THREADS=1 .venv/bin/python bench/train_step.py [--batch 32] [--threads 1[,2]] [--repeats 15]
                                       [--models cnn,mobilenet-v1[,resnet18-gn]] [--baseline] [--profile-onnx]
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from executorch.extension.pybindings import portable_lib
from machine import cpu_model

from device_profiles import get_profile
from edge_runtime.training import ExecuTorchBackend, OnnxBackend, ProgramBackend
from export import Lowered, Prepared, lower_executorch_training, lower_onnx_training, prepare
from pfl_edge.checkpoint import ModelSpec
from pfl_edge.table import format_table
from pfl_edge.train import TrainConfig

SHAPES = {"cnn": (1, 28), "mobilenet-v1": (3, 32), "resnet18-gn": (3, 32)}
RUNTIMES = ("onnxruntime", "executorch")
BASELINE = "executorch before issue 16"
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def thread_cpu_s() -> dict[int, float]:
    """CPU seconds (user + system) each thread of this process has used so far, by thread id."""
    out: dict[int, float] = {}
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended between the listing and the read
            continue
        out[int(t)] = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime: fields 14 and 15 of stat(5)
    return out


def busy_s() -> tuple[float, float]:
    """CPU seconds the whole machine has been busy (all cores, /proc/stat) and this process has used, so far."""
    with open("/proc/stat") as f:
        v = [int(a) for a in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    t = os.times()
    return (sum(v) - v[3] - v[4]) / CLK_TCK, t.user + t.system


def export_programs(prep: Prepared, args: argparse.Namespace) -> tuple[dict[str, Lowered], dict[str, float]]:
    """Each runtime's gradient program of ``prep`` (and the pre-issue-16 one with ``--baseline``), timed."""
    makers: dict[str, Callable[[], Lowered]] = {
        "onnxruntime": lambda: lower_onnx_training(prep, mode="fedper", batch_size=args.batch),
        "executorch": lambda: lower_executorch_training(prep, mode="fedper", batch_size=args.batch),
    }
    if args.baseline:
        makers[BASELINE] = lambda: lower_executorch_training(prep, mode="fedper", batch_size=args.batch,
                                                             convolutions="native", delegate="none")
    lowered, export_s = {}, {}
    for name, make in makers.items():
        start = time.perf_counter()
        lowered[name] = make()
        export_s[name] = time.perf_counter() - start
        print(f"  exported {name}: {export_s[name]:.1f} s, {len(lowered[name].program) / 1024:.0f} KB", flush=True)
    return lowered, export_s


def open_backends(lowered: dict[str, Lowered], state: dict[str, torch.Tensor],
                  threads: int) -> tuple[dict[str, ProgramBackend], dict[str, object]]:
    """The backends on ``threads`` threads, loaded with ``state``, and the thread checks (asserted)."""
    checks: dict[str, object] = {}
    backends: dict[str, ProgramBackend] = {}
    # ONNX Runtime: its intra-op pool has threads - 1 workers (the caller runs too), inter-op is 1. Measured around
    # the backend's creation, which makes the session (edge_runtime.backends.onnx_session) and calls it once
    before = thread_ids()
    backends["onnxruntime"] = OnnxBackend.from_lowered(lowered["onnxruntime"], threads=threads)
    added = thread_ids() - before
    checks["onnxruntime_threads_added_by_session"] = len(added)
    assert len(added) == threads - 1, f"ONNX Runtime on {threads} threads added {len(added)} threads to the process"
    # ExecuTorch: load_program resizes the runtime's global pool before loading. XNNPACK takes the pool at a
    # program's init, so every program is opened after the pool has its final size, and none is reset under it
    for name in (n for n in lowered if n != "onnxruntime"):
        before = thread_ids()
        backends[name] = ExecuTorchBackend.from_lowered(lowered[name], threads=threads)
        pool = portable_lib._threadpool_get_thread_count()
        checks[f"{name}_threadpool"] = pool
        checks[f"{name}_threads_added_by_load"] = len(thread_ids() - before)
        checks[f"{name}_threads_ended_by_load"] = len(before - thread_ids())
        assert pool == threads, f"ExecuTorch's thread pool has {pool} threads after loading, not {threads}"
    for b in backends.values():
        b.load(state)
    return backends, checks


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The worst tensor's norm-wise relative difference of ``a`` from ``b``."""
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm()) for k in b)


def measure(name: str, prep: Prepared, lowered: dict[str, Lowered], export_s: dict[str, float], threads: int,
            args: argparse.Namespace) -> dict[str, Any]:
    ch, size = SHAPES[name]
    torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads, f"torch runs {torch.get_num_threads()} threads, not {threads}"
    backends, checks = open_backends(lowered, prep.model.state_dict(), threads)
    checks |= {"torch_num_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
               "process_threads": len(thread_ids())}
    cfg = TrainConfig(lr=0.01, momentum=0.9)
    sgds = {k: b.sgd(cfg) for k, b in backends.items()}
    model = copy.deepcopy(prep.model).train()  # prep.model itself keeps its initial weights for the next row
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, ch, size, size, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    xn, yn, wn = x.numpy(), y.numpy(), np.ones(args.batch, np.float32)

    # same weights, same batch: the gradients must agree before the timings mean anything. Against a float64
    # eager reference too, which says how much float32 rounding alone moves them (deep GroupNorm stacks at a
    # fresh init are ill-conditioned: the mean gradient is a small difference of large per-sample ones)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    ref64 = copy.deepcopy(model).double()
    F.cross_entropy(ref64(x.double()), y).backward()
    g32 = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    g64 = {k: p.grad for k, p in ref64.named_parameters() if p.grad is not None}
    rel_errs: dict[str, float] = {"eager_vs_float64": rel(g32, g64)}
    abs_errs: dict[str, float] = {}
    for k, b in backends.items():
        _, grads = b.gradients(x, y)
        rel_errs[f"{k}_vs_eager"], rel_errs[f"{k}_vs_float64"] = rel(grads, g32), rel(grads, g64)
        abs_errs[f"{k}_vs_eager"] = max(float((g - grads[p]).abs().max()) for p, g in g32.items())

    def eager() -> dict[str, float]:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        return {"eager": time.perf_counter() - t0}

    def program_step(k: str) -> Callable[[], dict[str, float]]:
        b, sgd = backends[k], sgds[k]

        def step() -> dict[str, float]:
            t0 = time.perf_counter()
            _, g = b.gradients(x, y)
            t1 = time.perf_counter()
            sgd.step(g)
            t2 = time.perf_counter()
            return {k: t2 - t0, f"{k} gradients": t1 - t0, f"{k} sgd": t2 - t1}

        return step

    def program_call(k: str) -> Callable[[], dict[str, float]]:
        b = backends[k]

        def call() -> dict[str, float]:
            inputs = [xn, yn, wn, *(b._w[p] for p in b.keys)]  # the runtime's forward as the backend calls it
            t0 = time.perf_counter()
            b._forward(inputs)
            return {f"{k} call": time.perf_counter() - t0}

        return call

    sides: dict[str, Callable[[], dict[str, float]]] = {"eager": eager}
    for k in RUNTIMES:
        sides[k] = program_step(k)
        sides[f"{k} call"] = program_call(k)
    if BASELINE in backends:
        sides[BASELINE] = program_call(BASELINE)
    for _ in range(args.warmup):
        for side in sides.values():
            side()
    times: dict[str, list[float]] = {}
    main_tid = threading.get_native_id()
    other_cpu = dict.fromkeys(sides, 0.0)  # CPU seconds of threads other than this one, during each side
    main_cpu = dict.fromkeys(sides, 0.0)
    order = list(sides)
    wall0, (machine0, own0) = time.perf_counter(), busy_s()
    for i in range(args.repeats):  # interleaved, the order rotated: drift on a shared machine hits all alike
        for s in order[i % len(order):] + order[:i % len(order)]:
            c0 = thread_cpu_s()
            got = sides[s]()
            c1 = thread_cpu_s()
            main_cpu[s] += c1.get(main_tid, 0.0) - c0.get(main_tid, 0.0)
            other_cpu[s] += sum(v - c0.get(t, 0.0) for t, v in c1.items() if t != main_tid)
            for key, v in got.items():
                times.setdefault(key, []).append(v * 1e3)
    wall, (machine1, own1) = time.perf_counter() - wall0, busy_s()
    # how many cores other processes kept busy, on average, while this loop ran (a shared machine's load)
    others_cores = (machine1 - machine0 - (own1 - own0)) / wall
    checks |= {"cpu_s_other_threads": other_cpu, "cpu_s_calling_thread": main_cpu,
               "process_threads_after": len(thread_ids()),
               "executorch_threadpool_after": portable_lib._threadpool_get_thread_count()}
    med = {k: statistics.median(v) for k, v in times.items()}
    row: dict[str, Any] = {
        "model": name, "input": [ch, size, size], "batch": args.batch, "threads": threads,
        "params": sum(p.numel() for p in model.parameters()), "repeats": args.repeats,
        "median_ms": med, "p95_ms": {k: float(np.percentile(v, 95)) for k, v in times.items()},
        "over_eager": {k: med[k] / med["eager"] for k in med if k != "eager"},
        "export_s": export_s, "program_bytes": {k: len(v.program) for k, v in lowered.items()},
        "grad_max_rel_err": rel_errs, "grad_max_abs_err": abs_errs, "thread_checks": checks,
        "timed_loop_s": wall, "other_processes_cores_busy": others_cores, "load_average_1min": os.getloadavg()[0],
    }
    if args.profile_onnx:
        row["onnxruntime_profile"] = profile_onnx(lowered["onnxruntime"], threads,
                                                  [xn, yn, wn, *(backends["onnxruntime"]._w[p]
                                                                 for p in backends["onnxruntime"].keys)], args)
    print(f"{name:13s} {threads} thread(s): eager {med['eager']:.1f} ms, onnxruntime {med['onnxruntime']:.1f} ms "
          f"(x{med['onnxruntime'] / med['eager']:.2f}), executorch {med['executorch']:.1f} ms "
          f"(x{med['executorch'] / med['eager']:.2f})"
          + (f", {BASELINE} {med[BASELINE + ' call']:.1f} ms" if BASELINE in backends else "") + "; grad rel err "
          + ", ".join(f"{k} {v:.1e}" for k, v in rel_errs.items()), flush=True)
    for d in (sides, sgds, backends):  # the programs go now: the next row's ExecuTorch pool is resized under none
        d.clear()
    gc.collect()
    return row


def profile_onnx(lowered: Lowered, threads: int, inputs: list[np.ndarray],
                 args: argparse.Namespace) -> dict[str, object]:
    """ONNX Runtime's own profiler over ``args.profile_calls`` calls of the program (after one call left out):
    kernel time per operator type, per call, and the whole run's, in ms."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1  # as edge_runtime.backends.onnx_session
    opts.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        opts.profile_file_prefix = str(Path(tmp) / "ort")
        sess = ort.InferenceSession(lowered.program, opts, providers=["CPUExecutionProvider"])
        feed = dict(zip([i.name for i in sess.get_inputs()], inputs, strict=True))
        for _ in range(1 + args.profile_calls):
            sess.run(None, feed)
        events = json.loads(Path(sess.end_profiling()).read_text())
    runs = sorted((float(e["ts"]), float(e["dur"])) for e in events
                  if e.get("cat") == "Session" and e.get("name") == "model_run")
    warm_end = runs[0][0] + runs[0][1]  # the first, unprofiled call's events are dropped
    kernels: dict[str, float] = {}
    nodes: dict[str, int] = {}
    run_us = 0.0
    for e in events:
        if float(e.get("ts", 0)) < warm_end:
            continue
        if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time"):
            op = str(e.get("args", {}).get("op_name", "?"))
            kernels[op] = kernels.get(op, 0.0) + float(e["dur"])
            nodes[op] = nodes.get(op, 0) + 1
        elif e.get("cat") == "Session" and e.get("name") == "model_run":
            run_us += float(e["dur"])
    calls = args.profile_calls
    total = sum(kernels.values())
    ops = sorted(kernels, key=lambda k: -kernels[k])
    return {"calls": calls, "run_ms_per_call": run_us / calls / 1e3, "kernels_ms_per_call": total / calls / 1e3,
            "by_op_type": {k: {"ms_per_call": kernels[k] / calls / 1e3, "share": kernels[k] / total,
                               "nodes": nodes[k] // calls} for k in ops}}


def main() -> None:
    threads_at_start = len(thread_ids())
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--baseline", action="store_true",
                    help="also time the pre-issue-16 ExecuTorch program (native convolutions, no delegate) in the "
                         "same loop (seconds a step)")
    ap.add_argument("--threads", default="1", help="comma-separated thread counts, one row each (default 1)")
    ap.add_argument("--repeats", type=int, default=15, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--models", default="cnn,mobilenet-v1", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--profile-onnx", action="store_true",
                    help="after the timings, profile the ONNX program per operator type (ONNX Runtime's profiler)")
    ap.add_argument("--profile-calls", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "train_step.json")
    args = ap.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",") if t]
    models = [m for m in args.models.split(",") if m]
    unknown = set(models) - set(SHAPES)
    if unknown:
        ap.error(f"unknown models {sorted(unknown)}; valid: {', '.join(SHAPES)}")
    load_before = os.getloadavg()[0]
    started = datetime.now(timezone.utc)
    results: list[dict[str, Any]] = []
    env = {k: os.environ.get(k) for k in THREAD_ENV}
    out = {
        "date": started.isoformat(timespec="seconds"),
        "finished": None,
        "command": " ".join([*(f"{k}={v}" for k, v in env.items() if v is not None), "python", *sys.argv]),
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "arch": platform.machine(),
                    "python": platform.python_version()},
        "versions": {"torch": torch.__version__, "onnxruntime": ort.__version__,
                     "executorch": importlib.metadata.version("executorch"), "numpy": np.__version__,
                     "onnx": importlib.metadata.version("onnx")},
        "thread_env": env,
        # threads of the process before any runtime ran (the interpreter's, plus what imports started: ONNX
        # Runtime's module starts one helper thread at import, idle in a timed wait, not a compute worker)
        "process_threads": {"at_start": threads_at_start},
        "load_average_1min": {"start": load_before, "end": None},
        "args": vars(args) | {"out": str(args.out)},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in models:
        ch, size = SHAPES[name]
        print(f"{name}: exporting", flush=True)
        prep = prepare(get_profile("phone-high"), spec=ModelSpec(name, 10, ch, size), seed=0)
        lowered, export_s = export_programs(prep, args)
        for t in thread_counts:
            results.append(measure(name, prep, lowered, export_s, t, args))
            # written after every row (a long run that dies keeps what it measured)
            out |= {"finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "load_average_1min": {"start": load_before, "end": os.getloadavg()[0]}}
            args.out.write_text(json.dumps(out, indent=1))
    print(format_table(table_rows(results), rule=True))
    print(f"results: {args.out}")


def table_rows(results: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = [(
        "model", "threads (torch/ORT added/ET pool)", "eager ms (p95)", "ORT step ms (p95)", "ORT call", "ORT/eager",
        "ET step ms (p95)", "ET call", "ET/eager", "export s ORT/ET", "program KB ORT/ET", "grad rel err ORT/ET",
        "other threads' CPU s", "others' cores busy")]
    for r in results:
        med, p95, ratio, chk = r["median_ms"], r["p95_ms"], r["over_eager"], r["thread_checks"]
        exp, size, err = r["export_s"], r["program_bytes"], r["grad_max_rel_err"]
        other = sum(chk["cpu_s_other_threads"].values())
        rows.append((
            str(r["model"]),
            f"{chk['torch_num_threads']}/{chk['onnxruntime_threads_added_by_session']}/{chk['executorch_threadpool']}",
            f"{med['eager']:.1f} ({p95['eager']:.1f})",
            f"{med['onnxruntime']:.1f} ({p95['onnxruntime']:.1f})", f"{med['onnxruntime call']:.1f}",
            f"x{ratio['onnxruntime']:.2f}",
            f"{med['executorch']:.1f} ({p95['executorch']:.1f})", f"{med['executorch call']:.1f}",
            f"x{ratio['executorch']:.2f}",
            f"{exp['onnxruntime']:.0f}/{exp['executorch']:.0f}",
            f"{size['onnxruntime'] / 1024:.0f}/{size['executorch'] / 1024:.0f}",
            f"{err['onnxruntime_vs_eager']:.1e}/{err['executorch_vs_eager']:.1e}", f"{other:.2f}",
            f"{r['other_processes_cores_busy']:.2f}"))
    return rows


if __name__ == "__main__":
    main()
