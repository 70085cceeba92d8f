"""Bytes on the wire per device per round in the real federation against the simulator's accounting, for the
demo's FedPer and DisPFL federations.

Real: what each device reported moving (server metrics ``bytes_up`` / ``bytes_down`` per device and round: the
bodies of its blob PUT and GETs) and the sizes of the blobs it uploaded (the server's blob table). Simulated:
``pfl_edge.sim.simulate(SimConfig.from_dict(config))`` on the federation's own config, per round
``client_bytes_up`` / ``client_bytes_down`` (codec payload sizes with an empty model id and round 0; DisPFL counts a
payload once per recipient, as peer-to-peer). The real runs are those of bench/round_overhead.py (read from its
JSON); ``--quick`` runs a fresh 2-round federation of each instead. The control traffic around the payloads (HTTP
headers, the JSON of updates and metrics, MQTT tasks and announcements) is estimated from the messages' sizes.
Writes bench/results/wire_bytes.json.

    .venv/bin/python bench/wire_bytes.py [--runs bench/results/round_overhead.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import torch

from pfl_edge.codec import encode
from pfl_edge.protocol import (
    API_PREFIX,
    MetricsReport,
    Neighbour,
    RoundAnnouncement,
    Task,
    UpdateAccepted,
    UpdateRequest,
    round_topic,
    task_topic,
)
from pfl_edge.sim import SimConfig, simulate

MODEL_ID = ""  # set from the federation's config: local.model_id of its model, in every real payload's header


def header_delta(t: int) -> int:
    """Bytes a real payload of round t has over the simulator's accounting of the same tensors in the same order
    (model id and round in the JSON header). A DisPFL device's payload lists its tensors in another order (its
    state comes back from safetensors sorted by name), which moves the offsets in the header: a few bytes more
    or less."""
    x = {"w": torch.zeros(1)}
    return len(encode(x, model_id=MODEL_ID, round=t)) - len(encode(x, model_id="", round=0))


def control_bytes(algorithm: str, neighbours: int) -> dict[str, int]:
    """Estimated control traffic of one device in one round, beyond the payload bodies: HTTP request lines and
    headers (as httpx builds them), response headers (uvicorn's: status line, date, server, content-length,
    content-type), the JSON bodies, and MQTT publishes (fixed header + topic + packet id + JSON)."""
    digest = "0" * 64
    client = httpx.Client(base_url="http://127.0.0.1:8080")
    auth = {"Authorization": "Bearer " + "x" * 43}

    def req(method: str, path: str, body: bytes = b"", ctype: str | None = None) -> int:
        h = dict(auth)
        if ctype:
            h["Content-Type"] = ctype
        r = client.build_request(method, path, content=body or None, headers=h)
        lines = [f"{method} {r.url.raw_path.decode()} HTTP/1.1"] + [f"{k}: {v}" for k, v in r.headers.items()]
        return len("\r\n".join(lines)) + 4 + len(body)

    resp_head = len("HTTP/1.1 200 OK\r\ndate: Sun, 29 Nov 2026 16:00:00 GMT\r\nserver: uvicorn\r\n"
                    "content-length: 1850000\r\ncontent-type: application/json\r\n\r\n")
    upd = UpdateRequest(digest=digest, n_samples=600, train_loss=0.123456789, train_s=1.23456789,
                        bytes_down=1_812_345).model_dump_json().encode()
    acc = UpdateAccepted(round=10, accepted=True, updates=6).model_dump_json().encode()
    met = MetricsReport(accuracy=0.912345678, loss=0.23456789, n_test=2000, bytes_up=1_812_345,
                        bytes_down=1_812_345, step_ms=53.123456, train_s=1.23456789).model_dump_json().encode()
    fed, dev = "demo", "dev-" + "0" * 16
    nbrs = [Neighbour(index=i, device_id=dev, digest=digest) for i in range(neighbours)]
    task = Task(federation=fed, round=10, algorithm=algorithm, base=None if neighbours else digest,
                neighbours=nbrs, deadline=1.8e9).model_dump_json().encode()
    ann = RoundAnnouncement(federation=fed, round=10, state="collecting", base=digest,
                            deadline=1.8e9).model_dump_json().encode()
    gets = neighbours if neighbours else 1
    http = (gets * (req("GET", f"{API_PREFIX}/blobs/{digest}") + resp_head)
            + req("PUT", f"{API_PREFIX}/blobs/{digest}", ctype="application/octet-stream") + resp_head + 40
            + req("POST", f"{API_PREFIX}/rounds/10/updates", upd, "application/json") + resp_head + len(acc)
            + req("POST", f"{API_PREFIX}/rounds/10/metrics", met, "application/json") + resp_head + 4)
    mqtt = (4 + len(task_topic(fed, dev)) + 2 + len(task)) + 4 * (4 + len(round_topic(fed)) + 2 + len(ann))
    client.close()
    return {"http": http, "mqtt": mqtt, "total": http + mqtt}


def compare(run: dict[str, Any], algorithm: str) -> dict[str, Any]:
    global MODEL_ID
    from server.fedmodel import fed_model

    cfg = run["config"]
    MODEL_ID = fed_model(cfg).model_id
    sim = simulate(SimConfig.from_dict(cfg), progress=False)
    names = run["names"]  # device id -> device-NN (slot NN: each device asked for its own partition)
    slot = {dev: int(name.split("-")[1]) for dev, name in names.items()}
    rows = []
    for rnd in run["metrics"]["rounds"]:
        t = rnd["round"]
        if t < 1:
            continue
        srnd = sim["rounds"][t - 1]
        assert srnd["round"] == t
        for dev, m in rnd["devices"].items():
            i = slot[dev]
            rows.append({"round": t, "device": names[dev], "real_up": m["bytes_up"], "real_down": m["bytes_down"],
                         "sim_up": srnd["client_bytes_up"][i], "sim_down": srnd["client_bytes_down"][i]})
    k = len(names) - 1 if algorithm == "dispfl" else 0  # random:K with K = clients - 1 for the demo
    for r in rows:
        t = r["round"]
        if algorithm == "dispfl":
            # down: K neighbours' payloads of round t-1; sim up: its payload of round t-1 once per recipient
            r["expected_down_delta"] = k * header_delta(t - 1)
        else:
            # down: the server's base of round t-1; up: the device's base of round t (same tensors)
            r["expected_down_delta"] = header_delta(t - 1)
            r["expected_up_delta"] = header_delta(t)
        r["down_ratio"] = r["real_down"] / r["sim_down"] if r["sim_down"] else None
        r["up_ratio"] = r["real_up"] / r["sim_up"] if r["sim_up"] else None
        r["down_delta"] = r["real_down"] - r["sim_down"]
        r["up_delta"] = r["real_up"] - r["sim_up"]
    ctl = control_bytes(algorithm, k)
    per_dev_round_real = statistics.fmean(r["real_up"] + r["real_down"] for r in rows)
    out = {
        "rows": rows,
        "down_ratio_min": min(r["down_ratio"] for r in rows if r["down_ratio"]),
        "down_ratio_max": max(r["down_ratio"] for r in rows if r["down_ratio"]),
        "up_ratio_min": min(r["up_ratio"] for r in rows if r["up_ratio"]),
        "up_ratio_max": max(r["up_ratio"] for r in rows if r["up_ratio"]),
        "down_delta_explained": all(r["down_delta"] == r["expected_down_delta"] for r in rows),
        "down_delta_values": sorted({r["down_delta"] for r in rows}),
        "expected_down_delta_values": sorted({r["expected_down_delta"] for r in rows}),
        "model_id": MODEL_ID,
        "mean_real_up": statistics.fmean(r["real_up"] for r in rows),
        "mean_real_down": statistics.fmean(r["real_down"] for r in rows),
        "mean_sim_up": statistics.fmean(r["sim_up"] for r in rows),
        "mean_sim_down": statistics.fmean(r["sim_down"] for r in rows),
        "control_bytes_estimate": ctl,
        "control_share_estimate": ctl["total"] / per_dev_round_real,
        "sim_final_mean_acc": sim["final"]["mean_acc"],
    }
    if algorithm != "dispfl":
        out["up_delta_explained"] = all(r["up_delta"] == r["expected_up_delta"] for r in rows)
        out["up_delta_values"] = sorted({r["up_delta"] for r in rows})
    else:
        # the relay: the device uploads once and the server serves it to each of its K recipients next round
        out["sim_up_over_k_ratio"] = statistics.fmean(r["real_up"] / (r["sim_up"] / k) for r in rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, default=Path(__file__).parent / "results" / "round_overhead.json")
    ap.add_argument("--quick", action="store_true", help="a fresh 2-round federation of each algorithm")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "wire_bytes.json")
    args = ap.parse_args()
    if args.quick:
        from round_overhead import run_federation

        from edge_runtime.fleet import DemoConfig

        runs = {}
        for algo in ("fedper", "dispfl"):
            cfg = DemoConfig(devices=6, rounds=2, algorithm=algo, live=False)
            raw = run_federation(cfg, Path("runs/bench-wire-bytes") / algo)
            runs[algo] = {"config": cfg.federation_config(), "metrics": raw["metrics"], "names": raw["names"]}
        source = "fresh 2-round federations (--quick)"
    else:
        runs = json.loads(args.runs.read_text())["runs"]
        source = str(args.runs)
    result: dict[str, Any] = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "source": source,
                              "algorithms": {}}
    for algo, run in runs.items():
        res = compare(run, algo)
        result["algorithms"][algo] = {"config": run["config"], **res}
        print(f"{algo}: per device per round real up {res['mean_real_up']:,.0f} B / sim {res['mean_sim_up']:,.0f} B "
              f"(ratio {res['up_ratio_min']:.6f}..{res['up_ratio_max']:.6f}); real down {res['mean_real_down']:,.0f} "
              f"B / sim {res['mean_sim_down']:,.0f} B (ratio {res['down_ratio_min']:.6f}..{res['down_ratio_max']:.6f});"
              f" down delta B {res['down_delta_values']} (model id + round: {res['expected_down_delta_values']});"
              f" control traffic ~"
              f"{res['control_bytes_estimate']['total']:,} B ({100 * res['control_share_estimate']:.3f} %)",
              flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
