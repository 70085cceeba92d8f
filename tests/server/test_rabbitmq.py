"""Devices on a two-node RabbitMQ cluster (its MQTT plugin) that authenticates every client and authorises every
topic by asking the server's HTTP hook: nothing provisioned per device. A stranger, a wrong password, a device
reading another's task, a device publishing another's status and a revoked device are refused, as on the
embedded broker; a FedPer federation of device processes spread over both nodes (a TCP balancer in front, as a
fleet would have) runs to its end."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from broker_clients import Raw, hook_calls
from pydantic import SecretStr
from server_testkit import FEDPER, Dev, create, wait_for

from edge_runtime.fleet import Federation
from pfl_edge.protocol import mqtt_client_id, round_topic, status_topic, task_topic
from server.balancer import HAPROXY, start_haproxy
from server.broker import free_port
from server.launch import start_background
from server.rabbitmq import RABBITMQ_SERVER, RabbitCluster, start_cluster
from server.settings import Settings

TOKEN = "admin-token-for-rabbitmq"
HOOK = "rabbit-hook-token-0123456789"
SERVER = ("pfl-server", "server-password-on-rabbitmq")

# two RabbitMQ nodes take half a minute to start and cluster, and the federation a minute more
pytestmark = [pytest.mark.skipif(RABBITMQ_SERVER is None, reason="RabbitMQ is not installed"), pytest.mark.slow]


@pytest.fixture(scope="module")
def rabbit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RabbitCluster, int]]:
    """Two clustered nodes asking the server's hook on a port reserved for the module's servers."""
    port = free_port()
    cluster = start_cluster(tmp_path_factory.mktemp("rabbitmq"), 2,
                            f"http://127.0.0.1:{port}/v1/broker/hook/{HOOK}")
    try:
        yield cluster, port
    finally:
        cluster.stop()


def _settings(tmp_path: Path, broker: str, **kw: object) -> Settings:
    return Settings(data_dir=tmp_path / "data", admin_token=TOKEN, broker_url=broker,  # type: ignore[arg-type]
                    broker_hook_token=SecretStr(HOOK), mqtt_username=SERVER[0], mqtt_password=SecretStr(SERVER[1]),
                    tick_s=0.1, **kw)


def test_the_cluster_lets_in_only_what_the_server_says(rabbit: tuple[RabbitCluster, int], tmp_path: Path) -> None:
    cluster, port = rabbit
    assert cluster.running_nodes() == sorted(cluster.names)
    srv = start_background(_settings(tmp_path, cluster.mqtt_urls[0]), port=port)
    try:
        c = httpx.Client(base_url=srv.url, timeout=30)
        create(c, TOKEN, "f", FEDPER)
        a, b, _ = Dev(c, "f"), Dev(c, "f"), Dev(c, "f")  # round 1 opens: each has a task
        node0, node1 = cluster.mqtt_urls
        assert Raw(node1, "stranger", clean=True).rc not in (None, 0)
        assert Raw(node1, "stranger", clean=True, user="nobody", password="x" * 40).rc not in (None, 0)
        pw = a.e["mqtt_password"]
        assert Raw(node0, a.client_id, user=a.id, password=pw[:-1] + "?").rc not in (None, 0)
        # its own password but another device's client id: it could take that device's session over
        assert Raw(node0, b.client_id, user=a.id, password=pw).rc not in (None, 0)
        # its own credentials on either node: in, its own task and the round topic granted
        obs = Raw(node0, "observer", clean=True, subs=("pfl/#",), user=SERVER[0], password=SERVER[1])
        assert obs.rc == 0 and obs.subscribed.wait(10)
        dev = Raw(node1, a.client_id, user=a.id, password=pw,
                  subs=(task_topic("f", a.id), round_topic("f")))
        assert dev.rc == 0 and dev.subscribed.wait(10) and all(g in (0, 1) for g in dev.granted), dev.granted
        dev.publish(status_topic("f", a.id), {"device_id": a.id, "state": "online"})  # its own: let through
        wait_for(lambda: status_topic("f", a.id) in obs.topics(), timeout=20, what="its own status, across nodes")
        dev.close()
        # another device's task: refused (RabbitMQ closes a connection that asks for what it may not have)
        spy = Raw(node1, a.client_id, user=a.id, password=pw, subs=(task_topic("f", b.id),))
        assert spy.rc == 0
        assert spy.gone.wait(20) or spy.granted == [0x80], spy.granted
        assert not any(t == task_topic("f", b.id) for t, _, _ in spy.got)
        spy.close()
        # another device's status: the publish is refused and the connection closed; the observer never sees it
        forger = Raw(node0, a.client_id, user=a.id, password=pw)
        assert forger.rc == 0
        forger.c.publish(status_topic("f", b.id), json.dumps({"device_id": b.id, "state": "offline"}), qos=1)
        assert forger.gone.wait(20), "RabbitMQ kept a connection that published where it may not"
        forger.close()
        probe = Raw(node0, b.client_id, user=b.id, password=b.e["mqtt_password"])  # a later publish of B
        probe.publish(status_topic("f", b.id), {"device_id": b.id, "state": "online"})
        wait_for(lambda: status_topic("f", b.id) in obs.topics(), timeout=20, what="B's own status")
        assert all(json.loads(p)["state"] == "online" for t, p, _ in obs.got if t == status_topic("f", b.id))
        probe.close()
        # revoked: the next CONNECT is refused on either node
        c.post(f"/v1/federations/f/devices/{a.id}/revoke", headers={"Authorization": f"Bearer {TOKEN}"}
               ).raise_for_status()
        for node in (node0, node1):
            assert Raw(node, a.client_id, user=a.id, password=pw).rc not in (None, 0)
        obs.close()
        c.close()
    finally:
        srv.stop()


def test_no_device_can_drop_another_devices_session_on_the_cluster(rabbit: tuple[RabbitCluster, int],
                                                                   tmp_path: Path) -> None:
    """Issue 49: on RabbitMQ 3.10 a device connecting with its own valid credentials under another device's client
    id (``pfl-<device id>``, which DisPFL tasks reveal) was refused, but the other device was disconnected first.
    Client ids are derived from each device's MQTT password now: under the id A can know, on either node, A is
    refused and B, connected on one node, keeps its session (a message published after reaches it)."""
    cluster, port = rabbit
    srv = start_background(_settings(tmp_path, cluster.mqtt_urls[0]), port=port)
    try:
        c = httpx.Client(base_url=srv.url, timeout=30)
        create(c, TOKEN, "f", FEDPER)
        a, b, _ = Dev(c, "f"), Dev(c, "f"), Dev(c, "f")
        node0, node1 = cluster.mqtt_urls
        obs = Raw(node0, "observer", clean=True, user=SERVER[0], password=SERVER[1])
        assert obs.rc == 0
        held = Raw(node1, b.client_id, user=b.id, password=b.e["mqtt_password"], subs=(task_topic("f", b.id),))
        assert held.rc == 0 and held.subscribed.wait(20)
        for node in (node0, node1):
            for guess in (mqtt_client_id(b.id), b.client_id[:-1] + ("0" if b.client_id[-1] != "0" else "1")):
                assert Raw(node, guess, user=a.id, password=a.e["mqtt_password"]).rc not in (None, 0)
        obs.publish(task_topic("f", b.id), {"ping": 1}, retain=False)
        wait_for(lambda: any(t == task_topic("f", b.id) and not r for t, _, r in held.got), timeout=30,
                 what="B, still connected, getting a message")
        assert not held.gone.is_set()
        for x in (held, obs):
            x.close()
        c.close()
    finally:
        srv.stop()


def test_a_caching_node_answers_a_devices_second_session_without_the_hook(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """rabbitmq_auth_backend_cache in front of the hook: a device's first session asks the server (login,
    vhost, queues, topics), its second, within the cache's life, asks nothing; the price: a device revoked since
    is let in until its cached answers expire (docs/operations.md)."""
    port = free_port()
    cluster = start_cluster(tmp_path_factory.mktemp("rabbitmq-cache"), 1,
                            f"http://127.0.0.1:{port}/v1/broker/hook/{HOOK}", hook_cache_s=600)
    srv = start_background(_settings(tmp_path, cluster.mqtt_urls[0]), port=port)
    try:
        calls = hook_calls(srv)
        c = httpx.Client(base_url=srv.url, timeout=30)
        create(c, TOKEN, "f", FEDPER)
        a, _ = Dev(c, "f"), Dev(c, "f")
        node = cluster.mqtt_urls[0]
        obs = Raw(node, "observer", clean=True, subs=(status_topic("f", a.id),), user=SERVER[0],
                  password=SERVER[1])
        assert obs.rc == 0 and obs.subscribed.wait(10)

        def session(n: int) -> None:
            dev = Raw(node, a.client_id, user=a.id, password=a.e["mqtt_password"],
                      subs=(task_topic("f", a.id), round_topic("f")))
            assert dev.rc == 0 and dev.subscribed.wait(10) and all(g in (0, 1) for g in dev.granted), dev.granted
            dev.publish(status_topic("f", a.id), {"device_id": a.id, "state": "online", "n": n})
            wait_for(lambda: sum(t == status_topic("f", a.id) for t, _, _ in obs.got) >= n, timeout=20,
                     what=f"session {n}'s status")
            dev.close()

        def asked() -> set[str]:
            return {q for q, user in calls if user == a.id}

        session(1)
        assert asked() >= {"hook_user", "hook_vhost", "hook_resource", "hook_topic"}, asked()
        calls.clear()
        session(2)
        assert asked() == set(), f"the cache let {sorted(asked())} through to the hook"
        c.post(f"/v1/federations/f/devices/{a.id}/revoke", headers={"Authorization": f"Bearer {TOKEN}"}
               ).raise_for_status()
        late = Raw(node, a.client_id, user=a.id, password=a.e["mqtt_password"])
        assert late.rc == 0  # the cache's price: its cached login stands until it expires
        late.close()
        obs.close()
        c.close()
    finally:
        srv.stop()
        cluster.stop()


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")
def test_a_federation_runs_on_the_cluster_with_devices_on_both_nodes(rabbit: tuple[RabbitCluster, int],
                                                                     tmp_path: Path) -> None:
    cluster, port = rabbit
    lb_port = free_port()
    lb = start_haproxy(tmp_path / "lb", lb_port, [u.removeprefix("mqtt://") for u in cluster.mqtt_urls], mode="tcp")
    srv = start_background(_settings(tmp_path, cluster.mqtt_urls[0],
                                     public_broker_url=f"mqtt://127.0.0.1:{lb_port}"), port=port)
    root = tmp_path / "run"
    (root / "devices").mkdir(parents=True)
    assert srv.app_state is not None
    fed = Federation(srv.url, TOKEN, None, root, ([], {}))  # type: ignore[arg-type]  # the server runs in process
    try:
        fed.create(f"rmq{secrets.token_hex(3)}", dict(FEDPER, clients=4, rounds=3), deadline_s=120.0)
        for i in range(4):
            fed.start_device(i, "phone-mid", extra=["--training-backend", "torch"])
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            info = fed.info()
            if info["state"] == "finished" and all(p.poll() is not None for p in fed.devices):
                break
            for i, p in enumerate(fed.devices):
                assert p.poll() in (None, 0), (root / "devices" / f"device-{i:02d}.log").read_text()[-3000:]
            time.sleep(0.5)
        else:
            raise AssertionError("the federation did not finish: "
                                 + (root / "devices" / "device-00.log").read_text()[-3000:])
        assert all(p.returncode == 0 for p in fed.devices)
        # devices on both nodes: every connection the nodes accepted counts (a 3-round federation can be over in
        # seconds, and a sampled client list missed the second node's under load)
        spread = cluster.nodes_that_accepted("pfl-[0-9a-f]{32}")
        assert spread == sorted(cluster.names), spread
        rounds = fed.get(f"/v1/federations/{fed.fed}/metrics")["rounds"]
        assert len(rounds) >= 3
    finally:
        for p in fed.devices:
            if p.poll() is None:
                p.kill()
        fed.http.close()
        srv.stop()
        lb.stop()
