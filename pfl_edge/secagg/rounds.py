"""A SecAgg+ round in one process (``run_round``): every client's and the server's steps in order, clients
dropping out where asked, with what each step sends and how long each side computes. The tests and the cost
benchmark (bench/secagg_cost.py) run it; a federation carries the same messages over its HTTP API, and its
server unmasks a round from the messages it stored (``stored_total``)."""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .protocol import Advert, Client, Params, Server

__all__ = ["RoundCost", "run_round", "stored_total"]

STEPS = ("advertise", "share", "input", "unmask")


@dataclass
class RoundCost:
    """What a round cost: bytes each client sent and received (summed over clients, per step), the clients'
    compute (seconds, summed and the most any one spent) and the server's."""

    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEPS, 0))
    received: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEPS, 0))
    client_s: dict[int, float] = field(default_factory=dict)
    server_s: float = 0.0

    def client(self, cid: int, seconds: float) -> None:
        self.client_s[cid] = self.client_s.get(cid, 0.0) + seconds


def run_round(inputs: Mapping[int, np.ndarray], params: Params, seed: int, *,
              drop: Mapping[str, Collection[int]] | None = None) -> tuple[np.ndarray, frozenset[int], RoundCost]:
    """The sum (mod 2^32) of the survivors' inputs as the server unmasks it, the survivors, and the cost.
    ``drop``: step name -> the clients that leave before sending that step's message ("share": after advertising;
    "input": after sharing keys, the case SecAgg+ recovers from; "unmask": after sending their input)."""
    gone: set[int] = set()
    drop = drop or {}
    cost = RoundCost()
    clients = {cid: Client(cid, params) for cid in inputs}
    server = Server(params, seed)

    def timed(cid: int, fn, *args):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = fn(*args)
        cost.client(cid, time.perf_counter() - t0)
        return out

    adverts = [timed(c.cid, c.advertise) for c in clients.values()]
    cost.sent["advertise"] = len(adverts) * (4 + 64)
    t0 = time.perf_counter()
    nbrs = server.advertised(adverts)
    cost.server_s += time.perf_counter() - t0
    gone |= set(drop.get("share", ()))
    for cid, c in clients.items():
        cost.received["advertise"] += len(nbrs[cid]) * (4 + 64)
        if cid not in gone:
            boxes = timed(cid, c.share_keys, nbrs[cid])
            cost.sent["share"] += sum(4 + len(b) + len(h) for b, h in boxes.values())
            server.route(cid, boxes)
    gone |= set(drop.get("input", ()))
    masked = {}
    for cid, c in clients.items():
        if cid not in gone:
            inbox = server.inbox(cid)
            cost.received["share"] += sum(4 + len(b) + len(h) for b, h in inbox.values())
            masked[cid] = timed(cid, c.masked_input, inputs[cid], inbox)
            if c.accused:  # a pair that does not open: the complaint goes before any input
                secret, accused = c.complaint()
                cost.sent["input"] += 32 + 4 * len(accused)
                server.complain(cid, secret, accused)
    for cid, y in masked.items():
        if cid not in server.excluded:
            server.receive(cid, y)
            cost.sent["input"] += 4 * params.size
    survivors, dropped = server.unmask_request()
    gone |= set(drop.get("unmask", ()))
    for cid in survivors - gone:
        cost.received["unmask"] += 4 * (len(survivors) + len(dropped))
        shares = timed(cid, clients[cid].unmask, survivors, dropped)
        cost.sent["unmask"] += sum(4 + 1 + len(s) for _, s in shares.values())
        server.collect(cid, shares)
    t0 = time.perf_counter()
    total = server.total()
    cost.server_s += time.perf_counter() - t0
    return total, survivors, cost


def stored_total(params: Params, seed: int, members: list[int], keys: Mapping[int, Mapping[str, Any]],
                 shares: Mapping[int, Mapping[str, Any]], complaints: Mapping[int, Mapping[str, Any]],
                 inputs: Iterable[tuple[int, np.ndarray]], answers: Mapping[int, Mapping[str, Any]]) -> np.ndarray:
    """The sum of one group's ``inputs`` (slot, masked vector), unmasked by a ``Server`` rebuilt from the group's
    stored messages as the wire carried them (``pfl_edge.secagg.wire``'s JSON, by slot: ``keys``, ``shares``,
    ``complaints``, ``answers`` of the unmask step), in the steps' order; raises as ``Server.total`` does."""
    srv = Server(params, seed)
    srv.advertised([Advert(i, bytes.fromhex(keys[i]["c_public"]), bytes.fromhex(keys[i]["s_public"]))
                    for i in members])
    for i in (i for i in members if i in shares):
        srv.route(i, {x["index"]: (bytes.fromhex(x["box"]), bytes.fromhex(x["commits"])) for x in shares[i]["shares"]})
    for i in (i for i in members if i in complaints):
        srv.complain(i, bytes.fromhex(complaints[i]["c_secret"]), list(complaints[i]["accused"]))
    for i, y in inputs:
        srv.receive(i, y)
    for i in (i for i in members if i in answers):
        srv.collect(i, {x["about"]: (x["kind"], bytes.fromhex(x["share"])) for x in answers[i]["shares"]})
    return srv.total()
