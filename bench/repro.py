"""Shared machinery of the reproduction benchmarks: run a table of configs (each run cached as JSON, so seeds
can be added later), then summarise whatever runs exist into JSON, Markdown and one PNG per table."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from pfl_edge.sim import SimConfig, plot_rounds, simulate, write_result


@dataclass(frozen=True)
class Row:
    name: str  # run file stem
    label: str  # in the table
    overrides: Mapping[str, Any]


@dataclass(frozen=True)
class Table:
    key: str
    title: str
    rows: tuple[Row, ...]


def command(budget: Mapping[str, Any], row: Row, seed: int) -> str:
    cfg = {**budget, **row.overrides, "seed": seed}
    options = cfg.pop("options", None) or {}
    privacy = cfg.pop("privacy", None) or {}
    secure = cfg.pop("secure_aggregation", None)
    flags = " ".join([f"--{k.replace('_', '-')} {','.join(map(str, v)) if isinstance(v, tuple) else v}"
                      for k, v in cfg.items()] + [f"--option {k}={v}" for k, v in options.items()]
                     + [f"--privacy {k}={v}" for k, v in privacy.items()]
                     + ([] if secure is None else
                        [" ".join(["--secure-aggregation", *(f"{k}={v}" for k, v in secure.items())])]))
    return f"pfl-edge simulate {flags} --out {row.name}-s{seed}.json"


def run_all(tables: list[Table], budget: Mapping[str, Any], seeds: list[int], out: Path, *,
            interleave: bool = False, only: set[str] | None = None) -> None:
    """Every row of ``tables`` for every seed (cached). ``interleave``: the first row of every table, then the
    second of every table, ... (so a run cut short has the head of each table). ``only``: these rows' names."""
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    if interleave:
        order = [t.rows[i] for i in range(max(len(t.rows) for t in tables)) for t in tables if i < len(t.rows)]
    else:
        order = [row for t in tables for row in t.rows]
    todo = {(row.name, seed): row for row in order for seed in seeds if only is None or row.name in only}
    for i, ((name, seed), row) in enumerate(todo.items(), 1):
        path = runs / f"{name}-s{seed}.json"
        if path.exists():
            continue
        start = time.perf_counter()
        # a run of hours shows where it is: the bar written to the log once a minute (tqdm reads TQDM_* defaults)
        os.environ.setdefault("TQDM_MININTERVAL", "60")
        res = simulate(SimConfig.from_dict({**budget, **row.overrides, "seed": seed}), progress=True)
        write_result(res, path)
        print(f"[{i}/{len(todo)}] {name} seed {seed}: final {res['final']['mean_acc']:.3f} "
              f"(std {res['final']['std_acc']:.3f}) in {time.perf_counter() - start:.0f}s", flush=True)


def row_summary(res: list[dict[str, Any]]) -> dict[str, Any]:
    finals = [r["final"]["mean_acc"] for r in res]
    rounds = [r["rounds"] for r in res]
    return {
        "seeds": [r["config"]["seed"] for r in res],
        "final_mean_acc": statistics.fmean(finals),
        "final_mean_acc_sd_over_seeds": statistics.pstdev(finals) if len(finals) > 1 else None,
        # the last five rounds' mean accuracy: less sensitive to round-to-round oscillation than the final one
        "last5_mean_acc": statistics.fmean(statistics.fmean(x["mean_acc"] for x in rs[-5:]) for rs in rounds),
        "client_std_acc": statistics.fmean(r["final"]["std_acc"] for r in res),
        # rounds to reach 90 % of the method's own final accuracy: a convergence-speed figure
        "round_to_90pct": statistics.fmean(
            next(x["round"] for x in rs if x["mean_acc"] >= 0.9 * r["final"]["mean_acc"])
            for r, rs in zip(res, rounds, strict=True)),
        "busiest_node_mb_per_round": statistics.fmean(x["busiest_node_bytes"] for rs in rounds for x in rs) / 1e6,
        # one direction, as the DisPFL paper counts: the most any node receives (older runs: not recorded)
        "busiest_node_received_mb_per_round": (
            statistics.fmean(x["busiest_node_received"] for rs in rounds for x in rs) / 1e6
            if all("busiest_node_received" in x for rs in rounds for x in rs) else None),
        # per participating client: a centralised round samples a fraction of the clients
        "client_mb_up_per_round": statistics.fmean(x["bytes_up"] / len(x.get("participants", x["client_acc"]))
                                                   for rs in rounds for x in rs) / 1e6,
        # runs made before FLOP accounting existed have none: None, not 0
        "gflops_per_client_round": (statistics.fmean(x["flops"] for rs in rounds for x in rs) / 1e9
                                    if all("flops" in x for rs in rounds for x in rs) else None),
        "mean_density": statistics.fmean(statistics.fmean(x.get("client_density", [1.0])) for rs in rounds
                                         for x in rs),
        "wall_s": statistics.fmean(r["meta"]["total_s"] for r in res),
    }


