"""The shipped HAProxy's limits per source address (``server.balancer.SourceLimits``, in docker/haproxy.cfg), in
front of a real server as ``haproxy_config`` renders them for a test (only the listening address differs): one
source's silent connections are cut off past 1,000 while another source's devices are answered, a source's
requests without a token past 300 in 10 s are answered 429 while its signed ones pass, and 100 devices behind one
address (a NAT) are all served, also beside a stranger on that address (issue 49 item 1)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from server_testkit import FEDPER, Dev, closed, create, fed_state, wait_for
from stranger_kit import Flood, connect_from, enrol, fetch_at_once, raise_nofile, summary

from server.balancer import HAPROXY, Haproxy, SourceLimits, start_haproxy
from server.broker import free_port
from server.launch import BackgroundServer, start_background
from server.settings import Settings

ADMIN = "admin-token-for-balancer-source-tests"
SHIPPED = SourceLimits()


@dataclass
class _Front:
    server: BackgroundServer
    lb: Haproxy

    @property
    def addr(self) -> tuple[str, int]:
        host, port = self.lb.url.split("://")[1].split(":")
        return host, int(port)


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory, broker_url: str) -> Iterator[_Front]:
    """A server at its default settings but for believing HAProxy's X-Forwarded-For (as compose's replicas do),
    behind HAProxy with the shipped limits per source."""
    if HAPROXY is None:
        pytest.skip("haproxy is not installed")
    raise_nofile(4 * SHIPPED.connections + 1000)
    tmp = tmp_path_factory.mktemp("balancer-sources")
    srv = start_background(Settings(
        data_dir=tmp / "data", database_url=f"sqlite:///{tmp / 'state.db'}", broker_url=broker_url,
        admin_token=ADMIN, tick_s=0.05, forwarded_allow_ips="127.0.0.1"))  # type: ignore[arg-type]
    try:
        lb = start_haproxy(tmp / "haproxy", free_port(), [srv.url.split("://")[1]])
        try:
            # HAProxy's first health check done: the server is up behind it
            wait_for(lambda: _healthz(lb.url) == 200, timeout=60, what="the server up behind HAProxy")
            yield _Front(srv, lb)
        finally:
            lb.stop()
    finally:
        srv.stop()


def _healthz(url: str, source: str = "127.0.0.1") -> int | str:
    try:
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=30) as c:
            return c.get(f"{url}/healthz").status_code
    except httpx.HTTPError as e:
        return type(e).__name__


def test_the_shipped_config_carries_the_limits_per_source() -> None:
    """docker/haproxy.cfg tracks every source of the devices' port (an IPv6 one by its /64), refuses one with
    more than 1,000 open, and answers 429 only to requests without Authorization (the hook's port has none)."""
    cfg = (Path(__file__).resolve().parents[2] / "docker" / "haproxy.cfg").read_text()
    devices, hook = cfg.split("frontend hook")
    assert "tcp-request connection track-sc0 src,ipmask(32,64)" in devices
    assert f"tcp-request connection reject if {{ sc_conn_cur(0) gt {SHIPPED.connections} }}" in devices
    assert ("http-request deny deny_status 429 if !{ req.hdr(authorization) -m found } "
            f"{{ sc_gpc0_rate(0) gt {SHIPPED.unsigned_per_10s} }}") in devices
    assert "stick-table" not in hook and "track-sc" not in hook


def test_one_sources_silent_connections_are_cut_off_and_anothers_devices_answered(front: _Front) -> None:
    """127.0.7.1 opens 1,100 connections through HAProxy and sends nothing: the 100 past 1,000 are closed at
    once by the stick-table, a new one from that source too, while an enrolled device's task calls from
    127.0.0.1 (each on a fresh connection) are answered 200."""
    url = front.lb.url
    with httpx.Client(base_url=url, timeout=60) as c:
        create(c, ADMIN, "cut", {**FEDPER, "clients": 2, "rounds": 1})
        dev, _other = Dev(c, "cut", index=0), Dev(c, "cut", index=1)
        wait_for(lambda: fed_state(c, ADMIN, "cut")[0] == 1, timeout=60, what="round 1")
    over = 100
    silent: list[socket.socket] = []
    try:
        silent = [connect_from("127.0.7.1", front.addr) for _ in range(SHIPPED.connections + over)]
        # the ones past the bound are closed at once; the 1,000 held last HAProxy's 10 s request timeout
        wait_for(lambda: sum(map(closed, silent)) >= over, timeout=60, what="HAProxy cutting the source off")
        late = connect_from("127.0.7.1", front.addr)
        wait_for(lambda: closed(late), timeout=30, what="one more from the source refused")
        late.close()
        got = []
        for _ in range(10):
            with httpx.Client(base_url=url, timeout=60) as c:
                got.append(c.get("/v1/rounds/current/task", headers=dev.h).status_code)
        print(f"\n{SHIPPED.connections + over} silent from 127.0.7.1: {sum(map(closed, silent))} closed; "
              f"device calls from 127.0.0.1 meanwhile: {got}")
        assert got == [200] * 10
    finally:
        for s in silent:
            s.close()


def test_a_sources_requests_without_a_token_are_bounded_and_its_signed_ones_pass(front: _Front) -> None:
    """127.0.8.1 sends requests without Authorization, 8 at a time, until HAProxy answers 429 (past 300 in
    10 s), and goes on: meanwhile a device's signed call from that same source is answered 200, and another
    source's /healthz too."""
    url = front.lb.url
    with httpx.Client(base_url=url, timeout=60) as c:
        create(c, ADMIN, "rate", {**FEDPER, "clients": 2, "rounds": 1})
        dev, _other = Dev(c, "rate", index=0), Dev(c, "rate", index=1)
        wait_for(lambda: fed_state(c, ADMIN, "rate")[0] == 1, timeout=60, what="round 1")
    statuses: list[int | str] = []
    stop = threading.Event()

    def stranger() -> None:
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.8.1"), timeout=60) as c:
            while not stop.is_set():
                try:
                    statuses.append(c.get(f"{url}/healthz").status_code)
                except httpx.HTTPError as e:
                    statuses.append(type(e).__name__)

    threads = [threading.Thread(target=stranger) for _ in range(8)]
    for th in threads:
        th.start()
    try:
        wait_for(lambda: 429 in statuses, timeout=120, what="HAProxy answering the source 429")
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.8.1"), base_url=url, timeout=60) as c:
            signed = c.get("/v1/rounds/current/task", headers=dev.h).status_code
        elsewhere = _healthz(url)
        refused_after = statuses.count(429)
    finally:
        stop.set()
        for th in threads:
            th.join(60)
    print(f"\n127.0.8.1: {len(statuses)} requests without a token, {statuses.count(200)} answered 200, "
          f"{statuses.count(429)} 429; its signed call meanwhile {signed}, /healthz from 127.0.0.1 {elsewhere}")
    assert set(statuses) == {200, 429}, sorted(set(statuses), key=str)
    assert statuses.count(200) >= SHIPPED.unsigned_per_10s  # none refused under the bound
    assert signed == 200 and elsewhere == 200 and refused_after > 0


@pytest.mark.slow
def test_100_devices_behind_one_address_are_served_through_haproxy(front: _Front) -> None:
    """100 enrolled devices behind 127.0.9.1 fetch the round's base at once through HAProxy (a connection each,
    held until all are answered): all served; again while a stranger on that address holds 64 silent sockets,
    reopened as they are closed."""
    url = front.lb.url
    with httpx.Client(base_url=url, timeout=60) as c:
        create(c, ADMIN, "nat", {**FEDPER, "clients": 100, "rounds": 1})
        devices = enrol(url, "nat", 100)  # each from its own address (X-Forwarded-For): enrolment is not tested
        wait_for(lambda: fed_state(c, ADMIN, "nat")[0] == 1, timeout=120, what="round 1")
    results = {}
    for stranger in (0, 64):
        flood = Flood(["127.0.9.1"], front.addr, stranger, reopen=True) if stranger else None
        try:
            if flood is not None:
                flood.start()
                # HAProxy takes connections in order: an answer on a later one means it holds the stranger's
                assert _healthz(url, "127.0.9.1") == 200
            results[stranger] = fetch_at_once(url, devices, "127.0.9.1")
        finally:
            if flood is not None:
                flood.close()
        print(f"\nthrough HAProxy, a stranger of {stranger} silent sockets on 127.0.9.1: {summary(results[stranger])}")
    for stranger, got in results.items():
        assert [(f.task, f.blob) for f in got] == [(200, 200)] * 100, (stranger, summary(got))
