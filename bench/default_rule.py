"""Which aggregation rule should be the default (issue 49 item 4): candidate rules measured in the simulator, which
applies the server's rule, against one hostile device of five and on honest runs.

Setting (``small``): ``bench/attackers.py``'s FedPer federation (its ``Settings.config``: the integration tests'
``BASE`` on Fashion-MNIST, cnn, pathological:2, 5 clients, 200 training samples a slot, 32 test samples a client, 6
rounds, 1 local epoch, batch 16, lr 0.05), every client every round (participation 1.0: a quorum never leaves
anyone out), seeds 0, 1, 2. Client 4 is honest, or hostile as attackers.py's attacker: it trains honestly and
uploads ``start - 1000 * (trained - start)`` (its step sign-flipped, x1000; ``start`` = the base of the round) and
claims 2^31-1 samples, which count for what the server would count them (``server.services.updates
.counted_samples``: at most the share dealt its slot, here its 200 samples, as every honest device's). Recorded:
the honest clients' (0-3) mean accuracy per round and at the end, per round each update's norm from the round's
start, its bound under the rule, and whether it was clipped.

Setting (``large``): honest runs at the scale of BENCHMARKS' "FedPer reproduction on Fashion-MNIST" (its Table 1
row fedper k=4: ``bench/fedper_repro.py``'s budget, cnn, 1,000 samples a client, 2 local epochs, batch 32, lr 0.01
momentum 0.9, pathological:4, 10 clients, K_P 2), cut to ``--large-rounds`` (15 by default, of its 30) so that a run
takes about 3 minutes on this bench's 2 shared cores; today's default against the ``--large-rules`` (``auto``: the
two rules, other than today's, that keep the attacked honest accuracy within 2 points of the honest one at the
smallest honest cost), seeds 0 and 1.

The simulator, unchanged but for two hooks:

* the rule: ``pfl_edge.aggregate.DEFAULT_RULE`` is set to the candidate (``CentralSimulation._bounded`` reads it at
  every round: the bounds of a ``mean`` rule, held to by the simulator's own code). The simulator composes only the
  ``mean`` family there; for another rule (``clipped-mean``, ``trimmed-mean``, ``median``) the round's base is made
  as the server's ``RoundMachine.average`` makes it: ``algo.aggregate(start, updates, rule=rule, history=...)``
  over the round's uploads in slot order;
* the attacker: ``CentralSimulation._trained`` (which yields each participant's ``(upload, weight)`` in slot order)
  is wrapped so that slot 4's upload and weight are the hostile ones; and, as a device does
  (``edge_runtime.agent``), a client whose training went non-finite keeps its last good model and sits the round
  out (its codec would refuse to send NaN/Inf), where the simulator would stop the run. A run whose base still went
  non-finite is recorded as lost (``diverged``).

Candidates: ``default`` (the default when this was measured, before issue 49 made ``mean-nm1``'s multiple the
default: mean weighted by samples, each update clipped to 3x the low median of the others' norms; "today's" below
means this), ``mean-nm1`` (the same at 1x), ``clipped-mean-nm1`` (equal weights, 1x), ``trimmed-mean`` (trim 0.2:
one of five dropped from each end, per coordinate; bound 3x), ``median`` (coordinate-wise; bound 3x). Results (written
after every run; ``--resume`` keeps the runs an earlier file holds) in bench/results/default_rule.json and the plot
bench/results/default_rule.png.

    nohup .venv/bin/python bench/default_rule.py > /tmp/default_rule.log 2>&1 &
    # what bench/results/default_rule.json holds (BENCHMARKS.md, "Issue 49: choosing a robust default rule"):
    .venv/bin/python bench/default_rule.py --seeds 0,1,2,3,4,5,6,7,8,9 --large-rules trimmed-mean,mean-nm1,median \
        --large-seeds 0,1,2
    .venv/bin/python bench/default_rule.py --phase small --seeds 0 --rules default,median   # a quick look
    # issue 49's check on one torch thread (float sums round otherwise than on two): 20 seeds
    .venv/bin/python bench/default_rule.py --phase small --rules default,mean-nm1 --threads 1 \
        --seeds 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19 --out bench/results/default_rule_threads1.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(REPO / "tests" / "integration"))

from fedkit import BASE  # attackers.py's config is built on the integration tests' BASE  # noqa: E402
from machine import cpu_model  # noqa: E402

import pfl_edge.aggregate as aggregate  # noqa: E402
from pfl_edge.aggregate import AggregationRule, update_norm  # noqa: E402
from pfl_edge.algorithms.central import CentralSimulation, all_finite  # noqa: E402
from pfl_edge.errors import DivergedError  # noqa: E402
from pfl_edge.sim import SimConfig, simulate  # noqa: E402
from server.services.updates import counted_samples  # noqa: E402

RULES: dict[str, AggregationRule] = {
    # "default": the default when this was measured (3x), which issue 49 then changed to mean-nm1's multiple
    "default": AggregationRule(norm_multiple=3.0),
    "mean-nm1": AggregationRule(norm_multiple=1.0),
    "clipped-mean-nm1": AggregationRule("clipped-mean", norm_multiple=1.0),
    "trimmed-mean": AggregationRule("trimmed-mean", norm_multiple=3.0, trim=0.2),
    "median": AggregationRule("median", norm_multiple=3.0),
}
ATTACKER_SLOT = 4
HONEST = 4  # clients 0-3
SCALE = 1000.0
CLAIMED_SAMPLES = 2**31 - 1
ATTACK_BUDGET = 0.02  # points of honest accuracy one hostile device of five may cost (issue 49)
HONEST_BUDGET = 0.005  # points an honest run may move against today's default (issue 49)

# bench/attackers.py's Settings().config("fedper"), less its server-side settings (quorum, deadline)
SMALL = {**BASE, "algorithm": "fedper", "dataset": "fashion-mnist", "clients": 5, "rounds": 6,
         "samples_per_client": 200, "lr": 0.05, "participation": 1.0}
# bench/fedper_repro.py's BUDGET and its Table 1 row "fedper k=4"
LARGE = dict(model="cnn", dataset="fashion-mnist", samples_per_client=1000, local_epochs=2, rounds=30, batch_size=32,
             lr=0.01, momentum=0.9, participation=1.0, algorithm="fedper", partition="pathological:4", clients=10,
             kp=2)


class Hooks:
    """The two hooks on the simulator (module docstring), installed once; ``attack`` and the rule set per run."""

    def __init__(self) -> None:
        self.attack = False
        self.log: list[dict[str, Any]] = []  # per round: norms, bounds, clipped, weights (the last pass's)
        self.skipped: set[tuple[int, int]] = set()  # (round, slot): training diverged, no upload (as a device)
        self._weights: dict[int, list[float]] = {}
        self._slots: dict[int, list[int]] = {}
        orig_trained, orig_bounded = CentralSimulation._trained, CentralSimulation._bounded
        hooks = self

        def trained(sim: CentralSimulation, t: int, participants: Tensor, losses: list[tuple[Tensor, Tensor]]
                    ) -> Iterator[tuple[dict[str, Tensor], float]]:
            start = sim.base or {}
            slots = participants.tolist()
            weights: list[float] = []
            sent: list[int] = []
            own = [k for k in sim.clients if k not in start]  # what never leaves a client
            before = {k: sim.clients[k][participants].clone() for k in own}
            for i, (slot, (up, w)) in enumerate(zip(slots, orig_trained(sim, t, participants, losses), strict=True)):
                if not (all_finite(up) and all(bool(torch.isfinite(sim.clients[k][slot]).all()) for k in own)):
                    # as a device does (edge_runtime.agent): training diverged, so it keeps its last good model
                    # and sits the round out (its codec would refuse to send NaN/Inf anyway)
                    for k in own:
                        sim.clients[k][slot] = before[k][i]
                    hooks.skipped.add((t, slot))
                    continue
                if hooks.attack and slot == ATTACKER_SLOT:
                    up = {k: start[k] - SCALE * (v - start[k]) for k, v in up.items()}
                    w = float(counted_samples(CLAIMED_SAMPLES, None, int(w)))  # the server's cap: its dealt share
                weights.append(w)
                sent.append(slot)
                yield up, w
            hooks._weights[t] = weights
            hooks._slots[t] = sent

        def bounded(sim: CentralSimulation, t: int, participants: Tensor, losses: list[tuple[Tensor, Tensor]]
                    ) -> dict[str, Tensor]:
            rule = aggregate.DEFAULT_RULE
            history = list(sim._norms)
            if rule.rule == "mean":  # the simulator's own code (it reads DEFAULT_RULE)
                new = orig_bounded(sim, t, participants, losses)
                norms = list(sim._norms)
            else:  # as the server's RoundMachine.average: the algorithm composes the robust rule
                base = sim.base
                assert base is not None
                ups = list(sim._trained(t, participants, losses))
                norms = [update_norm(base, s) for s, _ in ups]
                sim._norms = norms
                out = sim.central.aggregate(base, ups, rule=rule, history=history, t=t)
                assert out is not None
                new = out
            bounds = rule.bounds(norms, history)
            hooks.log.append({"round": t, "slots": hooks._slots.get(t), "norms": norms, "bounds": bounds,
                              "weights": hooks._weights.get(t),
                              "clipped": [b is not None and n > b for n, b in zip(norms, bounds, strict=True)]})
            return new

        CentralSimulation._trained = trained  # type: ignore[method-assign,assignment]
        CentralSimulation._bounded = bounded  # type: ignore[method-assign,assignment]


def say(msg: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def one_run(hooks: Hooks, setting: str, rule: str, attacked: bool, seed: int, rounds: int | None) -> dict[str, Any]:
    cfg = {**(SMALL if setting == "small" else LARGE), "seed": seed}
    if rounds is not None:
        cfg["rounds"] = rounds
    shipped, aggregate.DEFAULT_RULE = aggregate.DEFAULT_RULE, RULES[rule]
    hooks.attack, hooks.log, hooks.skipped = attacked, [], set()
    t0 = time.perf_counter()
    diverged = None
    try:
        res = simulate(SimConfig.from_dict(cfg))
    except DivergedError as e:  # the base itself non-finite: recorded, the run counts as lost
        diverged, res = str(e), None
    finally:
        aggregate.DEFAULT_RULE = shipped
        hooks.attack = False
    wall = time.perf_counter() - t0
    honest = HONEST if setting == "small" else cfg["clients"]

    def is_honest(slot: int) -> bool:
        return not (attacked and slot == ATTACKER_SLOT)

    out: dict[str, Any] = {
        "setting": setting, "rule": rule, "attacked": attacked, "seed": seed, "config": cfg, "honest_clients": honest,
        "rounds_log": hooks.log, "skipped_uploads": sorted(hooks.skipped), "diverged": diverged,
        "honest_updates_clipped": sum(c for r in hooks.log for sl, c in zip(r["slots"], r["clipped"], strict=True)
                                      if is_honest(sl)),
        "honest_updates": sum(1 for r in hooks.log for sl in r["slots"] if is_honest(sl)),
        "wall_s": round(wall, 1)}
    if res is None:
        return {**out, "honest_acc_per_round": None, "honest_final": None, "client_final": None}
    return {**out, "honest_acc_per_round": [statistics.fmean(r["client_acc"][:honest]) for r in res["rounds"]],
            "honest_final": statistics.fmean(res["final"]["client_acc"][:honest]),
            "client_final": res["final"]["client_acc"]}


def key(r: dict[str, Any]) -> tuple[str, str, bool, int]:
    return r["setting"], r["rule"], r["attacked"], r["seed"]


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setting and rule: the honest clients' final accuracy (mean over seeds, and each seed's), honest and
    attacked; the attack's cost (this rule's honest run - its attacked run, paired by seed; also against today's
    default's honest run) and the honest cost (today's default's honest run - this rule's, paired by seed); whether
    each meets the issue's budget. A run whose base went non-finite (``diverged``) is left out of the means and
    fails the budget it is measured for."""
    by = {key(r): r for r in runs}

    def fin(setting: str, rl: str, att: bool, sd: int) -> float | None:
        r = by.get((setting, rl, att, sd))
        return None if r is None else r["honest_final"]

    def diffs(pairs: list[tuple[float | None, float | None]]) -> dict[str, Any]:
        d = [None if a is None or b is None else a - b for a, b in pairs]
        ok = [x for x in d if x is not None]
        return {"mean": statistics.fmean(ok) if ok else None, "per_seed": d, "lost": len(d) - len(ok)}

    out: dict[str, Any] = {}
    for setting in ("small", "large"):
        rules = [rl for rl in RULES if any(k[0] == setting and k[1] == rl for k in by)]
        s: dict[str, Any] = {}
        for rl in rules:
            row: dict[str, Any] = {}
            for att in (False, True):
                seeds = sorted(k[3] for k in by if k[:3] == (setting, rl, att))
                if not seeds:
                    continue
                rs = [by[(setting, rl, att, sd)] for sd in seeds]
                kept = [r for r in rs if r["honest_final"] is not None]
                row["attacked" if att else "honest"] = {
                    "seeds": seeds, "per_seed": [r["honest_final"] for r in rs], "lost": len(rs) - len(kept),
                    "final": statistics.fmean(r["honest_final"] for r in kept) if kept else None,
                    "per_round": [statistics.fmean(x) for x in zip(*(r["honest_acc_per_round"] for r in kept),
                                                                    strict=True)] if kept else None,
                    "honest_updates_clipped": sum(r["honest_updates_clipped"] for r in rs),
                    "honest_updates": sum(r["honest_updates"] for r in rs),
                    "uploads_skipped": sum(len(r["skipped_uploads"]) for r in rs)}
            paired = [sd for sd in row.get("honest", {}).get("seeds", []) if (setting, rl, True, sd) in by]
            if paired:
                row["attack_cost"] = {"seeds": paired, **diffs(
                    [(fin(setting, rl, False, sd), fin(setting, rl, True, sd)) for sd in paired])}
                if all((setting, "default", False, sd) in by for sd in paired):
                    row["attack_cost_vs_default_honest"] = diffs(
                        [(fin(setting, "default", False, sd), fin(setting, rl, True, sd)) for sd in paired])
                c = row["attack_cost"]
                row["meets_attack_budget"] = c["lost"] == 0 and c["mean"] is not None and c["mean"] <= ATTACK_BUDGET
            ref = [sd for sd in row.get("honest", {}).get("seeds", []) if (setting, "default", False, sd) in by]
            if ref:
                c = row["honest_cost"] = {"seeds": ref, **diffs([(fin(setting, "default", False, sd),
                                                                  fin(setting, rl, False, sd)) for sd in ref])}
                row["meets_honest_budget"] = (c["lost"] == 0 and c["mean"] is not None
                                              and abs(c["mean"]) <= HONEST_BUDGET)
            s[rl] = row
        if s:
            out[setting] = s
    return out