def summarise(tables: list[Table], budget: Mapping[str, Any], out: Path, rel: str) -> dict[str, Any]:
    """``rel``: the results folder as BENCHMARKS.md links to it."""
    runs = out / "runs"
    summary: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
        "budget": dict(budget),
        "tables": {},
    }
    md = [f"Budget for every method: `{json.dumps(dict(budget))}`.", ""]
    for table in tables:
        rows, curves = [], {}
        for row in table.rows:
            files = sorted(runs.glob(f"{row.name}-s*.json"))
            if not files:
                continue
            res = [json.loads(f.read_text()) for f in files]
            rows.append({"run": row.name, "label": row.label, **row_summary(res),
                         "command": command(budget, row, res[0]["config"]["seed"])})
            curves[row.label] = res[0]
        if not rows:
            continue
        summary["tables"][table.key] = rows
        plot_rounds(curves, out / f"table{table.key}.png", title=table.title)
        md += [f"**Table {table.key}**: {table.title}", "",
               "| method | final mean acc | last-5-rounds mean | std across clients | round to 90 % of final "
               "| busiest node MB/round (sent + received) | busiest node MB/round (received) "
               "| MB up/participant/round | GFLOPs/participant/round | density | seeds |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            sd = r["final_mean_acc_sd_over_seeds"]
            acc = f"{r['final_mean_acc']:.3f}" + (f" ± {sd:.3f}" if sd is not None else "")
            md.append(f"| {r['label']} | {acc} | {r['last5_mean_acc']:.3f} | {r['client_std_acc']:.3f} | "
                      f"{r['round_to_90pct']:.1f} | "
                      f"{r['busiest_node_mb_per_round']:.2f} | {_num(r['busiest_node_received_mb_per_round'])} | "
                      f"{r['client_mb_up_per_round']:.2f} | "
                      f"{_num(r['gflops_per_client_round'])} | {r['mean_density']:.2f} | {len(r['seeds'])} |")
        md += ["", f"![table {table.key}]({rel}/table{table.key}.png)", ""]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text("\n".join(md))
    return summary


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def main(doc: str | None, tables: list[Table], budget: Mapping[str, Any], name: str,
         after: Callable[[Path], None] | None = None, *, interleave: bool = False) -> None:
    """The command line of a reproduction script: run the chosen tables and seeds (cached), then summarise
    into bench/results/NAME; ``after`` adds what else the script draws from the runs."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", default=",".join(t.key for t in tables))
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / name)
    ap.add_argument("--summary-only", action="store_true")
    # two workers of one thread each (OMP_NUM_THREADS=1) finish a table sooner than one of two threads: a small
    # model's step does not scale over threads
    ap.add_argument("--rows", default="", help="run only these rows (comma-separated names)")
    args = ap.parse_args()
    if not args.summary_only:
        chosen = [t for t in tables if t.key in args.tables.split(",")]
        run_all(chosen, budget, [int(s) for s in args.seeds.split(",")], args.out, interleave=interleave,
                only=set(args.rows.split(",")) if args.rows else None)
    summarise(sorted(tables, key=lambda t: t.key), budget, args.out, f"bench/results/{name}")
    if after is not None:
        after(args.out)
    print((args.out / "summary.md").read_text())
