"""The server holds a DisPFL device to the density it gave it: per parameter tensor, its mask carries at most the
ones ERK allots at that density (``int(density_l * numel)``; a tensor sent without a mask counts as all ones) and
at least one where ERK allots any. Checked against ERK written here from docs/algorithms.md, with the masks an
honest device draws (accepted), and with a dense model, one tensor over its count and one emptied (refused with
422, naming the tensor and both counts, and changing nothing). Also under ``profile_capacity``, where the density
comes from the device's profile."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from server_testkit import DISPFL, Dev, bearer, create, dispfl_initial, snapshot

from edge_runtime.data import load_local_data
from pfl_edge.codec import encode
from pfl_edge.federation import FederationConfig
from server.app import create_app
from server.services.updates import mask_bound
from server.settings import Settings

ADMIN = "admin-token-for-dispfl-checks"


@pytest.fixture
def client(tmp_path: Path, broker_url: str) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path / "data", broker_url=broker_url, admin_token=ADMIN,  # type: ignore[arg-type]
                        tick_s=0.05)
    with TestClient(create_app(settings)) as c:
        yield c


def _erk_counts(shapes: dict[str, tuple[int, ...]], d: float) -> dict[str, int]:
    """docs/algorithms.md's ERK, independently: raw_l = sum(dims) / prod(dims); eps from the overall density;
    layers whose eps * raw_l exceeds 1 turn dense; ones = int(density_l * numel)."""
    n = {k: math.prod(s) for k, s in shapes.items()}
    if d == 1:
        return n
    raw = {k: sum(s) / n[k] for k, s in shapes.items()}
    dense: set[str] = set()
    while True:
        sparse = [k for k in shapes if k not in dense]
        eps = (d * sum(n[k] for k in sparse) - (1 - d) * sum(n[k] for k in dense)) / sum(raw[k] * n[k] for k in sparse)
        top = max(raw[k] for k in sparse)
        if top * eps <= 1:
            return {k: n[k] if k in dense else int(eps * raw[k] * n[k]) for k in shapes}
        dense |= {k for k in sparse if raw[k] == top}


def _honest(dev: Dev) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The sparse initial model and travelling masks an honest device of ``dev``'s slot and density draws."""
    cfg = FederationConfig.from_dict(dict(dev.e["config"]))
    return dispfl_initial(cfg, load_local_data(cfg, dev.index), dev.index, dev.e["density"], dev.fm.init_state())


def _refused(c: TestClient, dev: Dev, payload: bytes) -> str:
    """The update of round 0 naming ``payload`` is refused with 422 and changes nothing; its detail."""
    digest = dev.put(payload)
    engine = c.app.state.pfl.engine  # type: ignore[attr-defined]
    before = snapshot(engine)
    r = dev.update(0, digest)
    assert r.status_code == 422, r.text
    assert snapshot(engine) == before
    return str(r.json()["detail"])


def _ones(detail: str) -> tuple[str, int, int]:
    """(tensor, its ones, ERK's most) as the refusal states them."""
    m = re.search(r"tensor '([^']+)' has (\d+) ones in its mask .*? allows (?:at least 1 and )?at most (\d+)", detail)
    assert m, detail
    return m.group(1), int(m.group(2)), int(m.group(3))


def _sparse_keys(counts: dict[str, int], shapes: dict[str, tuple[int, ...]]) -> list[str]:
    return [k for k, c in counts.items() if c < math.prod(shapes[k])]


