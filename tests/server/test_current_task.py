"""``GET /v1/rounds/current/task``: the calling device's task exactly as the server publishes it on MQTT (base,
neighbours, deadline, final), 404 when it has none (before round 1, between rounds), 401 without a token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_testkit import (
    DISPFL,
    FEDPER,
    Dev,
    Mqtt,
    background_server,
    create,
    dispfl_initial,
    fed_state,
    perturbed,
    wait_for,
)

from edge_runtime.data import load_local_data
from pfl_edge.codec import encode
from pfl_edge.federation import FederationConfig
from server.launch import BackgroundServer

ADMIN = "admin-token-for-task-tests"
METRICS = {"accuracy": 0.5, "loss": 1.0, "n_test": 10}


@pytest.fixture
def srv(tmp_path: Path, broker_url: str) -> Iterator[BackgroundServer]:
    s = background_server(tmp_path, broker_url, ADMIN)
    yield s
    s.stop()


def _task(c: httpx.Client, d: Dev) -> httpx.Response:
    return c.get("/v1/rounds/current/task", headers=d.h)


def _published(watch: Mqtt, fed: str, d: Dev, t: int, final: bool = False) -> dict[str, Any]:
    return watch.wait(f"pfl/{fed}/device/{d.id}/task", lambda m: m["round"] == t and m["final"] == final)


def test_fedper_task_and_final_task_are_the_published_ones(srv: BackgroundServer) -> None:
    c = httpx.Client(base_url=srv.url, timeout=30)
    assert c.get("/v1/rounds/current/task").status_code == 401
    create(c, ADMIN, "fp", {**FEDPER, "clients": 2, "rounds": 1})
    watch = Mqtt(srv.broker_url, ["pfl/fp/device/+/task"])
    a = Dev(c, "fp", index=0)
    r = _task(c, a)
    assert r.status_code == 404 and "no task" in r.json()["detail"]  # enrolment: round 1 has not opened
    b = Dev(c, "fp", index=1)
    wait_for(lambda: fed_state(c, ADMIN, "fp") == (1, "collecting"), what="round 1")
    for d in (a, b):
        got = _task(c, d)
        assert got.status_code == 200 and got.json() == _published(watch, "fp", d, 1)
        assert got.json()["base"] == d.e["init_digest"]  # its K_P's base part of the initial model
    base = a.get(a.e["init_digest"]).tensors
    for i, d in enumerate((a, b)):
        d.send(1, perturbed(base, i))
    wait_for(lambda: fed_state(c, ADMIN, "fp") == (1, "finished"), what="finished")
    for d in (a, b):
        got = _task(c, d).json()
        assert got["final"] and got == _published(watch, "fp", d, 1, final=True)
    watch.close()


def test_dispfl_tasks_name_the_published_neighbours(srv: BackgroundServer) -> None:
    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, ADMIN, "dp", DISPFL)
    cfg = FederationConfig.from_dict(dict(DISPFL))
    watch = Mqtt(srv.broker_url, ["pfl/dp/device/+/task"])
    devs = [Dev(c, "dp", index=i) for i in range(4)]
    init = devs[0].fm.init_state()
    for d in devs:
        assert _task(c, d).status_code == 404
        w, m = dispfl_initial(cfg, load_local_data(cfg, d.index), d.index, d.e["density"], init)
        assert d.update(0, d.put(encode(w, model_id=d.fm.model_id, round=0, masks=m))).status_code == 200
    wait_for(lambda: fed_state(c, ADMIN, "dp") == (1, "collecting"), what="round 1")
    for d in devs:
        got = _task(c, d).json()
        assert got == _published(watch, "dp", d, 1) and got["neighbours"], json.dumps(got)
    watch.close()


def test_sampled_rounds_task_only_the_simulators_participants(srv: BackgroundServer) -> None:
    """participation 0.5 of 4 slots: each round tasks exactly the simulator's draw (by slot); the others get 404
    and their updates and metrics are refused; the round closes on the sampled updates alone, averaged with their
    weights."""
    import torch

    from pfl_edge.aggregate import weighted_average
    from pfl_edge.algorithms import sample_participants

    c = httpx.Client(base_url=srv.url, timeout=30)
    cfg = {**FEDPER, "clients": 4, "rounds": 3, "participation": 0.5}
    create(c, ADMIN, "sp", cfg, aggregation={"norm_multiple": None})  # compared with the unclipped weighted_average
    devs = [Dev(c, "sp", index=i) for i in range(4)]
    watch = Mqtt(srv.broker_url, ["pfl/sp/device/+/task"])
    base = devs[0].get(devs[0].e["init_digest"]).tensors
    drawn, prev = set(), set()
    for t in (1, 2, 3):
        wait_for(lambda t=t: fed_state(c, ADMIN, "sp") == (t, "collecting"), what=f"round {t}")
        want = set(sample_participants(cfg["seed"], t, 4, 0.5).tolist())
        assert len(want) == 2
        if t > 1:  # round t - 1's metrics: its own draw's, and round t's, whose tasks bring round t - 1's base
            for d in devs:
                r = c.post(f"/v1/rounds/{t - 1}/metrics", json=METRICS, headers=d.h)
                assert r.status_code == (200 if d.index in want | prev else 409), r.text
        prev = want
        drawn.add(frozenset(want))
        for d in devs:
            got = _task(c, d)
            if d.index in want:
                assert got.status_code == 200 and got.json() == _published(watch, "sp", d, t)
                assert devs[0].get(got.json()["base"]).tensors.keys() == base.keys()
            else:
                assert got.status_code == 404, got.text
        out = next(d for d in devs if d.index not in want)
        r = out.update(t, out.put(encode(perturbed(base, 99), model_id=out.fm.model_id, round=t)))
        assert r.status_code == 409 and "did not draw this device" in r.json()["detail"], r.text
        ups, ns = [], []
        for d in sorted((d for d in devs if d.index in want), key=lambda d: d.index):
            sent = perturbed(base, 10 * t + d.index)
            ups.append(sent)
            ns.append(20 + 7 * d.index)
            d.send(t, sent, n=ns[-1])
        expected = weighted_average(ups, ns)
        m = METRICS
        if t < 3:  # a round's metrics are its participants' (the last round's: every device's final evaluation)
            r = c.post(f"/v1/rounds/{t}/metrics", json=m, headers=out.h)
            assert r.status_code == 409 and "not one of them" in r.json()["detail"], r.text
        for d in devs:
            if d.index in want or t == 3:
                assert c.post(f"/v1/rounds/{t}/metrics", json=m, headers=d.h).status_code == 200
        if t < 3:
            wait_for(lambda t=t: fed_state(c, ADMIN, "sp") == (t + 1, "collecting"), what=f"round {t + 1}")
            nxt = next(_task(c, d).json() for d in devs if _task(c, d).status_code == 200)
            base = devs[0].get(nxt["base"]).tensors
        else:
            wait_for(lambda: fed_state(c, ADMIN, "sp") == (3, "finished"), what="finished")
            finals = [_task(c, d).json() for d in devs]  # every device evaluates the last base, sampled or not
            assert all(f["final"] for f in finals) and len({f["base"] for f in finals}) == 1
            base = devs[0].get(finals[0]["base"]).tensors
        for k in expected:
            assert torch.equal(base[k], expected[k]), k
    assert len(drawn) > 1  # the draw changes with the round
    rounds = c.get("/v1/federations/sp/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).json()["rounds"]
    assert [r["updates"] for r in rounds] == [2, 2, 2]
    watch.close()


def test_a_device_cannot_choose_its_slot_where_rounds_sample(srv: BackgroundServer) -> None:
    """The draw of a sampled federation is public (its seed), so the slot a device asks for is ignored there and
    a free one drawn at random (the server's generator, seeded here to check the draws against the same
    generator's: random probes among the 16 slots until a free one); without sampling the slot asked for is
    given, as before."""
    import random

    assert srv.app_state is not None
    srv.app_state.coordinator.enrolment.rng = random.Random(7)
    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, ADMIN, "ns", {**FEDPER, "clients": 16, "participation": 0.25})
    got = [Dev(c, "ns", index=3).index for _ in range(6)]
    ref, want = random.Random(7), []
    for _ in range(6):
        slot = ref.randrange(16)
        while slot in want:
            slot = ref.randrange(16)
        want.append(slot)
    assert got == want and got[0] != 3, got
    create(c, ADMIN, "all", {**FEDPER, "clients": 16})
    assert [Dev(c, "all", index=i).index for i in (3, 9)] == [3, 9]
