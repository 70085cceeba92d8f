"""What serving the model as an artefact costs (issue 11), through the real endpoints of a real server (a
subprocess; SQLite, embedded broker). Per model of the registry, on 1x28x28 inputs (the synthetic set: the shapes
of Fashion-MNIST), per profile class:

- phone (``phone-mid``: ExecuTorch training, so its card lists the ONNX inference program and the training
  program) and jetson (``jetson-orin-nano``: torch training, onnxruntime inference: the ONNX program only), each on
  a fresh server with an empty program cache: the time from the first ``GET /v1/federations/{fed}/model?profile=``
  (answered 503 + Retry-After while the child process exports) to the first 200, polled every ``--poll-s``;
  an export that fails is reported with its error (the server's 503 says so) and the model is skipped;
- each program's size, the card's JSON size, a cached card request's latency (median of ``--card-requests``, one
  keep-alive connection) and a program download's throughput (best of ``--downloads``);
- what the device no longer does: before commit a0a75e8 the agent exported its ExecuTorch training program at its
  first start (``prepare`` -> ``lower_executorch_training`` -> ``package`` into its state dir); that export is
  timed here in a fresh process, as the device ran it (imports included).

    .venv/bin/python bench/artefacts.py [--models cnn mobilenet-v1 resnet18-gn] [--out bench/results/artefacts.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from pfl_edge.protocol import API_PREFIX
from server.launch import start_subprocess

PROFILES = {"phone": "phone-mid", "jetson": "jetson-orin-nano"}
SECRET = "artefact-bench-secret"


def fed_config(model: str) -> dict[str, Any]:
    """A FedPer federation of ``model`` on the synthetic set (1x28x28, 10 classes), batch 32, K_P 2; 2 clients
    that never enrol, so no round runs while the programs export."""
    return {"algorithm": "fedper", "model": model, "dataset": "synthetic", "clients": 2,
            "rounds": 1, "kp": 2, "batch_size": 32}


def wait_card(c: httpx.Client, fed: str, profile: str, poll_s: float, timeout_s: float) -> dict[str, Any]:
    """Ask for the card until it is ready or its export failed; what it took."""
    url = f"{API_PREFIX}/federations/{fed}/model"
    t0 = time.perf_counter()
    polls, retry_after = 0, None
    while True:
        r = c.get(url, params={"profile": profile})
        polls += 1
        if r.status_code == 200:
            return {"ready_s": time.perf_counter() - t0, "polls": polls, "retry_after_s": retry_after,
                    "card": r.json(), "card_bytes": len(r.content)}
        if r.status_code != 503:
            raise RuntimeError(f"{url}?profile={profile}: {r.status_code} {r.text[:500]}")
        retry_after = retry_after or int(r.headers["retry-after"])
        detail = str(r.json().get("detail", ""))
        if "failed" in detail:  # the server's 503 after a failed export: it waits 60 s before trying again
            return {"failed_after_s": time.perf_counter() - t0, "polls": polls, "error": detail[:1500]}
        if time.perf_counter() - t0 > timeout_s:
            return {"failed_after_s": time.perf_counter() - t0, "polls": polls, "error": f"not ready in {timeout_s} s"}
        time.sleep(poll_s)


def cached_costs(c: httpx.Client, fed: str, profile: str, card: dict[str, Any], args: argparse.Namespace
                 ) -> dict[str, Any]:
    """A cached card's latency and each program's download throughput."""
    url = f"{API_PREFIX}/federations/{fed}/model"
    lat = []
    for _ in range(args.card_requests):
        t0 = time.perf_counter()
        c.get(url, params={"profile": profile}).raise_for_status()
        lat.append(time.perf_counter() - t0)
    programs = []
    for p in card["programs"]:
        walls = []
        for _ in range(args.downloads):
            t0 = time.perf_counter()
            r = c.get(p["url"])
            r.raise_for_status()
            walls.append(time.perf_counter() - t0)
            if len(r.content) != p["bytes"]:
                raise RuntimeError(f"{p['file']}: {len(r.content)} bytes, the card says {p['bytes']}")
        programs.append({"file": p["file"], "kind": p["kind"], "mode": p["mode"], "runtime": p["runtime"],
                         "bytes": p["bytes"], "download_best_s": min(walls),
                         "download_mb_per_s": p["bytes"] / min(walls) / 1e6})
    return {"card_p50_ms": 1e3 * statistics.median(lat), "card_p90_ms": 1e3 * sorted(lat)[int(0.9 * len(lat))],
            "card_requests": len(lat), "programs": programs}


def profile_class(cls: str, models: list[str], args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """A fresh server (empty program cache) and every model's card for this profile class."""
    token = secrets.token_urlsafe(24)
    log = tmp / f"server-{cls}.log"  # the export child's errors, per program, are logged by the server
    srv = start_subprocess({"PFL_DATA_DIR": str(tmp / f"server-{cls}"), "PFL_ADMIN_TOKEN": token}, timeout=120,
                           log=log)
    out: dict[str, Any] = {}
    try:
        with httpx.Client(base_url=srv.url, timeout=120, headers={"Authorization": f"Bearer {token}"}) as c:
            for model in models:
                fed = model.replace(".", "-")
                c.post(f"{API_PREFIX}/federations", json={"id": fed, "enrol_secret": SECRET,
                                                          "config": fed_config(model)}).raise_for_status()
                print(f"[{cls}] {model}: asking for the card of {PROFILES[cls]} ...", flush=True)
                got = wait_card(c, fed, PROFILES[cls], args.poll_s, args.timeout_s)
                if "card" not in got:
                    got["export_errors"] = export_errors(log, model)
                    print(f"[{cls}] {model}: export FAILED after {got['failed_after_s']:.1f} s: "
                          f"{got['error'][:300]}", flush=True)
                    out[model] = got
                    continue
                card = got.pop("card")
                got.update(cached_costs(c, fed, PROFILES[cls], card, args))
                if cls == "phone":  # both classes' cards from one server, interleaved (the jetson's is cached too)
                    got["cards_side_by_side"] = cards_side_by_side(c, fed, args.card_requests)
                print(f"[{cls}] {model}: card ready after {got['ready_s']:.1f} s, {got['card_bytes']} B, "
                      f"cached {got['card_p50_ms']:.1f} ms", flush=True)
                out[model] = got
    finally:
        srv.stop()
    return out


