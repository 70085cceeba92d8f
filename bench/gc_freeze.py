"""What ``gc.freeze()`` after start-up (``server.app``'s lifespan) saves a request that allocates many objects: a
stranger's 64 KiB JSON body of ``[[],[],...]`` (21,800 lists: each allocation counts towards a cyclic collection,
which walks every tracked object of the server's heap unless it is frozen), refused 422 by the device route,
through the whole app (in-process ASGI client). Alternating blocks, heap frozen (as the server runs) and unfrozen
(as it ran before), medians and maxima per block; results in bench/results/gc_freeze.json.

    .venv/bin/python bench/gc_freeze.py [--requests 40] [--blocks 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "gc_freeze.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--blocks", type=int, default=3)
    args = ap.parse_args()
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    tmp = Path(tempfile.mkdtemp())
    settings = Settings(data_dir=tmp / "d", database_url=f"sqlite:///{tmp / 's.db'}", broker_url="embedded",
                        admin_token="a" * 32)  # type: ignore[arg-type]
    body = b"[" + b"[]," * (64 * 1024 // 3 - 2) + b"[]]"
    rows = []
    with TestClient(create_app(settings)) as c:
        for block in range(args.blocks):
            for frozen in (True, False):
                if frozen:
                    gc.freeze()
                else:
                    gc.unfreeze()
                tracked = len(gc.get_objects())
                ms = []
                for _ in range(args.requests):
                    t = time.perf_counter()
                    r = c.post("/v1/devices", content=body, headers={"content-type": "application/json"})
                    ms.append((time.perf_counter() - t) * 1e3)
                    if r.status_code != 422:
                        raise SystemExit(f"expected 422, got {r.status_code}")
                rows.append({"block": block, "frozen": frozen, "tracked_objects": tracked,
                             "median_ms": statistics.median(ms), "max_ms": max(ms)})
                print(rows[-1], flush=True)
        gc.freeze()
    med = {f: statistics.median(r["median_ms"] for r in rows if r["frozen"] == f) for f in (True, False)}
    mx = {f: statistics.median(r["max_ms"] for r in rows if r["frozen"] == f) for f in (True, False)}
    out = {"command": "bench/gc_freeze.py", "date": datetime.now(UTC).isoformat(timespec="seconds"),
           "machine": platform.platform(), "body_bytes": len(body), "rows": rows,
           "median_ms": {"frozen": med[True], "unfrozen": med[False]},
           "max_ms_median_of_blocks": {"frozen": mx[True], "unfrozen": mx[False]}}
    RESULTS.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("median_ms", "max_ms_median_of_blocks")}))


if __name__ == "__main__":
    main()
