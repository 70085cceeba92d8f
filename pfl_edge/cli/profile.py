"""``pfl-edge profile``: latency and memory of a model per device class."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import InternalError


def _fleet_table(args: argparse.Namespace) -> int:
    """A running federation's per-class costs, as its devices report them (``GET .../classes``)."""
    import json

    from ..errors import ConfigError, DataError
    from ..fleet import ClassCosts, Spread
    from ..secret_file import read_secret_file
    from ..table import format_table
    from .report import fetch_live

    if not (args.federation and args.admin_token_file):
        raise ConfigError("profile --fleet URL needs --federation and --admin-token-file")
    raw = fetch_live(args.fleet, args.federation, read_secret_file(args.admin_token_file), ca_file=args.ca_file,
                     paths={"classes": "/classes"})["classes"]
    try:
        classes = [ClassCosts.model_validate(c) for c in json.loads(raw)]
    except ValueError as e:
        raise DataError(f"the server's classes answer is not a list of ClassCosts: {str(e)[:300]}") from None

    def spread(s: Spread, fmt: str, scale: float = 1.0) -> str:
        if not s.n or s.p50 is None or s.p95 is None:
            return "-"
        return f"{format(s.p50 * scale, fmt)} / {format(s.p95 * scale, fmt)}"

    rows: list[tuple[str, ...]] = [("profile", "devices", "reporting", "step ms p50/p95", "round s p50/p95",
                                    "transfer s p50/p95", "peak RSS MiB p50/p95", "up KB p50/p95",
                                    "down KB p50/p95")]
    for c in classes:
        rows.append((c.profile, str(c.devices), str(c.reporting), spread(c.step_ms, ".1f"), spread(c.round_s, ".2f"),
                     spread(c.transfer_s, ".3f"), spread(c.peak_rss_mb, ".0f"), spread(c.bytes_up, ".0f", 1 / 1024),
                     spread(c.bytes_down, ".0f", 1 / 1024)))
    print(f"federation {args.federation} at {args.fleet}: what each class's devices report their rounds cost "
          "(their own word), over every round they reported")
    print(format_table(rows))
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    """Export the model once per runtime the profiles need, then measure each device class (or, with
    ``--fleet``, print what a running federation's devices report per class)."""
    if args.fleet:
        return _fleet_table(args)
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
    p.add_argument("--fleet", metavar="URL", help="instead: a running server's URL, http(s)://host:port; prints the "
                                                  "per-class costs its federation's devices report")
    p.add_argument("--federation", help="with --fleet: the federation's id")
    p.add_argument("--admin-token-file", help="with --fleet: a file whose first line is the admin token")
    p.add_argument("--ca-file", help="with --fleet: the CA certificate an https:// server's must chain to")
    p.set_defaults(func=_cmd_profile)
