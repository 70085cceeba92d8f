"""A private federation's draw is the server's secret (issue 48 item 3, docs/privacy.md): the server draws each
round under a sampling key it makes at creation and keeps in its database; the simulator given that key draws the
same slots; two servers given the same config draw differently (the config does not decide the draw); nothing a
device is sent holds the key or another slot's draw; and in the distributed mode the federation's metrics report
the epsilon its rounds achieved from their realised counts."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from server_testkit import FEDPER, Dev, Mqtt, bearer, create, fed_state, wait_for
from sqlalchemy.orm import Session

from pfl_edge.codec import encode
from pfl_edge.federation import FederationConfig
from pfl_edge.privacy import ORDERS, epsilon, privatize
from pfl_edge.protocol import round_topic, task_topic
from pfl_edge.sim import simulate
from server.db import Federation
from server.fedmodel import fed_model
from server.launch import BackgroundServer, start_background
from server.settings import Settings

ADMIN = "admin-token-for-secret-draw-tests"
PRIVACY: dict[str, Any] = {"clip": 0.5, "noise_multiplier": 0.6, "delta": 1e-3}
DRAWN: dict[str, Any] = {**FEDPER, "clients": 6, "rounds": 3, "participation": 0.5, "privacy": PRIVACY}


def _server(tmp: Path, broker_url: str, export: str = "none") -> BackgroundServer:
    """A server in this process on its own SQLite file, exporting at creation only what ``export`` says (the
    tests here need the ONNX inference program at most: the card's)."""
    return start_background(Settings(data_dir=tmp / "data", database_url=f"sqlite:///{tmp / 'state.db'}",
                                     broker_url=broker_url, admin_token=ADMIN, tick_s=0.05,  # type: ignore[arg-type]
                                     export_on_create=export))  # type: ignore[arg-type]


def _hmac_draw(key: bytes, t: int, n: int, q: float) -> set[int]:
    """docs/privacy.md's rule, written out here: slot i when HMAC-SHA256(key, "pfl-participants" || t || i)'s first
    8 bytes, big-endian, are below q 2^64."""
    def below(i: int) -> bool:
        mac = hmac.new(key, b"pfl-participants" + t.to_bytes(8, "big") + i.to_bytes(8, "big"), hashlib.sha256)
        return Fraction(int.from_bytes(mac.digest()[:8], "big"), 2**64) < Fraction(q)
    return {i for i in range(n) if below(i)}


def _row(srv: BackgroundServer, fed: str) -> Federation:
    assert srv.app_state is not None
    with Session(srv.app_state.engine) as s:
        row = s.get(Federation, fed)
        assert row is not None
        return row


def _past(c: httpx.Client, fed: str, t: int) -> bool:
    got, state = fed_state(c, ADMIN, fed)
    return got > t or state == "finished"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, broker_url: str) -> Iterator[dict[str, Any]]:
    """Federation ``sd`` (6 slots, q 0.5, central noise) run through its 3 rounds by 6 devices: in each round, every
    device asks for its task, the drawn ones send their update and an undrawn one tries to. Kept: each round's
    drawn slots as the tasks showed them, the admin's metrics, the server's row, and everything each device was
    sent (HTTP answers, its task topic, the round topic, the model card)."""
    srv = _server(tmp_path_factory.mktemp("secret-draw"), broker_url, export="inference")
    c = httpx.Client(base_url=srv.url, timeout=60)
    info = create(c, ADMIN, "sd", DRAWN)
    rounds_mq = Mqtt(srv.broker_url, [round_topic("sd")], client_id="watcher-sd")
    devs = [Dev(c, "sd") for _ in range(6)]
    seen: dict[str, list[str]] = {d.id: [json.dumps(d.e)] for d in devs}
    tasks_mq = {d.id: Mqtt(srv.broker_url, [task_topic("sd", d.id)], client_id=f"tasks-{d.id}") for d in devs}
    cfg = FederationConfig.from_dict(dict(info["config"]))
    drawn: dict[int, set[int]] = {}
    for t in (1, 2, 3):
        wait_for(lambda t=t: _past(c, "sd", t - 1) and (_past(c, "sd", t) or fed_state(c, ADMIN, "sd") == (
            t, "collecting")), timeout=120, what=f"round {t}")
        tasks = {d.id: c.get("/v1/rounds/current/task", headers=d.h) for d in devs}
        for d in devs:
            seen[d.id] += [tasks[d.id].text, c.get("/v1/federations/sd", headers=d.h).text]
        mine = [d for d in devs if tasks[d.id].status_code == 200 and tasks[d.id].json()["round"] == t]
        drawn[t] = {d.index for d in mine}  # a round that drew nobody closed at once: no task of it
        assert all(tasks[d.id].status_code == 404 or tasks[d.id].json()["round"] > t for d in devs if d not in mine)
        out = [d for d in devs if d not in mine]
        for d in mine:
            start = d.get(tasks[d.id].json()["base"]).tensors
            payload = encode(privatize(cfg, start, start), model_id=d.fm.model_id, round=t)
            if out and d is mine[-1]:  # an undrawn device tries the same round, before the round can close
                refused = out[0].update(t, out[0].put(payload))
                assert refused.status_code == 409, refused.text
                seen[out[0].id].append(refused.text)
            r = d.update(t, d.put(payload))
            assert r.status_code == 200, r.text
            seen[d.id].append(r.text)
    wait_for(lambda: fed_state(c, ADMIN, "sd")[1] == "finished", timeout=120, what="the federation's end")
    got: dict[str, httpx.Response] = {}

    def card() -> bool:  # its ONNX program is exported in the background: 503 until then
        got["card"] = c.get("/v1/federations/sd/model", params={"training_backend": "torch"}, headers=devs[0].h)
        return got["card"].status_code != 503
    wait_for(card, timeout=300, what="the model card")
    assert got["card"].status_code == 200, got["card"].text
    seen[devs[0].id].append(got["card"].text)
    for d in devs:
        seen[d.id] += [p.decode() for _, p, _ in tasks_mq[d.id].all] + [p.decode() for _, p, _ in rounds_mq.all]
        tasks_mq[d.id].close()
    rounds_mq.close()
    summary = c.get("/v1/federations/sd/metrics", headers=bearer(ADMIN)).json()
    yield {"cfg": cfg, "devs": devs, "drawn": drawn, "seen": seen, "summary": summary, "row": _row(srv, "sd")}
    c.close()
    srv.stop()


