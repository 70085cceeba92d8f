"""One malicious device of five cannot steer a FedPer federation: whatever update and sample count it sends, the
published base stays within the round's norm bound of the honest devices' average (clipped mean, coordinate
median, trimmed mean, and the plain weighted mean with its default bound), and an update's weight is clamped to
what the device declared at enrolment and to the federation's cap."""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from server_testkit import FEDPER, SECRET, bearer, create, fed_state, perturbed, wait_for
from sqlalchemy import select

from pfl_edge.aggregate import DEFAULT_RULE
from pfl_edge.codec import decode, encode
from server.app import create_app
from server.db import Device, Federation, Update
from server.fedmodel import FedModel, fed_model
from server.settings import Settings

ADMIN = "admin-token-for-robust-tests"
CONFIG: dict[str, Any] = {**FEDPER, "clients": 5, "rounds": 1}
HONEST_N = 48  # every slot is dealt samples_per_client = 48
HUGE = 2**31 - 1


@pytest.fixture
def client(tmp_path: Path, broker_url: str) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'state.db'}",
                        broker_url=broker_url, admin_token=ADMIN, tick_s=0.05)  # type: ignore[arg-type]
    with TestClient(create_app(settings)) as c:
        yield c


class _Device:
    def __init__(self, c: TestClient, fed: str, index: int, declared: int | None) -> None:
        body: dict[str, Any] = {"federation": fed, "enrol_secret": SECRET, "profile": "phone-mid", "index": index}
        if declared is not None:
            body["n_samples"] = declared
        r = c.post("/v1/devices", json=body)
        assert r.status_code == 201, r.text
        self.c, self.e, self.h = c, r.json(), bearer(r.json()["token"])
        self.fm: FedModel = fed_model(self.e["config"])

    def send(self, t: int, tensors: dict[str, torch.Tensor], n: int) -> None:
        payload = encode(tensors, model_id=self.fm.model_id, round=t)
        dg = hashlib.sha256(payload).hexdigest()
        assert self.c.put(f"/v1/blobs/{dg}", content=payload, headers=self.h).status_code in (200, 201)
        r = self.c.post(f"/v1/rounds/{t}/updates", json={"digest": dg, "n_samples": n}, headers=self.h)
        assert r.status_code == 200, r.text


def _norm(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[k].double() - b[k].double()).square().sum()) for k in a))


def _round_with_an_attacker(c: TestClient, fed: str, aggregation: dict[str, Any] | None) -> dict[str, Any]:
    """Round 1 of a five-device FedPer federation whose slot 4 sends base + 1000 with 2^31-1 samples."""
    create(c, ADMIN, fed, CONFIG, **({} if aggregation is None else {"aggregation": aggregation}))
    # slots 0-3 declare their 48 samples; slot 0 then reports more than it declared; the attacker declares nothing
    devs = [_Device(c, fed, i, HONEST_N if i < 4 else None) for i in range(5)]
    wait_for(lambda: fed_state(c, ADMIN, fed) == (1, "collecting"), what="round 1 collecting")
    r = c.get(f"/v1/blobs/{devs[0].e['init_digest']}", headers=devs[0].h)
    base = {k: v.double() for k, v in decode(r.content).tensors.items()}
    honest = [perturbed(base, i) for i in range(4)]
    for d, up in zip(devs[:4], honest, strict=True):
        d.send(1, {k: v.float() for k, v in up.items()}, HONEST_N + 50 if d is devs[0] else HONEST_N)
    attack = {k: v + 1000.0 for k, v in base.items()}
    devs[4].send(1, {k: v.float() for k, v in attack.items()}, HUGE)
    wait_for(lambda: fed_state(c, ADMIN, fed)[1] == "finished", what="round 1 closed")
    engine = c.app.state.pfl.engine  # type: ignore[attr-defined]
    with engine.connect() as conn:
        digest = conn.execute(select(Federation.base_digest).where(Federation.id == fed)).scalar_one()
        rows = conn.execute(select(Update.device, Update.n_samples, Update.delta_norm).where(Update.federation == fed))
        counted = {dev: (n, norm) for dev, n, norm in rows}
        declared = dict(conn.execute(select(Device.id, Device.declared_samples).where(Device.federation == fed)).all())
    whole = decode(c.get(f"/v1/blobs/{digest}", headers=bearer(ADMIN)).content).tensors
    ups = [{k: v.float().double() for k, v in u.items()} for u in [*honest, attack]]
    return dict(base=base, honest=ups[:4], attack=ups[4], published={k: whole[k].double() for k in base},
                counted=[counted[d.e["device_id"]][0] for d in devs],
                norms=[counted[d.e["device_id"]][1] for d in devs], declared=[declared[d.e["device_id"]] for d in devs])


