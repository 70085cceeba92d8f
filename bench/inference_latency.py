"""Batch-1 inference latency of the exported artefacts against eager PyTorch, side by side in one process.

For each model: eager PyTorch (torch.no_grad, eval), ONNX Runtime and ExecuTorch (XNNPACK, fp32), all on the same
thread count, interleaved in rounds so that load on a shared machine hits them alike; median and p95 of many
single-sample calls. Also the artefact sizes. Writes bench/results/inference_latency.json.

    .venv/bin/python bench/inference_latency.py [--threads 2] [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from device_profiles import get_profile
from edge_runtime import load_inference
from export import lower_executorch, lower_onnx, package, prepare, verify
from pfl_edge.checkpoint import ModelSpec

MODELS = [("cnn", 1, 28), ("mobilenet-v1", 3, 32), ("resnet18-gn", 3, 32)]


def measure_model(name: str, ch: int, size: int, tmp: str, args: argparse.Namespace) -> dict[str, object]:
    prep = prepare(get_profile("raspberry-pi-5"), spec=ModelSpec(name, 10, ch, size))
    onnx_pkg = package(lower_onnx(prep), tmp)
    pte_pkg = package(lower_executorch(prep), tmp)
    for p in (onnx_pkg, pte_pkg):
        verify(p)
    x = torch.randn(1, ch, size, size)
    xn = x.numpy()
    ort = load_inference(onnx_pkg.path, "onnxruntime", args.threads)
    et = load_inference(pte_pkg.path, "executorch", args.threads)

    def eager() -> None:
        with torch.no_grad():
            prep.model(x)

    runners = {"eager": eager, "onnxruntime": lambda: ort.run(xn), "executorch": lambda: et.run(xn)}
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
        "median_ms": med,
        "p95_ms": {k: float(np.percentile(v, 95)) for k, v in times.items()},
        "speedup_vs_eager": {k: med["eager"] / v for k, v in med.items()},
        "artefact_bytes": {"onnx": onnx_pkg.entry["bytes"], "executorch": pte_pkg.entry["bytes"]},
    }
    print(f"{name:13s} " + "  ".join(f"{k} {med[k]:.3f} ms (x{med['eager'] / med[k]:.2f})" for k in runners),
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "inference_latency.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure_model(name, ch, size, tmp, args) for name, ch, size in MODELS]
    out = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, torch {torch.__version__}, {args.threads} threads",
        "args": vars(args) | {"out": str(args.out)},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