def test_the_simulator_given_the_servers_key_draws_the_servers_rounds(run: dict[str, Any]) -> None:
    """The rounds the devices were given tasks in are the HMAC rule's under the server's sampling key (recomputed
    here), the server counted them so, and the simulator given that key draws exactly them; the reported epsilon
    (central noise, hidden draw) is the accountant's."""
    row: Federation = run["row"]
    assert row.sampling_key is not None and row.noise_key is not None and row.sampling_key != row.noise_key
    key, cfg = bytes.fromhex(row.sampling_key), run["cfg"]
    assert len(key) == 32
    rows = {r["round"]: r for r in run["summary"]["rounds"]}
    for t, slots in run["drawn"].items():
        assert slots == _hmac_draw(key, t, 6, 0.5), t
        assert rows[t]["active"] == len(slots) and rows[t]["updates"] == len(slots)
        assert rows[t]["epsilon"] == pytest.approx(epsilon(cfg, t))
    sim = simulate(cfg, progress=False, sampling_key=key)
    assert [set(r["participants"]) for r in sim["rounds"]] == [run["drawn"][t] for t in (1, 2, 3)]


def test_no_device_facing_answer_holds_the_key_or_another_slots_draw(run: dict[str, Any]) -> None:
    """Enrolment (its config), tasks over HTTP and MQTT, round announcements, the federation's state, update answers,
    the refusal of an undrawn device's update and the model card: none holds the sampling key or the noise key (in
    any case), none names another device, and the refusal names only the round and the device's own slot."""
    row: Federation = run["row"]
    secrets = [k for k in (row.sampling_key, row.noise_key) if k]
    devs: list[Dev] = run["devs"]
    ids = {d.id for d in devs}
    refusals = 0
    for d in devs:
        texts = run["seen"][d.id]
        assert len(texts) > 8, d.id
        for text in texts:
            low = text.lower()
            assert not any(k.lower() in low for k in secrets), text[:200]
            assert not any(other in text for other in ids - {d.id}), text[:200]
            if "did not draw" in text:
                refusals += 1
                said = {int(n) for n in re.findall(r"\d+", json.loads(text)["detail"])}
                assert said <= {1, 2, 3, d.index}, text
        assert "sampling" not in json.dumps(d.e["config"])
    assert refusals >= 1  # an undrawn device was refused at least once (q 0.5, 6 slots, 3 rounds)