def export_errors(log: Path, model: str) -> dict[str, str]:
    """What the server logged of each failed export of ``model``'s programs: {file: error}."""
    pat = re.compile(r"exporting (" + re.escape(model.replace(".", "-")) + r"-\S+) failed: (.*)")
    return {m.group(1): m.group(2)[:1500] for m in map(pat.search, log.read_text(errors="replace").splitlines())
            if m}


def cards_side_by_side(c: httpx.Client, fed: str, n: int) -> dict[str, float]:
    """Cached card latency of each profile class, interleaved on one server: p50 ms."""
    lat: dict[str, list[float]] = {cls: [] for cls in PROFILES}
    for _ in range(n):
        for cls, profile in PROFILES.items():
            t0 = time.perf_counter()
            c.get(f"{API_PREFIX}/federations/{fed}/model", params={"profile": profile}).raise_for_status()
            lat[cls].append(time.perf_counter() - t0)
    return {f"{cls}_p50_ms": 1e3 * statistics.median(v) for cls, v in lat.items()}


_OLD_AGENT = """
import sys, time, tempfile
t0 = time.perf_counter()
from device_profiles import get_profile
from export import lower_executorch_training, package, prepare
from pfl_edge.checkpoint import ModelSpec
t1 = time.perf_counter()
prep = prepare(get_profile("phone-mid"), spec=ModelSpec(sys.argv[1], 10, 1, 28), seed=0)
lowered = lower_executorch_training(prep, mode="fedper", batch_size=32)
p = package(lowered, tempfile.mkdtemp())
t2 = time.perf_counter()
print(t1 - t0, t2 - t1, p.path.stat().st_size)
"""


def device_export(model: str) -> dict[str, Any]:
    """The agent's export before a0a75e8, in a fresh process as the device ran it."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _OLD_AGENT, model], capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:], "wall_s": wall}
    imports, export, size = proc.stdout.split()[-3:]
    return {"wall_s": wall, "imports_s": float(imports), "export_s": float(export), "bytes": int(size)}


def table(res: dict[str, Any]) -> str:
    rows = ["| model | class | card ready (cold), s | card JSON, B | cached card p50, ms | programs (bytes) "
            "| download (small: its time) | device export before, s |", "|---" * 8 + "|"]
    for model in res["models"]:
        dev = res["device_export"].get(model, {})
        for cls in PROFILES:
            r = res["classes"][cls].get(model, {})
            if "card_bytes" not in r:
                rows.append(f"| {model} | {cls} | FAILED after {r.get('failed_after_s', 0):.0f} s | | | | | |")
                continue
            progs = ", ".join(f"{p['kind']}{'/' + p['mode'] if p['mode'] else ''} {p['bytes']:,}"
                              for p in r["programs"])
            mbs = ", ".join(f"{p['download_mb_per_s']:.0f} MB/s" if p["bytes"] >= 100_000
                            else f"{1e3 * p['download_best_s']:.1f} ms" for p in r["programs"])
            before = f"{dev['wall_s']:.1f}" if cls == "phone" and "wall_s" in dev and "error" not in dev else "-"
            rows.append(f"| {model} | {cls} | {r['ready_s']:.1f} | {r['card_bytes']:,} | {r['card_p50_ms']:.1f} "
                        f"| {progs} | {mbs} | {before} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["cnn", "mobilenet-v1"],
                    help="registry names (resnet18-gn's training export alone takes ~4 min here)")
    ap.add_argument("--poll-s", type=float, default=0.25, help="between card requests while it exports")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per card")
    ap.add_argument("--card-requests", type=int, default=50)
    ap.add_argument("--downloads", type=int, default=3)
    ap.add_argument("--no-device-export", action="store_true", help="skip timing the agent's former export")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "artefacts.json")
    args = ap.parse_args()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pfl-artefacts-") as tmp:
        classes = {cls: profile_class(cls, args.models, args, Path(tmp)) for cls in PROFILES}
    dev: dict[str, Any] = {}
    if not args.no_device_export:
        for model in args.models:
            if "card_bytes" in classes["phone"].get(model, {}):
                print(f"[device] {model}: the agent's former export ...", flush=True)
                dev[model] = device_export(model)
    res = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
           "load_average_before": load0, "load_average_after": os.getloadavg(), "models": args.models,
           "profiles": PROFILES, "poll_s": args.poll_s, "classes": classes, "device_export": dev}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(table(res))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
