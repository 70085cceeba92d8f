"""What each aggregation rule costs the server at close, through its own code (``RoundMachine.average``): N uploads
of the demo's FedPer base (cnn, Fashion-MNIST, 1.8 MB each, as ``bench/server_aggregation.py`` makes them) in a
blob store, one torch thread, best of two. Also: the norm the server computes per update as it accepts it (the
default bound's only extra work), and the close with the default bound when those norms were not kept (a second
pass over the blobs). Writes bench/results/robust_aggregation.json.

    .venv/bin/python bench/robust_aggregation.py [--uploads 100]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from sqlalchemy.orm import sessionmaker  # no database: the averaging reads blobs only

sys.path.insert(0, str(Path(__file__).parent))

import server_aggregation as sa  # the same uploads as the aggregation benchmark

from pfl_edge.aggregate import AggregationRule, update_norm
from server.blobs import DirBlobStore
from server.coordinator import Coordinator
from server.fedmodel import fed_model

RULES = {
    "mean, no bound": AggregationRule(norm_multiple=None),
    "mean, 3x median norm bound (the default before issue 49)": AggregationRule(norm_multiple=3.0),
    "mean, 1x median norm bound (default)": AggregationRule(),
    "mean, absolute bound": AggregationRule(max_update_norm=10.0),
    "clipped-mean": AggregationRule("clipped-mean"),
    "median": AggregationRule("median"),
    "trimmed-mean (0.2)": AggregationRule("trimmed-mean"),
}


def _best(fn: Any, repeats: int = 2) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(min(times), 3)


def run(n: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    man = sa.make_store(root, n)
    fm = fed_model(sa.CONFIG)
    coord = Coordinator(sessionmaker(), DirBlobStore(root, max_bytes=1 << 30), None,  # type: ignore[arg-type]
                        device_broker_url="mqtt://127.0.0.1:1883")
    ups3 = [(d, s, kp) for d, s, kp, _ in man["uploads"]]
    prev = coord.blob_access.load(man["start"], fm).tensors
    norms = [update_norm(prev, coord.blob_access.load(d, fm, fm.expected(kp)).tensors) for d, _, kp in ups3]
    one = coord.blob_access.load(ups3[0][0], fm, fm.expected(ups3[0][2])).tensors
    norm_ms = _best(lambda: [update_norm(prev, one) for _ in range(20)]) / 20 * 1e3
    ups = [(d, s, kp, nm) for (d, s, kp), nm in zip(ups3, norms, strict=True)]
    out: dict[str, Any] = {"uploads": n, "payload_bytes_each": man["uploads"][0][3],
                           "norm_ms_per_update_at_acceptance": round(norm_ms, 2),
                           "default_bound_without_kept_norms_s": _best(
                               lambda: coord.rounds.average(fm, man["start"], ups3, AggregationRule()))}
    out["close_s"] = {name: _best(lambda r=rule: coord.rounds.average(fm, man["start"], ups, r))
                      for name, rule in RULES.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--uploads", type=int, default=100)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "robust_aggregation.json")
    args = ap.parse_args()
    res = run(args.uploads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
