"""FedPer's accuracy under grouped secure aggregation, with and without one hostile device (issue 48, item 2:
"Measure FedPer's accuracy with one group and with groups of 10, with and without one hostile device, 2 seeds").

The real simulator (``pfl_edge.sim.simulate``): FedPer (the cnn, K_P = 2: 453,632 base coordinates) on
Fashion-MNIST, pathological:4 (each client 4 classes, as the project's FedPer benchmarks deal it), 40 clients,
participation 1.0 (every client every round), ``--samples`` training samples a client, ``--rounds`` rounds, the
FedPer budget of bench/fedper_repro.py otherwise (2 local epochs, batch 32, SGD lr 0.01 momentum 0.9), with
``secure_aggregation = {bound = --bound, min_group = M}`` and the default bits (26 for 40 clients). Grid:

* ``min_group`` 0 (one SecAgg+ round of all 40) or 10 (four groups of 10 drawn by the round's public seed, each
  sum unmasked alone, the groups' means combined by their coordinate-wise median, the default ``across``);
* device 0 honest, ``in-range`` hostile (its quantized input replaced by the extreme opposite of its honest
  update: 0 where the honest value is above the midpoint (2^bits - 1) / 2, 2^bits - 1 where below; a valid
  input, indistinguishable from an honest one) or ``out-of-range`` hostile (its honest input + 2^31 mod 2^32:
  what an attacker who ignores the range sends; its group's unmasked sum fails ``check_sum``);
* seeds 0 and 1.

The hostile device is injected by wrapping ``pfl_edge.secagg.aggregate.run_round`` (the module attribute
``secure_mean`` calls per group): when slot 0 is among a group's inputs its vector is replaced before the round
runs. ``apply_sum`` is wrapped only to observe (it runs unchanged): per round, how many groups passed the check,
whether the base moved (a round whose every group fails publishes nothing: the simulator keeps the base), the
published step against the honest step (the mean of all 40 honest updates as quantized), and the honest updates'
largest |coordinate| and clipped fraction (inputs at 0 or 2^bits - 1), so that the bound's choice is checked on
every run. Accuracy is the simulator's own per-round mean test accuracy over the 40 clients.

Results (written after every run; ``--resume`` skips the runs already there) in bench/results/secagg_groups.json,
a plot of accuracy per round for the six configurations (mean of the seeds) beside it; progress on stderr:

    nohup .venv/bin/python bench/secagg_groups.py > bench/results/secagg_groups.log 2>&1 &

(``--replot``: only redraw the plot from the JSON.)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from machine import cpu_model

import pfl_edge.secagg.aggregate as agg
from pfl_edge.privacy import MIN_CLIENTS
from pfl_edge.sim import SimConfig, simulate

OUT = Path(__file__).parent / "results" / "secagg_groups.json"
HOSTILE = 0  # the hostile device's slot
DEVICES = ("honest", "in-range", "out-of-range")
GROUPS = (0, 10)


class Probe:
    """What the wrappers do and see in the run under way."""

    def __init__(self) -> None:
        self.device, self.bits, self.t = "honest", 0, 0
        self.rounds: dict[int, dict[str, Any]] = {}
        self.honest: dict[int, np.ndarray] = {}  # slot -> its honest quantized input, round t's

    def reset(self, device: str, bits: int) -> None:
        self.device, self.bits, self.t, self.rounds, self.honest = device, bits, 0, {}, {}


PROBE = Probe()
_run_round, _apply_sum = agg.run_round, agg.apply_sum


def _round_of(params: Any) -> int:
    m = re.fullmatch(rb"round-(\d+)", params.round_id)
    if m is None:
        raise RuntimeError(f"unexpected round id {params.round_id!r}")
    return int(m.group(1))


def hostile_input(x: np.ndarray, device: str, bits: int) -> np.ndarray:
    """Device 0's replacement for its honest quantized input ``x`` (uint32)."""
    levels = (1 << bits) - 1
    if device == "in-range":  # the extreme opposite of its honest update, every coordinate in range
        return np.where(x.astype(np.float64) > levels / 2, 0, levels).astype(np.uint32)
    if device == "out-of-range":  # + 2^31 mod 2^32
        return ((x.astype(np.uint64) + (1 << 31)) % (1 << 32)).astype(np.uint32)
    raise ValueError(device)