@pytest.mark.parametrize("rule", ["clipped-mean", "median", "trimmed-mean"])
def test_one_attacker_of_five_stays_within_the_bound(client: TestClient, rule: str) -> None:
    got = _round_with_an_attacker(client, "rb", {"rule": rule})
    base, honest = got["base"], got["honest"]
    honest_avg = {k: sum(u[k] for u in honest) / 4 for k in base}
    norms = [_norm(u, base) for u in [*honest, got["attack"]]]
    bound = 3 * statistics.median(norms)
    moved = _norm(got["published"], honest_avg)
    assert moved <= bound, (rule, moved, bound)
    assert _norm(got["attack"], honest_avg) > 1e4 * bound  # the attack itself is far beyond it


def test_plain_mean_with_the_default_bound_and_clamped_weights(client: TestClient) -> None:
    got = _round_with_an_attacker(client, "rm", None)
    base, honest, attack = got["base"], got["honest"], got["attack"]
    # weights: at most each slot's dealt share (48): slot 0 reported 98, the attacker 2^31-1; neither counts more
    assert got["counted"] == [48, 48, 48, 48, 48]
    assert got["declared"] == [48, 48, 48, 48, 48]  # undeclared at enrolment: its first counted update binds
    norms = [_norm(u, base) for u in [*honest, attack]]
    assert got["norms"] == pytest.approx(norms, rel=1e-9)  # computed by the server as it accepted each update
    m = DEFAULT_RULE.norm_multiple
    assert m == 1.0  # the default since issue 49 (3 before)
    # each update's bound, by hand: m x the low median of the *other* four norms, never its own
    bounds = [m * statistics.median_low(norms[:i] + norms[i + 1:]) for i in range(5)]
    bound = bounds[4]
    assert bound == m * statistics.median_low(norms[:4]) < m * statistics.median_low(norms)  # (all five: larger)
    scale = [min(1.0, b / n) for b, n in zip(bounds, norms, strict=True)]
    assert scale[4] < 1e-4 and sum(c < 1 for c in scale[:4]) == 2  # at 1x the two honest updates above it too
    ups = [*honest, attack]
    clipped = [{k: base[k] + (u[k] - base[k]) * c for k in base} for u, c in zip(ups, scale, strict=True)]
    want = {k: sum(u[k] for u in clipped) / 5 for k in base}
    for k in base:
        assert torch.allclose(got["published"][k], want[k], atol=1e-7, rtol=1e-6), k
    honest_avg = {k: sum(u[k] for u in clipped[:4]) / 4 for k in base}
    # the attacker's weight is 1/5 (its dealt share, as every slot's) and its difference is clipped to the bound
    moved = _norm(got["published"], honest_avg)
    assert moved <= (bound + _norm(honest_avg, base)) / 5 + 1e-4 and moved <= bound


def test_a_round_of_two_bounds_the_attacker_by_the_honest_norm_and_publishes_finite(client: TestClient) -> None:
    """A round with 2 updates (min_devices 2 of 5: a sampled or thin round): the median of two was their mean, so
    nothing was clipped and a 1e30 update was published. Now the bound is the default multiple (1) of the low
    median (the honest norm): the attacker is clipped to it and the published base is finite, within (1 + 1) / 2
    of the honest step of the start."""
    create(client, ADMIN, "r2", CONFIG, min_devices=2)
    devs = [_Device(client, "r2", i, HONEST_N) for i in range(2)]
    wait_for(lambda: fed_state(client, ADMIN, "r2") == (1, "collecting"), what="round 1 collecting")
    r = client.get(f"/v1/blobs/{devs[0].e['init_digest']}", headers=devs[0].h)
    base = {k: v.double() for k, v in decode(r.content).tensors.items()}
    honest = perturbed(base, 0)
    devs[0].send(1, {k: v.float() for k, v in honest.items()}, HONEST_N)
    devs[1].send(1, {k: (v + 1e30).float() for k, v in base.items()}, HUGE)
    wait_for(lambda: fed_state(client, ADMIN, "r2")[0] >= 2 or fed_state(client, ADMIN, "r2")[1] == "finished",
             what="round 1 closed")
    engine = client.app.state.pfl.engine  # type: ignore[attr-defined]
    with engine.connect() as conn:
        digest = conn.execute(select(Federation.base_digest).where(Federation.id == "r2")).scalar_one()
    whole = decode(client.get(f"/v1/blobs/{digest}", headers=bearer(ADMIN)).content).tensors
    published = {k: whole[k].double() for k in base}
    assert all(bool(v.isfinite().all()) for v in published.values())
    step = _norm({k: v.float().double() for k, v in honest.items()}, base)
    assert _norm(published, base) <= (1 + DEFAULT_RULE.norm_multiple) / 2 * step + 1e-4  # (honest + m x honest) / 2


@pytest.mark.parametrize("bad", [{"rule": "mode"}, {"trim": 0.5}, {"max_update_norm": 0}, {"norm_multiple": 0.5},
                                 {"max_samples": 0}, {"max_update_norm": 1e300}])
