"""Partial sums (server.services.partials): replicas fold the updates they accept into sums that the leader merges
at close. The merge equals a float64 reference over every update; a sum that names an update not of the round,
one another sum holds, more or fewer updates than it counts, a tensor of another shape, or an update the norm
bound clips is left out and its updates read one by one. Two server processes on one PostgreSQL database, each
accepting half of a FedPer round's updates, close it from their sums, and the base is the weighted mean."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_testkit import BETA, FEDPER, Dev, create, perturbed, wait_for
from sqlalchemy import select

from pfl_edge.aggregate import DEFAULT_RULE, AggregationRule, PartialAverage, robust_aggregate, update_norm
from pfl_edge.codec import encode
from pfl_edge.split import take
from server.db import PartialSum, Round, make_engine
from server.launch import BackgroundServer, start_background
from server.migrations import make_sessionmaker
from server.services.partials import Sum, merge_sums, pack, unpack
from server.settings import Settings

ADMIN = "admin-token-for-partial-sums"
SHAPES = {"w": (4, 3), "b": (3,)}


def _updates(n: int, seed: int = 0) -> list[tuple[dict[str, torch.Tensor], float]]:
    g = torch.Generator().manual_seed(seed)
    return [({k: torch.randn(s, generator=g) for k, s in SHAPES.items()}, float(3 + 5 * i)) for i in range(n)]


def _reference(ups: list[tuple[dict[str, torch.Tensor], float]]) -> dict[str, torch.Tensor]:
    """sum_j n_j x_j / sum_j n_j in float64, one update at a time (independent of PartialAverage)."""
    total = sum(n for _, n in ups)
    return {k: sum((x[k].double() * n for x, n in ups), torch.zeros(s, dtype=torch.float64)) / total
            for k, s in SHAPES.items()}


def _sum(ups: list[tuple[dict[str, torch.Tensor], float]], ids: list[int], max_norm: float | None = 1.0) -> Sum:
    avg = PartialAverage()
    for i in ids:
        avg.add(*ups[i])
    return Sum(frozenset(ids), max_norm, pack(avg))


def _merged(sums: list[Sum], ups: list[tuple[dict[str, torch.Tensor], float]], bound: float | None = None
            ) -> tuple[dict[str, torch.Tensor], set[int], int]:
    """What the leader does: merge the usable sums, then add every update no sum holds."""
    merged, covered, k = merge_sums(sums, list(range(len(ups))), bound, SHAPES, PartialAverage())
    avg = merged if merged is not None else PartialAverage()
    for i, (x, n) in enumerate(ups):
        if i not in covered:
            avg.add(x, n)
    return {k2: v.double() for k2, v in avg.result().items()}, covered, k


def test_merged_sums_equal_the_reference_and_bad_sums_are_left_out() -> None:
    ups = _updates(8)
    want = _reference(ups)

    def check(sums: list[Sum], covered: set[int], k: int, bound: float | None = None) -> None:
        got, cov, n = _merged(sums, ups, bound)
        assert (cov, n) == (covered, k)
        for name in SHAPES:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6)

    check([_sum(ups, [0, 1, 2]), _sum(ups, [5, 3])], {0, 1, 2, 3, 5}, 2)
    assert unpack(pack(unpack(_sum(ups, [0, 1]).data))).count == 2
    # an update that is not the round's; one a used sum already holds; a sum counting 2 that names 3
    foreign = _sum(ups, [0, 1])
    check([Sum(frozenset({0, 9}), 1.0, foreign.data)], set(), 0)
    check([_sum(ups, [0, 1]), _sum(ups, [1, 2])], {0, 1}, 1)
    short = _sum(ups, [4, 6])
    check([Sum(frozenset({4, 6, 7}), 1.0, short.data)], set(), 0)
    # an update the bound clips (or a norm unknown) with a bound; no bound: both used
    check([_sum(ups, [0, 1], max_norm=5.0), _sum(ups, [2], max_norm=None)], set(), 0, bound=4.0)
    check([_sum(ups, [0, 1], max_norm=5.0), _sum(ups, [2], max_norm=None)], {0, 1, 2}, 2)
    # another model's tensor shapes, and bytes that are no sum at all
    odd = PartialAverage()
    odd.add({"w": torch.ones(2, 2), "b": torch.ones(3)}, 1.0)
    check([Sum(frozenset({3}), 1.0, pack(odd)), Sum(frozenset({4}), 1.0, b"\x08" + b"\0" * 7 + b"{}"),
           Sum(frozenset({5}), 1.0, b"nonsense")], set(), 0)
    # an algorithm that takes no partial sums (``partial_sum()`` None): good sums are not used either
    assert merge_sums([_sum(ups, [0, 1])], list(range(len(ups))), None, SHAPES, None) == (None, set(), 0)


@pytest.fixture
def replicas(tmp_path: Path, pg_url: str, broker_url: str) -> Iterator[list[BackgroundServer]]:
    """Two server processes' worth (in threads) on one database and blob store, folding partial sums."""
    out: list[BackgroundServer] = []
    try:
        for i in range(2):
            out.append(start_background(Settings(
                data_dir=tmp_path / f"r{i}", blob_dir=tmp_path / "blobs", database_url=pg_url,  # type: ignore[arg-type]
                broker_url=broker_url, admin_token=ADMIN, tick_s=0.05, partial_sums=True, partial_flush_s=0.05)))
        yield out
    finally:
        for s in out:
            s.stop()


