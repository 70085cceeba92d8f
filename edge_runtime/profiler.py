"""Measure what a device class promises: inference latency (batch 1 and the profile's batch), one training
step (on the profile's training backend: eager torch, or an ExecuTorch training program, then also eager
torch's step beside it and the ratio), peak memory of each, artefact sizes.

Every measurement runs in a fresh (spawned) child process, so its peak RSS is its own: the peak is read from
/proc/self/status (VmHWM belongs to the process image, while ru_maxrss survives execve and would report the
parent's peak on Linux). On a real device this measures the device; anywhere else the numbers are this host's, run under
the profile's thread count, and the report says so.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import platform
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from device_profiles import Profile
from pfl_edge.checkpoint import ModelSpec, build_model

from .reports import peak_rss_mb

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
        elif args.get("training_backend") == "executorch":
            from pfl_edge.train import TrainConfig

            from .training import ExecuTorchBackend

            torch.manual_seed(0)
            program = ExecuTorchBackend.from_file(args["program"])
            program.load(build_model(ModelSpec(**args["spec"])).state_dict())
            sgd = program.sgd(TrainConfig(lr=0.01, momentum=0.9))
            x = torch.randn(shape)
            y = torch.randint(0, args["spec"]["num_classes"], (args["batch"],))

            def step() -> None:  # what a device's step costs: the program's forward and backward, then SGD
                _, grads = program.gradients(x, y)
                sgd.step(grads)

            times = _timed(step, args["repeats"])
            name = program.name
        else:
            from .backends import TorchTrainer

            torch.manual_seed(0)
            trainer = TorchTrainer(build_model(ModelSpec(**args["spec"])), threads=args["threads"])
            x = torch.randn(shape)
            y = torch.randint(0, args["spec"]["num_classes"], (args["batch"],))
            times = _timed(lambda: trainer.step(x, y), args["repeats"])
            name = trainer.name
        conn.send(("ok", name, times, peak_rss_mb()))
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


def _training_programs(profiles: list[Profile], spec: ModelSpec, out: Path,
                       given: Mapping[int, Path]) -> tuple[dict[int, Path], dict[int, str]]:
    """An ExecuTorch training program (whole model trainable) per batch size the ``executorch`` profiles use,
    exported into OUT/artefacts unless ``given``; and, per batch size, why there is none (export failed)."""
    from export import ExportError, lower_executorch_training, package, prepare

    programs, failed = dict(given), {}
    for prof in profiles:
        b = prof.batch_size
        if prof.training_backend != "executorch" or b in programs or b in failed:
            continue
        try:
            lowered = lower_executorch_training(prepare(prof, spec=spec), mode="fedper", batch_size=b)
        except ExportError as e:  # e.g. a BatchNorm model: measured with torch instead, and the report says why
            failed[b] = str(e)
            continue
        programs[b] = package(lowered, out / "artefacts").path
    return programs, failed


def profile_devices(profiles: list[Profile], spec: ModelSpec, artefacts: dict[str, Path], out: Path,
                    *, repeats: int = 30, training_artefacts: Mapping[int, Path] | None = None) -> dict[str, Any]:
    """Measure every profile; ``artefacts`` maps an inference runtime to its exported file. A profile whose
    training backend is ``executorch`` has its step measured on an ExecuTorch training program of its batch size
    (``training_artefacts``: batch size -> ``.pte`` with its manifest beside it; exported here when missing).
    Writes OUT/profile.json and OUT/profile.png and returns the report."""
    shape = (spec.in_channels, spec.image_size, spec.image_size)
    programs, failed = _training_programs(profiles, spec, out, training_artefacts or {})
    rows = []
    for prof in profiles:
        path = artefacts[prof.inference_runtime]
        base = {"threads": prof.threads, "input_shape": shape, "repeats": repeats}
        train_args: dict[str, Any] = {**base, "batch": prof.batch_size, "spec": asdict(spec)}
        program = programs.get(prof.batch_size) if prof.training_backend == "executorch" else None
        if program is not None:
            train_args.update(training_backend="executorch", program=str(program))
        ms = [measure("inference", "inference b1", {**base, "batch": 1, "path": str(path),
                                                     "runtime": prof.inference_runtime}),
              measure("inference", f"inference b{prof.batch_size}",
                      {**base, "batch": prof.batch_size, "path": str(path), "runtime": prof.inference_runtime}),
              measure("train", "train step", train_args)]
        if program is not None:  # beside the program, eager PyTorch's step on the same batch: what the program costs
            ms.append(measure("train", "train step eager", {k: v for k, v in train_args.items()
                                                             if k not in ("training_backend", "program")}))
        row: dict[str, Any] = {
            "profile": prof.name, "threads": prof.threads, "inference_runtime": prof.inference_runtime,
            # what ran the step, as the measuring process reports it, not what was asked for
            "training_backend_requested": prof.training_backend, "training_backend_used": ms[2].backend,
            "artefact": path.name, "artefact_bytes": path.stat().st_size,
            "training_artefact": None if program is None else program.name,
            "measurements": [asdict(m) for m in ms],
            # a phone-class device pays this multiple of eager PyTorch's step (on this host)
            "program_over_eager": ms[2].median_ms / ms[3].median_ms if len(ms) > 3 else None}
        if prof.training_backend == "executorch" and program is None:
            row["training_backend_note"] = f"no ExecuTorch training program: {failed.get(prof.batch_size)}"
        rows.append(row)
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
    kinds = ["inference b1", "inference bN", "train step", "train step eager"]
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    width = 0.2
    for k, kind in enumerate(kinds):
        vals = [r["measurements"][k]["median_ms"] if k < len(r["measurements"]) else 0.0 for r in report["profiles"]]
        ax.bar([i + (k - 1.5) * width for i in range(len(names))], vals, width, label=kind)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_ylabel("median latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{report['model']['model']}: {report['note']}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
