"""Batch-1 inference latency of the exported artefacts against eager PyTorch, side by side in one process, and
the accuracy cost of the int8 program on real data.

Latency: for each model, eager PyTorch (torch.no_grad, eval), ONNX Runtime, ExecuTorch (XNNPACK, fp32) and
ExecuTorch int8 (XNNPACK, post-training static quantisation), all on the same thread count, interleaved in rounds
so that load on a shared machine hits them alike; median and p95 of many single-sample calls. Also the artefact
sizes. Speed does not depend on the weights' values, so these are fresh models; the int8 program's activation
ranges are calibrated on random inputs here (they set scales, not the amount of work).

Accuracy: a briefly trained cnn (and mobilenet-v1 at 1x28x28) on Fashion-MNIST, int8 calibrated on training
images and checked with ``export.verify_int8`` on the whole test set: top-1 of float32 and int8, agreement.
Writes bench/results/inference_latency.json.

    .venv/bin/python bench/inference_latency.py [--threads 2] [--calls 200] [--accuracy-models cnn,mobilenet-v1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from device_profiles import get_profile
from edge_runtime import load_inference
from export import (
    ExportError,
    lower_executorch,
    lower_executorch_int8,
    lower_onnx,
    package,
    prepare,
    verify,
    verify_int8,
)
from pfl_edge.checkpoint import ModelSpec
from pfl_edge.data import get_dataset

MODELS = [("cnn", 1, 28), ("mobilenet-v1", 3, 32), ("resnet18-gn", 3, 32)]
# SGD learning rates for the accuracy models: the GroupNorm MobileNet stays at chance (top-1 0.10) after 300
# steps at the cnn's 0.05, and learns at 0.01
LEARNING_RATES = {"cnn": 0.05, "mobilenet-v1": 0.01}


def measure_model(name: str, ch: int, size: int, tmp: str, args: argparse.Namespace) -> dict[str, object]:
    prep = prepare(get_profile("raspberry-pi-5"), spec=ModelSpec(name, 10, ch, size))
    onnx_pkg = package(lower_onnx(prep), tmp)
    pte_pkg = package(lower_executorch(prep), tmp)
    for p in (onnx_pkg, pte_pkg):
        verify(p)
    int8_pkg = package(lower_executorch_int8(prep, torch.randn(64, ch, size, size,
                                                               generator=torch.Generator().manual_seed(1))), tmp)
    x = torch.randn(1, ch, size, size)
    xn = x.numpy()
    ort = load_inference(onnx_pkg.path, "onnxruntime", args.threads)
    et = load_inference(pte_pkg.path, "executorch", args.threads)
    et8 = load_inference(int8_pkg.path, "executorch", args.threads)

    def eager() -> None:
        with torch.no_grad():
            prep.model(x)

    runners: dict[str, Callable[[], object]] = {"eager": eager, "onnxruntime": lambda: ort.run(xn),
                                                "executorch": lambda: et.run(xn),
                                                "executorch-int8": lambda: et8.run(xn)}
    times: dict[str, list[float]] = {k: [] for k in runners}
    for fn in runners.values():
        for _ in range(20):
            fn()
    per_round = max(1, args.calls // args.rounds)
    for _ in range(args.rounds):  # interleaved rounds: drift on a shared machine hits every runtime alike
        for k, fn in runners.items():
            for _ in range(per_round):
                start = time.perf_counter()
                fn()
                times[k].append((time.perf_counter() - start) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {
        "model": name,
        "input": [ch, size, size],
        "median_ms": med,
        "p95_ms": {k: float(np.percentile(v, 95)) for k, v in times.items()},
        "speedup_vs_eager": {k: med["eager"] / v for k, v in med.items()},
        "int8_speedup_vs_fp32_executorch": med["executorch"] / med["executorch-int8"],
        "artefact_bytes": {"onnx": onnx_pkg.entry["bytes"], "executorch": pte_pkg.entry["bytes"],
                           "executorch-int8": int8_pkg.entry["bytes"]},
    }
    print(f"{name:13s} " + "  ".join(f"{k} {med[k]:.3f} ms (x{med['eager'] / med[k]:.2f})" for k in runners),
          flush=True)
    return row


def int8_accuracy(name: str, tmp: str, args: argparse.Namespace) -> dict[str, object]:
    """Train ``name`` briefly on Fashion-MNIST, lower it to int8 calibrated on training images, and compare
    top-1 on the whole test set with ``verify_int8`` (which raises past its thresholds)."""
    ds = get_dataset("fashion-mnist")
    spec = ModelSpec(name, ds.num_classes, ds.in_channels, ds.image_size)
    prep = prepare(get_profile("raspberry-pi-5"), spec=spec, seed=0)
    model = prep.model.train()
    lr = args.lr if args.lr is not None else LEARNING_RATES.get(name, 0.01)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _ in range(args.steps):
        idx = torch.randint(0, ds.train_x.shape[0], (64,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(ds.train_x[idx]), ds.train_y[idx]).backward()
        opt.step()
    model.eval()
    train_s = time.perf_counter() - start
    # calibration from the training split; the check on the test split, which calibration never saw
    calib = ds.train_x[torch.randperm(ds.train_x.shape[0], generator=gen)[: args.calibration]]
    pkg = package(lower_executorch_int8(prep, calib), tmp)
    row: dict[str, object] = {"model": name, "input": list(prep.input_shape), "train_steps": args.steps,
                              "batch": 64, "lr": lr, "train_s": train_s, "calibration_samples": args.calibration}
    try:
        report = verify_int8(pkg, ds.test_x, ds.test_y)
    except ExportError as e:  # a failed check is a result too: record it rather than lose the run
        print(f"{name:13s} int8 check FAILED: {e}", flush=True)
        return row | {"passed": False, "error": str(e)}
    row |= report
    print(f"{name:13s} fp32 top-1 {report['fp32_accuracy']:.4f}  int8 top-1 {report['int8_accuracy']:.4f}  "
          f"change {100 * (report['int8_accuracy'] - report['fp32_accuracy']):+.2f} points  "
          f"agreement {100 * report['top1_agreement']:.2f} %", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--accuracy-models", default="cnn,mobilenet-v1",
                    help="comma-separated; trained briefly on Fashion-MNIST for the int8 accuracy check ('' skips)")
    ap.add_argument("--steps", type=int, default=300, help="SGD steps of batch 64 for the accuracy models")
    ap.add_argument("--lr", type=float, default=None, help="one rate for all (default: per model, LEARNING_RATES)")
    ap.add_argument("--calibration", type=int, default=512, help="training images for int8 calibration")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "inference_latency.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure_model(name, ch, size, tmp, args) for name, ch, size in MODELS]
        accuracy = [int8_accuracy(name, tmp, args) for name in args.accuracy_models.split(",") if name]
    out = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads",
        "load_average_1min": {"start": load_before, "end": os.getloadavg()[0]},
        "args": vars(args) | {"out": str(args.out)},
        "results": results,
        "int8_accuracy": accuracy,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
