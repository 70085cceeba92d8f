"""Measure what a device class promises: inference latency (batch 1 and the profile's batch), one training
step, peak memory of each, artefact sizes.

Every measurement runs in a fresh (spawned) child process, so its peak RSS is its own: the peak is read from
/proc/self/status (VmHWM belongs to the process image, while ru_maxrss survives execve and would report the
parent's peak on Linux). On a real device this measures the device; anywhere else the numbers are this host's, run under
the profile's thread count, and the report says so.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import platform
import resource
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from device_profiles import Profile
from pfl_edge.checkpoint import ModelSpec, build_model

__all__ = ["Measurement", "measure", "profile_devices"]


@dataclass(frozen=True)
class Measurement:
    what: str  # "inference b1", "inference bN", "train step"
    backend: str
    batch: int
    median_ms: float
    p95_ms: float
    peak_rss_mb: float


def _timed(fn: Any, repeats: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def _peak_rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # elsewhere: KiB on most systems


def _child(kind: str, args: dict[str, Any], conn: Any) -> None:
    try:
        torch.set_num_threads(args["threads"])
        shape = (args["batch"], *args["input_shape"])
        if kind == "inference":
            from .backends import load_inference

            backend = load_inference(args["path"], args["runtime"], args["threads"])
            xs = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
            times = _timed(lambda: backend.run(xs), args["repeats"])
            name = backend.name
        else:
            from .backends import TorchTrainer

            torch.manual_seed(0)
            trainer = TorchTrainer(build_model(ModelSpec(**args["spec"])), threads=args["threads"])
            x = torch.randn(shape)
            y = torch.randint(0, args["spec"]["num_classes"], (args["batch"],))
            times = _timed(lambda: trainer.step(x, y), args["repeats"])
            name = trainer.name
        conn.send(("ok", name, times, _peak_rss_mb()))
    except Exception as e:  # sent to the parent, which raises it with context
        conn.send(("error", repr(e), [], 0.0))
    finally:
        conn.close()


def measure(kind: str, what: str, args: dict[str, Any], timeout_s: float = 600) -> Measurement:
    ctx = mp.get_context("spawn")  # a clean process: no memory of earlier measurements
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(kind, args, child))
    proc.start()
    child.close()
    if not parent.poll(timeout_s):
        proc.kill()
        raise RuntimeError(f"{what}: no result within {timeout_s} s")
    status, name, times, rss = parent.recv()
    proc.join()
    if status != "ok":
        raise RuntimeError(f"{what} failed in the measuring process: {name}")
    q = float(np.percentile(times, 95))
    return Measurement(what, name, args["batch"], statistics.median(times), q, rss)


def profile_devices(profiles: list[Profile], spec: ModelSpec, artefacts: dict[str, Path], out: Path,
                    *, repeats: int = 30) -> dict[str, Any]:
    """Measure every profile; ``artefacts`` maps a runtime to its exported file. Writes OUT/profile.json and
    OUT/profile.png and returns the report."""
    shape = (spec.in_channels, spec.image_size, spec.image_size)
    rows = []
    for prof in profiles:
        path = artefacts[prof.inference_runtime]
        base = {"threads": prof.threads, "input_shape": shape, "repeats": repeats}
        ms = [measure("inference", "inference b1", {**base, "batch": 1, "path": str(path),
                                                     "runtime": prof.inference_runtime}),
              measure("inference", f"inference b{prof.batch_size}",
                      {**base, "batch": prof.batch_size, "path": str(path), "runtime": prof.inference_runtime}),
              # the torch backend stands in where the profile asks for ExecuTorch training: its training
              # programs are not in this release
              measure("train", "train step", {**base, "batch": prof.batch_size, "spec": asdict(spec)})]
        rows.append({"profile": prof.name, "threads": prof.threads, "inference_runtime": prof.inference_runtime,
                     "training_backend_requested": prof.training_backend, "training_backend_used": "torch",
                     "artefact": path.name, "artefact_bytes": path.stat().st_size,
                     "measurements": [asdict(m) for m in ms]})
    report = {
        "model": asdict(spec),
        "host": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
        "note": "measured on this host under each profile's thread count, not on the device itself",
        "repeats": repeats,
        "profiles": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    _plot(report, out / "profile.png")
    return report


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["profile"] for r in report["profiles"]]
    kinds = ["inference b1", "inference bN", "train step"]
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    width = 0.27
    for k, kind in enumerate(kinds):
        vals = [r["measurements"][k]["median_ms"] for r in report["profiles"]]
        ax.bar([i + (k - 1) * width for i in range(len(names))], vals, width, label=kind)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_ylabel("median latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{report['model']['model']}: {report['note']}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
