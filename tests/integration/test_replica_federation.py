"""Three server replicas on one PostgreSQL database and one Mosquitto, behind HAProxy, carry FedPer and DisPFL
federations of device processes to their end while the federation's leader is SIGKILLed mid-round: another
replica takes the leadership over and resumes the federation from the database, the devices ride it out through
the balancer, every device ends with the simulator's model, and the soak's ledger check finds nothing lost and
nothing counted twice."""

from __future__ import annotations

import importlib
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fedkit import BASE, assert_simulator_models, device_log, ended
from mosquitto_kit import mosquitto
from pgkit import schema_or_skip

from edge_runtime.fleet import Federation
from pfl_edge.sim import SimConfig
from server.balancer import HAPROXY, Replicas, start_replicas

BENCH = Path(__file__).resolve().parents[2] / "bench"

pytestmark = [pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (apt-get install haproxy)"),
              pytest.mark.slow]  # three servers and three devices through four rounds: a minute each


@pytest.fixture
def pg() -> Iterator[str]:
    with schema_or_skip("pfl_rep") as url:
        yield url


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with mosquitto(tmp_path_factory.mktemp("mosquitto")) as url:
        yield url


def _ledger(pg: str, reps: Replicas, root: Path, n: int) -> dict[str, Any]:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    check = importlib.import_module("soak_ledger").check
    from server.settings import Settings

    url = Settings(database_url=pg).resolved_database_url
    return dict(check(url, reps.folder / "blobs", [root / "devices" / f"device-{i:02d}" for i in range(n)]))


@pytest.mark.parametrize("algorithm", ["fedper", "dispfl"])
def test_replicas_ride_out_the_leaders_death_mid_round(tmp_path: Path, pg: str, broker: str,
                                                       algorithm: str) -> None:
    extra = {"densities": (0.3, 0.7, 1.0), "options": {"topology": "random:2"}} if algorithm == "dispfl" else {"kp": 2}
    cfg = SimConfig(algorithm=algorithm, clients=3, **extra, **{**BASE, "rounds": 4})
    root = tmp_path / "run"
    (root / "devices").mkdir(parents=True)
    token = secrets.token_urlsafe(24)
    reps = start_replicas(tmp_path / "servers", 3, {"PFL_ADMIN_TOKEN": token, "PFL_DATABASE_URL": pg,
                                                    "PFL_BROKER_URL": broker, "PFL_TICK_S": "0.5"})
    first = reps.servers[0]
    assert first is not None
    fed = Federation(reps.url, token, first.proc, root, ([], {}))
    killed: int | None = None
    taken_over: int | None = None
    try:
        fed.create(f"rep-{algorithm}", cfg.to_dict(), deadline_s=120.0)
        for i in range(cfg.clients):
            fed.start_device(i, "phone-mid", extra=["--training-backend", "torch"])
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            info = fed.info()  # through the balancer: whichever replica is alive answers
            if killed is None and info["round"] == 2 and info["state"] == "collecting":
                killed = reps.leader_of(fed.fed)
                assert killed is not None, "no replica says it leads the federation"
                reps.kill(killed)  # mid-round: the round is collecting its updates
            if killed is not None and taken_over is None:
                taken_over = reps.leader_of(fed.fed)
            if ended(fed, root, info):
                break
            time.sleep(0.3)
        else:
            raise AssertionError("federation did not finish: " + device_log(root, 0)
                                 + "".join(p.read_text()[-2000:] for p in reps.folder.glob("replica-*.log")))
        assert all(p.returncode == 0 for p in fed.devices)
    finally:
        for p in fed.devices:
            if p.poll() is None:
                p.terminate()
        reps.stop()
        fed.http.close()
    assert killed is not None and taken_over is not None and taken_over != killed
    ledger = _ledger(pg, reps, root, cfg.clients)
    assert ledger["lost"] == 0, ledger["lost_detail"]
    assert ledger["double_counted"] == 0
    assert ledger["inconsistent_devices"] == 0, ledger["devices"]
    assert ledger["inputs_mismatched"] == 0 and ledger["inputs_checked"] >= cfg.rounds
    if algorithm == "fedper":
        agg = ledger["aggregates"]  # every round's average recomputed, but those whose blobs were collected
        assert agg["mismatched"] == 0 and agg["checked"] >= 2 and agg["checked"] + agg["unverifiable"] == cfg.rounds
    assert_simulator_models(cfg, tmp_path)