def _round_one(replicas: list[BackgroundServer], fed: str, config: dict[str, Any],
               **kw: Any) -> tuple[httpx.Client, list[Dev], tuple[str, ...], dict[str, torch.Tensor],
                                   list[tuple[dict[str, torch.Tensor], float]]]:
    """Federation ``fed`` of four devices enrolled alternately through the two replicas, round 1 open: (the first
    replica's client, the devices, the base keys, the initial model, each device's base upload and weight)."""
    a, b = (httpx.Client(base_url=s.url, timeout=30) for s in replicas)
    create(a, ADMIN, fed, {**config, "clients": 4, "rounds": 1}, **kw)
    devs = [Dev(a, fed, index=0), Dev(b, fed, index=1), Dev(a, fed, index=2), Dev(b, fed, index=3)]
    base_keys = tuple(devs[0].fm.base_keys(FEDPER["kp"]))
    init = devs[0].fm.init_state()
    wait_for(lambda: a.get("/v1/rounds/current/task", headers=devs[0].h).status_code == 200, what="round 1")
    return a, devs, base_keys, init, [(take(perturbed(init, i), base_keys), float(10 + 7 * i)) for i in range(4)]


def test_two_replicas_close_a_round_from_their_sums(replicas: list[BackgroundServer], pg_url: str) -> None:
    # a multiple of 3 that none of these four similar updates reaches, so that every sum may merge; at the default
    # (1) the updates above the others' low median are clipped and read one by one (the test below)
    a, devs, base_keys, _, ups = _round_one(replicas, "ps", FEDPER, aggregation={"norm_multiple": 3})
    sessions = make_sessionmaker(make_engine(Settings(database_url=pg_url).resolved_database_url))

    def summed() -> set[int]:
        with sessions() as s:
            return {u for p in s.scalars(select(PartialSum)) for u in p.updates}

    for d, (x, n) in zip(devs[:3], ups[:3], strict=True):  # each through its own replica
        dg = d.put(encode(x, model_id=d.fm.model_id, round=1))
        assert d.update(1, dg, int(n)).json()["accepted"]
    wait_for(lambda: len(summed()) == 3, what="both replicas' sums of the first three updates")
    dg = devs[3].put(encode(ups[3][0], model_id=devs[3].fm.model_id, round=1))
    assert devs[3].update(1, dg, int(ups[3][1])).json()["accepted"]  # the last: it may close before a sum has it
    wait_for(lambda: a.get("/v1/federations/ps", headers={"Authorization": f"Bearer {ADMIN}"}).json()["state"]
             == "finished", what="the round's close")
    merged = [s.app_state.coordinator.rounds.merged.get(("ps", 1)) for s in replicas if s.app_state is not None]
    took, sums = next(m for m in merged if m is not None)  # the leader's close
    assert took >= 3 and sums >= 2, (took, sums)  # updates through both replicas came from their sums
    assert summed() == set()  # the close deleted the round's sums
    with sessions() as s:
        base_digest = s.scalar(select(Round.base_digest).where(Round.federation == "ps", Round.round == 1))
    assert base_digest is not None
    got = devs[0].get(base_digest).tensors
    total = sum(n for _, n in ups)
    for k in base_keys:
        want = sum(x[k].double() * n for x, n in ups) / total
        torch.testing.assert_close(got[k].double(), want, rtol=0, atol=1e-6)


