"""One hostile device in a secure round, against a real server over HTTP (issue 48; docs/secagg.md, "What one
device can do"): whatever message of the round it forges, the published base moves by no more than the
documented per-device bound, the next round opens, and where the message could only have been forged by it, it
is named (its refused count, the log) and the round goes on without it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from secure_kit import adverts, at_step, dealt_json, enrolled, expected_base, inbox
from server_testkit import FEDPER, background_server, bearer

from pfl_edge.protocol import task_topic
from pfl_edge.secagg import Client, Params, encode_masked, round_id
from pfl_edge.secagg.aggregate import secure_input
from server.launch import BackgroundServer

ADMIN = "admin-token-for-hostile-secure-tests"
HOSTILE: dict[str, Any] = {**FEDPER, "clients": 5, "rounds": 2,
                           "secure_aggregation": {"bound": 0.5, "bits": 16, "degree": 4, "threshold": 3}}
# what each attack by slot 0 leads to: the slots whose inputs the published base is the mean of (None: nothing
# published), and whether slot 0 is named
ATTACKS: dict[str, tuple[list[int] | None, bool]] = {
    "input-out-of-range": (None, False),  # indistinguishable from an honest input until summed: not attributable
    "forged-unmask-share": ([0, 1, 2, 3, 4], True),  # the forged share discarded; its input stays (seed known)
    "forged-share-of-a-dropout": ([0, 1, 2, 3], True),
    "sealed-pair-of-random-bytes": ([1, 2, 3, 4], True),  # out of the round on its neighbour's complaint
    "false-complaint": ([1, 2, 3, 4], True),  # out of the round on its own complaint
}


@pytest.fixture
def srv(tmp_path: Path, broker_url: str) -> Iterator[BackgroundServer]:
    s = background_server(tmp_path, broker_url, ADMIN)
    yield s
    s.stop()


def _flip(share_hex: str) -> str:
    raw = bytearray(bytes.fromhex(share_hex))
    raw[-1] ^= 0x5A  # the share's value, not its index: interpolation would take it as it comes
    return bytes(raw).hex()


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_one_hostile_device_cannot_move_the_base_or_stall_the_federation(srv: BackgroundServer, attack: str) -> None:
    """Before (319f720): an out-of-range input and a forged unmask share published a base moved by thousands per
    coordinate; a forged share of a dropout's key left round 1 in ``closing`` for good; a pair of random bytes
    made every honest neighbour leave the round, nothing released, nobody named."""
    c, cfg, devs, mq, task, start, keys, sent = enrolled(srv, ADMIN, "hx", HOSTILE, 2)
    xs = [secure_input(cfg, start, s) for s in sent]
    clients = {d.index: Client(d.index, Params(4, 3, 1)) for d in devs}
    for d in devs:
        cl = clients[d.index]
        assert c.post("/v1/rounds/1/secagg/keys", headers=d.h, json={
            "c_public": cl.c.public.hex(), "s_public": cl.s.public.hex()}).status_code == 200
    at = {d.index: at_step(c, d, 1, "share") for d in devs}
    size = sum(start[k].numel() for k in keys)
    victim = min(n["index"] for n in at[0]["neighbours"])
    for d in devs:
        cl = clients[d.index]
        cl.params = Params(4, 3, size, round_id("hx", 1))
        dealt = cl.share_keys(adverts(at[d.index]))
        if d.index == 0 and attack == "sealed-pair-of-random-bytes":
            box, commits = dealt[victim]
            dealt[victim] = (np.random.default_rng(0).bytes(len(box)), commits)
        assert c.post("/v1/rounds/1/secagg/shares", headers=d.h, json=dealt_json(dealt)).status_code == 200
    dropped = {4} if attack == "forged-share-of-a-dropout" else set()
    for i in (i for i in range(5) if i not in dropped):
        cl = clients[i]
        y = cl.masked_input(xs[i], inbox(at_step(c, devs[i], 1, "input")))
        if i == 0 and attack == "input-out-of-range":
            y = (y.astype(np.uint64) + (1 << 31)).astype(np.uint32)  # wraps mod 2^32 as the sum does
        if i == 0 and attack == "false-complaint":
            r = c.post("/v1/rounds/1/secagg/complaint", headers=devs[0].h,
                       json={"c_secret": cl.c.secret.hex(), "accused": [victim]})
            assert r.status_code == 422 and "false complaint" in r.text, r.text
        if cl.accused:  # the victim of the random pair: it complains, the server names the dealer, it stays
            assert cl.accused == {0}
            secret, accused = cl.complaint()
            r = c.post("/v1/rounds/1/secagg/complaint", headers=devs[i].h,
                       json={"c_secret": secret.hex(), "accused": accused})
            assert r.status_code == 200, r.text
        r = devs[i].update(1, devs[i].put(encode_masked(y, 1)))
        assert r.status_code == (409 if i == 0 and attack == "false-complaint" else 200), r.text
    coord = srv.app_state.coordinator  # type: ignore[union-attr]
    if dropped:  # the input step waits for the dropout until its deadline: move the clock past it
        coord.rounds.clock = lambda: time.time() + 10**6
    # else every input came and the step ends on its own (moving the clock then could expire the unmask step
    # the worker had just opened under the old clock, before any device answered it)
    coord.worker.kick()
    ask = at_step(c, devs[1], 1, "unmask")
    survivors, gone = frozenset(ask["survivors"]), frozenset(ask["dropped"])
    for i in sorted(survivors):  # slot 0 first: its shares would be among the first the server interpolates
        body = [{"about": j, "kind": k, "share": s.hex()}
                for j, (k, s) in clients[i].unmask(survivors, gone).items()]
        forging = i == 0 and attack in ("forged-unmask-share", "forged-share-of-a-dropout")
        if forging:
            want = "s" if dropped else "b"
            forged = next(x for x in body if x["kind"] == want)
            forged["share"] = _flip(forged["share"])
        r = c.post("/v1/rounds/1/secagg/unmask", headers=devs[i].h, json={"shares": body})
        assert r.status_code == (422 if forging else 200), r.text
    coord.rounds.clock = lambda: time.time() + 2 * 10**6
    coord.worker.kick()
    nxt = mq.wait(task_topic("hx", devs[0].id), lambda x: x["round"] == 2, timeout=60)  # round 2 opened
    who, named = ATTACKS[attack]
    got = devs[0].get(nxt["base"]).tensors
    if who is None:
        assert nxt["base"] == task["base"]  # nothing was published: the base is round 1's start, unmoved
        assert all(torch.equal(got[k], start[k]) for k in start)
    else:
        assert sorted(survivors) == who
        base = expected_base(start, keys, xs, who, 0.5, 16)
        assert all(torch.equal(got[k], base[k]) for k in keys)
    listing = {d["index"]: d for d in httpx.get(f"{srv.url}/v1/federations/hx/devices",
                                                headers=bearer(ADMIN)).json()}
    assert listing[0]["refused"] == (1 if named else 0)
    assert all(listing[i]["refused"] == 0 for i in range(1, 5))  # nobody honest is named
    mq.close()


GROUPED: dict[str, Any] = {**FEDPER, "clients": 9, "rounds": 2,
                           "secure_aggregation": {"bound": 0.5, "bits": 16, "min_group": 3}}


@pytest.mark.parametrize("hostile", [False, True])
def test_in_groups_one_hostile_device_spoils_only_its_own_group(srv: BackgroundServer, hostile: bool) -> None:
    """Grouped secure aggregation (``min_group`` 3: three groups of three, by the round's seed), each group's sum
    unmasked alone: honest, the published base is the simulator's (``secure_mean`` over the same slots: the
    median of the three groups' means, not the plain mean); with slot 0's input out of range, its group's sum
    fails its check and is left out, and the base moves by the median of the other two groups' means (their
    mean, at equal sizes; before groups: nothing was published)."""
    from pfl_edge.secagg import groups
    from pfl_edge.secagg.aggregate import group_seed, secure_mean

    c, cfg, devs, mq, _task, start, keys, sent = enrolled(srv, ADMIN, "gx", GROUPED, 3)
    xs = [secure_input(cfg, start, s) for s in sent]
    parts = groups(list(range(9)), 3, group_seed(cfg, 1))
    assert len(parts) == 3
    clients = {d.index: Client(d.index, Params(2, 2, 1)) for d in devs}
    for d in devs:
        cl = clients[d.index]
        assert c.post("/v1/rounds/1/secagg/keys", headers=d.h, json={
            "c_public": cl.c.public.hex(), "s_public": cl.s.public.hex()}).status_code == 200
    size = sum(start[k].numel() for k in keys)
    for d in devs:
        at = at_step(c, d, 1, "share")
        group = next(p for p in parts if d.index in p)
        assert sorted(n["index"] for n in at["neighbours"]) == [j for j in group if j != d.index]
        cl = clients[d.index]
        cl.params = Params(at["params"]["degree"], at["params"]["threshold"], size, round_id("gx", 1))
        assert c.post("/v1/rounds/1/secagg/shares", headers=d.h,
                      json=dealt_json(cl.share_keys(adverts(at)))).status_code == 200
    for d in devs:
        y = clients[d.index].masked_input(xs[d.index], inbox(at_step(c, d, 1, "input")))
        if hostile and d.index == 0:
            y = (y.astype(np.uint64) + (1 << 31)).astype(np.uint32)
        assert d.update(1, d.put(encode_masked(y, 1))).status_code == 200
    coord = srv.app_state.coordinator  # type: ignore[union-attr]
    coord.worker.kick()  # every input came: the input step ends on its own
    for d in devs:
        ask = at_step(c, d, 1, "unmask")
        shares = clients[d.index].unmask(frozenset(ask["survivors"]), frozenset(ask["dropped"]))
        assert c.post("/v1/rounds/1/secagg/unmask", headers=d.h, json={"shares": [
            {"about": j, "kind": k, "share": s.hex()} for j, (k, s) in shares.items()]}).status_code == 200
    coord.rounds.clock = lambda: time.time() + 2 * 10**6
    coord.worker.kick()
    nxt = mq.wait(task_topic("gx", devs[0].id), lambda x: x["round"] == 2, timeout=60)
    got = devs[0].get(nxt["base"]).tensors
    if hostile:
        want = expected_base(start, keys, xs, sorted(i for p in parts if 0 not in p for i in p), 0.5, 16)
    else:
        want = secure_mean(cfg, {k: start[k] for k in keys}, [(s, 1.0) for s in sent], t=1, ids=list(range(9)))
        plain = expected_base(start, keys, xs, list(range(9)), 0.5, 16)
        assert not all(torch.allclose(got[k].double(), plain[k].double(), rtol=0, atol=1e-6) for k in keys)
    assert all(torch.allclose(got[k].double(), want[k].double(), rtol=0, atol=1e-6) for k in keys)
    mq.close()
