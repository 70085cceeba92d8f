"""The long run that can show DisPFL's claim or refute it here (issue 20, item 6): DisPFL against Local, FedAvg-FT,
D-PSGD-FT and D-PSGD for 300 rounds of 5 local epochs, on the reference's two splits: its random-pair split
(``pathological-random:2``: two random classes per client, samples reused when a class runs out) and client-wise
Dir(0.3) dealt in interleaved order (``dirichlet-client:0.3``).

The reference's optimiser (SGD lr 0.1 x 0.998^round, momentum 0, weight decay 5e-4, gradient norm clipped at 10,
batch 128), its fine-tuning cadence and its fine-tune (issue 37): FedAvg-FT fine-tunes in the last round only
(``ft_every = 0``; every other round deploys FedAvg's global model), D-PSGD-FT fine-tunes the uniform mean of
every client's trained model every 100 rounds (``ft_every = 100, ft_from = "uniform"``), both for the local epoch
count at the reference's learning rate (``ft_recipe = "reference"``); each client's test set is drawn from its own
training label mix, images shared between clients (the reference's draw, the default on these splits). 20 clients
of 200 training samples each (the issue asks for 20-30; the cost grows with both), 10 random neighbours per round
as in the paper (the same graphs for every decentralised method, from the seed), and FedAvg-FT sampling 10 clients
a round, the paper's count. D-PSGD is read from D-PSGD-FT's run (between fine-tunes it deploys D-PSGD's models),
scored two ways: on each client's neighbourhood average (what a client deploys) and, as the paper draws it, the
uniform mean of every client's model on every client's test set (``mean_acc_global``).

Each run is cached as JSON in OUT/runs, so the runs can be spread over several sittings (``nice`` keeps the
machine usable meanwhile); the issue-20 runs under pfl-edge's fine-tune and disjoint test draw stay in
bench/results/dispfl-long:

    nohup nice -n 19 .venv/bin/python bench/dispfl_long.py --seeds 0,1 > bench/results/dispfl-long-ref/log.txt 2>&1 &

Beside the tables and the accuracy-against-round plots (the mean of the seeds) it writes, from every seed that ran:
``checkpoints.md`` (each method at rounds 50/100/200/300, the mean and each seed), ``claims.md``/``claims.json``
(DisPFL's margin over each baseline per seed, its mean, spread and verdict: a sub-point difference is a tie) and
``crossings.json`` (per seed, the rounds at which DisPFL's 10-round moving average moves above or below each
baseline's, and every method's rank at the checkpoints).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
from repro import Row, Table, main

from pfl_edge.algorithms import FinetuneOptions

ROUNDS = 300
BUDGET = dict(model="cnn", dataset="fashion-mnist", clients=20, samples_per_client=200, local_epochs=5,
              rounds=ROUNDS, batch_size=128, lr=0.1, lr_decay=0.998, momentum=0.0, weight_decay=5e-4, clip_norm=10.0,
              topology="random:10", density=0.5, alpha0=0.5, regrow="gradient")
SPLITS = {"L1": ("pathological-random:2", "patho"), "L2": ("dirichlet-client:0.3", "dir")}
WINDOW = 10  # rounds in the moving average the crossings are read from


def _rows(part: str, tag: str) -> tuple[Row, ...]:
    p = dict(partition=part)
    return (
        Row(f"dispfl-{tag}", "DisPFL (d=0.5)", dict(algorithm="dispfl", **p)),
        Row(f"local-{tag}", "Local", dict(algorithm="local", **p)),
        Row(f"fedavg-ft-{tag}", "FedAvg-FT (10/round, FT at the end)",
            dict(algorithm="fedavg-ft", participation=0.5, options={"ft_every": 0, "ft_recipe": "reference"}, **p)),
        Row(f"dpsgd-ft-{tag}", "D-PSGD-FT (uniform mean, FT every 100)",
            dict(algorithm="dpsgd-ft", options={"ft_every": 100, "ft_from": "uniform", "ft_recipe": "reference"},
                 **p)),
        Row(f"dpsgd-{tag}", "D-PSGD", dict(algorithm="dpsgd", **p)),
    )


TABLES = [Table(key, f"DisPFL vs baselines over 300 rounds, {part}, 20 clients", _rows(part, tag))
          for key, (part, tag) in SPLITS.items()]


Curve = list[float | None]  # mean client accuracy per round; None where a round has no value for the method


def _smooth(xs: Curve) -> list[float]:
    """The moving average over the last WINDOW rounds that have a value."""
    out = []
    for i in range(len(xs)):
        window = [x for x in xs[max(0, i - WINDOW + 1):i + 1] if x is not None]
        out.append(statistics.fmean(window) if window else float("nan"))
    return out


def _at(xs: Curve, t: int) -> float:
    """Round ``t``'s value, or the last round's before it that has one."""
    return next(x for x in reversed(xs[:t]) if x is not None)


def _ft_rounds(row: Row) -> set[int]:
    """The rounds in which a -FT row deploys fine-tuned models (none for the others): its options' cadence."""
    if "ft" not in row.overrides["algorithm"].split("-"):
        return set()
    due = FinetuneOptions(**row.overrides["options"]).due
    return {t for t in range(1, ROUNDS + 1) if due(t, ROUNDS)}


