"""``pfl-edge emulate``: the demo's federation on an emulated fleet, each device held by the kernel to its
profile's speed, memory, links and round trip, coming and going on a seeded diurnal trace (docs/emulation.md)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from types import FrameType

from .common import _check_writable

__all__ = ["register"]


def _terminated(signum: int, frame: FrameType | None) -> None:
    sys.exit(128 + signum)  # SystemExit: the emulator's finally blocks undo its cgroups, namespaces and links


def _cmd_emulate(args: argparse.Namespace) -> int:
    from edge_runtime.emulation_plan import EmulationConfig
    from edge_runtime.emulator import run_emulation
    from edge_runtime.fleet import DemoConfig

    cfg = DemoConfig(devices=args.devices, rounds=args.rounds, algorithm=args.algorithm, fleet=args.fleet,
                     out=str(args.out), dataset=args.dataset, partition=args.partition, seed=args.seed,
                     samples_per_client=args.samples_per_client, local_epochs=args.local_epochs,
                     batch_size=args.batch_size, live=not args.no_progress, deadline_s=args.deadline_s,
                     timeout_s=args.timeout_s,
                     training_backend=None if args.training_backend == "profile" else args.training_backend)
    ecfg = EmulationConfig(dilation=args.dilation, cpu_budget=args.cpu_budget, period_us=args.cpu_period_us,
                           runtime_overhead_mb=args.runtime_overhead_mb, availability=args.availability,
                           day_s=args.day_s, start_hour=args.start_hour, mean_session_h=args.mean_session_h,
                           horizon_s=args.timeout_s)
    _check_writable(Path(args.out) / "metrics.json", None)
    before = signal.signal(signal.SIGTERM, _terminated)
    try:
        summary = run_emulation(cfg, ecfg)
    finally:
        signal.signal(signal.SIGTERM, before)
    return 0 if summary["finished"] else 1


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("emulate", help="a federation on an emulated fleet: each device held by the kernel to its "
                                       "profile (CPU quota, memory, shaped links, round trip, availability); root")
    p.add_argument("--fleet", default="mixed", help="device fleet the devices are drawn from (pfl-edge list)")
    p.add_argument("--devices", type=int, default=6, help="device processes (default 6)")
    p.add_argument("--rounds", type=int, default=10, help="rounds (default 10)")
    p.add_argument("--algorithm", default="fedper", help="fedper | fedper-ft | fedavg | dispfl | ...")
    p.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist (default) or synthetic")
    p.add_argument("--partition", default="pathological:2", help="non-IID split (default pathological:2)")
    p.add_argument("--samples-per-client", type=int, default=600)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="the run's seed: the federation's and the availability "
                                                       "traces' (default 0)")
    p.add_argument("--out", type=Path, default=Path("runs/emulate"), help="run folder (default runs/emulate)")
    p.add_argument("--deadline-s", type=float, default=600.0, help="a round's deadline (default 600)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="give up after (default 3600); also the "
                                                                   "availability traces' length")
    p.add_argument("--no-progress", action="store_true", help="no live table; one line per round")
    p.add_argument("--training-backend", choices=["torch", "profile"], default="torch",
                   help="torch (default) or each device's profile's backend")
    e = p.add_argument_group("emulation (docs/emulation.md)")
    e.add_argument("--dilation", type=float, default=None,
                   help="wall seconds per device second: quotas and link rates divided by it, round trips "
                        "multiplied (default: the least that keeps the quotas within --cpu-budget)")
    e.add_argument("--cpu-budget", type=float, default=None,
                   help="host cores the devices' quotas may add up to (default 60 %% of this host's)")
    e.add_argument("--cpu-period-us", type=int, default=100_000, help="cpu.cfs_period_us (default 100000)")
    e.add_argument("--runtime-overhead-mb", type=int, default=512,
                   help="added to each class's memory: what CPython and torch take (default 512)")
    e.add_argument("--availability", choices=["profile", "always"], default="profile",
                   help="profile (default): each class's (diurnal for phones); always: every device online")
    e.add_argument("--day-s", type=float, default=1200.0,
                   help="seconds one emulated day lasts, times the dilation on the wall clock (default 1200)")
    e.add_argument("--start-hour", type=float, default=20.0, help="local hour the run starts at (default 20)")
    e.add_argument("--mean-session-h", type=float, default=2.0,
                   help="mean online period of a diurnal device, in emulated hours (default 2)")
    p.set_defaults(func=_cmd_emulate)