def run_round(inputs: Any, params: Any, seed: int, **kw: Any) -> Any:
    """``secure_mean``'s per-group SecAgg+ round, device 0's input replaced when it is in the group."""
    t = _round_of(params)
    if t != PROBE.t:  # a new round: only its inputs are kept
        PROBE.t, PROBE.honest = t, {}
    PROBE.honest.update(inputs)
    if PROBE.device != "honest" and HOSTILE in inputs:
        inputs = dict(inputs)
        inputs[HOSTILE] = hostile_input(inputs[HOSTILE], PROBE.device, PROBE.bits)
    return _run_round(inputs, params, seed, **kw)


def apply_sum(cfg: Any, prev: Any, sums: Any) -> Any:
    """The real ``apply_sum``, observed: groups passing the check, the published step against the honest one."""
    bound, bits, _ = agg.secagg_config(cfg).resolved(cfg, MIN_CLIENTS)
    levels = (1 << bits) - 1
    t, honest = PROBE.t, PROBE.honest
    xs = np.stack([honest[i] for i in sorted(honest)])
    honest_step = agg.dequantize_sum(xs.astype(np.uint64).sum(axis=0).astype(np.uint32), len(xs), bound,
                                     bits) / len(xs)
    clipped = float(((xs == 0) | (xs == levels)).mean())
    max_abs = float(np.abs(xs.astype(np.float64) * (2 * bound / levels) - bound).max())
    failed = 0
    for total, survivors in sums:
        try:
            agg.check_sum(total, survivors, bits)
        except agg.SumOutOfRange:
            failed += 1
    rec: dict[str, Any] = {"groups": len(sums), "groups_failed": failed, "participants": len(xs),
                           "honest_max_abs_update": max_abs, "honest_clipped_fraction": clipped,
                           "honest_step_norm": float(np.linalg.norm(honest_step))}
    PROBE.rounds[t] = rec
    try:
        out = _apply_sum(cfg, prev, sums)
    except agg.SumOutOfRange:
        rec.update(published=False, base_moved=False)
        raise
    keys = agg.float_keys(prev)
    step = agg._vector(out, keys) - agg._vector(prev, keys)
    dev = step - honest_step
    cos = float(step @ honest_step / (np.linalg.norm(step) * np.linalg.norm(honest_step) or 1.0))
    rec.update(published=True, base_moved=bool(np.any(step != 0)), step_norm=float(np.linalg.norm(step)),
               deviation_from_honest_norm=float(np.linalg.norm(dev)),
               deviation_from_honest_max_abs=float(np.abs(dev).max()), cosine_with_honest=cos)
    return out


agg.run_round = run_round
agg.apply_sum = apply_sum


def config(args: argparse.Namespace, min_group: int, seed: int) -> dict[str, Any]:
    return dict(algorithm="fedper", model="cnn", dataset="fashion-mnist", partition="pathological:4", clients=40,
                participation=1.0, rounds=args.rounds, samples_per_client=args.samples, local_epochs=2,
                batch_size=32, lr=0.01, momentum=0.9, kp=2, seed=seed,
                secure_aggregation={"bound": args.bound, "min_group": min_group})


def one(args: argparse.Namespace, min_group: int, device: str, seed: int) -> dict[str, Any]:
    cfg = SimConfig.from_dict(config(args, min_group, seed))
    sa = agg.secagg_config(cfg)
    PROBE.reset(device, sa.resolved(cfg, MIN_CLIENTS)[1])
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    res = simulate(cfg, progress=True)
    wall = time.perf_counter() - t0
    rounds = []
    for r in res["rounds"]:
        seen = PROBE.rounds.get(r["round"], {"published": False, "base_moved": False, "note": "no secure round"})
        rounds.append({"round": r["round"], "mean_acc": r["mean_acc"], "std_acc": r["std_acc"],
                       "wall_s": r["wall_s"], **seen})
    return {"min_group": min_group, "device": device, "seed": seed, "bits": PROBE.bits,
            "final_acc": res["final"]["mean_acc"], "final_std_acc": res["final"]["std_acc"],
            "acc_per_round": [r["mean_acc"] for r in res["rounds"]],
            "rounds_base_moved": sum(r["base_moved"] for r in rounds), "rounds": rounds,
            "wall_s": wall, "setup_s": res["meta"]["setup_s"], "loadavg_start": load0,
            "loadavg_end": os.getloadavg(), "base_keys": res["meta"]["base_keys"],
            "config": config(args, min_group, seed)}