def _run(out: Path, name: str, seed: int = 0) -> dict[str, Any] | None:
    f = out / "runs" / f"{name}-s{seed}.json"
    return json.loads(f.read_text()) if f.exists() else None


Curves = tuple[dict[str, Curve], dict[str, dict[int, float]]]  # each method's curve, its fine-tuned rounds apart
CHECKPOINTS = (50, 100, 200, 300)
POINT = 0.01  # a difference under a point is a tie (issue 37)


def _seeds(out: Path) -> list[int]:
    """The seeds some run of this benchmark has."""
    return sorted({int(f.stem.rsplit("-s", 1)[1]) for f in (out / "runs").glob("*-s*.json")})


def _curves(out: Path, part: str, tag: str, seed: int = 0) -> Curves:
    """Each method's curve on a split for one seed, and the -FT baselines' fine-tuned rounds apart from it (a -FT
    baseline on the reference's cadence deploys its un-fine-tuned model in every other round: FedAvg's, D-PSGD's).

    Where D-PSGD was not run, its curve is read from D-PSGD-FT's run: between fine-tunes D-PSGD-FT deploys exactly
    D-PSGD's models (the same random streams; a fine-tune feeds nothing back:
    tests/pfl_edge/test_sim.py::test_finetune_cadence_is_selectable), so a run of D-PSGD would only add rounds
    100, 200 and 300."""
    acc: dict[str, Curve] = {}
    ft: dict[str, dict[int, float]] = {}
    rows = _rows(part, tag)
    for row in rows:
        res = _run(out, row.name, seed)
        if res is None:
            continue
        xs = [x["mean_acc"] for x in res["rounds"]]
        tuned = _ft_rounds(row)
        acc[row.label] = [None if t in tuned else x for t, x in enumerate(xs, 1)]
        if tuned:
            ft[row.label] = {t: xs[t - 1] for t in sorted(tuned) if t <= len(xs)}
    dpsgd_ft, dpsgd = rows[3].label, rows[4].label
    if dpsgd not in acc and dpsgd_ft in acc:
        acc[f"{dpsgd} (read from D-PSGD-FT)"] = acc[dpsgd_ft]
        # the paper's D-PSGD figure: the uniform mean of every client's trained model on every client's test set
        res = _run(out, rows[3].name, seed)
        if res is not None and all("mean_acc_global" in x for x in res["rounds"]):
            acc[f"{dpsgd}, all-client mean (the paper's)"] = [x["mean_acc_global"] for x in res["rounds"]]
    return acc, ft


