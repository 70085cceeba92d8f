"""The soak in short (``bench/soak.py``): a FedPer federation of three device processes, each in its own network
namespace behind the fault proxy (latency, connections reset mid-transfer, a bandwidth limit), through a device
SIGKILL, a server SIGKILL and a partition of every link; then the ledger check: no accepted update lost, none
counted twice, every device's state matching the server's. The check itself is shown to catch a lost update and
a wrong aggregate on a tampered copy of the run's database."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def _bench(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def _skip_reason() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the soak needs root (network namespaces)"
    reason: str | None = _bench("netns").unavailable_reason()
    return reason


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    why = _skip_reason()
    if why is not None:
        pytest.skip(why)
    work = tmp_path_factory.mktemp("soak")
    out = work / "soak.json"
    cmd = [sys.executable, str(BENCH / "soak.py"), "--minutes", "0.35", "--algorithms", "fedper", "--devices", "3",
           "--latency-ms", "50", "--cut", "0.05", "--rate", "50mbit", "--partition-s", "6", "--deadline-s", "15",
           "--schedule", "1:device_kill,6:server_kill,12:partition", "--settle-rounds", "1", "--samples", "32",
           "--workdir", str(work / "run"), "--out", str(out), "--prefix", f"pfc{os.getpid() % 1000}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert out.exists(), f"no report (exit {proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    return json.loads(out.read_text()), work / "run"


@pytest.mark.slow  # the soak's own run, its faults and ledger check: about a minute, more under load
@pytest.mark.needs_fmnist  # the soak's federations train on Fashion-MNIST
def test_the_short_soak_loses_nothing_and_counts_nothing_twice(soak: tuple[dict[str, Any], Path]) -> None:
    report, _ = soak
    faults = report["faults"]
    assert faults.get("device_kill") == 1 and faults.get("server_kill") == 1 and faults.get("partition_all") == 1
    assert report["lost"] == 0, report["ledger"]["lost_detail"]
    assert report["double_counted"] == 0
    assert report["inconsistent_devices"] == 0, report["ledger"]["devices"]
    assert report["ledger"]["unlogged"] == 0
    # every closed round's rows are what its close took
    assert report["ledger"]["inputs_checked"] >= report["rounds_closed"]["soak-fedper"]
    assert report["ledger"]["inputs_mismatched"] == 0
    assert report["settle"]["settled"], report["settle"]  # after the faults, a round with every device's update
    assert report["rounds_closed"]["soak-fedper"] >= 2
    assert report["updates_accepted"] == report["ledger"]["ledger_entries"] > 0
    agg = report["ledger"]["aggregates"]
    assert agg["checked"] == report["rounds_closed"]["soak-fedper"] and agg["mismatched"] == 0
    assert report["ok"]


@pytest.mark.needs_fmnist
@pytest.mark.slow  # on the soak's run
def test_the_check_catches_a_lost_update_and_a_wrong_aggregate(soak: tuple[dict[str, Any], Path],
                                                                 tmp_path: Path) -> None:
    """The same run's database, tampered: one update the ledgers name deleted, one round's published model
    swapped for another round's. The check must see both."""
    _, run = soak
    db = tmp_path / "state.db"
    src = sqlite3.connect(run / "server" / "state.db")
    with sqlite3.connect(db) as dst:
        src.backup(dst)
    src.close()
    with sqlite3.connect(db) as c:
        uid, t = c.execute("SELECT id, round FROM pfl_updates WHERE round >= 1 ORDER BY id LIMIT 1").fetchone()
        c.execute("DELETE FROM pfl_updates WHERE id = ?", (uid,))
        # the last closed round's model swapped for the one before (a loaded machine may close only two rounds)
        closed = [r for (r,) in c.execute("SELECT round FROM pfl_rounds WHERE round >= 1 AND base_digest IS NOT NULL "
                                          "ORDER BY round")]
        assert len(closed) >= 2, closed
        (prev,) = c.execute("SELECT base_digest FROM pfl_rounds WHERE round = ?", (closed[-2],)).fetchone()
        c.execute("UPDATE pfl_rounds SET base_digest = ? WHERE round = ?", (prev, closed[-1]))
    ledger = _bench("soak_ledger")
    dirs = sorted(p for p in (run / "devices").iterdir() if p.is_dir())
    got = ledger.check(f"sqlite:///{db}", run / "witness-blobs", dirs)
    assert got["aggregates"]["mismatched"] >= 1  # the swapped round (and round t, short of the deleted update)
    assert any(d.get("round") == t and "no such update row" in d["why"] for d in got["lost_detail"])
    # the close of round t took the deleted row: its record no longer matches the rows
    assert any(d.get("round") == t and "what the close took" in d["why"] for d in got["lost_detail"])
    assert got["inputs_checked"] >= len(closed) and got["inputs_mismatched"] >= 1
    assert got["lost"] >= 3
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_the_proxy_adds_its_latency_each_way_and_cuts_what_it_draws() -> None:
    """No root needed: an echo server behind the proxy, in this process."""
    import asyncio
    import time

    proxy_mod = _bench("fault_proxy")

    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    async def run() -> tuple[float, bool, dict[str, Any]]:
        target = await asyncio.start_server(echo, "127.0.0.1", 0)
        tport = target.sockets[0].getsockname()[1]
        slow = proxy_mod.Proxy([("127.0.0.1", 0, "127.0.0.1", tport)], latency_s=0.1, cut=0.0)
        cutting = proxy_mod.Proxy([("127.0.0.1", 0, "127.0.0.1", tport)], latency_s=0.0, cut=1.0)
        servers = [*await slow.serve(), *await cutting.serve()]
        r, w = await asyncio.open_connection("127.0.0.1", servers[0].sockets[0].getsockname()[1])
        t0 = time.monotonic()
        w.write(b"ping")
        await r.readexactly(4)
        rtt = time.monotonic() - t0
        w.close()
        r, w = await asyncio.open_connection("127.0.0.1", servers[1].sockets[0].getsockname()[1])
        reset = False
        try:  # 1 MiB each way: more than any cut budget (<= 256 KiB), so the proxy resets the connection
            w.write(b"x" * (1 << 20))
            await asyncio.wait_for(r.readexactly(1 << 20), 30)
        except (ConnectionError, asyncio.IncompleteReadError):
            reset = True
        for s in [*servers, target]:
            s.close()
        stats = {k: v.cut for k, v in cutting.stats.items()}
        return rtt, reset, stats

    rtt, reset, stats = asyncio.run(run())
    assert 0.2 <= rtt < 1.0  # 100 ms each way
    assert reset and sum(stats.values()) == 1


def test_the_ledger_keeps_one_line_per_accepted_update(tmp_path: Path) -> None:
    from edge_runtime.state import StateDir

    sd = StateDir(tmp_path)
    sd.append_ledger(1, "a" * 64, 64)
    sd.append_ledger(2, "b" * 64, 64)
    with open(tmp_path / "ledger.jsonl", "a") as f:
        f.write('{"round": 3, "dig')  # a line cut short
    got = sd.read_ledger()
    assert [(e["round"], e["digest"], e["n_samples"]) for e in got] == [(1, "a" * 64, 64), (2, "b" * 64, 64)]
