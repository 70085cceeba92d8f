"""Reproduce, in kind, the FedPer paper's findings on Fashion-MNIST (ALGORITHMS.md; issue 2).

One budget for every method: the cnn, 1,000 training samples per client, 2 local epochs, 30 rounds, batch 32,
SGD lr 0.01 momentum 0.9, all clients every round. Tables:
  1. pathological:4 / :8 / :10, 10 clients: FedAvg vs FedPer (K_P = 2)
  2. the preference task (stands in for FLICKR-AES), 30 clients: FedAvg, FedPer, local
  3. pathological:4, 10 clients: K_P = 0..4, local, the linear base, FedPer-FT

Every run is one ``simulate`` call, written to OUT/runs/NAME-sSEED.json (an existing file is reused, so more
seeds can be added later); OUT/summary.json, OUT/summary.md and a PNG per table are made from whatever runs
exist. Run it in the background:

    nohup .venv/bin/python bench/fedper_repro.py --seeds 0 > bench/results/fedper/log.txt 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pfl_edge.sim import SimConfig, plot_rounds, simulate, write_result

BUDGET = dict(model="cnn", dataset="fashion-mnist", samples_per_client=1000, local_epochs=2, rounds=30,
              batch_size=32, lr=0.01, momentum=0.9, participation=1.0)

# table -> list of (run name, label in the table, config overrides)
TABLES: dict[str, list[tuple[str, str, dict[str, Any]]]] = {
    "1": [(f"{alg}-patho{k}", f"{alg} k={k}", dict(algorithm=alg, partition=f"pathological:{k}", clients=10, kp=2))
          for k in (4, 8, 10) for alg in ("fedavg", "fedper")],
    "2": [(f"{alg}-pref", alg, dict(algorithm=alg, partition="preference", clients=30, kp=2))
          for alg in ("fedavg", "fedper", "local")],
    "3": [("fedavg-patho4", "K_P=0 (FedAvg)", dict(algorithm="fedavg", partition="pathological:4", clients=10)),
          *[(f"fedper-kp{kp}-patho4" if kp != 2 else "fedper-patho4", f"K_P={kp}",
             dict(algorithm="fedper", partition="pathological:4", clients=10, kp=kp)) for kp in (1, 2, 3, 4)],
          ("local-patho4", "local", dict(algorithm="local", partition="pathological:4", clients=10)),
          ("fedper-linear-patho4", "linear base, K_P=2",
           dict(algorithm="fedper", partition="pathological:4", clients=10, kp=2, base="linear")),
          ("fedper-ft-patho4", "FedPer-FT, K_P=2",
           dict(algorithm="fedper-ft", partition="pathological:4", clients=10, kp=2))],
}
TITLES = {
    "1": "FedAvg vs FedPer (K_P=2) as classes per client k grow; 10 clients",
    "2": "Preference task (user-dependent labels; stands in for FLICKR-AES); 30 clients",
    "3": "K_P sweep and controls; pathological:4, 10 clients",
}


def command(name: str, overrides: dict[str, Any], seed: int) -> str:
    cfg = {**BUDGET, **overrides, "seed": seed}
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in cfg.items())
    return f"pfl-edge simulate {flags} --out {name}-s{seed}.json"


def run_all(tables: list[str], seeds: list[int], out: Path) -> None:
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    todo = {(name, seed): ov for t in tables for name, _, ov in TABLES[t] for seed in seeds}
    for i, ((name, seed), ov) in enumerate(todo.items(), 1):
        path = runs / f"{name}-s{seed}.json"
        if path.exists():
            continue
        start = time.perf_counter()
        res = simulate(SimConfig(**{**BUDGET, **ov, "seed": seed}), progress=False)
        write_result(res, path)
        print(f"[{i}/{len(todo)}] {name} seed {seed}: final {res['final']['mean_acc']:.3f} "
              f"(std {res['final']['std_acc']:.3f}) in {time.perf_counter() - start:.0f}s", flush=True)


def summarise(out: Path) -> dict[str, Any]:
    runs = out / "runs"
    summary: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "budget": BUDGET,
        "tables": {},
    }
    md = [f"Budget for every method: {json.dumps(BUDGET)}.", ""]
    for t, rows in TABLES.items():
        table = []
        curves = {}
        for name, label, ov in rows:
            files = sorted(runs.glob(f"{name}-s*.json"))
            if not files:
                continue
            res = [json.loads(f.read_text()) for f in files]
            finals = [r["final"]["mean_acc"] for r in res]
            spreads = [r["final"]["std_acc"] for r in res]
            # rounds to reach 90 % of the method's own final accuracy: a convergence-speed figure
            speed = [next(x["round"] for x in r["rounds"] if x["mean_acc"] >= 0.9 * r["final"]["mean_acc"])
                     for r in res]
            table.append({
                "run": name, "label": label, "seeds": [r["config"]["seed"] for r in res],
                "final_mean_acc": statistics.fmean(finals),
                "final_mean_acc_sd_over_seeds": statistics.pstdev(finals) if len(finals) > 1 else None,
                "client_std_acc": statistics.fmean(spreads),
                "round_to_90pct": statistics.fmean(speed),
                "mb_up_per_client_round": res[0]["rounds"][0]["client_bytes_up"][0] / 1e6,
                "command": command(name, ov, res[0]["config"]["seed"]),
            })
            curves[label] = res[0]
        if not table:
            continue
        summary["tables"][t] = table
        plot_rounds(curves, out / f"table{t}.png", title=TITLES[t])
        md += [f"**Table {t}**: {TITLES[t]}", "",
               "| method | final mean acc | std across clients | round to 90 % of final "
               "| MB up / client / round | seeds |",
               "|---|---|---|---|---|---|"]
        for row in table:
            sd = row["final_mean_acc_sd_over_seeds"]
            acc = f"{row['final_mean_acc']:.3f}" + (f" ± {sd:.3f}" if sd is not None else "")
            md.append(f"| {row['label']} | {acc} | {row['client_std_acc']:.3f} | {row['round_to_90pct']:.1f} | "
                      f"{row['mb_up_per_client_round']:.2f} | {len(row['seeds'])} |")
        md += ["", f"![table {t}](results/fedper/table{t}.png)", ""]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text("\n".join(md))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", default="1,2,3")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fedper")
    ap.add_argument("--summary-only", action="store_true")
    args = ap.parse_args()
    if not args.summary_only:
        run_all(args.tables.split(","), [int(s) for s in args.seeds.split(",")], args.out)
    summarise(args.out)
    print((args.out / "summary.md").read_text())


if __name__ == "__main__":
    main()
