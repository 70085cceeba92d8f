"""Simulator training throughput against plain PyTorch loops, and the simulator of this tree against the simulator
of a previous commit, side by side in one run with interleaved repeats.

Every layout trains the same thing: one local epoch of every client's data (``--clients`` x ``--samples``,
Fashion-MNIST ``pathological:4`` as the simulator deals it), the ``cnn``, batch 32, SGD lr 0.01 momentum 0.9, a
fresh optimizer per client. Layouts, each in its own child process(es):

* ``plain_1proc_2threads``: the textbook loop (``for x, y in batches: zero_grad / forward / backward / step``,
  one model reset per client) over all clients in one process, ``torch.set_num_threads(2)``;
* ``plain_2procs_1thread``: the same loop split over two concurrent single-thread processes (half the clients
  each); timed from the start signal until both have finished. On 2 cores this is the best plain layout;
* ``sim_new`` / ``sim_prev``: ``simulate()`` of this tree / of ``--prev`` (a worktree of the previous commit, put
  first on PYTHONPATH), FedPer, ``--sim-rounds`` rounds (default 4), ``workers=2`` (its default on 2 cores: two
  forked single-thread workers, loop engine). Timed: the ``Trainer.train`` call of each round from round 2 on
  (every client's local epoch, shipping states to the workers and back included), i.e. what a simulator round
  spends training; a run's figure is the median over its rounds 2+. Round 1 is the warm-up (fresh worker
  processes).

The same child runs also give full simulator rounds (training + evaluation + aggregation/mask update): the
``wall_s`` that ``simulate()`` records for each round from round 2 on, of FedPer and of DisPFL, on both trees,
with a breakdown into the round's ``Trainer`` calls (train, evaluate, dense_gradients) and the rest.

Plain-loop children stay alive across repeats (set up once, warmed up, then one run per "go"); simulator children
are one process per run (setup not timed). Repeats are interleaved, the order reversed every other repeat, so
drift on a shared machine hits every layout alike. Reported: the median over repeats (min and max alongside).
Without a previous tree at ``--prev`` only this tree is measured. Writes bench/results/throughput.json.

    .venv/bin/python bench/throughput.py [--repeats 3] [--sim-rounds 4] [--prev /tmp/pfl-prev]
        [--algorithms fedper,dispfl] [--clients 10] [--samples 6000]
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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from machine import cpu_model

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]


# ----------------------------------------------------------------------------------------------- child: plain loop

def child_plain(args: argparse.Namespace) -> None:
    """Set up (data, model), warm up, then per "go" line on stdin: the textbook loop over this child's clients,
    answered with one JSON line. Data dealt as the simulator deals it."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    from pfl_edge.checkpoint import build_model
    from pfl_edge.federation import FederationConfig, deal

    cfg = FederationConfig(algorithm="fedper", clients=args.clients, samples_per_client=args.samples,
                           dataset=args.dataset, partition=args.partition, seed=0, local_epochs=1,
                           batch_size=args.batch_size, lr=0.01, momentum=0.9)
    ds, part, spec = deal(cfg)
    lo, hi = (int(s) for s in args.clients_range.split(":"))
    xs = [ds.train_x[c.train_idx].contiguous() for c in part.clients[lo:hi]]
    ys = [torch.as_tensor(c.train_y, dtype=torch.int64) for c in part.clients[lo:hi]]
    torch.manual_seed(0)
    model = build_model(spec)
    model.train()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)

    def run(max_steps: int | None = None) -> int:
        samples = 0
        for x, y in zip(xs, ys, strict=True):
            model.load_state_dict(init)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            perm = torch.randperm(len(x), generator=gen)
            for s, i in enumerate(range(0, len(x), args.batch_size)):
                if max_steps is not None and s >= max_steps:
                    break
                b = perm[i:i + args.batch_size]
                opt.zero_grad()
                F.cross_entropy(model(x[b]), y[b]).backward()
                opt.step()
                samples += len(b)
        return samples

    run(max_steps=30)  # warm-up: allocator, oneDNN kernels
    import pfl_edge

    print(json.dumps({"ready": True, "pfl_edge": pfl_edge.__file__, "threads": torch.get_num_threads()}),
          flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        t0 = time.time()
        n = run()
        t1 = time.time()
        print(json.dumps({"start": t0, "end": t1, "samples": n}), flush=True)


# ------------------------------------------------------------------------------------------------ child: simulate

def child_sim(args: argparse.Namespace) -> None:
    """One ``simulate()`` run of whichever tree is first on sys.path, with its Trainer's calls timed per round."""
    import torch

    import pfl_edge
    import pfl_edge.sim.simulator as simulator
    from pfl_edge.parallel import Trainer
    from pfl_edge.sim import SimConfig, simulate

    calls: list[dict[str, Any]] = []
    state = {"round": 0}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(self: Any, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(self, *a, **k)
            calls.append({"round": state["round"], "call": name, "s": time.perf_counter() - t0})
            return out
        return wrapper

    for name in ("train", "evaluate", "dense_gradients"):
        if hasattr(Trainer, name):
            setattr(Trainer, name, timed(name, getattr(Trainer, name)))

    def marked(inner: Any) -> Any:  # marks round boundaries: run_round(t, ...) sets the current round
        def run_round(*a: Any, **k: Any) -> Any:
            state["round"] = a[1] if len(a) > 1 and not isinstance(a[0], int) else a[0]
            try:
                return inner(*a, **k)
            finally:
                state["round"] = 0
        return run_round

    if hasattr(simulator, "Runner"):  # this tree's one runner
        simulator.Runner.run_round = marked(simulator.Runner.run_round)
    else:  # an older tree's runner per algorithm family
        make = simulator.make_algorithm

        def make_marked(ctx: Any) -> Any:
            runner = make(ctx)
            runner.run_round = marked(runner.run_round)
            return runner

        simulator.make_algorithm = make_marked
    cfg = SimConfig(algorithm=args.algorithm, model="cnn", dataset=args.dataset, partition=args.partition,
                    clients=args.clients, samples_per_client=args.samples, rounds=args.sim_rounds, local_epochs=1,
                    batch_size=args.batch_size, lr=0.01, momentum=0.9, workers=args.workers, seed=0)
    res = simulate(cfg, progress=False)
    rounds = []
    for r in res["rounds"]:
        t = r["round"]
        mine = [c for c in calls if c["round"] == t]
        by = {n: sum(c["s"] for c in mine if c["call"] == n) for n in ("train", "evaluate", "dense_gradients")}
        rounds.append({"round": t, "wall_s": r["wall_s"], **{f"{k}_s": v for k, v in by.items()},
                       "train_calls": sum(c["call"] == "train" for c in mine),
                       "other_s": r["wall_s"] - sum(by.values()), "mean_acc": r["mean_acc"]})
    print(json.dumps({
        "pfl_edge": pfl_edge.__file__,
        "torch": torch.__version__,
        "workers": res["meta"]["workers"],
        "threads": res["meta"]["threads"],
        "engine": res["config"].get("engine"),
        "train_samples": sum(res["meta"]["client_train_samples"]),
        "setup_s": res["meta"]["setup_s"],
        "rounds": rounds,
    }), flush=True)


# --------------------------------------------------------------------------------------------------------- parent

def tree_env(tree: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env.update(extra)
    return env


def check_tree(tree: Path) -> dict[str, str]:
    """The files a child with this tree first on PYTHONPATH imports (and fail if they are not the tree's)."""
    out = subprocess.run([sys.executable, "-c", "import json, pfl_edge, server, edge_runtime; print(json.dumps("
                          "{m.__name__: m.__file__ for m in (pfl_edge, server, edge_runtime)}))"],
                         cwd=tree, env=tree_env(tree), capture_output=True, text=True, check=True)
    files = json.loads(out.stdout)
    for name, f in files.items():
        if not Path(f).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"a child meant to run {tree} imports {name} from {f}")
    return files


def child_args(args: argparse.Namespace) -> list[str]:
    return ["--clients", str(args.clients), "--samples", str(args.samples), "--batch-size", str(args.batch_size),
            "--dataset", args.dataset, "--partition", args.partition]


class PlainChild:
    def __init__(self, args: argparse.Namespace, threads: int, clients: tuple[int, int]) -> None:
        cmd = [sys.executable, str(HERE), "--child", "plain", "--threads", str(threads),
               "--clients-range", f"{clients[0]}:{clients[1]}", *child_args(args)]
        env = tree_env(REPO, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.info: dict[str, Any] | None = None

    def wait_ready(self) -> dict[str, Any]:
        if self.info is None:
            self.info = self._read()
            if not self.info.get("ready"):
                raise RuntimeError(f"plain child not ready: {self.info}")
        return self.info

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"plain child exited (rc {self.proc.wait()})")
        return dict(json.loads(line))

    def result(self) -> dict[str, Any]:
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run_plain(children: list[PlainChild]) -> dict[str, Any]:
    t0 = time.perf_counter()
    for c in children:
        c.go()
    res = [c.result() for c in children]
    wall = time.perf_counter() - t0
    return {"s": wall, "samples": sum(r["samples"] for r in res),
            "child_s": [r["end"] - r["start"] for r in res],
            "spread_s": max(r["end"] for r in res) - min(r["start"] for r in res)}


def run_sim(args: argparse.Namespace, tree: Path, algorithm: str) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE), "--child", "sim", "--algorithm", algorithm, "--workers", str(args.workers),
           "--sim-rounds", str(args.sim_rounds), *child_args(args)]
    out = subprocess.run(cmd, cwd=tree, env=tree_env(tree), capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"simulate child ({tree}, {algorithm}) failed:\n{out.stderr[-4000:]}")
    res = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    if not Path(res["pfl_edge"]).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"simulate child for {tree} imported {res['pfl_edge']}")
    return res


