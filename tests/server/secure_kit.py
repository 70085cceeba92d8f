"""What the secure-round tests share: reading a round's step over HTTP, a secure federation enrolled at round 1,
and the JSON of the library's messages."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import torch
from server_testkit import Dev, Mqtt, create, wait_for

from pfl_edge.federation import FederationConfig
from pfl_edge.protocol import task_topic
from pfl_edge.secagg import Advert, dequantize_sum
from pfl_edge.secagg.aggregate import float_keys

__all__ = ["adverts", "at_step", "dealt_json", "enrolled", "expected_base", "honest_round", "inbox", "state"]


def state(c: httpx.Client, d: Dev, t: int) -> dict[str, Any]:
    r = c.get(f"/v1/rounds/{t}/secagg", headers=d.h)
    assert r.status_code == 200, r.text
    return dict(r.json())


def at_step(c: httpx.Client, d: Dev, t: int, step: str) -> dict[str, Any]:
    got: dict[str, Any] = {}

    def reached() -> bool:
        got.update(state(c, d, t))
        return bool(got["step"] == step)

    wait_for(reached, timeout=30, what=f"step {step}")
    return got


def adverts(at: dict[str, Any]) -> dict[int, Advert]:
    """A share step's neighbours as the library's adverts."""
    return {n["index"]: Advert(n["index"], bytes.fromhex(n["c_public"]), bytes.fromhex(n["s_public"]))
            for n in at["neighbours"]}


def dealt_json(dealt: dict[int, tuple[bytes, bytes]]) -> dict[str, Any]:
    """``Client.share_keys``'s pairs and commitments as the shares message."""
    return {"shares": [{"index": j, "box": b.hex(), "commits": h.hex()} for j, (b, h) in dealt.items()]}


def inbox(at: dict[str, Any]) -> dict[int, tuple[bytes, bytes]]:
    """An input step's inbox as ``Client.masked_input`` takes it."""
    return {x["index"]: (bytes.fromhex(x["box"]), bytes.fromhex(x["commits"])) for x in at["inbox"]}


def enrolled(srv: Any, admin: str, fed: str, config: dict[str, Any], seed: int) -> tuple[Any, ...]:
    """A secure federation ``fed`` with every slot enrolled, at round 1: its client, config, devices, an MQTT
    reader of device 0's tasks, round 1's task, its base, the base's float tensors, and each device's trained
    model (the base plus small noise, from ``seed``)."""
    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, admin, fed, config)
    cfg = FederationConfig.from_dict(dict(config))
    devs = [Dev(c, fed, index=i) for i in range(cfg.clients)]
    mq = Mqtt(srv.broker_url, [task_topic(fed, devs[0].id)])
    task = mq.wait(task_topic(fed, devs[0].id), lambda x: x["round"] == 1)
    start = devs[0].get(task["base"]).tensors
    keys = float_keys(start)
    g = torch.Generator().manual_seed(seed)
    sent = [{k: v + 0.05 * torch.randn(v.shape, generator=g) if k in keys else v for k, v in start.items()}
            for _ in devs]
    return c, cfg, devs, mq, task, start, keys, sent


def expected_base(start: dict[str, torch.Tensor], keys: list[str], xs: list[np.ndarray], who: list[int],
                  bound: float, bits: int) -> dict[str, torch.Tensor]:
    """The round's start plus the dequantized mean of the inputs of ``who``, computed from the plain inputs."""
    total = np.sum([xs[i].astype(np.uint64) for i in who], axis=0).astype(np.uint32)
    mean = dequantize_sum(total, len(who), bound, bits) / len(who)
    out, at = dict(start), 0
    for k in keys:
        n = start[k].numel()
        v = torch.from_numpy(start[k].double().numpy().ravel() + mean[at:at + n]).reshape(start[k].shape)
        out[k] = v.to(start[k].dtype)
        at += n
    return out


def honest_round(srv: Any, c: httpx.Client, devs: list[Dev], fed: str, xs: list[np.ndarray], size: int) -> None:
    """Round 1's four steps over HTTP for every device of ``devs``, each an honest ``Client`` with input ``xs``
    (every step ends on its own, all having answered; the unmask step's end is hurried by moving the round
    machine's clock); the round then closes."""
    import time

    from pfl_edge.secagg import Client, Params, encode_masked, round_id

    clients = {d.index: Client(d.index, Params(2, 2, 1)) for d in devs}
    for d in devs:
        cl = clients[d.index]
        r = c.post("/v1/rounds/1/secagg/keys", headers=d.h, json={"c_public": cl.c.public.hex(),
                                                                   "s_public": cl.s.public.hex()})
        assert r.status_code == 200, r.text
    for d in devs:
        at = at_step(c, d, 1, "share")
        cl = clients[d.index]
        cl.params = Params(at["params"]["degree"], at["params"]["threshold"], size, round_id(fed, 1))
        assert c.post("/v1/rounds/1/secagg/shares", headers=d.h,
                      json=dealt_json(cl.share_keys(adverts(at)))).status_code == 200
    for d in devs:
        y = clients[d.index].masked_input(xs[d.index], inbox(at_step(c, d, 1, "input")))
        assert d.update(1, d.put(encode_masked(y, 1))).status_code == 200
    coord = srv.app_state.coordinator
    coord.worker.kick()  # every input came: the input step ends on its own (a moved clock could expire the next)
    for d in devs:
        ask = at_step(c, d, 1, "unmask")
        shares = clients[d.index].unmask(frozenset(ask["survivors"]), frozenset(ask["dropped"]))
        assert c.post("/v1/rounds/1/secagg/unmask", headers=d.h, json={"shares": [
            {"about": j, "kind": k, "share": s.hex()} for j, (k, s) in shares.items()]}).status_code == 200
    coord.rounds.clock = lambda: time.time() + 2 * 10**6
    coord.worker.kick()
