"""What keeps devices connected, on the embedded broker and on a private Mosquitto alike: client-id takeover,
a half-open link (keepalive expiry), a network blip, retained messages by topic filter only."""

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

from pfl_edge.protocol import mqtt_client_id, round_topic, status_topic, task_topic
from server.broker import EmbeddedBroker

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
    t0 = time.monotonic()
    wait_for(lambda: any(b'"offline"' in p for _, p, _ in watcher.got), timeout=10, what="the will")
    assert time.monotonic() - t0 < 5  # 1.5 x the keepalive, not the TCP timeout
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
    wait_for(lambda: bool(sub.got), timeout=5, what="the retained announcement")
    time.sleep(0.5)  # anything else would have arrived by now
    assert [(t, json.loads(p), r) for t, p, r in sub.got] == [(round_topic("a"), {"federation": "a"}, True)]
    wild = Raw(url, "reader-2", clean=True, subs=("pfl/b/#",))
    wait_for(lambda: len(wild.got) == 2, timeout=5, what="two retained messages")
    time.sleep(0.3)
    assert sorted(wild.topics()) == sorted([round_topic("b"), task_topic("b", "dev-x")])
    for c in (pub, sub, wild):
        c.close()