def test_two_servers_draw_one_config_differently(tmp_path: Path, broker_url: str) -> None:
    """The same config on two servers: each makes its own sampling key, and their draws differ (the config, seed
    and all, does not decide who takes part), and neither is the seed's public draw. The draw is the server's own
    (``participation(t, key)``, which its planner, update checks and metrics ask: the test above holds the tasks
    to it)."""
    config = {**DRAWN, "clients": 16, "rounds": 20}
    draws, configs = [], []
    for name in ("a", "b"):
        srv = _server(tmp_path / name, broker_url)
        try:
            c = httpx.Client(base_url=srv.url, timeout=60)
            configs.append(create(c, ADMIN, "same", config)["config"])
            row = _row(srv, "same")
            c.close()
        finally:
            srv.stop()
        algo = fed_model(row.config).algorithm()
        draws.append([algo.participation(t, row.draw_key).slots for t in range(1, 21)])
    assert configs[0] == configs[1]
    public = [fed_model(configs[0]).algorithm().participation(t).slots for t in range(1, 21)]
    assert draws[0] != draws[1] and public not in draws
    assert sum(a == b for a, b in zip(*draws, strict=True)) < 5  # each round's two draws agree with chance 2^-16


def _gaussian_epsilon(z: float, rounds: int, delta: float) -> float:
    """``rounds`` Gaussian mechanisms of multiplier ``z`` (every client in every round: no subsampling): RDP
    rounds a / (2 z^2) at order a exactly, converted as Balle et al. 2020 do (the accountant's conversion),
    minimised over the accountant's orders."""
    return min(rounds * a / (2 * z * z) - (math.log(delta) + math.log(a)) / (a - 1) + math.log((a - 1) / a)
               for a in ORDERS)


def test_distributed_metrics_report_the_epsilon_the_rounds_achieved(tmp_path: Path, broker_url: str) -> None:
    """Distributed noise, 4 devices, every one in every round (q 1, q N = 4), a quorum of half: each round closes on
    2 noised updates, so each released sum holds 2 shares, and what hides one participant is the other's:
    z_r = z sqrt(1 / 4) = 0.75 for z 1.5. The metrics report, after round t, t Gaussian mechanisms at 0.75,
    computed here; above the nominal epsilon at z 1.5."""
    privacy = {"clip": 0.5, "noise_multiplier": 1.5, "delta": 1e-3, "mode": "distributed", "allow_unmasked": True}
    srv = _server(tmp_path, broker_url)
    c = httpx.Client(base_url=srv.url, timeout=60)
    try:
        info = create(c, ADMIN, "dd", {**FEDPER, "clients": 4, "rounds": 2, "privacy": privacy}, quorum=0.5)
        cfg = FederationConfig.from_dict(dict(info["config"]))
        devs = [Dev(c, "dd") for _ in range(4)]
        for t in (1, 2):
            wait_for(lambda t=t: fed_state(c, ADMIN, "dd") == (t, "collecting"), timeout=120, what=f"round {t}")
            for i, d in enumerate(devs[:2]):
                task = c.get("/v1/rounds/current/task", headers=d.h).json()
                start = d.get(task["base"]).tensors
                sent = privatize(cfg, start, start, np.random.default_rng([t, i]))
                d.send(t, sent)
            wait_for(lambda t=t: _past(c, "dd", t), timeout=120, what=f"round {t}'s close")
        rows = {r["round"]: r for r in c.get("/v1/federations/dd/metrics", headers=bearer(ADMIN)).json()["rounds"]}
    finally:
        c.close()
        srv.stop()
    for t in (1, 2):
        assert rows[t]["updates"] == 2
        assert rows[t]["epsilon"] == pytest.approx(_gaussian_epsilon(0.75, t, 1e-3), rel=1e-9), t
        assert rows[t]["epsilon"] > epsilon(cfg, t)


def test_a_secure_rounds_count_is_the_inputs_of_the_groups_it_released() -> None:
    """Under secure aggregation the achieved epsilon counts the inputs of the groups whose unmasked sums the
    algorithm's ``apply_sum`` kept: a group whose sum fails ``check_sum`` is left out of the base, and its noise
    shares with it."""
    from server.services.rounds import _released_inputs

    privacy = {"clip": 0.5, "noise_multiplier": 1.0, "delta": 1e-3, "mode": "distributed"}
    cfg = FederationConfig.from_dict({**FEDPER, "clients": 12, "privacy": privacy,
                                      "secure_aggregation": {"bits": 16}})
    top = 2**16 - 1
    honest = [(np.full(10, 3 * top, np.uint32), 3), (np.zeros(10, np.uint32), 5)]
    forged = (np.full(10, 2**32 - 1, np.uint32), 4)  # no 4 inputs of 16 bits sum to this
    assert _released_inputs(cfg, honest) == 8
    assert _released_inputs(cfg, [honest[0], forged, honest[1]]) == 8
    assert _released_inputs(cfg, [forged]) == 0
