"""Wire-format size against the information-theoretic floor, and encode/decode throughput, in one run.

For each density the tensor is sent sparse with a Bernoulli(density) mask. The floor is 32 bits per value sent plus
n·H(density) bits for the mask (H the binary entropy of the mask's actual density); "data" is the payload less its
fixed prefix, JSON header and sha256, which are reported apart as "header". Throughput is dense-equivalent:
4 bytes × numel / seconds, best of --repeats. Writes bench/results/codec.json.

    .venv/bin/python bench/codec_bench.py [--sizes 1000000 100000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import struct
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pfl_edge.codec import decode, encode

DENSITIES = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]
PREFIX, SHA = 9, 32  # magic + version + header length; trailing sha256


def entropy(p: float) -> float:
    return 0.0 if p in (0.0, 1.0) else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def best_of(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{platform.node()} {cpu}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"


def measure(n: int, density: float | None, repeats: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    masks = None if density is None else {"w": torch.rand(n, generator=g) < density}
    payload = encode({"w": x}, model_id="bench", round=0, masks=masks)
    head_len = struct.unpack_from("<I", payload, 5)[0]
    entry = json.loads(payload[PREFIX : PREFIX + head_len])["tensors"][0]
    ones = n if masks is None else int(masks["w"].sum())
    p = ones / n
    data = len(payload) - PREFIX - head_len - SHA
    floor_bits = 32 * ones + (0.0 if masks is None else n * entropy(p))
    enc = best_of(lambda: encode({"w": x}, model_id="bench", round=0, masks=masks), repeats)
    dec = best_of(lambda: decode(payload), repeats)
    return {
        "numel": n,
        "density": density,
        "actual_density": p,
        "coding": "dense" if masks is None else f"{entry[5]} k={entry[6]}",
        "payload_bytes": len(payload),
        "header_bytes": len(payload) - data,
        "data_bytes": data,
        "mask_bytes": 0 if masks is None else entry[8],
        "floor_bytes": floor_bits / 8,
        "data_over_floor": 8 * data / floor_bits if floor_bits else float("nan"),
        "mask_over_entropy": 8 * entry[8] / (n * entropy(p)) if masks is not None and 0 < p < 1 else None,
        "encode_mb_s": 4 * n / enc / 1e6,
        "decode_mb_s": 4 * n / dec / 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 100_000])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "codec.json")
    args = ap.parse_args()

    rows = []
    head = f"{'numel':>9} {'density':>7} {'coding':>10} {'data B':>9} {'floor B':>11} {'data/floor':>10} "
    head += f"{'mask/H':>7} {'header B':>8} {'enc MB/s':>9} {'dec MB/s':>9}"
    print(head)
    for n in args.sizes:
        for i, density in enumerate([None, *DENSITIES]):
            r = measure(n, density, args.repeats, seed=i)
            rows.append(r)
            mask_h = "" if r["mask_over_entropy"] is None else f"{r['mask_over_entropy']:.3f}"
            print(
                f"{n:>9} {'dense' if density is None else density:>7} {r['coding']:>10} {r['data_bytes']:>9} "
                f"{r['floor_bytes']:>11.0f} {r['data_over_floor']:>10.4f} {mask_h:>7} {r['header_bytes']:>8} "
                f"{r['encode_mb_s']:>9.0f} {r['decode_mb_s']:>9.0f}"
            )

    sparse = [r for r in rows if r["density"] is not None]
    summary = {
        "worst_data_over_floor": max(r["data_over_floor"] for r in sparse),
        "min_encode_mb_s": min(r["encode_mb_s"] for r in rows),
        "min_decode_mb_s": min(r["decode_mb_s"] for r in rows),
        "targets": {"data_over_floor_max": 1.05, "encode_mb_s_min": 200, "decode_mb_s_min": 200},
    }
    summary["meets_targets"] = bool(
        summary["worst_data_over_floor"] <= 1.05
        and summary["min_encode_mb_s"] >= 200
        and summary["min_decode_mb_s"] >= 200
    )
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__},
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "floor": "32 bits per value sent + n*H(actual density) bits for the mask; header reported apart",
        "summary": summary,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(
        f"worst data/floor {summary['worst_data_over_floor']:.4f} (target <= 1.05), "
        f"slowest encode {summary['min_encode_mb_s']:.0f} MB/s, decode {summary['min_decode_mb_s']:.0f} MB/s "
        f"(target >= 200); {result['machine']}; wrote {args.out}"
    )


if __name__ == "__main__":
    main()
