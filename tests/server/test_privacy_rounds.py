"""A private federation's round on the server (pfl_edge.privacy, docs/privacy.md): the published base is the
private mean of what came (a hostile update clipped, sample counts ignored), noised under the federation's secret
key, which no device sees; every published round reports the epsilon it spent; robust rules are refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from server_testkit import FEDPER, SECRET, Dev, Mqtt, background_server, bearer, create, train_one
from sqlalchemy import select
from sqlalchemy.orm import Session

from edge_runtime.data import load_local_data
from pfl_edge.algorithms import get_algorithm
from pfl_edge.codec import encode
from pfl_edge.federation import FederationConfig
from pfl_edge.privacy import epsilon, noise_rng, private_mean, privatize, seed_key
from pfl_edge.protocol import task_topic
from pfl_edge.split import take
from server.db import Federation
from server.launch import BackgroundServer

ADMIN = "admin-token-for-privacy-tests"
PRIVATE: dict[str, Any] = {**FEDPER, "rounds": 2, "privacy": {"clip": 0.5, "noise_multiplier": 0.6, "delta": 1e-3}}


@pytest.fixture
def srv(tmp_path: Path, broker_url: str) -> Iterator[BackgroundServer]:
    s = background_server(tmp_path, broker_url, ADMIN)
    yield s
    s.stop()


def test_the_published_base_is_the_private_mean_under_a_secret_key(srv: BackgroundServer) -> None:
    c = httpx.Client(base_url=srv.url, timeout=30)
    info = create(c, ADMIN, "dp", PRIVATE)
    cfg = FederationConfig.from_dict(dict(PRIVATE))
    devs = [Dev(c, "dp", index=i) for i in range(3)]
    mq = [Mqtt(srv.broker_url, [task_topic("dp", d.id)], client_id=d.id, clean=False) for d in devs]
    assert srv.app_state is not None
    with Session(srv.app_state.engine) as s:
        key = s.scalar(select(Federation.noise_key).where(Federation.id == "dp"))
    assert key is not None and len(bytes.fromhex(key)) == 32
    seen = [str(info), *(str(d.e) for d in devs), c.get("/v1/federations/dp", headers=bearer(ADMIN)).text]
    tasks = [m.wait(task_topic("dp", d.id), lambda x: x["round"] == 1) for m, d in zip(mq, devs, strict=True)]
    assert not any(key in text for text in [*seen, *map(str, tasks)])  # the key never leaves the server
    data = [load_local_data(cfg, d.index) for d in devs]
    split = get_algorithm(cfg, data[0].model, cfg.kp).split
    start = devs[0].get(tasks[0]["base"]).tensors
    init = devs[0].fm.init_state()
    ups = []
    for i, d in enumerate(devs):
        trained = take(train_one(data[i], {**init, **start}, cfg, 1, d.index), split.base)
        # device 0 honest (clipped by privatize), 1 sends its update unclipped and claims a huge sample count,
        # 2 sends an update 100 times too large: the server bounds both itself
        sent = privatize(cfg, start, trained) if i == 0 else trained if i == 1 else {
            k: start[k] + (v - start[k]) * 100 if v.is_floating_point() else v for k, v in trained.items()}
        d.send(1, sent, n=10**6 if i == 1 else 48)
        ups.append((sent, 1.0))
    nxt = mq[0].wait(task_topic("dp", devs[0].id), lambda x: x["round"] == 2)
    got = devs[0].get(nxt["base"]).tensors
    want = private_mean(cfg, start, ups, noise_rng(bytes.fromhex(key), 1))
    public = private_mean(cfg, start, ups, noise_rng(seed_key(cfg.seed), 1))
    for k in got:
        assert torch.equal(got[k], want[k]), k
    assert any(not torch.equal(got[k], public[k]) for k in got if got[k].is_floating_point())
    # the hostile update moved the base no further than an honest one may: ||clipped sum|| <= 3 C, noise aside
    noise_free = private_mean(cfg.replace(privacy={**PRIVATE["privacy"], "noise_multiplier": 0.0}), start, ups,
                              noise_rng(b"x", 1))
    moved = np.sqrt(sum(float((noise_free[k].double() - start[k].double()).square().sum()) for k in got
                        if got[k].is_floating_point()))
    assert moved <= 3 * 0.5 / 3 + 1e-6
    rounds = c.get("/v1/federations/dp/metrics", headers=bearer(ADMIN)).json()["rounds"]
    assert rounds[0]["round"] == 1 and rounds[0]["epsilon"] == pytest.approx(epsilon(cfg, 1))
    for m in mq:
        m.close()


def test_a_private_federation_refuses_a_robust_rule(srv: BackgroundServer) -> None:
    c = httpx.Client(base_url=srv.url, timeout=30)
    r = c.post("/v1/federations", json={"id": "dpm", "enrol_secret": SECRET, "config": PRIVATE,
                                        "aggregation": {"rule": "median"}}, headers=bearer(ADMIN))
    assert r.status_code == 422 and "privacy.clip" in r.text
    bad = {**PRIVATE, "privacy": {"clip": 0.5, "target_epsilon": 4.0, "mode": "distributed"}}
    r = c.post("/v1/federations", json={"id": "dpd", "enrol_secret": SECRET, "config": bad}, headers=bearer(ADMIN))
    assert r.status_code == 422 and "distributed-mode device" in r.text
    assert c.get("/v1/federations/dpm", headers=bearer(ADMIN)).status_code == 404


def test_an_upload_is_what_privatize_made_of_it() -> None:
    """The payload a device encodes from ``privatize``'s output decodes to within the bound (float32 rounding
    stays inside the margin)."""
    from pfl_edge.codec import decode

    cfg = FederationConfig.from_dict(dict(PRIVATE))
    g = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(1000, generator=g)}
    sent = privatize(cfg, start, {"w": start["w"] + torch.randn(1000, generator=g)})
    back = decode(encode(sent, model_id="m", round=1)).tensors["w"]
    assert float((back.double() - start["w"].double()).norm()) <= 0.5


def test_a_private_federation_takes_devices_of_one_base_only(srv: BackgroundServer) -> None:
    """Capacities from profiles: a device whose profile keeps another K_P than the federation's would send
    another base, which the private mean would shrink; it is refused, and one that fits enrols."""
    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, ADMIN, "dpk", {**PRIVATE, "kp": 1}, profile_capacity=True)
    r = c.post("/v1/devices", json={"federation": "dpk", "enrol_secret": SECRET, "profile": "phone-mid"})
    assert r.status_code == 422 and "share one base" in r.text
    create(c, ADMIN, "dpk2", {**PRIVATE, "kp": 2}, profile_capacity=True)
    assert Dev(c, "dpk2").e["kp"] == 2
