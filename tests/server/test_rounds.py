"""Whole rounds over real HTTP (uvicorn) and a real MQTT broker: FedPer's average equals
``pfl_edge.aggregate.weighted_average`` to the bit, DisPFL's tasks name the right neighbours, quorum and deadline
close a round without a dead device, and a server killed mid-round resumes it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_testkit import (
    DISPFL,
    FEDPER,
    Dev,
    Mqtt,
    base_payload,
    bearer,
    create,
    dispfl_initial,
    fed_state,
    perturbed,
    settled,
    train_one,
    wait_for,
)
from sqlalchemy.orm import Session

from edge_runtime.data import load_local_data
from pfl_edge.aggregate import weighted_average
from pfl_edge.algorithms import get_algorithm
from pfl_edge.codec import encode
from pfl_edge.federation import FederationConfig
from pfl_edge.protocol import round_topic, status_topic, task_topic
from pfl_edge.split import take
from pfl_edge.topology import neighbours
from server.db import Round
from server.launch import BackgroundServer, start_background, start_subprocess
from server.settings import Settings

PLAIN = {"norm_multiple": None}  # the unclipped mean: these tests compare with weighted_average
ADMIN = "admin-token-for-round-tests"


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'state.db'}"


def _server(tmp_path: Path, database_url: str, broker_url: str) -> BackgroundServer:
    return start_background(Settings(data_dir=tmp_path / "data", database_url=database_url, broker_url=broker_url,
                                     admin_token=ADMIN, tick_s=0.05))  # type: ignore[arg-type]


@pytest.fixture
def srv(tmp_path: Path, sqlite_url: str, broker_url: str) -> Iterator[BackgroundServer]:
    s = _server(tmp_path, sqlite_url, broker_url)
    yield s
    s.stop()


def at_round(t: int) -> Callable[[dict[str, Any]], bool]:
    return lambda x: bool(x["round"] == t)


def after(t: int) -> Callable[[dict[str, Any]], bool]:
    return lambda x: bool(x["round"] == t + 1 or x["final"])


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_fedper_rounds_average_like_weighted_average(tmp_path: Path, database_url: str, broker_url: str) -> None:
    srv = _server(tmp_path, database_url, broker_url)
    try:
        c = httpx.Client(base_url=srv.url, timeout=30)
        # the unclipped weighted mean, as this test computes it (the default rule's bounds: test_robust.py,
        # test_partial_sums.py, tests/pfl_edge/test_aggregate.py)
        create(c, ADMIN, "fp", FEDPER, aggregation=PLAIN)
        cfg = FederationConfig.from_dict(dict(FEDPER))
        devs = [Dev(c, "fp", index=i) for i in range(3)]
        # each device listens on its own task topic, as the agent does (persistent session, last will)
        mq = [Mqtt(srv.broker_url, [task_topic("fp", d.id)], client_id=d.id, clean=False,
                   will=(status_topic("fp", d.id), b"")) for d in devs]
        data = [load_local_data(cfg, d.index) for d in devs]
        split = get_algorithm(cfg, data[0].model, cfg.kp).split
        init = devs[0].fm.init_state()
        states = [dict(init) for _ in devs]
        for t in (1, 2):
            tasks = [m.wait(task_topic("fp", d.id), at_round(t)) for m, d in zip(mq, devs, strict=True)]
            assert {x["base"] for x in tasks} == ({devs[0].e["init_digest"]} if t == 1 else {tasks[0]["base"]})
            base = devs[0].get(tasks[0]["base"]).tensors
            assert set(base) == set(split.base)
            uploads, weights = [], []
            for i, d in enumerate(devs):
                states[i] = train_one(data[i], {**states[i], **base}, cfg, t, d.index)
                payload = base_payload(states[i], split, data[i], t)
                n = data[i].n_train - 10 * i  # unequal weights (at most its dealt share: more would be cut to it)
                dg = d.put(payload)
                r = d.update(t, dg, n)
                assert r.status_code == 200 and r.json()["accepted"], r.text
                uploads.append(take(states[i], split.base))
                weights.append(n)
            want = weighted_average(uploads, weights)
            nxt = [m.wait(task_topic("fp", d.id), after(t))
                   for m, d in zip(mq, devs, strict=True)]
            _equal(devs[0].get(nxt[0]["base"]).tensors, want)
        assert all(x["final"] and x["round"] == 2 for x in nxt)
        assert fed_state(c, ADMIN, "fp") == (2, "finished")
        for i, d in enumerate(devs):
            r = c.post("/v1/rounds/2/metrics", json={"accuracy": 0.5 + 0.1 * i, "loss": 1.0, "n_test": 32},
                       headers=d.h)
            assert r.status_code == 200, r.text
        got = c.get("/v1/federations/fp/metrics", headers=bearer(ADMIN)).json()["rounds"]
        assert [r["state"] for r in got] == ["published", "published"]
        assert got[1]["mean_accuracy"] == pytest.approx(0.6) and got[0]["updates"] == 3
        assert all(r["wall_s"] is not None and r["wall_s"] >= 0 for r in got)
        devices = c.get("/v1/federations/fp/devices", headers=bearer(ADMIN)).json()
        assert [d["last_round"] for d in devices] == [2, 2, 2] and all(d["bytes_up"] > 0 for d in devices)
        for m in mq:
            m.close()
    finally:
        srv.stop()


def test_dispfl_tasks_name_the_neighbours_latest_models(srv: BackgroundServer) -> None:
    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, ADMIN, "dp", DISPFL)
    cfg = FederationConfig.from_dict(dict(DISPFL))
    watch = Mqtt(srv.broker_url, ["pfl/dp/device/+/task", round_topic("dp")])
    devs = [Dev(c, "dp", index=i) for i in (2, 0, 3, 1)]  # enrol out of order: slots, not arrival, decide
    by_slot = {d.index: d for d in devs}
    assert [by_slot[i].e["density"] for i in range(4)] == [0.3, 0.6, 1.0, 0.3]
    data = {i: load_local_data(cfg, i) for i in range(4)}
    init = devs[0].fm.init_state()
    latest: dict[int, str] = {}
    for i in range(4):
        d = by_slot[i]
        assert fed_state(c, ADMIN, "dp")[0] == 0  # round 1 waits for every initial model
        w, m = dispfl_initial(cfg, data[i], i, d.e["density"], init)
        latest[i] = d.put(encode(w, model_id=d.fm.model_id, round=0, masks=m))
        r = d.update(0, latest[i])
        assert r.status_code == 200 and r.json()["accepted"], r.text
    for t in (1, 2):
        nbrs = neighbours(DISPFL["topology"], cfg.clients, t, cfg.seed)  # the config as given, independently
        new: dict[int, str] = {}
        for i in range(4):
            d = by_slot[i]
            task = watch.wait(task_topic("dp", d.id), at_round(t))
            assert task["base"] is None and task["algorithm"] == "dispfl" and not task["final"]
            assert [(n["index"], n["device_id"], n["digest"]) for n in task["neighbours"]] == [
                (j, by_slot[j].id, latest[j]) for j in nbrs[i]]
            for n in task["neighbours"]:  # a neighbour's sparse model: its mask travels with it
                assert bool(d.get(n["digest"]).masks) == (by_slot[n["index"]].e["density"] < 1)
            if t == 1:  # a model of a device that is not its neighbour is not served to it
                # (a dense device's initial model is the server's initial model, byte for byte: public)
                for j in set(range(4)) - set(nbrs[i]) - {i}:
                    if by_slot[j].e["density"] < 1:
                        r = c.get(f"/v1/blobs/{latest[j]}", headers=d.h)
                        assert r.status_code == 403 and "neighbours" in r.json()["detail"]
            w, m = dispfl_initial(cfg, data[i], i, d.e["density"], init)
            new[i] = d.send(t, {k: v * 1.01 for k, v in w.items()}, masks=m)
        latest = new
    wait_for(lambda: fed_state(c, ADMIN, "dp") == (2, "finished"), what="finished")
    assert watch.wait(round_topic("dp"), lambda x: x["state"] == "finished")["round"] == 2
    watch.close()


def test_quorum_deadline_and_a_dead_device(srv: BackgroundServer) -> None:
    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, ADMIN, "q", {**FEDPER, "rounds": 3}, deadline_s=1.0, min_updates=2, aggregation=PLAIN)
    devs = [Dev(c, "q") for _ in range(3)]
    agents = [Mqtt(srv.broker_url, [task_topic("q", d.id)], client_id=d.id,
                   will=(status_topic("q", d.id), f'{{"device_id": "{d.id}", "state": "offline"}}'.encode()))
              for d in devs]
    for a, d in zip(agents, devs, strict=True):
        a.publish(status_topic("q", d.id), f'{{"device_id": "{d.id}", "state": "online"}}'.encode())

    def online() -> list[bool]:
        return [x["online"] for x in c.get("/v1/federations/q/devices", headers=bearer(ADMIN)).json()]

    wait_for(lambda: online() == [True, True, True], what="devices online")
    agents[2].die()  # device 2 loses power
    wait_for(lambda: online() == [True, True, False], what="the last will")

    base = take(devs[0].fm.init_state(), devs[0].fm.base_keys(2))
    agents[0].wait(task_topic("q", devs[0].id), lambda x: x["round"] == 1)
    d0 = devs[0].send(1, perturbed(base, 0), n=10)
    with Session(srv.app_state.engine) as s:  # type: ignore[union-attr]
        open_round = s.get(Round, ("q", 1))
        assert open_round is not None
        deadline = open_round.deadline
    settled(srv, past=deadline)  # past the deadline with 1 update: min_updates is 2, so the round waits
    assert fed_state(c, ADMIN, "q") == (1, "collecting")
    d1 = devs[1].send(1, perturbed(base, 1), n=30)  # the second update closes it at once
    task = agents[0].wait(task_topic("q", devs[0].id), lambda x: x["round"] == 2)
    want = weighted_average([perturbed(base, 0), perturbed(base, 1)], [10, 30])
    _equal(devs[0].get(task["base"]).tensors, want)
    # the dead device's late update for round 1 is refused, and it never held the round up
    r = devs[2].update(1, devs[2].put(encode(perturbed(base, 2), model_id=devs[2].fm.model_id, round=1)))
    assert r.status_code == 409 and "round 2" in r.json()["detail"]
    # the close recorded what it took: both updates, not the refused one (sha256 of the sorted device:digest lines)
    took = hashlib.sha256("\n".join(sorted([f"{devs[0].id}:{d0}", f"{devs[1].id}:{d1}"])).encode()).hexdigest()
    if srv.app_state is None:
        raise AssertionError("no app state")
    with Session(srv.app_state.engine) as s:
        closed = s.get(Round, ("q", 1))
        assert closed is not None and (closed.inputs, closed.inputs_digest) == (2, took)
    for a in agents[:2]:
        a.close()


def test_quorum_fraction_closes_early(srv: BackgroundServer) -> None:
    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, ADMIN, "h", {**FEDPER, "clients": 4}, quorum=0.5, deadline_s=600)
    devs = [Dev(c, "h") for _ in range(4)]
    wait_for(lambda: fed_state(c, ADMIN, "h") == (1, "collecting"), what="round 1")
    base = take(devs[0].fm.init_state(), devs[0].fm.base_keys(2))
    devs[0].send(1, perturbed(base, 0))
    settled(srv)  # a whole tick after one update of four: quorum 0.5 is not reached, the round goes on
    assert fed_state(c, ADMIN, "h") == (1, "collecting")
    devs[1].send(1, perturbed(base, 1))
    wait_for(lambda: fed_state(c, ADMIN, "h") == (2, "collecting"), what="round 2 after half the devices")


def test_restart_resumes_the_round(tmp_path: Path, broker_url: str) -> None:
    env = {"PFL_DATA_DIR": str(tmp_path / "data"), "PFL_BROKER_URL": broker_url, "PFL_ADMIN_TOKEN": ADMIN,
           "PFL_TICK_S": "0.05"}
    s = start_subprocess(env)
    try:
        c = httpx.Client(base_url=s.url, timeout=30)
        create(c, ADMIN, "r", FEDPER, aggregation=PLAIN)
        devs = [Dev(c, "r") for _ in range(3)]
        wait_for(lambda: fed_state(c, ADMIN, "r") == (1, "collecting"), what="round 1")
        base = take(devs[0].fm.init_state(), devs[0].fm.base_keys(2))
        ups = [perturbed(base, i) for i in range(3)]
        sent = [devs[i].send(1, ups[i], n=10 + i) for i in range(2)]
        s.kill()  # SIGKILL mid-round: no shutdown at all

        # the retained task must be re-published by the new server: clear it first to see that happen
        clear = Mqtt(broker_url, [])
        clear.publish(task_topic("r", devs[2].id), b"")
        clear.close()
        s = start_subprocess({**env})
        c = httpx.Client(base_url=s.url, timeout=30)
        for d in devs:
            d.c = c
        assert fed_state(c, ADMIN, "r") == (1, "collecting")
        agent = Mqtt(broker_url, [task_topic("r", devs[2].id)], client_id=devs[2].id)
        assert agent.wait(task_topic("r", devs[2].id))["round"] == 1
        r = devs[0].update(1, sent[0], n=10)  # a retry after the crash: already counted
        assert r.status_code == 200 and r.json() == {"round": 1, "accepted": False, "updates": 2}
        devs[2].send(1, ups[2], n=12)
        task = agent.wait(task_topic("r", devs[2].id), lambda x: x["round"] == 2)
        _equal(devs[2].get(task["base"]).tensors, weighted_average(ups, [10, 11, 12]))
        agent.close()
    finally:
        s.stop()


def test_default_embedded_broker_end_to_end(tmp_path: Path) -> None:
    """The default settings: the app starts its own broker; a device-like client gets its retained task."""
    srv = start_background(Settings(data_dir=tmp_path / "data", admin_token=ADMIN, tick_s=0.05))  # type: ignore[arg-type]
    try:
        assert srv.broker_url.startswith("mqtt://127.0.0.1:")
        c = httpx.Client(base_url=srv.url, timeout=30)
        create(c, ADMIN, "e", FEDPER)
        devs = [Dev(c, "e") for _ in range(3)]
        assert devs[0].e["broker_url"] == srv.broker_url
        wait_for(lambda: fed_state(c, ADMIN, "e") == (1, "collecting"), what="round 1")
        agent = Mqtt(devs[1].e["broker_url"], [task_topic("e", devs[1].id), round_topic("e")],
                     client_id=devs[1].client_id, clean=False, username=devs[1].e["mqtt_username"],
                     password=devs[1].e["mqtt_password"])
        task = agent.wait(task_topic("e", devs[1].id))
        assert (task["round"], task["base"], task["final"]) == (1, devs[1].e["init_digest"], False)
        assert agent.wait(round_topic("e"))["state"] == "collecting"
        agent.close()
    finally:
        srv.stop()