def label(min_group: int, device: str) -> str:
    return f"{'one group' if min_group == 0 else f'groups of {min_group}'}, {device}"


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in GROUPS:
        for d in DEVICES:
            rs = [r for r in runs if r["min_group"] == m and r["device"] == d]
            if not rs:
                continue
            finals = [r["final_acc"] for r in rs]
            curve = np.mean([r["acc_per_round"] for r in rs], axis=0).tolist()
            out.append({"config": label(m, d), "min_group": m, "device": d, "seeds": [r["seed"] for r in rs],
                        "final_acc_mean": statistics.fmean(finals), "final_acc_per_seed": finals,
                        "acc_per_round_mean": curve,
                        "rounds_base_moved_per_seed": [r["rounds_base_moved"] for r in rs],
                        "groups_failed_per_round": [[x.get("groups_failed") for x in r["rounds"]] for r in rs],
                        "deviation_from_honest_norm_mean": _mean(x.get("deviation_from_honest_norm")
                                                                 for r in rs for x in r["rounds"]),
                        "honest_step_norm_mean": _mean(x.get("honest_step_norm") for r in rs for x in r["rounds"]),
                        "cosine_with_honest_mean": _mean(x.get("cosine_with_honest") for r in rs
                                                         for x in r["rounds"]),
                        "honest_max_abs_update": max(x.get("honest_max_abs_update", 0.0) for r in rs
                                                     for x in r["rounds"]),
                        "honest_clipped_fraction_max": max(x.get("honest_clipped_fraction", 0.0) for r in rs
                                                           for x in r["rounds"]),
                        "wall_s_mean": statistics.fmean(r["wall_s"] for r in rs)})
    return out


def _mean(xs: Any) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def plot(summary: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {"honest": "-", "in-range": "--", "out-of-range": ":"}
    colours = {0: "tab:blue", 10: "tab:orange"}
    for s in summary:
        xs = range(1, len(s["acc_per_round_mean"]) + 1)
        ax.plot(xs, s["acc_per_round_mean"], styles[s["device"]], color=colours[s["min_group"]], marker="o",
                markersize=3, label=s["config"])
    ax.set_xlabel("round")
    ax.set_ylabel("mean test accuracy over clients")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--samples", type=int, default=500, help="training samples per client")
    ap.add_argument("--bound", type=float, default=0.1, help="secure_aggregation.bound (per coordinate)")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--groups", default="0,10")
    ap.add_argument("--devices", default=",".join(DEVICES))
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--resume", action="store_true", help="keep the runs already in --out, run the rest")
    ap.add_argument("--replot", action="store_true", help="only redraw the plot from --out")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("TQDM_MININTERVAL", "30")
    seeds = [int(s) for s in args.seeds.split(",")]
    grid = [(m, d, s) for s in seeds for m in (int(g) for g in args.groups.split(",")) for d in args.devices.split(",")]
    runs: list[dict[str, Any]] = []
    if args.resume and args.out.exists():
        runs = [r for r in json.loads(args.out.read_text())["runs"]
                if (r["min_group"], r["device"], r["seed"]) in grid]
    done = {(r["min_group"], r["device"], r["seed"]) for r in runs}
    title = (f"FedPer, Fashion-MNIST pathological:4, 40 clients, all every round, {args.samples} samples each\n"
             f"secure aggregation bound {args.bound}, device 0 honest or hostile; mean of {len(seeds)} seeds")
    if args.replot:
        plot(json.loads(args.out.read_text())["summary"], args.out.with_suffix(".png"), title)
        return
    t_start = time.perf_counter()
    for i, (m, d, s) in enumerate(grid, 1):
        if (m, d, s) in done:
            continue
        print(f"[{i}/{len(grid)}] {label(m, d)}, seed {s}: starting (load {os.getloadavg()[0]:.2f})",
              file=sys.stderr, flush=True)
        r = one(args, m, d, s)
        runs.append(r)
        print(f"[{i}/{len(grid)}] {label(m, d)}, seed {s}: final acc {r['final_acc']:.4f}, base moved in "
              f"{r['rounds_base_moved']}/{args.rounds} rounds, {r['wall_s']:.0f} s "
              f"(elapsed {time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
        summary = summarise(runs)
        result = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                  "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()}, Python "
                             f"{platform.python_version()}, torch {torch.__version__}",
                  "command": " ".join([".venv/bin/python", *sys.argv]),
                  "setup": {"rounds": args.rounds, "samples_per_client": args.samples, "bound": args.bound,
                            "hostile_slot": HOSTILE, "across": "median (default)", "bits": r["bits"]},
                  "summary": summary, "runs": runs}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        plot(summary, args.out.with_suffix(".png"), title)
    print(f"done in {time.perf_counter() - t_start:.0f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
