"""The demo federation's round overhead (bench/round_overhead.py) of this tree and of a previous commit, side by
side in one run: previous FedPer, this FedPer, previous DisPFL, this DisPFL, repeated.

Both trees are measured by this tree's bench/round_overhead.py (it parses the agents of both), each run in a child
process whose working directory and PYTHONPATH are that tree, so the script, the server and the device processes
it launches all import that tree (checked: each run records where its children import pfl_edge from). The
previous tree is a worktree, e.g. ``git worktree add /tmp/pfl-prev 976e24b``. Writes
bench/results/round_overhead_compare.json (per run: the script's per-round analysis, without per-device rows and
raw server records, which stay in each run's JSON under --work; pooled per-device phase medians in the summary)
and prints the medians.

    .venv/bin/python bench/compare_prev.py [--prev /tmp/pfl-prev] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
SCRIPT = HERE.parent / "round_overhead.py"

# per run, the figures compared (medians over its rounds, as round_overhead.py computes them)
FIELDS = ("median_overhead_pct_rounds_2_on", "median_system_overhead_pct_rounds_2_on", "median_wall_s_rounds_2_on",
          "median_overhead_pct", "median_cpu_utilisation", "median_close_s", "median_start_lag_s",
          "median_post_train_s", "total_s")


def run_one(tree: Path, algo: str, runs: Path, out: Path, quick: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(SCRIPT), "--algorithms", algo, "--runs", str(runs), "--out", str(out)]
    if quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"round_overhead.py on {tree} ({algo}) failed:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    print(proc.stdout.rstrip(), flush=True)
    res = json.loads(out.read_text())
    if Path(res["code"]["root"]).resolve() != tree.resolve():
        raise RuntimeError(f"a run meant for {tree} ran {res['code']['root']}")
    return dict(res)


def steady(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in run["rounds"] if r["round"] >= 2] or run["rounds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prev", type=Path, default=Path("/tmp/pfl-prev"))
    ap.add_argument("--algorithms", default="fedper,dispfl")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="3 rounds per federation")
    ap.add_argument("--work", type=Path, default=Path("/tmp/pfl-compare-prev"), help="run folders")
    ap.add_argument("--out", type=Path, default=HERE.parent / "results" / "round_overhead_compare.json")
    args = ap.parse_args()
    if not (args.prev / "pfl_edge" / "__init__.py").exists():
        raise SystemExit(f"no previous tree at {args.prev}: git worktree add {args.prev} <commit>")
    trees = {"prev": args.prev.resolve(), "new": REPO}
    algos = args.algorithms.split(",")
    load_start = os.getloadavg()
    started = datetime.now(UTC).isoformat(timespec="seconds")
    runs: dict[str, list[dict[str, Any]]] = {f"{a}_{t}": [] for a in algos for t in trees}
    meta: dict[str, Any] = {}
    for r in range(args.repeats):
        for algo in algos:
            for name, tree in trees.items():  # previous first, then this tree, per algorithm
                print(f"\n=== repeat {r + 1}/{args.repeats}: {algo} on {name} ({tree})", flush=True)
                res = run_one(tree, algo, args.work / name / str(r), args.work / f"{name}-{algo}-{r}.json",
                              args.quick)
                meta.setdefault(name, {"code": res["code"], "machine": res["machine"]})
                run = res["runs"][algo]
                for k in ("metrics", "updates", "names"):  # raw server records: in the run folders
                    run.pop(k, None)
                run["repeat"] = r + 1
                run["load_average"] = [res["load_average_start"], res["load_average_end"]]
                runs[f"{algo}_{name}"].append(run)

    summary: dict[str, Any] = {}
    for key, rs in runs.items():
        s: dict[str, Any] = {f: statistics.median(x[f] for x in rs) for f in FIELDS}
        s["per_repeat_overhead_pct_rounds_2_on"] = [x["median_overhead_pct_rounds_2_on"] for x in rs]
        s["per_repeat_wall_s_rounds_2_on"] = [x["median_wall_s_rounds_2_on"] for x in rs]
        rows = [row for x in rs for row in steady(x)]  # every steady round of every repeat
        s["pooled_rounds"] = len(rows)
        s["pooled_median_overhead_pct"] = statistics.median(row["overhead_pct"] for row in rows)
        s["pooled_median_system_overhead_pct"] = statistics.median(row["system_overhead_pct"] for row in rows)
        s["pooled_median_wall_s"] = statistics.median(row["wall_s"] for row in rows)
        s["pooled_median_slowest_compute_s"] = statistics.median(row["slowest_compute_s"] for row in rows)
        s["pooled_median_slowest_train_s"] = statistics.median(row["slowest_train_s"] for row in rows)
        s["pooled_median_slowest_eval_s"] = statistics.median(row["slowest_eval_s"] for row in rows)
        s["pooled_median_post_train_s"] = statistics.median(row["last"]["post_train_s"] for row in rows)
        # phases, every device of every steady round (round_overhead.py's per-device fields)
        devs = [d for row in rows for d in row.get("devices", [])]
        for f in ("start_lag_s", "train_s", "eval_s", "upload_s", "post_s", "post_train_s", "device_work_s"):
            xs = [d[f] for d in devs if d.get(f) is not None]
            if xs:
                s[f"pooled_median_device_{f}"] = statistics.median(xs)
        s["pooled_median_close_s"] = statistics.median(row["close_s"] for row in rows)
        s["solo_slowest_compute_s"] = statistics.median(x["solo"]["slowest_compute_s"] for x in rs)
        s["solo_slowest_device_work_s"] = statistics.median(x["solo"]["slowest_device_work_s"] for x in rs)
        s["train_stretch"] = statistics.median(x["solo"]["train_stretch"] for x in rs)
        summary[key] = s
    for algo in algos:
        p, n = summary[f"{algo}_prev"], summary[f"{algo}_new"]
        summary[f"{algo}_new_vs_prev"] = {
            "overhead_pct_points": n["median_overhead_pct_rounds_2_on"] - p["median_overhead_pct_rounds_2_on"],
            "system_overhead_pct_points": (n["median_system_overhead_pct_rounds_2_on"]
                                           - p["median_system_overhead_pct_rounds_2_on"]),
            "wall_s_ratio": n["median_wall_s_rounds_2_on"] / p["median_wall_s_rounds_2_on"],
            "pooled_wall_s_ratio": n["pooled_median_wall_s"] / p["pooled_median_wall_s"],
            "pooled_slowest_compute_s_ratio": (n["pooled_median_slowest_compute_s"]
                                               / p["pooled_median_slowest_compute_s"]),
        }
    for rs in runs.values():  # per-device rows: in each run's own JSON (--work); summarised above
        for x in rs:
            for row in x["rounds"]:
                row.pop("devices", None)
    result = {
        "date": started,
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "trees": meta,
        "order": "per repeat: " + ", ".join(f"{a} {t}" for a in algos for t in trees),
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))

    print(f"\n{'':14s} {'overhead % (rounds 2+)':>30s} {'system overhead %':>18s} {'round wall s':>13s} "
          f"{'slowest compute s':>18s} {'post-train s':>13s}")
    for algo in algos:
        for name in trees:
            s = summary[f"{algo}_{name}"]
            reps = " ".join(f"{x:.1f}" for x in s["per_repeat_overhead_pct_rounds_2_on"])
            print(f"{algo + ' ' + name:14s} {s['median_overhead_pct_rounds_2_on']:6.1f} ({reps:>20s}) "
                  f"{s['median_system_overhead_pct_rounds_2_on']:18.1f} {s['median_wall_s_rounds_2_on']:13.3f} "
                  f"{s['pooled_median_slowest_compute_s']:18.3f} {s['pooled_median_post_train_s']:13.3f}")
        d = summary[f"{algo}_new_vs_prev"]
        for name in trees:
            s = summary[f"{algo}_{name}"]
            print(f"  {name} phases (median, every device, rounds 2+): " + ", ".join(
                f"{f} {s[f'pooled_median_device_{f}_s']:.3f}" for f in ("start_lag", "eval", "train", "upload", "post")
                if f"pooled_median_device_{f}_s" in s) + f", close {s['pooled_median_close_s']:.3f} s")
        print(f"{algo} new - prev: overhead {d['overhead_pct_points']:+.1f} points, system overhead "
              f"{d['system_overhead_pct_points']:+.1f} points, round wall x{d['wall_s_ratio']:.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
