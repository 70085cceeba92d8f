"""What keeps devices connected, on the embedded broker and on a private Mosquitto alike: client-id takeover,
a half-open link (keepalive expiry), a network blip, retained messages by topic filter only, QoS 2 publishes and
wills from clients that use them."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from broker_clients import Raw, control, next_msg
from mosquitto_kit import mosquitto
from server_testkit import wait_for

from pfl_edge.protocol import (
    MAX_CLIENTS,
    MAX_NEIGHBOURS,
    MAX_ROUND,
    Neighbour,
    Task,
    mqtt_client_id,
    round_topic,
    status_topic,
    task_topic,
)
from server.broker import EmbeddedBroker
from server.broker_core import MAX_PACKET

TASK = task_topic("f", "dev-a")


@pytest.fixture(params=["embedded", "mosquitto"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "embedded":
        with EmbeddedBroker() as b:
            yield b.url
    else:
        with mosquitto(tmp_path / "mosquitto") as u:
            yield u


def test_a_second_connection_with_the_client_id_takes_the_session_over(url: str) -> None:
    old = Raw(url, "pfl-dev-a", subs=(TASK,))
    assert old.rc == 0 and old.subscribed.wait(5)
    new = Raw(url, "pfl-dev-a")  # no subscription of its own: it must get the old one's session
    assert new.rc == 0 and new.present
    assert old.gone.wait(5), "the old connection was not closed"
    pub = Raw(url, "publisher", clean=True)
    pub.publish(TASK, {"round": 7}, retain=False)
    wait_for(lambda: TASK in new.topics(), timeout=5, what="the task on the new connection")
    assert TASK not in old.topics()
    for c in (pub, new, old):
        c.close()


def test_the_device_keeps_receiving_tasks_after_a_stranger_used_its_client_id(url: str) -> None:
    ctl, inbox = control(url)
    assert ctl.connected.wait(10)
    stranger = Raw(url, mqtt_client_id("dev-a"), clean=True)  # takes over, then leaves
    assert stranger.rc == 0
    time.sleep(0.5)
    stranger.close()
    pub = Raw(url, "server-like", clean=True)
    for t in (1, 2):
        pub.publish(TASK, {"round": t})
        assert next_msg(inbox, TASK, lambda m, t=t: m["round"] == t, timeout=15)["round"] == t
    pub.close()
    ctl.close()


def test_a_half_open_link_expires_and_the_device_comes_back(url: str) -> None:
    watcher = Raw(url, "watcher", clean=True, subs=(status_topic("f", "dev-a"),))
    ctl, inbox = control(url, keepalive=1)
    assert ctl.connected.wait(10)
    wait_for(lambda: any(b'"online"' in p for _, p, _ in watcher.got), timeout=5, what="online")
    ctl.client.loop_stop()  # the socket stays open but nothing reads or pings: a half-open link
    # the broker gives up after 1.5 x the keepalive (1.5 s); TCP alone would take many minutes (retransmission
    # timeout), so a bound of 30 s tells them apart on a loaded machine without timing the broker
    wait_for(lambda: any(b'"offline"' in p for _, p, _ in watcher.got), timeout=30, what="the will")
    pub = Raw(url, "server-like", clean=True)
    pub.publish(TASK, {"round": 3}, retain=False)  # queued in its persistent session while it is away
    ctl.client.loop_start()
    assert next_msg(inbox, TASK, timeout=15)["round"] == 3
    pub.close()
    watcher.close()
    ctl.close()


def test_a_blip_loses_no_task(url: str) -> None:
    ctl, inbox = control(url)
    assert ctl.connected.wait(10)
    sock = cast(socket.socket, ctl.client.socket())
    sock.shutdown(socket.SHUT_RDWR)  # the link drops; paho reconnects by itself
    wait_for(lambda: not ctl.connected.is_set(), timeout=5, what="the disconnect")
    pub = Raw(url, "server-like", clean=True)
    pub.publish(TASK, {"round": 4}, retain=False)  # sent during the blip
    assert next_msg(inbox, TASK, timeout=15)["round"] == 4
    pub.publish(TASK, {"round": 5}, retain=False)
    assert next_msg(inbox, TASK, timeout=10)["round"] == 5
    pub.close()
    ctl.close()


def test_retained_messages_by_topic_filter_only(url: str) -> None:
    pub = Raw(url, "server-like", clean=True)
    for fed in ("a", "b"):
        pub.publish(round_topic(fed), {"federation": fed})
        pub.publish(task_topic(fed, "dev-x"), {"federation": fed})
    sub = Raw(url, "reader", clean=True, subs=(round_topic("a"),))
    assert sub.subscribed.wait(5)
    # a message published after the subscription reaches it after every retained one the subscription matched,
    # so once this marker is in, nothing retained can still be on its way
    pub.publish(round_topic("a"), {"marker": 1}, retain=False)
    wait_for(lambda: any(json.loads(p) == {"marker": 1} for _, p, _ in sub.got), timeout=10, what="the marker")
    assert [(t, json.loads(p), r) for t, p, r in sub.got] == [(round_topic("a"), {"federation": "a"}, True),
                                                              (round_topic("a"), {"marker": 1}, False)]
    wild = Raw(url, "reader-2", clean=True, subs=("pfl/b/#",))
    assert wild.subscribed.wait(5)
    pub.publish("pfl/b/marker", {"marker": 2}, retain=False)
    wait_for(lambda: "pfl/b/marker" in wild.topics(), timeout=10, what="the second marker")
    assert sorted(wild.topics()) == sorted([round_topic("b"), task_topic("b", "dev-x"), "pfl/b/marker"])
    for c in (pub, sub, wild):
        c.close()


def test_qos2_publishes_and_wills_are_taken_and_delivered_once(url: str) -> None:
    sub = Raw(url, "qos2-reader", clean=True, subs=("q2/#",))
    assert sub.subscribed.wait(5)
    pub = Raw(url, "qos2-writer", clean=True, will=("q2/will", b"gone"), will_qos=2)
    assert pub.rc == 0  # a QoS 2 will is accepted
    for i in range(3):
        pub.publish("q2/data", {"i": i}, retain=False, qos=2)  # each waits for the broker's PUBCOMP
    wait_for(lambda: len(sub.got) == 3, timeout=10, what="three QoS 2 messages")
    assert [json.loads(p) for _, p, _ in sub.got] == [{"i": 0}, {"i": 1}, {"i": 2}]
    cast(socket.socket, pub.c.socket()).shutdown(socket.SHUT_RDWR)  # gone without DISCONNECT: the will fires
    pub.c.loop_stop()
    wait_for(lambda: "q2/will" in sub.topics(), timeout=10, what="the QoS 2 will")
    assert sub.topics().count("q2/data") == 3 and sub.got[-1][1] == b"gone"
    sub.close()


def test_the_largest_task_fits_the_embedded_brokers_packet_limit(url: str) -> None:
    fed, dev = "f" * 64, "d" * 64  # ids at their longest
    task = Task(federation=fed, round=MAX_ROUND, algorithm="dispfl", deadline=1e11, base="0" * 64,
                neighbours=[Neighbour(index=MAX_CLIENTS - 1 - i, device_id=f"{i:0>64}", digest="a" * 64)
                            for i in range(MAX_NEIGHBOURS)])
    payload = task.model_dump_json().encode()  # as the server publishes it (server.mqtt)
    topic = task_topic(fed, dev)
    remaining = 2 + len(topic.encode()) + 2 + len(payload)  # a QoS 1 PUBLISH: topic, packet id, payload
    assert remaining <= MAX_PACKET, f"the largest Task takes {remaining:,} bytes, over {MAX_PACKET:,}"
    sub = Raw(url, "task-reader", clean=True, subs=(topic,))
    assert sub.subscribed.wait(5)
    pub = Raw(url, "server-like", clean=True)
    pub.publish(topic, payload, retain=False)
    wait_for(lambda: bool(sub.got), timeout=10, what="the largest task")
    assert Task.model_validate_json(sub.got[0][1]) == task and not pub.gone.is_set()
    for c in (pub, sub):
        c.close()
