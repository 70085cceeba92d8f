"""What secure aggregation costs on the wire (issue 36): the same FedPer federation of device processes, plain and
under SecAgg+, side by side in one run (alternating, each repeated), on one machine over the loopback.

Per mode: each round's wall time from opening to close (the server's), what a device uploads per round (its
update's payload: a model in the clear, or its masked input), and under SecAgg+ the JSON of its step messages
(keys, sealed shares, revealed shares, as the server stored them) and the answers it polled for. The devices
train the same rounds either way, so the difference is the protocol's.

    OMP_NUM_THREADS=1 .venv/bin/python bench/secagg_wire.py [--devices 8] [--rounds 3] [--repeats 2]

-> bench/results/secagg_wire.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from edge_runtime.fleet import start_server
from pfl_edge.protocol import API_PREFIX

QUICK: dict[str, Any] = dict(algorithm="fedper", kp=2, dataset="synthetic", partition="pathological:2",
                             samples_per_client=48, test_per_client=32, local_epochs=1, batch_size=16, lr=0.05,
                             workers=1, seed=3)


def run(root: Path, devices: int, rounds: int, secure: bool) -> dict[str, Any]:
    cfg = {**QUICK, "clients": devices, "rounds": rounds,
           **({"secure_aggregation": {"bound": 0.5, "bits": 16}} if secure else {})}
    fed = start_server(root, broker_url="embedded")
    try:
        fed.create("bench", cfg, deadline_s=600.0)
        for i in range(devices):
            fed.start_device(i, "phone-mid", extra=["--training-backend", "torch"])
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline:
            if fed.info()["state"] == "finished" and all(p.poll() is not None for p in fed.devices):
                break
            bad = [i for i, p in enumerate(fed.devices) if p.poll() not in (None, 0)]
            if bad:
                raise RuntimeError(f"device(s) {bad} failed; logs in {root}")
            time.sleep(0.5)
        else:
            raise RuntimeError(f"the federation did not finish; logs in {root}")
        rounds_ = [r for r in fed.get(f"{API_PREFIX}/federations/bench/metrics")["rounds"] if r["round"] >= 1]
    finally:
        fed.close()
    engine = create_engine(f"sqlite:///{root / 'server' / 'state.db'}")
    with engine.connect() as c:
        up = [n for (n,) in c.execute(text("SELECT b.size FROM pfl_blob_refs r JOIN pfl_blobs b ON b.digest = "
                                           "r.digest JOIN pfl_devices d ON d.id = r.uploader"))]
        steps = [len(json.dumps(b)) if isinstance(b, dict) else len(b) for (b,) in
                 c.execute(text("SELECT body FROM pfl_secagg"))] if secure else []
    engine.dispose()
    walls = [r["wall_s"] for r in rounds_ if r["wall_s"] is not None]
    return {"secure": secure, "round_wall_s": walls, "mean_round_wall_s": statistics.fmean(walls),
            "upload_bytes_per_device_round": statistics.fmean(up) if up else 0,
            "step_message_bytes_per_device_round": sum(steps) / (devices * rounds) if secure else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "secagg_wire.json")
    args = ap.parse_args()
    runs = []
    for rep in range(args.repeats):
        for secure in (False, True):  # alternating: the machine's load falls on both alike
            with tempfile.TemporaryDirectory(prefix="secagg-wire-") as tmp:
                res = run(Path(tmp), args.devices, args.rounds, secure)
            print(f"repeat {rep}, {'secure' if secure else 'plain'}: {res['mean_round_wall_s']:.2f} s a round",
                  flush=True)
            runs.append(res)
    out = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
           "devices": args.devices, "rounds": args.rounds, "config": QUICK, "runs": runs, **summary(runs)}
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(summary(runs), indent=1))


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the runs of each mode: of every round, and of the rounds after the first (round 1 holds each
    device's start: its program download and check, the same in both modes)."""
    def mean(secure: bool, first: int) -> float:
        return statistics.fmean(w for r in runs if r["secure"] == secure for w in r["round_wall_s"][first:])

    return {"mean_round_wall_s": {"plain": mean(False, 0), "secure": mean(True, 0)},
            "mean_round_wall_s_after_round_1": {"plain": mean(False, 1), "secure": mean(True, 1)},
            "secure_over_plain_after_round_1": mean(True, 1) / mean(False, 1)}


if __name__ == "__main__":
    main()
