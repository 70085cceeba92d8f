"""Issue 49 item 1 at full size, against a server at its default settings (``server.peers``): silent sockets from
many addresses leave every device call answered, and a fleet behind one address (a NAT) is served, also while a
stranger shares its address. Slow tier; each prints what it measured (BENCHMARKS.md, "Issue 49")."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_testkit import FEDPER, Dev, create, fed_state, wait_for
from stranger_kit import Flood, enrol, fetch_at_once, listen_overflows, probe, raise_nofile, summary

from server.launch import SubprocessServer, start_subprocess

ADMIN = "admin-token-for-stranger-fleet-tests"
ADDRESSES, PER_ADDRESS = 70, 64  # the attack: 4,480 silent sockets
FLEET, NAT = 100, "127.0.9.1"


def _server(tmp_path: Path, broker_url: str) -> SubprocessServer:
    """``pfl-edge server`` as shipped: nothing of the connection settings changed."""
    return start_subprocess({"PFL_ADMIN_TOKEN": ADMIN, "PFL_DATA_DIR": str(tmp_path / "data"),
                             "PFL_BROKER_URL": broker_url, "PFL_TICK_S": "0.1"}, log=tmp_path / "server.log")


def _addr(srv: SubprocessServer) -> tuple[str, int]:
    host, port = srv.url.split("://")[1].split(":")
    return host, int(port)


@pytest.mark.slow
@pytest.mark.flood  # ~4,500 connections a second: alone (make test-flood), not beside the slow tier's others
def test_70_addresses_of_64_silent_sockets_leave_every_device_call_answered(tmp_path: Path,
                                                                             broker_url: str) -> None:
    """The issue's attack: 70 addresses (127.0.100.1-70) x 64 sockets that send nothing, each reopened as soon as
    the server closes it (before: /healthz 503 in 19 of 25 probes, the task call in 21 of 25, as the 4,480 filled
    uvicorn's limit_concurrency of 4,096). At the default settings the server holds at most 1,024 of them
    (``http_max_unproven_connections``) and resets the oldest for each new one: 25 probes from 127.0.0.1, each
    /healthz and an enrolled device's task call on a fresh connection, are all 200 while the flood keeps
    reopening."""
    raise_nofile(ADDRESSES * PER_ADDRESS + 1000)
    srv = _server(tmp_path, broker_url)
    flood: Flood | None = None
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            create(c, ADMIN, "fl", {**FEDPER, "clients": 2, "rounds": 1})
            dev, _other = Dev(c, "fl", index=0), Dev(c, "fl", index=1)  # two of two: round 1 opens
            wait_for(lambda: fed_state(c, ADMIN, "fl")[0] == 1, what="round 1")
        flood = Flood([f"127.0.100.{a + 1}" for a in range(ADDRESSES)], _addr(srv), PER_ADDRESS, reopen=True)
        flood.start()
        # standing: all 4,480 opened, and the server already closing the ones past its bound (the flood reopens)
        wait_for(lambda: flood.seen_closed >= ADDRESSES * PER_ADDRESS - 1024, timeout=120,
                 what="the server closing the silent sockets past its bound")
        before, overflows = flood.opened, listen_overflows()
        got = probe(srv.url, dev.h, 25)
        reopened, stood = flood.opened - before, len(flood.socks)
        dropped = None if overflows is None else (listen_overflows() or 0) - overflows
        flood.close()
        seconds = sorted(s for *_, s in got)
        print(f"\n{ADDRESSES} x {PER_ADDRESS} silent sockets opened in {flood.open_s:.2f} s; during the probes "
              f"{reopened} reopened as the server closed them, {dropped} connections dropped at a full accept "
              f"queue (the whole machine's), {stood} open at the end; {len(got)} probes (/healthz, task) from "
              f"127.0.0.1: statuses {sorted({(h, t) for h, t, _ in got}, key=str)}, "
              f"median {seconds[len(got) // 2]:.2f} s, slowest {seconds[-1]:.2f} s")
        assert reopened > 0, "the flood stood still: the server closed none of its sockets during the probes"
        assert {(h, t) for h, t, _ in got} == {(200, 200)}, got
    finally:
        if flood is not None:
            flood.close()
        srv.stop()


@pytest.mark.slow
def test_100_devices_behind_one_address_are_served_also_beside_a_stranger(tmp_path: Path, broker_url: str) -> None:
    """The issue's NAT: 100 enrolled devices behind 127.0.9.1 fetch the round's base at once, a connection each
    (their task, then the base blob it names), each holding its connection until all are answered (before: 64
    answered, 36 reset). All 100 are served; again while a stranger on the same address holds 64 silent sockets,
    reopened as the server closes them (before: 0 of 100); and again with the stranger at the address's whole cap
    (256), where each device's connection resets one of the stranger's."""
    raise_nofile(4 * FLEET + 256 + 1000)
    srv = _server(tmp_path, broker_url)
    flood: Flood | None = None
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            create(c, ADMIN, "nat", {**FEDPER, "clients": FLEET, "rounds": 1})
            devices = enrol(srv.url, "nat", FLEET)  # each from its own address: enrolment's bucket is not tested
            wait_for(lambda: fed_state(c, ADMIN, "nat")[0] == 1, timeout=120, what="round 1")
        results = {}
        for stranger in (0, 64, 256):
            if stranger:
                flood = Flood([NAT], _addr(srv), stranger, reopen=True)
                flood.start()
                # the server takes connections in order: a request from the address answered after the stranger's
                # were made means the server has counted all of them
                with httpx.Client(transport=httpx.HTTPTransport(local_address=NAT), timeout=60) as c:
                    assert c.get(f"{srv.url}/healthz").status_code == 200
            results[stranger] = fetch_at_once(srv.url, devices, NAT)
            if flood is not None:
                print(f"\nstranger of {stranger} on {NAT}: {flood.seen_closed} of its sockets closed by the server")
                flood.close()
                flood = None
            print(f"\nstranger of {stranger} silent sockets on {NAT}: {summary(results[stranger])}")
        for stranger, got in results.items():
            assert [(f.task, f.blob) for f in got] == [(200, 200)] * FLEET, (stranger, summary(got))
    finally:
        if flood is not None:
            flood.close()
        srv.stop()
