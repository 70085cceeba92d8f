"""Secure aggregation on the wire (server.services.secure, docs/secagg.md): seven devices go through a round's four
steps over HTTP, one dropping out after it shared its keys and one after it sent its masked input; the published
base is the round's start plus the dequantized mean of the survivors' inputs, computed here from the plain inputs.
The server refuses messages out of their step, to strangers, or asking it to learn more than the sum."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from secure_kit import adverts, at_step, dealt_json, enrolled, expected_base, honest_round, inbox, state
from server_testkit import BETA, FEDPER, Dev, background_server, bearer, create, wait_for

from pfl_edge.protocol import task_topic
from pfl_edge.secagg import Client, Params, encode_masked, round_id
from pfl_edge.secagg.aggregate import secure_input
from server.launch import BackgroundServer

ADMIN = "admin-token-for-secure-tests"
SECURE: dict[str, Any] = {**FEDPER, "clients": 7, "rounds": 2,
                          "secure_aggregation": {"bound": 0.5, "bits": 16, "degree": 6, "threshold": 4}}


@pytest.fixture
def srv(tmp_path: Path, broker_url: str) -> Iterator[BackgroundServer]:
    s = background_server(tmp_path, broker_url, ADMIN)
    yield s
    s.stop()


_state, _at = state, at_step


def _enrolled(srv: BackgroundServer, fed: str, config: dict[str, Any], seed: int) -> tuple[Any, ...]:
    return enrolled(srv, ADMIN, fed, config, seed)


def test_a_secure_round_over_http_publishes_the_survivors_mean_through_dropouts(srv: BackgroundServer) -> None:
    c, cfg, devs, mq, _task, start, keys, sent = _enrolled(srv, "sa", SECURE, 1)
    xs = [secure_input(cfg, start, s) for s in sent]
    # nothing out of its step: shares before the graph exists, a masked input while keys are advertised
    r = c.post("/v1/rounds/1/secagg/shares", json={"shares": []}, headers=devs[0].h)
    assert r.status_code == 409 and "advertise step" in r.text
    clients: dict[int, Client] = {}
    for d in devs:
        cl = Client(d.index, Params(6, 4, 1))  # keys now; the round's parameters come with the graph
        clients[d.index] = cl
        r = c.post("/v1/rounds/1/secagg/keys", headers=d.h,
                   json={"c_public": cl.c.public.hex(), "s_public": cl.s.public.hex()})
        assert r.status_code == 200, r.text
    # another message from a device that advertised already
    r = c.post("/v1/rounds/1/secagg/keys", headers=devs[0].h, json={"c_public": "00" * 32, "s_public": "00" * 32})
    assert r.status_code == 409 and "different keys message" in r.text
    at = {d.index: _at(c, d, 1, "share") for d in devs}
    size = sum(start[k].numel() for k in keys)
    assert at[0]["params"] == {"degree": 6, "threshold": 4, "size": size}
    for d in devs:
        cl = clients[d.index]
        cl.params = Params(6, 4, size, round_id("sa", 1))
        dealt = cl.share_keys(adverts(at[d.index]))
        if d.index == 0:  # a pair missing: refused, nothing kept
            r = c.post("/v1/rounds/1/secagg/shares", headers=d.h, json=dealt_json(dict(list(dealt.items())[1:])))
            assert r.status_code == 422 and "one sealed pair to each" in r.text
        r = c.post("/v1/rounds/1/secagg/shares", headers=d.h, json=dealt_json(dealt))
        assert r.status_code == 200, r.text
    # device 4 drops out after sharing (never sends its input); the rest send theirs
    survivors = [0, 1, 2, 3, 5, 6]
    for i in survivors:
        got = inbox(_at(c, devs[i], 1, "input"))
        assert sorted(got) == [j for j in range(7) if j != i]
        y = clients[i].masked_input(xs[i], got)
        assert devs[i].update(1, devs[i].put(encode_masked(y, 1))).status_code == 200
    srv.app_state.coordinator.rounds.clock = lambda: time.time() + 10**6  # the input step's deadline has passed
    srv.app_state.coordinator.worker.kick()
    ask = _at(c, devs[0], 1, "unmask")
    assert ask["survivors"] == survivors and ask["dropped"] == [4]
    # device 3 drops out after sending its input (never unmasks); the other survivors reveal what is asked (each
    # secret has 4 shares left of 6: the threshold)
    for i in (0, 1, 2, 5, 6):
        shares = clients[i].unmask(frozenset(survivors), frozenset({4}))
        if i == 0:  # asking to learn both secrets of one device, or sending one it was not asked: refused
            bad = [{"about": j, "kind": "b", "share": s.hex()} for j, (_, s) in shares.items()]
            r = c.post("/v1/rounds/1/secagg/unmask", headers=devs[i].h, json={"shares": bad})
            assert r.status_code == 422 and "asks this device for" in r.text
        r = c.post("/v1/rounds/1/secagg/unmask", headers=devs[i].h, json={"shares": [
            {"about": j, "kind": k, "share": s.hex()} for j, (k, s) in shares.items()]})
        assert r.status_code == 200, r.text
    srv.app_state.coordinator.rounds.clock = lambda: time.time() + 2 * 10**6  # and the unmask step's
    srv.app_state.coordinator.worker.kick()
    nxt = mq.wait(task_topic("sa", devs[0].id), lambda x: x["round"] == 2, timeout=30)
    got = devs[0].get(nxt["base"]).tensors
    want = expected_base(start, keys, xs, survivors, 0.5, 16)
    assert all(torch.equal(got[k], want[k]) for k in keys)
    # the mean of the plain updates, to the quantization's step (2 x bound / (2^16 - 1) per coordinate)
    for k in keys:
        plain = torch.stack([sent[i][k] - start[k] for i in survivors]).clamp(-0.5, 0.5).double().mean(0)
        assert float((got[k].double() - start[k].double() - plain).abs().max()) <= 1.0 / 65535 + 1e-6
    mq.close()


def test_secure_messages_need_a_secure_round_and_a_device(srv: BackgroundServer) -> None:
    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, ADMIN, "plain", FEDPER)
    d = Dev(c, "plain")
    r = c.get("/v1/rounds/1/secagg", headers=d.h)
    assert r.status_code == 409 and "does not aggregate securely" in r.text
    r = c.get("/v1/rounds/1/secagg", headers=bearer("not-a-token"))
    assert r.status_code == 401
    create(c, ADMIN, "sa2", SECURE)
    d2 = Dev(c, "sa2")
    # before round 1 (enrolment): no secure round yet
    r = c.post("/v1/rounds/1/secagg/keys", headers=d2.h, json={"c_public": "11" * 32, "s_public": "22" * 32})
    assert r.status_code == 409 and "no secure aggregation" in r.text
    # malformed keys never reach the service; a body past its bound is refused before it is parsed
    r = c.post("/v1/rounds/1/secagg/keys", headers=d2.h, json={"c_public": "zz", "s_public": "22" * 32})
    assert r.status_code == 422
    r = c.post("/v1/rounds/1/secagg/keys", headers={**d2.h, "Content-Type": "application/json"},
               content=b'{"c_public": "' + b"a" * (70 << 10) + b'"}')
    assert r.status_code == 413
    big = {"shares": [{"index": 1, "box": "01" * 168, "commits": "00" * 64}] * 15_000}  # 7.4 MB: past 6 MiB
    assert c.post("/v1/rounds/1/secagg/shares", headers=d2.h, json=big).status_code == 413


def test_advertising_ends_at_the_federations_quorum(srv: BackgroundServer) -> None:
    """Half of six devices advertising ends the step (quorum 0.5), as a plain round closes at its quorum of
    updates; a fourth device's keys come too late and are refused, and it is in nobody's graph."""
    from pfl_edge.secagg import KeyPair

    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, ADMIN, "sq", {**SECURE, "clients": 6}, quorum=0.5)
    devs = [Dev(c, "sq", index=i) for i in range(6)]
    wait_for(lambda: c.get("/v1/rounds/1/secagg", headers=devs[0].h).status_code == 200, timeout=30,
             what="round 1 collecting")

    def keys(d: Dev) -> httpx.Response:
        k = KeyPair()
        return c.post("/v1/rounds/1/secagg/keys", headers=d.h, json={"c_public": k.public.hex(),
                                                                     "s_public": KeyPair().public.hex()})

    # a low-order public key would make every neighbour's agreement fail: refused, nothing kept
    r = c.post("/v1/rounds/1/secagg/keys", headers=devs[0].h, json={"c_public": "00" * 32, "s_public": "00" * 32})
    assert r.status_code == 422 and "unusable" in r.text
    for d in devs[:3]:
        assert keys(d).status_code == 200
    at = _at(c, devs[0], 1, "share")
    assert sorted(n["index"] for n in at["neighbours"]) == [1, 2]
    r = keys(devs[3])
    assert r.status_code == 409 and "share step" in r.text
    assert _state(c, devs[3], 1)["neighbours"] == []


def _raw_answer(url: str, request: bytes, timeout: float = 60.0) -> bytes:
    """Send ``request`` (headers, perhaps part of a body) on a plain socket and read until the server answers."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as sock:
        sock.sendall(request)
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = sock.recv(4096)
            if not chunk:
                break
            got += chunk
    return got