def _plot_zoom(acc: dict[str, Curve], ft: dict[str, dict[int, float]], path: Path, title: str) -> None:
    """Every method's smoothed curve, its fine-tuned rounds as stars, the y axis zoomed to where they end (the
    table's plot spans 0-1, where curves a point apart look alike)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
    low, drawn = 1.0, {}  # id of a curve -> its line's colour: D-PSGD read from D-PSGD-FT is one curve, drawn once
    for label, xs in acc.items():
        ys = _smooth(xs)
        last = max(i for i, x in enumerate(xs) if x is not None) + 1
        if id(xs) not in drawn:
            name = label + (", between fine-tunes" if label in ft else "")
            if sum(c is xs for c in acc.values()) > 1:
                name += " = D-PSGD"
            (line,) = ax.plot(range(1, len(ys) + 1), ys, label=f"{name} ({_at(xs, last):.3f} at {last})")
            drawn[id(xs)] = line.get_color()
        if label in ft:
            pts = ft[label]
            ax.scatter(list(pts), list(pts.values()), marker="*", s=90, zorder=3, color=drawn[id(xs)],
                       label=f"{label}, fine-tuned ({pts[max(pts)]:.3f} at {max(pts)})")
        low = min(low, min(ys[min(len(ys) - 1, 20):]))
    ax.set_ylim(max(0.0, low - 0.02), 1.0)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("round")
    ax.set_ylabel("mean client test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _value(acc: dict[str, Curve], ft: dict[str, dict[int, float]], label: str, t: int) -> float:
    """A method's accuracy as deployed in round ``t`` (a -FT baseline's fine-tuned one where it fine-tunes)."""
    return ft[label][t] if t in ft.get(label, {}) else _at(acc[label], t)


def _tail_mean(xs: Curve) -> float | None:
    """The mean over rounds 251-300 of a method that deploys the same kind of model every round."""
    tail = [x for x in xs[ROUNDS - 50:ROUNDS] if x is not None]
    return statistics.fmean(tail) if tail else None


def _cell(vals: list[float | None], seeds: list[int]) -> str:
    """The mean over seeds, each seed's value in brackets (a lone seed named)."""
    got = [(s, v) for s, v in zip(seeds, vals, strict=True) if v is not None]
    if not got:
        return "–"
    if len(got) == 1:
        return f"{got[0][1]:.3f} (s{got[0][0]})"
    return f"{statistics.fmean(v for _, v in got):.3f} ({' / '.join(f'{v:.3f}' for _, v in got)})"


def _checkpoints(curves: dict[str, dict[int, Curves]]) -> str:
    """Per split, each method's mean client accuracy as deployed at rounds 50/100/200/300 and, for those that
    deploy the same kind of model every round, its mean over rounds 251-300 (one round's figure is noisy): the
    mean over the seeds that ran it, each seed's value in brackets."""
    md = []
    for part, by_seed in curves.items():
        seeds = sorted(by_seed)
        md += [f"**{part}**: the mean over seeds, each seed's value in brackets (seeds {', '.join(map(str, seeds))}; "
               "a -FT baseline's value in a round it does not fine-tune is its plain model's)", "",
               "| method | round 50 | round 100 | round 200 | round 300 | mean of rounds 251-300 |",
               "|---|---|---|---|---|---|"]
        labels = list(dict.fromkeys(label for s in seeds for label in by_seed[s][0]))
        for label in labels:
            have = [s for s in seeds if label in by_seed[s][0]]
            cells = [_cell([_value(*by_seed[s], label, t) if len(by_seed[s][0][label]) >= t else None
                            for s in have], have) for t in CHECKPOINTS]
            tails = [None if label in by_seed[s][1] else _tail_mean(by_seed[s][0][label]) for s in have]
            md.append(f"| {label} | {' | '.join(cells)} | {_cell(tails, have)} |")
        md.append("")
    return "\n".join(md)


def _verdict(margins: list[float]) -> str:
    """DisPFL's standing against a baseline from its margin on each seed: a sub-point difference is a tie."""
    if all(m > POINT for m in margins):
        return "holds"
    if all(m < -POINT for m in margins):
        return "reversed"
    if abs(statistics.fmean(margins)) <= POINT:
        return "tie"
    return "seeds disagree"


def _margin(c: Curves, dispfl: str, label: str, t: int | None) -> float | None:
    """DisPFL's accuracy minus a baseline's in round ``t`` as each deploys it, or (``t`` None) over rounds
    251-300 where the baseline deploys one kind of model throughout; None where a run has no such value."""
    acc, ft = c
    if t is None:
        mine, theirs = _tail_mean(acc[dispfl]), None if label in ft else _tail_mean(acc[label])
        return None if mine is None or theirs is None else mine - theirs
    if min(len(acc[label]), len(acc[dispfl])) < t:
        return None
    return _value(acc, ft, dispfl, t) - _value(acc, ft, label, t)