def test_masks_are_held_to_erk_at_the_devices_density(client: TestClient) -> None:
    create(client, ADMIN, "d", DISPFL)  # densities [0.3, 0.6, 1.0] by slot
    dev = Dev(client, "d", index=0)
    assert dev.e["density"] == 0.3
    fm = dev.fm
    shapes = {k: tuple(v.shape) for k, v in fm.model.named_parameters()}
    counts = _erk_counts(shapes, 0.3)
    assert mask_bound(fm, 0.3) == counts and mask_bound(fm, 0.3) is mask_bound(fm, 0.3)  # computed once, kept
    w, masks = _honest(dev)
    assert {k: int(m.sum()) for k, m in masks.items()} == {k: counts[k] for k in _sparse_keys(counts, shapes)}
    big = max(_sparse_keys(counts, shapes), key=lambda k: counts[k])

    # dense: every sparse tensor counts as all ones; the first one in the payload's order is named
    detail = _refused(client, dev, encode(fm.init_state(), model_id=fm.model_id, round=0))
    name, ones, most = _ones(detail)
    assert name in masks and (ones, most) == (math.prod(shapes[name]), counts[name]), detail
    assert "sent dense" in detail and "density 0.3" in detail

    # one tensor with one one too many
    over = dict(masks)
    flat = masks[big].reshape(-1).clone()
    flat[int(torch.nonzero(~flat)[0])] = True
    over[big] = flat.view_as(masks[big])
    detail = _refused(client, dev, encode(w, model_id=fm.model_id, round=0, masks=over))
    assert _ones(detail) == (big, counts[big] + 1, counts[big]), detail

    # a tensor whose mask is emptied where ERK keeps weights
    empty = {**masks, big: torch.zeros_like(masks[big])}
    detail = _refused(client, dev, encode({**w, big: torch.zeros_like(w[big])}, model_id=fm.model_id, round=0,
                                          masks=empty))
    assert _ones(detail) == (big, 0, counts[big]) and "at least 1" in detail, detail

    # exactly ERK's counts: accepted
    r = dev.update(0, dev.put(encode(w, model_id=fm.model_id, round=0, masks=masks)))
    assert r.status_code == 200 and r.json()["accepted"], r.text


def test_fewer_ones_than_erk_are_accepted_and_a_dense_device_sends_dense(client: TestClient) -> None:
    create(client, ADMIN, "d", DISPFL)
    sparse, dense = Dev(client, "d", index=3), Dev(client, "d", index=2)
    assert (sparse.e["density"], dense.e["density"]) == (0.3, 1.0)
    w, masks = _honest(sparse)
    fewer = {}
    for k, m in masks.items():  # one one less in every sparse tensor that has more than one
        flat = m.reshape(-1).clone()
        if int(flat.sum()) > 1:
            flat[int(torch.nonzero(flat)[0])] = False
        fewer[k] = flat.view_as(m)
    r = sparse.update(0, sparse.put(encode(w, model_id=sparse.fm.model_id, round=0, masks=fewer)))
    assert r.status_code == 200 and r.json()["accepted"], r.text
    assert mask_bound(dense.fm, 1.0) == {k: math.prod(s) for k, s in _shapes(dense).items()}
    r = dense.update(0, dense.put(encode(dense.fm.init_state(), model_id=dense.fm.model_id, round=0)))
    assert r.status_code == 200 and r.json()["accepted"], r.text


def _shapes(dev: Dev) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in dev.fm.model.named_parameters()}


def test_profile_capacity_takes_the_density_from_the_profile(client: TestClient) -> None:
    config: dict[str, Any] = {**DISPFL, "densities": [1.0]}  # the config alone would let every device send dense
    create(client, ADMIN, "p", config, profile_capacity=True)
    dev = Dev(client, "p", profile="phone-low")
    assert dev.e["density"] == 0.2
    counts = _erk_counts(_shapes(dev), 0.2)
    w, masks = _honest(dev)
    at_mid = _erk_counts(_shapes(dev), 0.6)  # what a phone-mid device may send: too many for phone-low
    over = {}
    for k, m in masks.items():
        flat = torch.zeros(m.numel(), dtype=torch.bool)
        flat[:at_mid[k]] = True
        over[k] = flat.view_as(m)
    detail = _refused(client, dev, encode(w, model_id=dev.fm.model_id, round=0, masks=over))
    name, ones, most = _ones(detail)
    assert (ones, most) == (at_mid[name], counts[name]) and "density 0.2" in detail, detail
    r = dev.update(0, dev.put(encode(w, model_id=dev.fm.model_id, round=0, masks=masks)))
    assert r.status_code == 200 and r.json()["accepted"], r.text


