"""One SGD training step of an ExecuTorch training program against eager PyTorch, side by side in one process.

For each model: a fresh model (speed does not depend on the weights' values), its whole-model ExecuTorch training
program (``export.lower_executorch_training``, mode fedper, fixed batch) and the same model in eager PyTorch, one
thread. A step is what a device runs per batch:

- eager: ``zero_grad``, forward, cross-entropy, backward, ``torch.optim.SGD.step`` (momentum 0.9);
- executorch: ``ExecuTorchBackend.gradients`` (the gradient program: weights and batch in, loss and gradients
  out, XNNPACK running what it supports) plus its SGD step (``ProgramSGD``: pfl_edge.sgd.SGD on the device's
  numpy weights). The two parts are timed separately too. ``--baseline`` also times, in the same loop, the program as
  it was before issue 16: ``aten.convolution`` on the runtime's portable kernels, no delegate.

Interleaved (one eager step, one ExecuTorch step, repeat) so that load on a shared machine hits both alike;
medians and p95. Also the export time, the program size, and the gradient difference from eager on the first
batch (a check that the two compute the same thing), beside eager float32's own difference from float64.
Writes bench/results/train_step.json and prints a table.

    .venv/bin/python bench/train_step.py [--batch 32] [--threads 1] [--repeats 5] [--models cnn,mobilenet-v1]
                                         [--baseline]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from device_profiles import get_profile
from edge_runtime import ExecuTorchBackend
from export import lower_executorch_training, prepare
from pfl_edge.checkpoint import ModelSpec
from pfl_edge.table import format_table
from pfl_edge.train import TrainConfig

SHAPES = {"cnn": (1, 28), "mobilenet-v1": (3, 32), "resnet18-gn": (3, 32)}


def measure_model(name: str, args: argparse.Namespace) -> dict[str, object]:
    ch, size = SHAPES[name]
    prep = prepare(get_profile("phone-high"), spec=ModelSpec(name, 10, ch, size), seed=0)
    start = time.perf_counter()
    lowered = lower_executorch_training(prep, mode="fedper", batch_size=args.batch)
    export_s = time.perf_counter() - start
    backend = ExecuTorchBackend.from_lowered(lowered)
    backend.load(prep.model.state_dict())
    cfg = TrainConfig(lr=0.01, momentum=0.9)
    sgd = backend.sgd(cfg)
    # the program as it was before issue 16 (aten.convolution on portable kernels, no delegate), in the same loop
    before = None
    if args.baseline:
        before = ExecuTorchBackend.from_lowered(lower_executorch_training(
            prep, mode="fedper", batch_size=args.batch, convolutions="native", delegate="none"))
        before.load(prep.model.state_dict())
    model = prep.model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, ch, size, size, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)

    # same weights, same batch: the gradients must agree before the timings mean anything. Against a float64
    # eager reference too, which says how much float32 rounding alone moves them (deep GroupNorm stacks at a
    # fresh init are ill-conditioned: the mean gradient is a small difference of large per-sample ones)
    _, grads = backend.gradients(x, y)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    ref64 = copy.deepcopy(model).double()
    F.cross_entropy(ref64(x.double()), y).backward()
    g32 = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    g64 = {k: p.grad for k, p in ref64.named_parameters() if p.grad is not None}
    grad_err = max(float((g - grads[k]).abs().max()) for k, g in g32.items())

    def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:  # worst tensor, norm-wise
        return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm()) for k in b)

    rel_errs = {"executorch_vs_eager": rel(grads, g32), "executorch_vs_float64": rel(grads, g64),
                "eager_vs_float64": rel(g32, g64)}

    def eager() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    times: dict[str, list[float]] = {"eager": [], "executorch": [], "executorch forward+backward": [],
                                     "executorch sgd": []}
    if before is not None:
        times["before (native convolutions, no delegate)"] = []
    for _ in range(args.warmup):
        eager()
        sgd.step(backend.gradients(x, y)[1])
    for _ in range(args.repeats):  # interleaved: drift on a shared machine hits both alike
        t0 = time.perf_counter()
        eager()
        t1 = time.perf_counter()
        _, g = backend.gradients(x, y)
        t2 = time.perf_counter()
        sgd.step(g)
        t3 = time.perf_counter()
        times["eager"].append((t1 - t0) * 1e3)
        times["executorch"].append((t3 - t1) * 1e3)
        times["executorch forward+backward"].append((t2 - t1) * 1e3)
        times["executorch sgd"].append((t3 - t2) * 1e3)
        if before is not None:
            t4 = time.perf_counter()
            before.gradients(x, y)
            times["before (native convolutions, no delegate)"].append((time.perf_counter() - t4) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    row: dict[str, object] = {
        "model": name, "input": [ch, size, size], "batch": args.batch,
        "params": sum(p.numel() for p in model.parameters()),
        "median_ms": med, "p95_ms": {k: float(np.percentile(v, 95)) for k, v in times.items()},
        "executorch_over_eager": med["executorch"] / med["eager"],
        "before_over_eager": (med["before (native convolutions, no delegate)"] / med["eager"]
                              if before is not None else None),
        "export_s": export_s, "program_bytes": len(lowered.program), "grad_max_abs_err": grad_err,
        "grad_max_rel_err": rel_errs,
    }
    print(f"{name:13s} eager {med['eager']:.1f} ms  executorch {med['executorch']:.1f} ms "
          f"(x{med['executorch'] / med['eager']:.1f})  grad err {grad_err:.1e} abs, relative "
          + ", ".join(f"{k} {v:.1e}" for k, v in rel_errs.items()), flush=True)
    return row


def rel_errs_of(row: dict[str, object], key: str) -> float:
    errs = row["grad_max_rel_err"]
    assert isinstance(errs, dict)
    return float(errs[key])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--baseline", action="store_true",
                    help="also time the pre-issue-16 program (native convolutions, no delegate) in the same loop")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per backend (ExecuTorch steps are slow)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--models", default="cnn,mobilenet-v1", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "train_step.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    results = [measure_model(name, args) for name in args.models.split(",") if name]
    out = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads",
        "load_average_1min": {"start": load_before, "end": os.getloadavg()[0]},
        "args": vars(args) | {"out": str(args.out)},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    rows: list[tuple[str, ...]] = [("model", "batch", "eager ms (p95)", "executorch ms (p95)", "of which fwd+bwd",
                                    "of which sgd", "ratio", "before ratio", "program MB", "export s",
                                    "grad rel err ET/eager", "eager/fp64")]
    for r in results:
        med, p95 = r["median_ms"], r["p95_ms"]
        assert isinstance(med, dict) and isinstance(p95, dict)
        rows.append((str(r["model"]), str(r["batch"]), f"{med['eager']:.1f} ({p95['eager']:.1f})",
                     f"{med['executorch']:.1f} ({p95['executorch']:.1f})",
                     f"{med['executorch forward+backward']:.1f}", f"{med['executorch sgd']:.2f}",
                     f"x{r['executorch_over_eager']:.1f}",
                     "-" if r["before_over_eager"] is None else f"x{float(str(r['before_over_eager'])):.1f}",
                     f"{int(str(r['program_bytes'])) / 2**20:.1f}",
                     f"{float(str(r['export_s'])):.1f}", f"{rel_errs_of(r, 'executorch_vs_eager'):.1e}",
                     f"{rel_errs_of(r, 'eager_vs_float64'):.1e}"))
    print(format_table(rows, rule=True))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
