"""What the issue-10 defences cost, side by side in one run: the decoder refusing the issue's mask attack (a
sparse tensor of 1,000 elements followed by a 63 MB mask stream of zero bits), and the enrolment gate checking a
secret (scrypt for a first or wrong secret; one keyed HMAC for the right secret again).

    .venv/bin/python bench/trust_costs.py [--attack-mb 63] [--hits 10000] [--out bench/results/trust_costs.json]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import platform
import struct
import time
import tracemalloc
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from pfl_edge.codec import decode
from pfl_edge.errors import CodecError
from server.db import hash_secret
from server.enrol_gate import EnrolGate
from server.errors import Forbidden
from server.ratelimit import Buckets

_PREFIX = struct.Struct("<4sBI")  # the codec's magic, version, header length (docs/protocol.md)


def attack_payload(coding: str, stream_bytes: int) -> bytes:
    ones = 999 if coding == "rice0" else 1
    header = {"model": "m", "round": 0,
              "tensors": [["w", [1000], "f4", 0, 4 * ones, coding, 0, ones, stream_bytes]]}
    head = json.dumps(header, separators=(",", ":")).encode()
    body = _PREFIX.pack(b"PFLE", 1, len(head)) + head + np.ones(ones, "<f4").tobytes() + b"\0" * stream_bytes
    return body + hashlib.sha256(body).digest()


def refusal(payload: bytes) -> dict[str, float]:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        decode(payload)
    except CodecError:
        pass
    else:
        raise SystemExit("the attack payload decoded: the mask bounds are gone")
    finally:
        wall = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return {"payload_bytes": len(payload), "peak_alloc_bytes": peak, "peak_over_payload": peak / len(payload),
            "wall_ms": wall * 1e3}


def gate_costs(hits: int) -> dict[str, float]:
    gate = EnrolGate(Buckets(1e9, 10**9), Buckets(1e9, 10**9))
    stored = hash_secret("right-secret")
    t0 = time.perf_counter()
    gate.check("f", "right-secret", stored, "a")  # scrypt, then remembered
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(hits):
        gate.check("f", "right-secret", stored, "a")
    hit = (time.perf_counter() - t0) / hits
    t0 = time.perf_counter()
    with contextlib.suppress(Forbidden):
        gate.check("f", "wrong-secret", stored, "a")
    wrong = time.perf_counter() - t0
    return {"first_right_ms": first * 1e3, "right_again_us": hit * 1e6, "wrong_ms": wrong * 1e3,
            "first_over_again": first / hit}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attack-mb", type=int, default=63)
    ap.add_argument("--hits", type=int, default=10_000)
    ap.add_argument("--out", type=Path, default=Path("bench/results/trust_costs.json"))
    args = ap.parse_args()
    out = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
           "machine": f"{platform.machine()}, Python {platform.python_version()}",
           "mask_attack": {c: refusal(attack_payload(c, args.attack_mb << 20)) for c in ("rice1", "rice0", "bitmap")},
           "enrol_gate": gate_costs(args.hits)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