def test_a_model_far_off_the_rounds_others_is_refused_and_counted(client: TestClient) -> None:
    """The server's side of the neighbour screen (``DisPFL.upload_norm_bound``): once it holds 3 uploads of the
    round, a model whose norm is past ``neighbour_bound`` (10) times their median (low) is refused, so no honest
    neighbour is served it; honest models (norms within the square root of their densities' ratio) pass. Each
    refusal counts for its device, in the devices' listing and in /metrics (the federation's total and the
    device's own series; a device with none adds no series), as do the neighbours a device reports leaving out."""
    from test_prometheus import get, parse

    # a sixth slot nobody enrols: with the refused device counted out, enrolment still waits for it, so the worker
    # cannot open round 1 between _refused's two snapshots (with 5 slots it did, once, on a loaded machine)
    create(client, ADMIN, "n", {**DISPFL, "clients": 6})
    devs = [Dev(client, "n", index=i) for i in range(5)]
    models = [_honest(d) for d in devs]
    norms = [math.sqrt(sum(float(v.double().square().sum()) for v in w.values())) for w, _ in models]
    big = {k: v * 1000 for k, v in models[0][0].items()}
    # the first upload has no others to be judged against: the devices' screens alone bound it
    r = devs[0].update(0, devs[0].put(encode(big, model_id=devs[0].fm.model_id, round=0, masks=models[0][1])))
    assert r.status_code == 200, r.text
    for d, (w, m) in zip(devs[1:4], models[1:4], strict=True):
        r = d.update(0, d.put(encode(w, model_id=d.fm.model_id, round=0, masks=m)))
        assert r.status_code == 200, r.text
    bound = 10 * sorted([1000 * norms[0], *norms[1:4]])[1]  # median_low of the 4 others dev 4 is judged against
    attacker = devs[4]
    w, m = models[4]
    scale = 1.02 * bound / norms[4]  # just past the bound; the same model at 0.98 of it passes
    detail = _refused(client, attacker, encode({k: v * scale for k, v in w.items()}, model_id=attacker.fm.model_id,
                                               round=0, masks=m))
    assert "norm" in detail and f"{bound:.4g}" in detail, detail
    listed = {d["index"]: d for d in client.get("/v1/federations/n/devices", headers=bearer(ADMIN)).json()}
    assert [listed[i]["refused"] for i in range(5)] == [0, 0, 0, 0, 1]
    s, _ = parse(client.get("/metrics", headers=bearer(ADMIN)).text)
    assert get(s, "pfl_updates_refused_total", federation="n") == 1
    assert get(s, "pfl_device_updates_refused_total", federation="n", device=attacker.id) == 1
    assert not [k for k in s if k[0] == "pfl_device_updates_refused_total" and ("device", devs[0].id) in k[1]]
    r = attacker.update(0, attacker.put(encode({k: v * (0.98 * bound / norms[4]) for k, v in w.items()},
                                               model_id=attacker.fm.model_id, round=0, masks=m)))
    assert r.status_code == 200, r.text
    # the neighbours a device reports leaving out (its screen), summed over its reports, listed and exposed
    for d, n in ((devs[1], 2), (devs[2], 0)):
        m0 = {"accuracy": 0.5, "loss": 1.0, "n_test": 10, "dropped": n}
        assert client.post("/v1/rounds/0/metrics", json=m0, headers=d.h).status_code == 200
    listed = {d["index"]: d for d in client.get("/v1/federations/n/devices", headers=bearer(ADMIN)).json()}
    assert [listed[i]["dropped"] for i in range(5)] == [0, 2, 0, 0, 0]
    s, _ = parse(client.get("/metrics", headers=bearer(ADMIN)).text)
    assert get(s, "pfl_neighbours_dropped_total", federation="n") == 2
    assert get(s, "pfl_device_neighbours_dropped_total", federation="n", device=devs[1].id) == 2
    assert not [k for k in s if k[0] == "pfl_device_neighbours_dropped_total" and ("device", devs[2].id) in k[1]]


def test_a_device_whose_initial_model_is_refused_does_not_hold_round_1_back(client: TestClient) -> None:
    """Round 1 waits for every slot's initial model (no ``min_devices``); a device whose initial model the server
    refused (here: 1000x the others' norm) no longer counts among those it waits for, so one hostile device cannot
    stall the federation in enrolment for ever (before: it stayed in round 0). Its model accepted later, it takes
    part from then on."""
    from server_testkit import fed_state, wait_for

    create(client, ADMIN, "r", {**DISPFL, "clients": 5})
    devs = [Dev(client, "r", index=i) for i in range(5)]
    for d in devs[:4]:
        w, m = _honest(d)
        assert d.update(0, d.put(encode(w, model_id=d.fm.model_id, round=0, masks=m))).status_code == 200
    assert fed_state(client, ADMIN, "r") == (0, "open")
    w, m = _honest(devs[4])
    _refused(client, devs[4], encode({k: v * 1000 for k, v in w.items()}, model_id=devs[4].fm.model_id, round=0,
                                     masks=m))
    wait_for(lambda: fed_state(client, ADMIN, "r") == (1, "collecting"), what="round 1 without the refused device")
    assert client.get("/v1/rounds/current/task", headers=devs[4].h).status_code == 404  # not in round 1
