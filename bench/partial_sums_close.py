"""A round's close with and without partial sums, side by side in one run: ``bench/fleet_load.py`` on the same
set-up (N replicas behind HAProxy, PostgreSQL, Mosquitto) without and then with ``--partial-sums``; for each
round, the close (the leader's closing -> published: reading the updates or merging the replicas' sums), the
round's wall time and the replicas' CPU, and their ratios. With ``--norm-multiples 3,1`` (issue 49: the default
multiple went from 3 to 1), instead: sums on at each ``norm_multiple`` in turn, then sums off at the last one
(every update read: the reference), in one run; ratios against the first multiple's close.

    .venv/bin/python bench/partial_sums_close.py --devices 1000 --replicas 3 [--rounds 2]
    .venv/bin/python bench/partial_sums_close.py --devices 1000 --replicas 3 --rounds 1 --norm-multiples 3,1

Writes ``bench/results/partial_sums_close_<devices>.json`` (both runs' whole reports beside it), with
``--norm-multiples`` ``partial_sums_close_<devices>_norm_multiples.json`` (and each run's beside it)."""

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


def run(sums: bool, args: argparse.Namespace, out: Path, norm_multiple: float | None = None) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / "fleet_load.py"), "--devices", str(args.devices), "--rounds", str(args.rounds),
           "--replicas", str(args.replicas), "--broker", "mosquitto", "--deadline-s", str(args.deadline_s),
           "--out", str(out), *(["--partial-sums"] if sums else []),
           *([] if norm_multiple is None else ["--norm-multiple", str(norm_multiple)])]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stdout if args.verbose else subprocess.DEVNULL)
    return dict(json.loads(out.read_text()))


def closes(r: dict[str, Any]) -> list[float | None]:
    """Each round's closing -> published time, from the states the run logged once a second."""
    out: list[float | None] = []
    for t in range(1, int(r["args"]["rounds"]) + 1):
        at = {e["state"]: e["t"] for e in r["states"] if e["round"] == t}
        end = at.get("published", at.get("finished"))  # the last round goes straight to finished
        out.append(end - at["closing"] if "closing" in at and end is not None else None)
    return out


def row(r: dict[str, Any]) -> dict[str, Any]:
    cpu = {k: v for k, v in r.items() if k.startswith("server") and k.endswith("_cpu_s")}
    return {"close_s": closes(r), "round_wall_s": [x["wall_s"] for x in r["rounds"]],
            "updates": [x["updates"] for x in r["rounds"]], "errors": r["errors"],
            "device_failures": r["device_failures"], "servers_cpu_s": sum(v for v in cpu.values() if v),
            "ledger_check": r.get("ledger_check"), "peak_rss_mb_by_process": r["peak_rss_mb_by_process"],
            "load_average_after": r["load_average_after"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--deadline-s", type=float, default=300.0)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--norm-multiples", default=None, help="e.g. 3,1: sums on at each multiple, then off at the last")
    args = ap.parse_args()
    res = HERE / "results"
    res.mkdir(exist_ok=True)
    if args.norm_multiples:
        by_multiple(args, res)
        return
    off = row(run(False, args, res / f"partial_sums_close_{args.devices}_off.json"))
    on = row(run(True, args, res / f"partial_sums_close_{args.devices}_on.json"))
    ratio = [b / a for a, b in zip(off["close_s"], on["close_s"], strict=True) if a and b]
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
              "args": {k: str(v) for k, v in vars(args).items()}, "sums_off": off, "sums_on": on,
              "close_on_over_off": ratio}
    out = res / f"partial_sums_close_{args.devices}.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"wrote {out}")


def by_multiple(args: argparse.Namespace, res: Path) -> None:
    """``--norm-multiples``: sums on at each multiple, then sums off at the last, side by side in one run."""
    ms = [float(x) for x in args.norm_multiples.split(",")]
    stem = f"partial_sums_close_{args.devices}_nm"
    runs = {f"sums_on_nm{m:g}": row(run(True, args, res / f"{stem}{m:g}_on.json", m)) for m in ms}
    runs[f"sums_off_nm{ms[-1]:g}"] = row(run(False, args, res / f"{stem}{ms[-1]:g}_off.json", ms[-1]))
    first = runs[f"sums_on_nm{ms[0]:g}"]["close_s"]
    ratio = {k: [b / a for a, b in zip(first, r["close_s"], strict=True) if a and b] for k, r in runs.items()}
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
              "args": {k: str(v) for k, v in vars(args).items()}, **runs, f"close_over_sums_on_nm{ms[0]:g}": ratio}
    out = res / f"partial_sums_close_{args.devices}_norm_multiples.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