def auto_rules(summary: dict[str, Any], n: int = 2) -> list[str]:
    """The ``n`` rules other than today's that meet the attack budget in the small setting, least honest cost
    first."""
    small = summary.get("small", {})
    ok = [rl for rl, row in small.items() if rl != "default" and row.get("meets_attack_budget")]
    return sorted(ok, key=lambda rl: abs(small[rl].get("honest_cost", {}).get("mean") or 1.0))[:n]


def machine() -> dict[str, Any]:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = report["summary"]
    panels = [s for s in ("small", "large") if s in summ]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    colours = dict(zip(RULES, ("black", "tab:blue", "tab:cyan", "tab:orange", "tab:green"), strict=True))
    for ax, setting in zip(axes[0], panels, strict=True):
        for rl, row in summ[setting].items():
            for att, style in ((False, "-"), (True, "--")):
                r = row.get("attacked" if att else "honest")
                if r is None or r["per_round"] is None:
                    continue
                xs = range(1, len(r["per_round"]) + 1)
                ax.plot(xs, r["per_round"], style, color=colours[rl], marker="o" if att else None, ms=3,
                        lw=3.5 if rl == "mean-nm1" else 1.5, alpha=0.45 if rl == "mean-nm1" else 1.0,
                        label=f"{rl}, {'client 4 hostile' if att else 'all honest'} ({r['final']:.3f})")
        seeds = sorted({sd for row in summ[setting].values() for r in (row.get("honest"), row.get("attacked"))
                        if r for sd in r["seeds"]})
        ax.set_title(("attackers.py's setting: 5 clients, honest clients 0-3" if setting == "small" else
                      f"FedPer reproduction, {report['large_rounds']} rounds: 10 honest clients")
                     + f"\nmean over seeds {','.join(map(str, seeds))}", fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("honest clients' mean accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("FedPer, candidate default rules in the simulator (solid: all honest; dashed: client 4 sends "
                 "its step sign-flipped x1000)\nmean-nm1 (wide) and clipped-mean-nm1 coincide: every client holds "
                 "the same number of samples", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=("small", "large", "all"), default="all")
    p.add_argument("--rules", default=",".join(RULES), help="the small setting's rules")
    p.add_argument("--seeds", default="0,1,2", help="the small setting's seeds")
    p.add_argument("--large-rules", default="auto", help="besides today's default: 'auto' or names")
    p.add_argument("--large-seeds", default="0,1")
    p.add_argument("--large-rounds", type=int, default=15)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "default_rule.json"))
    p.add_argument("--resume", action="store_true", help="keep the runs the output file already holds")
    p.add_argument("--replot", action="store_true", help="only redraw the plot from the output file")
    p.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own choice)")
    a = p.parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    out = Path(a.out)
    if a.replot:
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        return 0
    rules = a.rules.split(",")
    for rl in rules:
        if rl not in RULES:
            p.error(f"unknown rule {rl!r}; one of {', '.join(RULES)}")
    runs: list[dict[str, Any]] = []
    earlier: list[dict[str, Any]] = []  # the invocations whose runs are kept (--resume)
    if a.resume and out.exists():
        old = json.loads(out.read_text())
        runs = old["runs"]
        earlier = [*old.get("earlier", []), {k: old.get(k) for k in ("command", "date", "commit", "machine")}]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=False).stdout.strip()
    except OSError:
        commit = ""
    report: dict[str, Any] = {
        "what": "issue 49 item 4: candidate default aggregation rules in the simulator, FedPer; see the docstring",
        "command": " ".join(["bench/default_rule.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": commit,
        "machine": {**machine(), "loadavg_start": os.getloadavg()},
        "rules": {k: {"rule": v.rule, "norm_multiple": v.norm_multiple, "max_update_norm": v.max_update_norm,
                      "trim": v.trim} for k, v in RULES.items()},
        "attack": {"slot": ATTACKER_SLOT, "upload": f"start - {SCALE:g} * (trained - start)",
                   "claimed_samples": CLAIMED_SAMPLES, "counted": "min(claimed, its slot's dealt share)"},
        "budgets": {"attack_cost_max": ATTACK_BUDGET, "honest_cost_max": HONEST_BUDGET},
        "small_config": SMALL, "large_config": LARGE, "large_rounds": a.large_rounds, "earlier": earlier,
        "runs": runs}
    hooks = Hooks()
    done = {key(r) for r in runs}

    def save() -> None:
        report["summary"] = summarise(runs)
        report["machine"]["loadavg_end"] = os.getloadavg()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))

    def go(setting: str, rule: str, attacked: bool, seed: int, rounds: int | None) -> None:
        if (setting, rule, attacked, seed) in done:
            return
        say(f"{setting} {rule} {'attacked' if attacked else 'honest'} seed {seed}: load {os.getloadavg()[0]:.1f}")
        r = one_run(hooks, setting, rule, attacked, seed, rounds)
        runs.append(r)
        done.add(key(r))
        clipped = f"{r['honest_updates_clipped']}/{r['honest_updates']}"
        if r["honest_final"] is None:
            say(f"  lost: {r['diverged']}; {r['wall_s']:.0f} s")
        else:
            say(f"  honest final {r['honest_final']:.3f} per round "
                f"{' '.join(f'{x:.3f}' for x in r['honest_acc_per_round'])}; honest updates clipped {clipped}; "
                f"uploads skipped (diverged) {r['skipped_uploads']}; {r['wall_s']:.0f} s")
        save()

    if a.phase in ("small", "all"):
        for seed in map(int, a.seeds.split(",")):
            for rl in rules:
                for attacked in (False, True):
                    go("small", rl, attacked, seed, None)
    if a.phase in ("large", "all"):
        report["summary"] = summarise(runs)
        large = auto_rules(report["summary"]) if a.large_rules == "auto" else a.large_rules.split(",")
        report["large_rules"] = ["default", *[rl for rl in large if rl != "default"]]
        say(f"large setting: rules {report['large_rules']}")
        for seed in map(int, a.large_seeds.split(",")):
            for rl in report["large_rules"]:
                go("large", rl, False, seed, a.large_rounds)
    save()
    plot(report, out.with_suffix(".png"))
    def f(x: float | None, sign: str = "") -> str:
        return "-" if x is None else f"{x:{sign}.3f}"

    for setting, s in report["summary"].items():
        print(f"\n{setting}: rule | honest final | attacked final | attack cost | honest cost vs default")
        for rl, row in s.items():
            h, at = row.get("honest", {}).get("final"), row.get("attacked", {}).get("final")
            ac, hc = row.get("attack_cost", {}).get("mean"), row.get("honest_cost", {}).get("mean")
            print(f"{rl:17s} | {f(h)} | {f(at)} | {f(ac, '+')} | {f(hc, '+')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