def test_bad_aggregation_settings_are_refused(client: TestClient, bad: dict[str, Any]) -> None:
    r = client.post("/v1/federations", json={"id": "bad", "enrol_secret": SECRET, "config": CONFIG,
                                             "aggregation": bad}, headers=bearer(ADMIN))
    assert r.status_code == 422, r.text


@pytest.mark.parametrize(("extra", "aggregation", "want"), [
    ({}, None, [1, 1, 1]),  # the operator said nothing of the devices' data: every update counts 1
    ({"samples_per_client": 500}, None, [500, 300, 500]),  # the config's word: at most 500 an update
    ({}, {"max_samples": 400}, [400, 300, 400]),  # the aggregation's cap
])
def test_an_own_data_device_weighs_what_the_operator_allows(
        client: TestClient, extra: dict[str, Any], aggregation: dict[str, Any] | None, want: list[int]) -> None:
    """Own data (``partition = "device"``): the server knows nothing of a device's data, so an update counts
    min(reported, declared, the operator's cap), the cap being ``max_samples``, else ``samples_per_client``, else 1
    for everyone. Before, the cap defaulted to 60,000 and a device claiming 2^31-1 took 98 % of the weight."""
    cfg = {k: v for k, v in CONFIG.items() if k != "samples_per_client"}
    fed = f"own{len(extra)}{aggregation is not None}"
    create(client, ADMIN, fed, {**cfg, "clients": 3, "partition": "device", **extra},
           **({} if aggregation is None else {"aggregation": aggregation}))
    devs = [_Device(client, fed, i, None) for i in range(3)]
    wait_for(lambda: fed_state(client, ADMIN, fed) == (1, "collecting"), what="round 1 collecting")
    r = client.get(f"/v1/blobs/{devs[0].e['init_digest']}", headers=devs[0].h)
    base = {k: v.double() for k, v in decode(r.content).tensors.items()}
    for i, (d, n) in enumerate(zip(devs, [HUGE, 300, 10**6], strict=True)):
        d.send(1, {k: v.float() for k, v in perturbed(base, i).items()}, n)
    engine = client.app.state.pfl.engine  # type: ignore[attr-defined]
    with engine.connect() as conn:
        counted = dict(conn.execute(select(Update.device, Update.n_samples).where(Update.federation == fed)).all())
    assert [counted[d.e["device_id"]] for d in devs] == want


@pytest.mark.parametrize("own_data", [False, True])
def test_a_sampled_round_of_two_with_a_1e30_update_publishes_a_finite_bounded_base(client: TestClient,
                                                                                  own_data: bool) -> None:
    """Participation 0.5 of 4 slots: every round is a round of 2, the first one without a previous round to
    bound by. One of the two drawn devices sends 1e30 with 2^31-1 samples: it is judged by the other's norm alone
    (the default 1x it), so the published base is finite and within the honest step (at most the mean of two
    updates of its norm); the same where devices bring their own data (every update counting 1)."""
    from pfl_edge.algorithms import sample_participants

    cfg = {**CONFIG, "clients": 4, "participation": 0.5}
    if own_data:
        cfg = {k: v for k, v in cfg.items() if k != "samples_per_client"} | {"partition": "device"}
    fed = f"s2{int(own_data)}"
    create(client, ADMIN, fed, cfg)
    devs = {d.e["index"]: d for d in (_Device(client, fed, i, None) for i in range(4))}
    wait_for(lambda: fed_state(client, ADMIN, fed) == (1, "collecting"), what="round 1 collecting")
    honest_slot, attacker_slot = sorted(sample_participants(CONFIG["seed"], 1, 4, 0.5).tolist())
    r = client.get(f"/v1/blobs/{devs[honest_slot].e['init_digest']}", headers=devs[honest_slot].h)
    base = {k: v.double() for k, v in decode(r.content).tensors.items()}
    honest = perturbed(base, 0)
    devs[honest_slot].send(1, {k: v.float() for k, v in honest.items()}, HONEST_N)
    devs[attacker_slot].send(1, {k: (v + 1e30).float() for k, v in base.items()}, HUGE)
    wait_for(lambda: fed_state(client, ADMIN, fed)[1] == "finished", what="round 1 (the last) closed")
    engine = client.app.state.pfl.engine  # type: ignore[attr-defined]
    with engine.connect() as conn:
        digest = conn.execute(select(Federation.base_digest).where(Federation.id == fed)).scalar_one()
    whole = decode(client.get(f"/v1/blobs/{digest}", headers=bearer(ADMIN)).content).tensors
    published = {k: whole[k].double() for k in base}
    assert all(bool(v.isfinite().all()) for v in published.values())
    step = _norm({k: v.float().double() for k, v in honest.items()}, base)
    assert _norm(published, base) <= (1 + DEFAULT_RULE.norm_multiple) / 2 * step + 1e-4  # equal weights: the mean