def claims(curves: dict[str, dict[int, Curves]], tags: dict[str, str], out: Path) -> dict[str, Any]:
    """The paper's rankings from every seed that ran both DisPFL and the baseline: at each checkpoint DisPFL's
    accuracy minus the baseline's as each deploys it (a -FT baseline's fine-tuned value where it fine-tunes), per
    seed, their mean and spread (max - min), and the verdict; against Local and plain D-PSGD also the mean over
    rounds 251-300, and the rounds DisPFL is above."""
    found: dict[str, Any] = {}
    for part, by_seed in curves.items():
        dispfl = _rows(part, tags[part])[0].label
        labels = list(dict.fromkeys(label for c in by_seed.values() for label in c[0] if label != dispfl))
        split: dict[str, Any] = {}
        for label in labels:
            seeds = [s for s, (acc, _) in sorted(by_seed.items()) if dispfl in acc and label in acc]
            if not seeds:
                continue
            at: dict[str, Any] = {}
            for key, t in [*((str(t), t) for t in CHECKPOINTS), ("251-300", None)]:
                got = [_margin(by_seed[s], dispfl, label, t) for s in seeds]
                margins = [m for m in got if m is not None]
                if len(margins) == len(seeds):
                    at[key] = {"per_seed": {str(s): round(m, 4) for s, m in zip(seeds, margins, strict=True)},
                               "mean": round(statistics.fmean(margins), 4),
                               "spread": round(max(margins) - min(margins), 4),
                               "verdict": _verdict(margins)}
            above = {str(s): sum(1 for o, x in zip(by_seed[s][0][dispfl], by_seed[s][0][label], strict=False)
                                 if o is not None and x is not None and o > x) for s in seeds}
            split[label] = {"seeds": seeds, "dispfl_minus_baseline": at, "rounds_dispfl_above_per_seed": above}
        found[part] = split
    (out / "claims.json").write_text(json.dumps(found, indent=1))
    md = ["DisPFL's accuracy minus each baseline's, in points, as each deploys it (a -FT baseline's fine-tuned "
          "value where it fine-tunes): the mean over seeds [each seed's]; the verdict: holds / reversed when every "
          f"seed's margin is past {POINT * 100:.0f} point, a tie when the mean is within it", ""]
    for part, split in found.items():
        md += [f"**{part}**", "", "| baseline | " + " | ".join(f"round {t}" for t in CHECKPOINTS)
               + " | rounds 251-300 |", "|---|" + "---|" * (len(CHECKPOINTS) + 1)]
        for label, c in split.items():
            cells = []
            for key in [*map(str, CHECKPOINTS), "251-300"]:
                m = c["dispfl_minus_baseline"].get(key)
                cells.append("–" if m is None else
                             f"{m['mean'] * 100:+.1f} [{', '.join(f'{v * 100:+.1f}' for v in m['per_seed'].values())}]"
                             f" {m['verdict']}")
            md.append(f"| {label} | {' | '.join(cells)} |")
        md.append("")
    (out / "claims.md").write_text("\n".join(md))
    return found


def _against_local(out: Path, tag: str) -> dict[str, Any]:
    """DisPFL against Local per seed run of both: per client over the last 50 rounds (how many at or above Local,
    every client's difference, sorted), the rounds DisPFL is above, and Local's last training loss."""
    found: dict[str, Any] = {}
    for f in sorted((out / "runs").glob(f"dispfl-{tag}-s*.json")):
        seed = int(f.stem.rsplit("-s", 1)[1])
        ours, local = json.loads(f.read_text()), _run(out, f"local-{tag}", seed)
        if local is None:
            continue
        mine, theirs = (np.array([x["client_acc"] for x in r["rounds"][-50:]]).mean(0) for r in (ours, local))
        diff = mine - theirs
        above = [x["round"] for x, y in zip(ours["rounds"], local["rounds"], strict=True)
                 if x["mean_acc"] > y["mean_acc"]]
        every_from = next((t for t in above if set(range(t, len(ours["rounds"]) + 1)) <= set(above)), None)
        found[f"seed {seed}"] = {
            "clients_at_or_above_local_last50": int((diff >= 0).sum()), "clients": len(diff),
            "client_diff_last50_sorted": [round(float(d), 4) for d in np.sort(diff)],
            "rounds_dispfl_above": len(above),
            "above_in_every_round_from": every_from,
            "checkpoints": {str(t): [round(ours["rounds"][t - 1]["mean_acc"], 4),
                                     round(local["rounds"][t - 1]["mean_acc"], 4)] for t in (50, 100, 200, 300)},
            "mean_251_300": [round(statistics.fmean(x["mean_acc"] for x in r["rounds"][250:300]), 4)
                             for r in (ours, local)],
            "local_last_train_loss": local["rounds"][-1]["train_loss"],
        }
    return found


