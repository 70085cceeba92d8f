"""The embedded MQTT broker under a fleet: N devices, each with its own credentials and topic rules, connect
(persistent sessions), subscribe to their task and round topics, and receive one retained task each (QoS 1,
acknowledged); then every device's link drops and comes back (a blip of the whole fleet) and the next task
reaches all of them again.

    .venv/bin/python bench/broker_load.py --devices 1000

Reports connections/s (each one authenticated), the time until every device holds its task, and the broker
process's memory. The devices are raw asyncio MQTT clients in this process (no paho threads), the broker runs in
its own thread as the server runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import resource
import struct
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pfl_edge.protocol import mqtt_client_id, round_topic, task_topic
from server import broker_wire as w
from server.broker import EmbeddedBroker
from server.broker_core import Identity
from server.services.broker_access import device_identity, mqtt_hash

FED = "load"


def _text(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack(">H", len(b)) + b


def _connect(client_id: str, user: str, password: str) -> bytes:
    body = _text("MQTT") + bytes([4, 0xC0]) + struct.pack(">H", 60) + _text(client_id) + _text(user) + _text(password)
    return bytes([0x10]) + _length(len(body)) + body


def _subscribe(pid: int, topics: list[str]) -> bytes:
    body = struct.pack(">H", pid) + b"".join(_text(t) + b"\x01" for t in topics)
    return bytes([0x82]) + _length(len(body)) + body


def _length(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n % 128, n // 128
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


async def device(host: str, port: int, dev: str, password: str, want_round: int) -> float:
    """Connect, subscribe, wait for a task of ``want_round`` (acknowledging it); the seconds that took."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(_connect(mqtt_client_id(dev), dev, password) + _subscribe(1, [task_topic(FED, dev), round_topic(FED)]))
    try:
        while True:
            kind, flags, body = await w.read_packet(reader, 1 << 20)
            if kind == w.CONNACK and body[1] != 0:
                raise RuntimeError(f"{dev} refused: {body[1]}")
            if kind == w.PUBLISH:
                p = w.parse_publish(flags, body)
                if p.qos:
                    writer.write(w.puback(p.pid))
                if p.topic == task_topic(FED, dev) and json.loads(p.payload)["round"] == want_round:
                    return time.perf_counter() - t0
    finally:
        writer.close()


async def fleet(host: str, port: int, devices: dict[str, str], want_round: int, limit: int) -> list[float]:
    sem = asyncio.Semaphore(limit)

    async def one(dev: str, pw: str) -> float:
        async with sem:
            return await device(host, port, dev, pw, want_round)

    return await asyncio.gather(*(one(d, p) for d, p in devices.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--parallel", type=int, default=500, help="connections opened at once")
    ap.add_argument("--out", type=Path, default=Path("bench/results/broker_load.json"))
    args = ap.parse_args()
    report: dict[str, object] = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "devices": args.devices,
                                 "parallel": args.parallel, "rounds": []}
    passwords = {f"dev-{i:06d}": hashlib.sha256(f"pw{i}".encode()).hexdigest() for i in range(args.devices)}
    hashes = {d: mqtt_hash(p) for d, p in passwords.items()}

    def authenticate(_cid: str, user: str | None, pw: bytes | None) -> Identity | None:
        if user == "server" and pw == b"server-password":
            return Identity("server")
        if user in hashes and pw is not None and mqtt_hash(pw) == hashes[user]:
            return device_identity(FED, user)
        return None

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # every device here connects from loopback, --parallel at once: a fleet behind one address bursting past
    # the cap on connections not logged in yet (server.broker_door), which it lifts as behind a TCP proxy
    with EmbeddedBroker(authenticate=authenticate, max_per_address=0, max_unauthenticated=0) as b:
        host, port = b.host, int(b.port or 0)
        for rnd in (1, 2):
            for d in passwords:  # the server publishes one retained task per device (in the broker's own loop)
                msg = w.Publish(task_topic(FED, d), json.dumps({"round": rnd}).encode(), qos=1, retain=True)
                b.call(b.core.publish, msg)
            t0 = time.perf_counter()
            times = sorted(asyncio.run(fleet(host, port, passwords, rnd, args.parallel)))
            wall = time.perf_counter() - t0
            row = {"round": rnd, "wall_s": wall, "per_s": args.devices / wall,
                   "p50_ms": times[len(times) // 2] * 1e3, "p99_ms": times[int(len(times) * 0.99)] * 1e3,
                   "sessions_kept": len(b.core.sessions)}
            report["rounds"].append(row)  # type: ignore[attr-defined]
            print(f"round {rnd}: {args.devices} devices connected, authenticated, subscribed and got their task in "
                  f"{wall:.2f} s ({row['per_s']:.0f}/s); per device p50 {row['p50_ms']:.0f} ms, "
                  f"p99 {row['p99_ms']:.0f} ms; sessions kept {row['sessions_kept']}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report["peak_rss_mib"], report["rss_growth_mib"] = rss / 1024, (rss - rss0) / 1024
    report["load_average_after"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"peak RSS of this process (broker and clients): {rss / 1024:.0f} MiB (+{(rss - rss0) / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