def test_a_strangers_large_secure_body_is_refused_before_it_is_read(srv: BackgroundServer) -> None:
    """A secure round's shares route takes up to 4 MiB: a stranger's (or a revoked device's) body is refused 401 as
    soon as its headers are in, without waiting for the body (which never comes here: had the server read it, the
    answer would be 408 after its 30 s body timeout)."""
    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, ADMIN, "sx", SECURE)
    dev = Dev(c, "sx", index=0)
    for token in ("forged-token", None):
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        req = (f"POST /v1/rounds/1/secagg/shares HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
               f"Content-Length: {4 << 20}\r\n\r\n").encode() + b'{"shares": ['
        got = _raw_answer(srv.url, req)
        assert got.startswith(b"HTTP/1.1 401"), got[:200]
    # a device's own call goes through to the route (which answers as to any device: no secure round here)
    r = c.post("/v1/rounds/1/secagg/shares", json={"shares": []}, headers=dev.h)
    assert r.status_code == 409, r.text


def test_a_large_body_is_checked_off_the_event_loop(srv: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The JSON check of a body over 64 KiB runs in a worker thread, of a small one on the loop (cheap)."""
    import asyncio

    import server.limits as limits

    seen: list[tuple[int, bool]] = []
    real = limits.json_problem

    def spy(body: bytes) -> str | None:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        seen.append((len(body), on_loop))
        return real(body)

    monkeypatch.setattr(limits, "json_problem", spy)
    c = httpx.Client(base_url=srv.url, timeout=30)
    create(c, ADMIN, "sl", SECURE)
    dev = Dev(c, "sl", index=0)
    small = {"shares": []}
    large = {"shares": [{"index": i, "box": "00" * 200} for i in range(300)]}  # about 130 KB
    for body in (small, large):
        c.post("/v1/rounds/1/secagg/shares", json=body, headers=dev.h)
    sizes = {n: on for n, on in seen if n > 10}
    assert any(on for n, on in sizes.items() if n <= limits.PARSE_ON_LOOP)
    assert any(n > limits.PARSE_ON_LOOP for n in sizes) and not any(
        on for n, on in sizes.items() if n > limits.PARSE_ON_LOOP), seen


def test_a_secure_round_goes_through_the_algorithms_aggregate(srv: BackgroundServer, mixing: str) -> None:
    """The server never replaces an algorithm's aggregate, secure rounds included: a toy algorithm's beta mixing
    (``server_testkit.mixing_algorithm``) is applied to the mean the server unmasked, as the simulator applies it
    (the simulator's aggregate over the same updates and slots: ``Algorithm.aggregate``)."""
    from server.fedmodel import fed_model

    config = {**SECURE, "algorithm": mixing, "clients": 5}
    c, cfg, devs, mq, _task, start, keys, sent = _enrolled(srv, "smx", config, 4)
    xs = [secure_input(cfg, start, s) for s in sent]
    honest_round(srv, c, devs, "smx", xs, sum(start[k].numel() for k in keys))
    nxt = mq.wait(task_topic("smx", devs[0].id), lambda x: x["round"] == 2, timeout=60)
    got = devs[0].get(nxt["base"]).tensors
    mean = expected_base(start, keys, xs, list(range(5)), 0.5, 16)
    sim = fed_model(config).algorithm().aggregate({k: start[k] for k in keys}, [(s, 1.0) for s in sent], t=1,
                                               ids=list(range(5)))
    assert sim is not None
    for k in keys:
        want = BETA * mean[k].double() + (1 - BETA) * start[k].double()
        torch.testing.assert_close(got[k].double(), want, rtol=0, atol=1e-6, msg=k)
        torch.testing.assert_close(sim[k].double(), want, rtol=0, atol=1e-6, msg=k)
        assert not torch.allclose(got[k].double(), mean[k].double(), atol=1e-6), "the plain mean: bypassed"
    mq.close()


def test_no_route_parses_a_strangers_body_over_64_kib() -> None:
    """Every JSON body a route may take above 64 KiB (``BODY_LIMITS``) is one only the admin or an enrolled device
    may send, and its token is checked before the body is read (``ADMIN_FIRST``, ``DEVICE_FIRST``); every other
    JSON body is at most ``JSON_BODY_LIMIT``, 64 KiB; a streamed body (None) is the blob route's own, never JSON."""
    from server import limits

    assert limits.JSON_BODY_LIMIT <= 64 << 10 and limits.PARSE_ON_LOOP <= 64 << 10
    first = {(m, p.pattern) for m, p in (*limits.ADMIN_FIRST, *limits.DEVICE_FIRST)}
    large = [(m, p.pattern) for m, p, n in limits.BODY_LIMITS if n is not None and n > 64 << 10]
    assert large and all(x in first for x in large), (large, first)
    streamed = [p.pattern for _, p, n in limits.BODY_LIMITS if n is None]
    assert streamed == [rf"^{limits.API_PREFIX}/blobs/[^/]*$"]
