"""One replica against N, side by side in one run: ``bench/fleet_load.py`` on the same set-up (PostgreSQL, a
K-node RabbitMQ cluster asking the servers' hook, HAProxy in front of the replicas) with ``--replicas 1`` and
then ``--replicas N``; enrolments/s and each round's time of both, and their ratios.

    .venv/bin/python bench/replica_scale.py --devices 2000 --replicas 3 [--broker-nodes 2] [--rounds 1]

Writes ``bench/results/replica_scale_<devices>.json`` (both runs' whole reports under ``runs``)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run(n: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / "fleet_load.py"), "--devices", str(args.devices), "--rounds", str(args.rounds),
           "--replicas", str(n), "--broker", args.broker, "--broker-nodes", str(args.broker_nodes), "--out", str(out)]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stdout if args.verbose else subprocess.DEVNULL)
    return dict(json.loads(out.read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2000)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--broker", default="rabbitmq", choices=["rabbitmq", "mosquitto"])
    ap.add_argument("--broker-nodes", type=int, default=2)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    res = HERE / "results"
    res.mkdir(exist_ok=True)
    one = run(1, args, res / f"replica_scale_{args.devices}_r1.json")
    many = run(args.replicas, args, res / f"replica_scale_{args.devices}_r{args.replicas}.json")

    def row(r: dict[str, Any]) -> dict[str, Any]:
        return {"enrolments_per_s": r["enrolments_per_s"], "errors": r["errors"],
                "device_failures": r["device_failures"], "wall_s": r["wall_s"],
                "round_wall_s": [x["wall_s"] for x in r["rounds"]],
                "updates_per_s": [x["updates_per_s"] for x in r["rounds"]],
                "peak_rss_mb_by_process": r["peak_rss_mb_by_process"], "load_average_after": r["load_average_after"]}

    a, b = row(one), row(many)
    ratio = {"enrolments_per_s": b["enrolments_per_s"] / a["enrolments_per_s"],
             "round_wall_s": [y / x for x, y in zip(a["round_wall_s"], b["round_wall_s"], strict=True) if x and y]}
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
              "args": {k: str(v) for k, v in vars(args).items()}, "one": a, f"replicas_{args.replicas}": b,
              "ratio_many_over_one": ratio}
    out = args.out or res / f"replica_scale_{args.devices}.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