def crossings(out: Path) -> None:
    """Per split and seed: where DisPFL's smoothed curve crosses each baseline's (the -FT baselines' curves between
    their fine-tunes), DisPFL's lead at rounds 50/100/200/300 (a -FT baseline's fine-tuned value where it has one),
    and every method's rank there; then the checkpoints and the claims over every seed, and the curves' plot (the
    mean over seeds)."""
    found: dict[str, Any] = {}
    curves: dict[str, dict[int, Curves]] = {}
    tags = {part: tag for part, tag in SPLITS.values()}
    for part, tag in SPLITS.values():
        dispfl = _rows(part, tag)[0].label
        curves[part] = {s: c for s in _seeds(out) if (c := _curves(out, part, tag, s))[0]}
        found[part] = {}
        for seed, (acc, ft) in curves[part].items():
            if dispfl not in acc:
                continue
            ours = acc[dispfl]
            mine = _smooth(ours)
            split: dict[str, Any] = {}
            for label, xs in acc.items():
                if xs is ours:
                    continue
                theirs = _smooth(xs)
                n = min(len(mine), len(theirs))
                diff = [mine[i] - theirs[i] for i in range(n)]
                # its lead over the model the baseline deploys between fine-tunes, from round 50 on (unsmoothed)
                lead = [o - x for o, x in zip(ours[49:], xs[49:], strict=False) if o is not None and x is not None]
                split[label] = {
                    "crossings": [{"round": i + 1, "dispfl_now": "above" if diff[i] > 0 else "below"}
                                  for i in range(1, n) if (diff[i] > 0) != (diff[i - 1] > 0)],
                    "lead_rounds_50_on_min_max": [round(min(lead), 4), round(max(lead), 4)] if lead else None,
                }
            # the paper ranks methods by their accuracy at the end; here at each checkpoint, unsmoothed
            split["ranking"] = {str(t): sorted(((label, round(_value(acc, ft, label, t), 4))
                                                for label, xs in acc.items() if len(xs) >= t), key=lambda p: -p[1])
                                for t in CHECKPOINTS}
            found[part][f"seed {seed}"] = split
        found[part]["against_local_per_seed"] = _against_local(out, tag)
        if curves[part]:
            acc, ft = _mean_curves(curves[part])
            _plot_zoom(acc, ft, out / f"curves-{tag}.png",
                       f"{part}: mean client accuracy, the mean of seeds {', '.join(map(str, sorted(curves[part])))}\n"
                       f"{WINDOW}-round moving average; stars: fine-tuned rounds")
    (out / "crossings.json").write_text(json.dumps(found, indent=1))
    (out / "checkpoints.md").write_text(_checkpoints({p: c for p, c in curves.items() if c}))
    claims({p: c for p, c in curves.items() if c}, tags, out)
    print((out / "claims.md").read_text())


def _mean_curves(by_seed: dict[int, Curves]) -> Curves:
    """Each method's curve and fine-tuned rounds averaged over the seeds that ran it (a -FT baseline's rounds
    without a value are the same on every seed: its cadence)."""
    acc: dict[str, Curve] = {}
    ft: dict[str, dict[int, float]] = {}
    labels = list(dict.fromkeys(label for c in by_seed.values() for label in c[0]))
    for label in labels:
        runs = [c for c in by_seed.values() if label in c[0]]
        n = min(len(c[0][label]) for c in runs)
        acc[label] = [None if any(c[0][label][i] is None for c in runs)
                      else statistics.fmean(c[0][label][i] or 0.0 for c in runs) for i in range(n)]
        if any(label in c[1] for c in runs):
            ft[label] = {t: statistics.fmean(c[1][label][t] for c in runs)
                         for t in runs[0][1][label] if all(t in c[1][label] for c in runs)}
    # a curve read under two names (D-PSGD from D-PSGD-FT's run) stays one object, as _plot_zoom expects
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            if all(a in c[0] and b in c[0] and c[0][a] is c[0][b] for c in by_seed.values()):
                acc[b] = acc[a]
    return acc, ft


if __name__ == "__main__":
    main(__doc__, TABLES, BUDGET, "dispfl-long-ref", crossings)
