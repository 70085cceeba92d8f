"""Server aggregation throughput and peak memory against the number of uploads: FedPer's streaming weighted average,
run through the server's own code (``Coordinator.rounds.average``: the accepted updates read from the blob
store one at a time, decoded, added into one float64 accumulator per tensor), then the result encoded and stored as
``_close`` does.

The uploads are bases of the demo's model (cnn, Fashion-MNIST: 10 classes, 1x28x28; base = every block but the last
K_P = 2) as devices send them: ``encode(take(state, base), model_id, round=1)``, each a different perturbation of
the federation's initial model, with n_samples drawn from 300..900, stored in a ``server.blobs.DirBlobStore`` (the
blobs are written once, so reads come from the page cache). Each size is measured in a fresh subprocess: its peak
RSS is reset (``/proc/self/clear_refs`` = 5) after the imports and the model skeleton are loaded, and read back
(VmHWM of /proc/self/status) after the average and the store. MB/s is of payload bytes aggregated. The 10-upload
result is checked against ``pfl_edge.aggregate.weighted_average`` over the decoded states. Writes
bench/results/server_aggregation.json.

    .venv/bin/python bench/server_aggregation.py [--sizes 10 100 1000] [--threads 1 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from sqlalchemy.orm import sessionmaker  # no database: the averaging reads blobs only

from edge_runtime.fleet import DemoConfig
from pfl_edge.codec import decode, encode
from pfl_edge.split import take
from server.blobs import DirBlobStore, sha256_hex
from server.fedmodel import fed_model

CONFIG = DemoConfig(devices=6, rounds=10).federation_config()  # the demo's FedPer federation
KP = 2


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def make_store(root: Path, n: int, seed: int = 0) -> dict[str, Any]:
    """The start model (the server's whole model) and ``n`` uploads in a blob store; the manifest."""
    fm = fed_model(CONFIG)
    store = DirBlobStore(root, max_bytes=1 << 30)
    init = fm.init_state()
    start = encode(init, model_id=fm.model_id, round=0)
    start_digest = sha256_hex(start)
    store.put(start_digest, start)
    keys = fm.base_keys(KP)
    base = take(init, keys)
    g = torch.Generator().manual_seed(seed)
    ups = []
    for _ in range(n):
        state = {k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                 for k, v in base.items()}
        payload = encode(state, model_id=fm.model_id, round=1)
        digest = sha256_hex(payload)
        store.put(digest, payload)
        ups.append((digest, int(torch.randint(300, 901, (1,), generator=g)), KP, len(payload)))
    return {"start": start_digest, "uploads": ups}


def child(store_dir: str, manifest: str, n: int, repeats: int, threads: int = 1) -> dict[str, Any]:
    """In a fresh process: time the server's average over the first ``n`` uploads on ``threads`` torch threads,
    then encode + store."""
    from server.coordinator import Coordinator

    man = json.loads(Path(manifest).read_text())
    fm = fed_model(CONFIG)
    coord = Coordinator(sessionmaker(), DirBlobStore(store_dir, max_bytes=1 << 30), None,  # type: ignore[arg-type]
                        device_broker_url="mqtt://127.0.0.1:1883")
    ups = [(d, s, kp) for d, s, kp, _ in man["uploads"][:n]]
    payload_bytes = sum(size for *_, size in man["uploads"][:n])
    torch.set_num_threads(threads)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    rss0 = status_kb("VmRSS")
    hwm0 = status_kb("VmHWM")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        new = coord.rounds.average(fm, man["start"], ups)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    out = encode(new, model_id=fm.model_id, round=1)
    digest = sha256_hex(out)
    coord.blobs.put(digest, out)
    store_s = time.perf_counter() - t0
    hwm = status_kb("VmHWM")
    res: dict[str, Any] = {
        "uploads": n, "torch_threads": threads, "payload_bytes": payload_bytes,
        "payload_bytes_each": man["uploads"][0][3],
        "average_s": min(times), "average_s_all": times, "store_result_s": store_s,
        "mb_per_s": payload_bytes / min(times) / 1e6,
        "rss_before_mb": rss0 / 1024, "hwm_after_reset_mb": hwm0 / 1024, "peak_rss_mb": hwm / 1024,
        "peak_over_start_mb": (hwm - rss0) / 1024, "result_bytes": len(out),
    }
    if n <= 10:  # against the reference average over the decoded states
        from pfl_edge.aggregate import weighted_average

        states = [decode(coord.blobs.get(d), expected=fm.expected(kp), model_id=fm.model_id).tensors
                  for d, _, kp in ups]
        ref = weighted_average(states, [float(s) for _, s, _ in ups])
        prev = decode(coord.blobs.get(man["start"]), expected=fm.shapes, model_id=fm.model_id).tensors
        res["max_abs_diff_vs_weighted_average"] = max(float((new[k] - ref[k]).abs().max()) for k in ref)
        res["personal_tensors_unchanged"] = all(torch.equal(new[k], prev[k]) for k in prev if k not in ref)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--quick", action="store_true", help="sizes 10 and 50: a smoke run")
    ap.add_argument("--repeats", type=int, default=3, help="timed averages per size (best of), 1 at >= 1000")
    ap.add_argument("--store", type=Path, help="blob store directory (default: a temporary one)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "server_aggregation.json")
    ap.add_argument("--threads", type=int, nargs="+", default=[1],
                    help="torch threads of the averaging process, each measured side by side (the server runs 1)")
    ap.add_argument("--child", nargs=5, metavar=("STORE", "MANIFEST", "N", "REPEATS", "THREADS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        store, manifest, n, repeats, threads = args.child
        print(json.dumps(child(store, manifest, int(n), int(repeats), int(threads))))
        return
    sizes = [10, 50] if args.quick else sorted(args.sizes)
    with tempfile.TemporaryDirectory(dir=args.store) as tmp:
        root = Path(tmp) / "blobs"
        t0 = time.perf_counter()
        man = make_store(root, max(sizes))
        print(f"wrote {max(sizes)} uploads of {man['uploads'][0][3]:,} B in {time.perf_counter() - t0:.0f} s",
              flush=True)
        manifest = Path(tmp) / "manifest.json"
        manifest.write_text(json.dumps(man))
        rows = []
        for n, th in [(n, th) for n in sizes for th in args.threads]:
            reps = 1 if n >= 1000 else args.repeats
            env = {**os.environ, "OMP_NUM_THREADS": str(th)}
            out = subprocess.run([sys.executable, __file__, "--child", str(root), str(manifest), str(n), str(reps),
                                  str(th)], check=True, stdout=subprocess.PIPE, text=True, env=env).stdout
            r = json.loads(out.strip().splitlines()[-1])
            rows.append(r)
            extra = (f"  max |diff| vs weighted_average {r['max_abs_diff_vs_weighted_average']:.2e}"
                     if "max_abs_diff_vs_weighted_average" in r else "")
            print(f"{n:>5} uploads, {th} thread(s): {r['payload_bytes'] / 1e6:8.1f} MB in {r['average_s']:7.3f} s = "
                  f"{r['mb_per_s']:6.0f} MB/s; store result {r['store_result_s'] * 1e3:.1f} ms; peak RSS "
                  f"{r['peak_rss_mb']:.1f} MB ({r['peak_over_start_mb']:+.1f} MB over the start){extra}", flush=True)
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
                   f"torch {torch.__version__}, torch threads {args.threads}",
        "load_average": os.getloadavg(),
        "config": CONFIG, "kp": KP,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
