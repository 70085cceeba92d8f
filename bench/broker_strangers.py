"""Issue 49 on the embedded broker: what half-sent CONNECTs from one address hold (loopback's: the server's own
link's address, once exempt from the cap), and how many of a fleet behind one address log in, alone and while a
stranger holds that address's places.

    .venv/bin/python bench/broker_strangers.py [--half-sent 5000] [--fleet 100] [--stranger 256] [--burst 100 500]

The broker runs in a child process as the server runs it (default limits; 120 s to send a CONNECT instead of 10,
so that what this machine opens in a minute counts as what a faster attacker opens within the 10 s), so its RSS is
the broker's alone. To measure another version, give the child that version's tree:
``git archive <commit> server pfl_edge | tar -x -C /tmp/old`` and ``--tree /tmp/old``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from contextlib import suppress
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import sys, time
from server.broker import EmbeddedBroker
from server.broker_wire import Identity
def who(cid, user, pw):
    return Identity(user, read=frozenset({"t"}), write=frozenset({"s"}), client_id=user) if user else None
b = EmbeddedBroker(authenticate=who)
b.core.connect_timeout_s = 120.0  # the attacker opens them all within the timeout (a faster one would in 10 s)
print(b.start(), flush=True)
sys.stdin.read()
"""


def _text(s: str) -> bytes:
    return len(s.encode()).to_bytes(2, "big") + s.encode()


def _connect(user: str) -> bytes:
    body = _text("MQTT") + bytes([4, 0xC2]) + (60).to_bytes(2, "big") + _text(user) + _text(user) + _text("pw")
    return bytes([0x10, len(body)]) + body


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _open(addr: tuple[str, int], source: str, first: bytes) -> socket.socket | None:
    try:
        s = socket.create_connection(addr, timeout=10, source_address=(source, 0))
        s.sendall(first)
        return s
    except OSError:
        return None


def _closed(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _answer(s: socket.socket) -> bytes:
    s.setblocking(True)
    s.settimeout(10)
    got = b""
    with suppress(OSError):
        while len(got) < 4 and (chunk := s.recv(4 - len(got))):
            got += chunk
    return got


def half_sent(addr: tuple[str, int], pid: int, n: int) -> dict[str, float]:
    """``n`` connections from 127.0.0.1, each a CONNECT announcing 4 KiB and sending all of it but its last byte,
    opened one after another as fast as the broker accepts them."""
    body = bytes(4095)
    first = bytes([0x10, 0x80, 0x20]) + body  # remaining length 4,096
    rss0, t0 = _rss_mib(pid), time.monotonic()
    peak, socks = rss0, []
    for i in range(n):
        if (s := _open(addr, "127.0.0.1", first)) is not None:
            socks.append(s)
        if i % 200 == 0:
            peak = max(peak, _rss_mib(pid))
    opened_s = time.monotonic() - t0
    for _ in range(20):  # the broker reads what was sent: its RSS settles within moments
        peak = max(peak, _rss_mib(pid))
        time.sleep(0.05)
    held = sum(not _closed(s) for s in socks)
    for s in socks:
        s.close()
    return {"connections": n, "opened_s": round(opened_s, 2), "held_open": held, "rss_before_mib": round(rss0, 1),
            "rss_peak_mib": round(peak, 1), "rss_growth_mib": round(peak - rss0, 1)}


def fleet(addr: tuple[str, int], n: int, stranger: int, tag: str) -> dict[str, int]:
    """``stranger`` half-sent CONNECTs from 127.0.0.2 held, then ``n`` devices there connect all at once."""
    held = [s for s in (_open(addr, "127.0.0.2", _connect("x")[:6]) for _ in range(stranger)) if s is not None]
    time.sleep(0.5)  # the broker accepts them (a bench, not a test: no event to wait for from outside)
    devices = [_open(addr, "127.0.0.2", _connect(f"fleet-{tag}-{i}")) for i in range(n)]
    ok = sum(s is not None and _answer(s) == b"\x20\x02\x00\x00" for s in devices)
    stranger_left = sum(not _closed(s) for s in held)
    for s in [*held, *devices]:
        if s is not None:
            s.close()
    return {"devices": n, "logged_in": ok, "stranger_held": stranger, "stranger_still_open": stranger_left}


def burst(addr: tuple[str, int], n: int, tag: str) -> dict[str, int]:
    """``n`` devices from 127.0.0.3 connect at once (asyncio, each CONNECT written as soon as it is connected)."""

    async def one(i: int) -> bool:
        reader, writer = await asyncio.open_connection(*addr, local_addr=("127.0.0.3", 0))
        writer.write(_connect(f"fleet-{tag}-{i}"))
        try:
            return await asyncio.wait_for(reader.readexactly(4), 30) == b"\x20\x02\x00\x00"
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            return False
        finally:
            writer.close()

    async def run() -> list[bool]:
        return await asyncio.gather(*(one(i) for i in range(n)))

    return {"at_once": n, "logged_in": sum(asyncio.run(run()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--half-sent", type=int, default=5000)
    ap.add_argument("--fleet", type=int, default=100)
    ap.add_argument("--stranger", type=int, default=256)
    ap.add_argument("--burst", type=int, nargs="*", default=[100, 300, 500, 1000], help="devices at once, one address")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose broker runs")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/broker_strangers.json")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(args.tree)}
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=env, cwd=args.tree)
    try:
        url = (child.stdout.readline() if child.stdout else "").strip()
        host, port = url.removeprefix("mqtt://").rsplit(":", 1)
        addr = (host, int(port))
        report = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "tree": str(args.tree),
                  "half_sent_from_loopback": half_sent(addr, child.pid, args.half_sent)}
        report["fleet_alone"] = fleet(addr, args.fleet, 0, "a")
        report["fleet_beside_a_stranger"] = fleet(addr, args.fleet, args.stranger, "b")
        report["bursts_from_one_address"] = [burst(addr, n, f"c{n}") for n in args.burst]
    finally:
        if child.stdin:
            child.stdin.close()
        child.wait(10)
    print(json.dumps(report, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
