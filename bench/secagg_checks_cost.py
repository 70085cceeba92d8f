"""What the verifiable shares of issue 48 (b5b86ec: SHA-256 commitments per share, complaints judged by the server,
each revealed share checked against its commitment, the consistency of more than t shares by Lagrange evaluation)
cost a SecAgg+ round, against the code just before them (93074b3), side by side in one run.

Each side is a git worktree of its commit (``git worktree add`` in a temp folder, removed at the end), and each
measurement a fresh subprocess of this script (``--worker``) with PYTHONPATH at that worktree, so the two sides
never share an import. The same round as bench/secagg_cost.py: ``run_round`` in one process, FedPer's base of the
cnn at K_P = 3 (52,096 coordinates), degree k = min(n - 1, 2 ceil(1.5 log2 n)) made even, threshold 2k/3 + 1, no
dropout and 5 % of the clients (at least one) dropping after they shared their keys. Per configuration the sides
alternate (old, new, new, old, ...) so that the machine's load falls on both alike; medians over the repeats.

What is timed, per round:
- ``server_s``: ``RoundCost.server_s`` as ``run_round`` counts it (the graph and ``Server.total``: reconstruction
  and unmasking; on the new side also the consistency checks, which run inside ``total``).
- ``server_all_s``: every method of ``Server`` (route, inbox, complain, receive, unmask_request, collect, total,
  ...), each call timed once (a method called from another is counted in its caller): on the new side this adds
  the check of every revealed share against its commitment (``collect``), which ``server_s`` does not see.
  ``server_all_cpu_s``: the same calls' CPU time (``time.thread_time``: what a loaded machine's other processes
  do not add to).
- within those, the time in ``protocol``'s helpers while a ``Server`` method runs: ``consistent`` (new: the
  Lagrange check of the shares beyond t), ``combine`` (the Shamir reconstructions), ``prg`` (the masks regenerated),
  ``matches`` and ``judge`` (new: the commitment checks, complaints).
- the clients' compute per step (``Client.share_keys``: Shamir splitting, sealing and now committing;
  ``Client.masked_input``: opening and now checking each pair, and the masks; ``Client.unmask``), median and max
  over clients, wall and CPU (``client_cpu_by_step``); and the bytes a client sends and receives per step
  (``RoundCost``).

Threads: every subprocess runs with OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS, NUMEXPR_NUM_THREADS
= 1 (numpy's uint32 arithmetic and ``cryptography``'s AES are single-threaded anyway).

    .venv/bin/python bench/secagg_checks_cost.py --out bench/results/secagg_checks_cost.json

A progress line per measurement goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
THREADS = {v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")}
SIZE = 52_096  # FedPer's base of the cnn at K_P = 3


# ---------------------------------------------------------------- one round, in a subprocess on one side's code


def _timing(cls: type, names: list[str], into: dict[str, float], per_call: dict[str, list[float]] | None,
            depth: list[int], cpu: dict[str, float] | None = None,
            per_call_cpu: dict[str, list[float]] | None = None) -> None:
    """Wrap ``cls``'s methods ``names`` to add their time to ``into`` (wall) and ``cpu`` (this thread's CPU
    time), outermost calls only."""
    for name in names:
        fn = getattr(cls, name, None)
        if fn is None:
            continue

        def wrapped(self: Any, *a: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
            depth[0] += 1
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return _fn(self, *a, **kw)
            finally:
                dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                depth[0] -= 1
                if depth[0] == 0:
                    into[_name] = into.get(_name, 0.0) + dt
                    if cpu is not None:
                        cpu[_name] = cpu.get(_name, 0.0) + dc
                    if per_call is not None:
                        per_call.setdefault(_name, []).append(dt)
                    if per_call_cpu is not None:
                        per_call_cpu.setdefault(_name, []).append(dc)

        setattr(cls, name, wrapped)


def worker(n: int, dropout: float, seed: int) -> dict[str, Any]:
    import numpy as np
    from secagg_cost import degree_for, droppable  # beside this script; its pfl_edge is this side's (PYTHONPATH)

    import pfl_edge.secagg.protocol as protocol
    from pfl_edge.secagg import Params, run_round

    k = degree_for(n)
    t = 2 * k // 3 + 1

    server_t: dict[str, float] = {}
    server_cpu: dict[str, float] = {}
    client_t: dict[str, float] = {}
    client_calls: dict[str, list[float]] = {}
    client_cpu: dict[str, list[float]] = {}
    sdepth, cdepth = [0], [0]
    _timing(protocol.Server, [m for m in vars(protocol.Server) if not m.startswith("__")
                              and callable(vars(protocol.Server)[m])], server_t, None, sdepth, server_cpu)
    _timing(protocol.Client, ["advertise", "share_keys", "masked_input", "complaint", "unmask"], client_t,
            client_calls, cdepth, None, client_cpu)
    inside: dict[str, float] = {}  # the server's time in the protocol module's helpers, while a Server method runs
    for name in ("consistent", "combine", "matches", "judge", "prg"):
        fn = getattr(protocol, name, None)
        if fn is None:
            continue

        def helper(*a: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
            if sdepth[0] == 0:
                return _fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                inside[_name] = inside.get(_name, 0.0) + time.perf_counter() - t0

        setattr(protocol, name, helper)
    rng = np.random.default_rng(n)
    x = rng.integers(0, 1 << 20, SIZE, dtype=np.uint32)
    inputs = {i: x for i in range(n)}
    drop = droppable(n, k, t, 1, max(1, int(dropout * n))) if dropout else set()
    t0 = time.perf_counter()
    total, survivors, cost = run_round(inputs, Params(k, t, SIZE, b"bench"), seed=seed, drop={"input": drop})
    wall = time.perf_counter() - t0
    want = (x.astype(np.uint64) * len(survivors) % (1 << 32)).astype(np.uint32)
    if not np.array_equal(total, want):
        raise SystemExit(f"n={n}: the unmasked sum is wrong")

    def spread(v: list[float]) -> dict[str, float]:
        return {"median_ms": statistics.median(v) * 1e3, "max_ms": max(v) * 1e3, "sum_s": sum(v)} if v else {}

    return {"code": str(Path(protocol.__file__).resolve().parents[2]),
            "clients": n, "degree": k, "threshold": t, "dropped": len(drop), "survivors": len(survivors),
            "server_s": cost.server_s, "server_all_s": sum(server_t.values()),
            "server_all_cpu_s": sum(server_cpu.values()), "server_cpu_by_method_s": server_cpu,
            "server_by_method_s": server_t,
            "server_in_helpers_s": inside,
            "client_by_step": {s: spread(v) for s, v in client_calls.items()},
            "client_cpu_by_step": {s: spread(v) for s, v in client_cpu.items()},
            "client_s_median_ms": statistics.median(cost.client_s.values()) * 1e3,
            "client_s_max_ms": max(cost.client_s.values()) * 1e3,
            "client_bytes_sent": {s: v / n for s, v in cost.sent.items()},
            "client_bytes_received": {s: v / n for s, v in cost.received.items()},
            "wall_s": wall, "threads_env": {v: os.environ.get(v) for v in THREADS}}


# ---------------------------------------------------------------- the driver


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def run_side(tree: Path, n: int, dropout: float, seed: int) -> dict[str, Any]:
    env = {**os.environ, **THREADS, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", "--n", str(n),
                        "--dropout", str(dropout), "--seed", str(seed)], env=env, cwd=tempfile.gettempdir(),
                       capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"worker on {tree} failed:\n{p.stderr[-3000:]}")
    r = dict(json.loads(p.stdout.strip().splitlines()[-1]))
    if Path(r["code"]) != tree.resolve():
        raise SystemExit(f"the worker imported pfl_edge from {r['code']}, not {tree}")
    return r


def med(rows: list[dict[str, Any]], *path: str) -> float:
    vals = []
    for r in rows:
        v: Any = r
        for p in path:
            v = v.get(p, {}) if isinstance(v, dict) else {}
        if isinstance(v, int | float):
            vals.append(float(v))
    return statistics.median(vals) if vals else float("nan")


SUMMARY = {  # name -> path in a worker's row
    "server_s": ("server_s",), "server_all_s": ("server_all_s",), "server_all_cpu_s": ("server_all_cpu_s",),
    "server_total_cpu_s": ("server_cpu_by_method_s", "total"),
    "server_collect_s": ("server_by_method_s", "collect"), "server_total_s": ("server_by_method_s", "total"),
    "server_consistent_s": ("server_in_helpers_s", "consistent"),
    "server_combine_s": ("server_in_helpers_s", "combine"), "server_prg_s": ("server_in_helpers_s", "prg"),
    "server_route_s": ("server_by_method_s", "route"), "server_receive_s": ("server_by_method_s", "receive"),
    "client_share_median_ms": ("client_by_step", "share_keys", "median_ms"),
    "client_input_median_ms": ("client_by_step", "masked_input", "median_ms"),
    "client_unmask_median_ms": ("client_by_step", "unmask", "median_ms"),
    "client_share_cpu_median_ms": ("client_cpu_by_step", "share_keys", "median_ms"),
    "client_input_cpu_median_ms": ("client_cpu_by_step", "masked_input", "median_ms"),
    "client_input_cpu_max_ms": ("client_cpu_by_step", "masked_input", "max_ms"),
    "client_round_median_ms": ("client_s_median_ms",), "client_round_max_ms": ("client_s_max_ms",),
    "client_sent_share_B": ("client_bytes_sent", "share"),
    "client_received_share_B": ("client_bytes_received", "share"),
    "client_sent_input_B": ("client_bytes_sent", "input"), "client_sent_unmask_B": ("client_bytes_sent", "unmask"),
    "wall_s": ("wall_s",),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=10, help=argparse.SUPPRESS)
    ap.add_argument("--dropout", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--clients", default="10,100,1000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--repeats-1000", type=int, default=None, help="repeats at 1,000 clients (default: --repeats)")
    ap.add_argument("--old", default="93074b3", help="the commit before the checks")
    ap.add_argument("--new", default="HEAD", help="the commit with the checks")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/secagg_checks_cost.json")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.n, args.dropout, args.seed)))
        return

    sides = {"old": git("rev-parse", args.old), "new": git("rev-parse", args.new)}
    tmp = Path(tempfile.mkdtemp(prefix="secagg-checks-"))
    trees = {s: tmp / s for s in sides}
    for s, sha in sides.items():
        git("worktree", "add", "--detach", str(trees[s]), sha)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    try:
        for n in [int(c) for c in args.clients.split(",")]:
            reps = args.repeats_1000 if n >= 1000 and args.repeats_1000 is not None else args.repeats
            for dropout in (0.0, 0.05):
                got: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
                load0 = os.getloadavg()
                t0 = time.perf_counter()
                for rep in range(reps):
                    for side in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                        r = run_side(trees[side], n, dropout, seed=1)
                        got[side].append(r)
                        print(f"n={n:5d} dropped={r['dropped']:3d} rep {rep + 1}/{reps} {side}: server "
                              f"{r['server_s']:.3f} s (all methods {r['server_all_s']:.3f} s, CPU "
                              f"{r['server_all_cpu_s']:.3f} s), wall {r['wall_s']:.1f} s,"
                              f" load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
                summary = {s: {k: med(v, *p) for k, p in SUMMARY.items()} for s, v in got.items()}
                ratio = {k: (summary["new"][k] / summary["old"][k] if summary["old"][k] else None) for k in SUMMARY}
                row = {"clients": n, "size": SIZE, "degree": got["new"][0]["degree"],
                       "threshold": got["new"][0]["threshold"], "dropped": got["new"][0]["dropped"],
                       "survivors": {s: got[s][0]["survivors"] for s in got}, "repeats": reps,
                       "median": summary, "ratio_new_over_old": ratio,
                       "load_before": load0, "load_after": os.getloadavg(),
                       "elapsed_s": time.perf_counter() - t0, "runs": got}
                rows.append(row)
                print(f"== n={n} dropped={row['dropped']} ({reps} repeats): server_s old "
                      f"{summary['old']['server_s']:.3f}"
                      f" new {summary['new']['server_s']:.3f} (x{ratio['server_s']:.2f}); all server methods old "
                      f"{summary['old']['server_all_s']:.3f} new {summary['new']['server_all_s']:.3f} "
                      f"(x{ratio['server_all_s']:.2f}); their CPU old {summary['old']['server_all_cpu_s']:.3f} new "
                      f"{summary['new']['server_all_cpu_s']:.3f} (x{ratio['server_all_cpu_s']:.2f}); load "
                      f"{row['load_before'][0]:.2f} -> {row['load_after'][0]:.2f}",
                      file=sys.stderr, flush=True)
    finally:
        for s in sides:
            subprocess.run(["git", "worktree", "remove", "--force", str(trees[s])], cwd=ROOT, check=False)
        tmp.rmdir() if tmp.exists() and not any(tmp.iterdir()) else None
    secagg_dirty = git("status", "--porcelain", "--", "pfl_edge/secagg")
    from machine import cpu_model  # bench/, this script's folder

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "started": started, "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join([str(Path(__file__).relative_to(ROOT)), *sys.argv[1:]]),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
        "threads": {**THREADS, "note": "set in every worker's environment, old and new alike"},
        "load_before": load_before, "load_after": os.getloadavg(),
        "commits": {"old": sides["old"], "new": sides["new"], "old_ref": args.old, "new_ref": args.new,
                    "repo_head": git("rev-parse", "HEAD"),
                    "pfl_edge/secagg uncommitted changes in the checkout": secagg_dirty or "none"},
        "round": "run_round in one process, FedPer base (cnn, K_P = 3), 52,096 coordinates, k = about 3 log2 n "
                 "made even, t = 2k/3 + 1; dropped: 5 % (at least one) after sharing keys",
        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
