"""``pfl-edge profile``: latency and memory of a model per device class."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import InternalError


def _cmd_profile(args: argparse.Namespace) -> int:
    """Export the model once per runtime the profiles need, then measure each device class."""
    from device_profiles import get_profile, list_profiles
    from edge_runtime import profile_devices
    from export import lower_executorch, lower_onnx, package, prepare, verify

    from ..checkpoint import ModelSpec
    from ..table import format_table

    names = list_profiles() if args.profiles == "all" else args.profiles.split(",")
    profiles = [get_profile(n) for n in names]
    spec = None if args.checkpoint else ModelSpec(args.model, args.num_classes, args.in_channels, args.image_size)
    artefacts: dict[str, Path] = {}
    for runtime, lower in (("onnxruntime", lower_onnx), ("executorch", lower_executorch)):
        needing = [p for p in profiles if p.inference_runtime == runtime]
        if needing:
            prep = prepare(needing[0], checkpoint=args.checkpoint, spec=spec)
            packaged = package(lower(prep), args.out / "artefacts")
            verify(packaged)
            artefacts[runtime] = packaged.path
            spec = prep.spec
    if spec is None:  # with a checkpoint, the spec comes from preparing it; no profile asked for a runtime
        raise InternalError("no inference runtime was prepared, so the model's spec is unknown")
    report = profile_devices(profiles, spec, artefacts, args.out, repeats=args.repeats)
    print(f"{spec.model}: {report['note']} ({report['host']})")
    header = ("profile", "thr", "runtime", "artefact KB", "infer b1 ms (p95)", "infer bN ms (p95)",
              "train step ms (p95)", "eager step ms", "program/eager", "peak RSS MB b1/bN/train")
    rows: list[tuple[str, ...]] = [header]
    for r in report["profiles"]:
        m = r["measurements"]
        rows.append((r["profile"], str(r["threads"]), r["inference_runtime"], f"{r['artefact_bytes'] / 1024:.0f}",
                     *(f"{x['median_ms']:.2f} ({x['p95_ms']:.2f}) b{x['batch']}" for x in m[:3]),
                     f"{m[3]['median_ms']:.2f}" if len(m) > 3 else "-",
                     f"x{r['program_over_eager']:.1f}" if r.get("program_over_eager") else "-",
                     "/".join(f"{x['peak_rss_mb']:.0f}" for x in m[:3])))
    print(format_table(rows))
    print(f"results: {args.out / 'profile.json'}  chart: {args.out / 'profile.png'}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("profile", help="measure latency and memory of a model per device class")
    p.add_argument("--model", default="cnn", help="for a fresh model")
    p.add_argument("--checkpoint", type=Path, help="a client checkpoint (default: a fresh model)")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--in-channels", type=int, default=1)
    p.add_argument("--image-size", type=int, default=28)
    p.add_argument("--profiles", default="all", help="all, or comma-separated profile names")
    p.add_argument("--repeats", type=int, default=30, help="timed runs per measurement (after 3 warm-up runs)")
    p.add_argument("--out", type=Path, default=Path("runs/profile"))
    p.set_defaults(func=_cmd_profile)