def test_replicas_sums_at_the_default_rule_merge_within_the_bound_and_clip_the_rest(
        replicas: list[BackgroundServer], pg_url: str) -> None:
    """At the default rule (each update held to 1x the low median of the others' norms) two replicas' sums: the
    replica holding the two smallest updates (norms s, 2s; its largest, 2s, is the round's least bound) is merged
    whole, the other's (3s, 4s: both over their bounds, 2s) read one by one and clipped. The published base is the
    float64 reference of the clipped weighted mean, as the simulator's ``DEFAULT_RULE`` makes it."""
    a, devs, base_keys, init, _ = _round_one(replicas, "dr", FEDPER)  # no aggregation: the default rule
    start = take(init, base_keys)
    g = torch.Generator().manual_seed(7)
    # devices 0 and 2 enrolled through the first replica, 1 and 3 through the second; step sizes 1, 3, 2, 4
    ups = [({k: v + 0.01 * s * torch.randn(v.shape, generator=g) for k, v in start.items()}, float(10 + 7 * i))
           for i, s in enumerate((1.0, 3.0, 2.0, 4.0))]
    ups = [({k: v.float() for k, v in x.items()}, n) for x, n in ups]
    norms = [update_norm(start, x) for x, _ in ups]
    assert sorted(range(4), key=norms.__getitem__) == [0, 2, 1, 3]
    bounds = DEFAULT_RULE.bounds(norms)
    assert bounds == [norms[1], norms[2], norms[1], norms[2]] and min(bounds) == norms[2]  # (1 x the low median)
    sessions = make_sessionmaker(make_engine(Settings(database_url=pg_url).resolved_database_url))

    def summed() -> int:
        with sessions() as s:
            return sum(len(p.updates) for p in s.scalars(select(PartialSum)))

    for i in (0, 2, 1):
        x, n = ups[i]
        assert devs[i].update(1, devs[i].put(encode(x, model_id=devs[i].fm.model_id, round=1)), int(n)).json()[
            "accepted"]
    wait_for(lambda: summed() == 3, what="both replicas' sums of the first three updates")
    x, n = ups[3]
    assert devs[3].update(1, devs[3].put(encode(x, model_id=devs[3].fm.model_id, round=1)), int(n)).json()["accepted"]
    wait_for(lambda: a.get("/v1/federations/dr", headers={"Authorization": f"Bearer {ADMIN}"}).json()["state"]
             == "finished", what="the round's close")
    merged = [s.app_state.coordinator.rounds.merged.get(("dr", 1)) for s in replicas if s.app_state is not None]
    assert next(m for m in merged if m is not None) == (2, 1)  # updates 0 and 2, from one sum; 1 and 3 read
    with sessions() as s:
        digest = s.scalar(select(Round.base_digest).where(Round.federation == "dr", Round.round == 1))
    assert digest is not None
    got = devs[0].get(digest).tensors
    total = sum(n for _, n in ups)
    scale = [min(1.0, b / m) for b, m in zip(bounds, norms, strict=True)]
    assert scale[0] == scale[2] == 1.0 and scale[1] < 1 and scale[3] < 1
    for k in base_keys:
        p = start[k].double()
        want = sum(n * (p + (x[k].double() - p) * c) for (x, n), c in zip(ups, scale, strict=True)) / total
        torch.testing.assert_close(got[k].double(), want, rtol=0, atol=1e-6, msg=k)
        plain = sum(n * x[k].double() for x, n in ups) / total
        assert not torch.allclose(got[k].double(), plain, atol=1e-5), "nothing was clipped"


@pytest.mark.parametrize("aggregation", [None, {"rule": "median"}])
def test_replicas_sums_and_robust_rules_go_through_the_algorithms_aggregate(
        replicas: list[BackgroundServer], pg_url: str, mixing: str, aggregation: dict[str, str] | None) -> None:
    """The server never replaces an algorithm's aggregate: with the replicas' partial sums merged (the mean) or a
    robust rule (the median), a toy algorithm's beta mixing is applied to what the rule gives."""
    # the mean at a multiple of 3, which none of these four similar updates reaches, so that the sums merge (at the
    # default, 1, half of them would be clipped and read one by one: the test above)
    a, devs, base_keys, init, ups = _round_one(replicas, "mx", {**FEDPER, "algorithm": mixing},
                                               aggregation=aggregation or {"norm_multiple": 3})
    sessions = make_sessionmaker(make_engine(Settings(database_url=pg_url).resolved_database_url))

    def summed() -> int:
        with sessions() as s:
            return sum(len(p.updates) for p in s.scalars(select(PartialSum)))

    for d, (x, n) in zip(devs[:3], ups[:3], strict=True):
        assert d.update(1, d.put(encode(x, model_id=d.fm.model_id, round=1)), int(n)).json()["accepted"]
    if aggregation is None:
        wait_for(lambda: summed() == 3, what="both replicas' sums of the first three updates")
    x, n = ups[3]
    assert devs[3].update(1, devs[3].put(encode(x, model_id=devs[3].fm.model_id, round=1)), int(n)).json()["accepted"]
    wait_for(lambda: a.get("/v1/federations/mx", headers={"Authorization": f"Bearer {ADMIN}"}).json()["state"]
             == "finished", what="the round's close")
    if aggregation is None:  # the leader merged the replicas' sums, and still mixed
        merged = [s.app_state.coordinator.rounds.merged.get(("mx", 1)) for s in replicas if s.app_state is not None]
        took, _ = next(m for m in merged if m is not None)
        assert took >= 3, took
    with sessions() as s:
        digest = s.scalar(select(Round.base_digest).where(Round.federation == "mx", Round.round == 1))
    assert digest is not None
    got = devs[0].get(digest).tensors
    total = sum(n for _, n in ups)
    # the rule's own result (its correctness is tests/server/test_robust.py's), then the algorithm's mixing
    median = robust_aggregate(take(init, base_keys), ups, AggregationRule("median")) if aggregation else {}
    for k in base_keys:
        plain = torch.stack([x[k].double() * n for x, n in ups]).sum(0) / total  # float64, one update at a time
        ruled = median[k].double() if aggregation else plain
        want = BETA * ruled + (1 - BETA) * init[k].double()
        torch.testing.assert_close(got[k].double(), want, rtol=0, atol=1e-5, msg=k)
        assert not torch.allclose(got[k].double(), plain, atol=1e-4), "the plain mean, the algorithm bypassed"