def git_rev(tree: Path) -> str:
    r = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return r.stdout.strip() + (" + uncommitted changes" if dirty else "")


def steady(run: dict[str, Any]) -> list[dict[str, Any]]:
    """A simulate() run's rounds from round 2 on (round 1 warms up fresh worker processes)."""
    return [x for x in run["rounds"] if x["round"] >= 2]


def med_of(run: dict[str, Any], key: str) -> float:
    return statistics.median(x[key] for x in steady(run))


def summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", choices=["plain", "sim"], help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--clients-range", default="0:10", help=argparse.SUPPRESS)
    ap.add_argument("--algorithm", default="fedper", help=argparse.SUPPRESS)
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--partition", default="pathological:4")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--samples", type=int, default=6000, help="training samples per client")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2, help="the simulator's training processes")
    ap.add_argument("--sim-rounds", type=int, default=4, help="rounds per simulate() run (round 1: warm-up)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--algorithms", default="fedper,dispfl", help="full simulator rounds timed (fedper is needed "
                    "for the training throughput)")
    ap.add_argument("--prev", type=Path, default=Path("/tmp/pfl-prev"),
                    help="worktree of the previous commit ('' to skip it)")
    ap.add_argument("--out", type=Path, default=HERE.parent / "results" / "throughput.json")
    args = ap.parse_args()
    if args.child == "plain":
        return child_plain(args)
    if args.child == "sim":
        return child_sim(args)

    algos = args.algorithms.split(",")
    if "fedper" not in algos:
        raise SystemExit("--algorithms must include fedper (its training round is the throughput measured)")
    trees = {"new": REPO}
    if str(args.prev) not in ("", "."):
        if (args.prev / "pfl_edge" / "__init__.py").exists():
            trees["prev"] = args.prev
        else:
            print(f"no previous tree at {args.prev} (git worktree add {args.prev} <commit>): measuring this tree only",
                  flush=True)
    imports = {name: check_tree(tree) for name, tree in trees.items()}
    half = args.clients // 2
    one = [PlainChild(args, 2, (0, args.clients))]
    two = [PlainChild(args, 1, (0, half)), PlainChild(args, 1, (half, args.clients))]
    for c in one + two:
        c.wait_ready()
    layouts: list[tuple[str, Any]] = [("plain_1proc_2threads", lambda: run_plain(one)),
                                      ("plain_2procs_1thread", lambda: run_plain(two))]
    for algo in algos:
        for name in ("prev", "new"):  # previous first, alternating
            if name in trees:
                layouts.append((f"sim_{name}:{algo}", lambda t=trees[name], a=algo: run_sim(args, t, a)))
    load_start = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k, _ in layouts}
    for r in range(args.repeats):
        order = layouts if r % 2 == 0 else layouts[::-1]
        for key, fn in order:
            t0 = time.time()
            res = fn()
            res["repeat"], res["t0"], res["t1"] = r + 1, t0, time.time()
            runs[key].append(res)
            if "s" in res:
                brief = f"{res['samples'] / res['s']:8.0f} samples/s"
            else:
                brief = "rounds 2+: train " + " ".join(f"{x['train_s']:.2f}" for x in steady(res)) + " s, wall " + \
                        " ".join(f"{x['wall_s']:.2f}" for x in steady(res)) + " s"

            print(f"repeat {r + 1}/{args.repeats} {key:28s} {brief}", flush=True)
    for c in one + two:
        c.close()

    samples = args.clients * args.samples
    rate: dict[str, dict[str, float]] = {}
    for key in ("plain_1proc_2threads", "plain_2procs_1thread"):
        rate[key] = summary([x["samples"] / x["s"] for x in runs[key]])
    for name in trees:
        sim = runs[f"sim_{name}:fedper"]
        assert all(x["train_samples"] == samples for x in sim), [x["train_samples"] for x in sim]
        rate[f"sim_{name}"] = summary([samples / med_of(x, "train_s") for x in sim])
        rate[f"sim_{name}_all_rounds"] = summary([samples / y["train_s"] for x in sim for y in steady(x)])
    med = {k: v["median"] for k, v in rate.items()}
    ratios: dict[str, Any] = {
        "sim_new / plain_2procs_1thread": med["sim_new"] / med["plain_2procs_1thread"],
        "sim_new / plain_1proc_2threads": med["sim_new"] / med["plain_1proc_2threads"],
        "plain_2procs_1thread / plain_1proc_2threads": med["plain_2procs_1thread"] / med["plain_1proc_2threads"],
    }
    if "prev" in trees:
        ratios["sim_prev / plain_2procs_1thread"] = med["sim_prev"] / med["plain_2procs_1thread"]
        ratios["sim_new / sim_prev"] = med["sim_new"] / med["sim_prev"]
        ratios["sim_new / sim_prev, all rounds"] = med["sim_new_all_rounds"] / med["sim_prev_all_rounds"]
        # paired per repeat (the two ran next to each other), so slow drift cancels
        ratios["sim_new / sim_prev, per repeat"] = [
            med_of(p, "train_s") / med_of(n, "train_s")
            for p, n in zip(runs["sim_prev:fedper"], runs["sim_new:fedper"], strict=True)]
    rounds: dict[str, Any] = {}
    for algo in algos:
        for name in trees:
            rs = runs[f"sim_{name}:{algo}"]
            rounds[f"{algo}_{name}"] = {k: summary([med_of(x, k) for x in rs]) for k in
                                        ("wall_s", "train_s", "evaluate_s", "dense_gradients_s", "other_s")}
            rounds[f"{algo}_{name}"]["wall_s_all_rounds"] = summary([y["wall_s"] for x in rs for y in steady(x)])
        if "prev" in trees:
            rounds[f"{algo}_new / {algo}_prev (wall_s)"] = (rounds[f"{algo}_new"]["wall_s"]["median"]
                                                            / rounds[f"{algo}_prev"]["wall_s"]["median"])
            rounds[f"{algo}_new / {algo}_prev (wall_s), all rounds"] = (
                rounds[f"{algo}_new"]["wall_s_all_rounds"]["median"]
                / rounds[f"{algo}_prev"]["wall_s_all_rounds"]["median"])
            rounds[f"{algo}_new / {algo}_prev (wall_s), per repeat"] = [
                med_of(n, "wall_s") / med_of(p, "wall_s")
                for p, n in zip(runs[f"sim_prev:{algo}"], runs[f"sim_new:{algo}"], strict=True)]

    import torch

    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs, {platform.node()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items() if k not in ("child", "threads", "clients_range",
                                                                         "algorithm")},
        "trees": {name: {"path": str(tree), "rev": git_rev(tree), "imports": imports[name]}
                  for name, tree in trees.items()},
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "timed": {
            "plain_*": "wall time of one pass over all clients' samples (2procs: from the start signal until both "
                       "children have finished)",
            "sim_*": "Trainer.train of each round from round 2 on of simulate(fedper, workers=2): every client's "
                     "local epoch through the default trainer (forked single-thread workers, loop engine); per "
                     "run the median over its rounds 2+ (sim_*_all_rounds: every round 2+ of every run)",
            "rounds": "rounds 2+ of simulate(): wall_s as the simulator records it (training + evaluation + "
                      "aggregation or mask update), split into the Trainer calls it made and the rest; per run "
                      "the median over its rounds 2+",
        },
        "samples": samples,
        "samples_per_s": rate,
        "ratios": ratios,
        "rounds": rounds,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))

    print(f"\n{'layout':22s} {'samples/s':>10s} {'(min-max)':>16s}  x of plain_2procs_1thread")
    for k, v in rate.items():
        print(f"{k:22s} {v['median']:10.0f} ({v['min']:6.0f}-{v['max']:6.0f})  "
              f"x{v['median'] / med['plain_2procs_1thread']:.3f}")
    for k, v in ratios.items():
        print(f"{k:45s} " + (f"{v:.3f}" if isinstance(v, float) else " ".join(f"{x:.3f}" for x in v)))
    print(f"\n{'rounds 2+':14s} {'wall s':>7s} {'train s':>8s} {'eval s':>7s} {'grads s':>8s} {'other s':>8s}")
    for k, v in rounds.items():
        if isinstance(v, dict):
            print(f"{k:14s} " + " ".join(f"{v[f]['median']:7.2f} " for f in
                                          ("wall_s", "train_s", "evaluate_s", "dense_gradients_s", "other_s")))
        elif isinstance(v, float):
            print(f"{k:50s} {v:.3f}")
        else:
            print(f"{k:50s} " + " ".join(f"{x:.3f}" for x in v))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
