"""What SecAgg+ (pfl_edge.secagg) costs a round: bytes each client sends and receives per step, the clients' and
the server's compute, at 10, 100 and 1,000 clients, for FedPer's base of the cnn at K_P = 3 (52,096 coordinates)
and K_P = 2 (453,632); with no dropout and with 5 % of the clients dropping after sharing their keys. The graph's
degree grows as SecAgg+ asks (about log n): k = min(n - 1, 2 ceil(1.5 log2 n)) made even, threshold 2k/3 + 1
(more than k/2, so a server cannot gather both secrets of a client; the dropouts a neighbourhood survives: k - t).

The whole round runs in this one process (``run_round``), each client's steps timed on their own: a client's
compute is what one device would spend, on this machine's core.

    .venv/bin/python bench/secagg_cost.py --out bench/results/secagg_cost.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from pfl_edge.secagg import Params, graph, run_round


def degree_for(n: int) -> int:
    k = min(n - 1, 2 * math.ceil(1.5 * math.log2(n)))
    return k - (k % 2)


def droppable(n: int, k: int, t: int, seed: int, want: int) -> set[int]:
    """Up to ``want`` clients whose dropping leaves every neighbourhood at least t: the round survives it."""
    g = graph(list(range(n)), k, seed)
    out: set[int] = set()
    rng = np.random.default_rng(seed)
    for c in rng.permutation(n).tolist():
        if len(out) >= want:
            break
        if all(len(g[j] & (out | {c})) <= k - t for j in g if j not in out | {c}):
            out.add(c)
    return out


def one(n: int, size: int, dropout: float) -> dict[str, Any]:
    k = degree_for(n)
    t = 2 * k // 3 + 1
    rng = np.random.default_rng(n)
    x = rng.integers(0, 1 << 20, size, dtype=np.uint32)
    inputs = {i: x for i in range(n)}  # one vector for all: the cost does not depend on the values
    drop = droppable(n, k, t, 1, max(1, int(dropout * n))) if dropout else set()
    t0 = time.perf_counter()
    total, survivors, cost = run_round(inputs, Params(k, t, size, b"bench"), seed=1, drop={"input": drop})
    wall = time.perf_counter() - t0
    want = (x.astype(np.uint64) * len(survivors) % (1 << 32)).astype(np.uint32)
    if not np.array_equal(total, want):
        raise SystemExit(f"n={n} size={size}: the unmasked sum is wrong")
    per_client_s = sorted(cost.client_s.values())
    sent = sum(cost.sent.values())
    return {"clients": n, "size": size, "degree": k, "threshold": t, "dropped": len(drop),
            "survivors": len(survivors),
            "client_bytes_sent": {s: v / n for s, v in cost.sent.items()},
            "client_bytes_sent_total": sent / n,
            "plain_upload_bytes": 4 * size,
            "overhead_vs_plain": sent / n / (4 * size),
            "client_bytes_received_total": sum(cost.received.values()) / n,
            "client_s_median": per_client_s[len(per_client_s) // 2], "client_s_max": per_client_s[-1],
            "server_s": cost.server_s, "wall_s": wall,
            "messages": "4 steps: advertise, share keys, masked input, unmask (each a client message and the "
                        "server's answer)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="10,100,1000")
    ap.add_argument("--sizes", default="52096,453632")
    ap.add_argument("--out", type=Path, default=Path("bench/results/secagg_cost.json"))
    args = ap.parse_args()
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        for n in [int(c) for c in args.clients.split(",")]:
            for dropout in (0.0, 0.05):
                r = one(n, size, dropout)
                rows.append(r)
                print(f"n={n:5d} d={size:7d} k={r['degree']:2d} t={r['threshold']:2d} dropped={r['dropped']:3d}: "
                      f"client sends {r['client_bytes_sent_total'] / 1e6:.3f} MB ({r['overhead_vs_plain']:.4f}x "
                      f"plain), median client {r['client_s_median'] * 1e3:.1f} ms, server {r['server_s']:.2f} s",
                      flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": datetime.now(UTC).isoformat(timespec="seconds"),
                                    "machine": f"{platform.machine()}, Python {platform.python_version()}",
                                    "command": "python bench/secagg_cost.py", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
