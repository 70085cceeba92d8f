"""The issue's attacker, kept as regression tests (issue 10 items 1, 2, 9, 11): bodies over their route's limit,
NaN and Infinity, 422s that echoed their input, absurd federation configs, metrics for rounds that do not exist,
personal layers in a FedPer upload, and a blob endpoint that told whether a digest exists in another federation.
Each refusal is a JSON ``{"detail": ...}`` with its status and changes nothing (SQLite: the rules are the
server's, not the database's)."""

from __future__ import annotations

import json
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from server_testkit import DISPFL, FEDPER, SECRET, Dev, bearer, create, fed_state, perturbed, sha, snapshot, wait_for

from pfl_edge.codec import encode
from pfl_edge.protocol import MAX_CLIENTS, MAX_DEADLINE_S, MAX_ROUND
from pfl_edge.split import take
from server.app import create_app
from server.limits import JSON_BODY_LIMIT, MAX_HEADERS
from server.services.updates import mask_bound
from server.settings import Settings

ADMIN = "admin-token-for-hostile-tests"
ROUTES = ["/v1/federations", "/v1/devices", "/v1/rounds/1/updates", "/v1/rounds/1/metrics"]


def _settings(tmp_path: Path, broker_url: str) -> Settings:
    return Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'state.db'}",
                    broker_url=broker_url, admin_token=ADMIN, max_blob_bytes=4 << 20, tick_s=0.05)  # type: ignore[arg-type]


@pytest.fixture
def client(tmp_path: Path, broker_url: str) -> Iterator[TestClient]:
    with TestClient(create_app(_settings(tmp_path, broker_url))) as c:
        yield c


def refused(c: TestClient, call: Any, status: int, match: str = "") -> dict[str, Any]:
    """``call()`` is refused with ``status``, a JSON detail containing ``match``, and nothing changed."""
    engine = c.app.state.pfl.engine  # type: ignore[attr-defined]
    before = snapshot(engine)
    r = call()
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json") and set(r.json()) == {"detail"}, r.text
    assert match in json.dumps(r.json()["detail"]), r.text
    assert snapshot(engine) == before
    return dict(r.json())


def post_raw(c: TestClient, path: str, body: bytes, token: str | None = None) -> Any:
    headers = {"content-type": "application/json", **(bearer(token) if token else {})}
    return c.post(path, content=body, headers=headers)


# ------------------------------------------------------------------------------------------------ body limits


def test_an_oversized_body_is_refused_before_parsing_without_a_token(client: TestClient) -> None:
    big = b'{"federation":"f","enrol_secret":"' + b"x" * (32 << 20) + b'","profile":"phone-mid"}'
    t0 = time.perf_counter()
    refused(client, lambda: post_raw(client, "/v1/devices", big), 413, "limit of 65536 bytes")
    assert time.perf_counter() - t0 < 2.0
    for path in ROUTES[1:]:
        refused(client, lambda p=path: post_raw(client, p, b" " * (JSON_BODY_LIMIT + 1)), 413, "limit")
    # without a Content-Length (chunked): counted while it streams
    chunks = (b" " * 4096 for _ in range(JSON_BODY_LIMIT // 4096 + 2))
    refused(client, lambda: client.post("/v1/rounds/1/updates", content=chunks), 413, "over this route's limit")
    # the admin's federation creation may be larger (1 MiB), but not without bound
    refused(client, lambda: post_raw(client, "/v1/federations", b" " * (2 << 20), ADMIN), 413, "1048576")
    body = json.dumps({"id": "f", "enrol_secret": SECRET, "config": FEDPER, "padding": " " * (200 << 10)}).encode()
    refused(client, lambda: post_raw(client, "/v1/federations", body, ADMIN), 422, "padding")
    refused(client, lambda: client.post("/v1/devices", content=b"{}", headers={"content-length": "x1"}), 400,
            "Content-Length")


def test_a_body_trickling_in_is_cut_off() -> None:
    import anyio

    from server.limits import InputLimits

    sent: list[dict[str, Any]] = []

    async def app(_scope: Any, _receive: Any, _send: Any) -> None:
        raise AssertionError("the app must not see a body that never completes")

    async def receive() -> dict[str, Any]:
        await anyio.sleep(0.05)  # a byte every 50 ms, for ever
        return {"type": "http.request", "body": b" ", "more_body": True}

    async def send(message: Any) -> None:
        sent.append(dict(message))

    scope = {"type": "http", "method": "POST", "path": "/v1/devices", "headers": []}
    t0 = time.perf_counter()
    anyio.run(InputLimits(app, body_timeout_s=0.3), scope, receive, send)
    assert time.perf_counter() - t0 < 2 and sent[0]["status"] == 408 and b"0.3 s" in sent[1]["body"]


def test_too_many_headers_are_refused(client: TestClient) -> None:
    headers = {f"x-h{i}": "v" for i in range(MAX_HEADERS + 1)}
    refused(client, lambda: client.get("/healthz", headers=headers), 431, "headers")
    assert client.get("/healthz", headers=dict(list(headers.items())[:10])).status_code == 200


def test_over_a_real_socket_the_body_is_never_read(tmp_path: Path, broker_url: str) -> None:
    from server.launch import start_background

    with start_background(_settings(tmp_path, broker_url)) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/devices HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000000000\r\n\r\n" + b"x" * 65536)
            answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert httpx.get(f"{srv.url}/healthz", timeout=5).status_code == 200


def test_a_federation_body_without_the_admin_token_is_never_read(tmp_path: Path, broker_url: str) -> None:
    """POST /v1/federations (a megabyte of JSON allowed) from a stranger: 401 at once, its body never read (the
    stranger sends headers only; before, the server waited for the body, then parsed it, then refused it). With the
    admin token the same route still reads and validates the body."""
    from server.launch import start_background

    with start_background(_settings(tmp_path, broker_url)) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        for auth in (b"", b"Authorization: Bearer wrong\r\n"):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(b"POST /v1/federations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             + auth + b"Content-Length: 1000000\r\n\r\n")  # and no body: it would wait 30 s
                answer = sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        r = httpx.post(f"{srv.url}/v1/federations", json={"id": "x"}, headers=bearer(ADMIN), timeout=10)
        assert r.status_code == 422, r.text  # the admin's body is read and validated as before


# -------------------------------------------------------------------------------------------- NaN, Infinity


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity", "1e400", "-1e999", "1" * 50])
def test_non_finite_numbers_anywhere_are_422_with_or_without_a_token(client: TestClient, bad: str) -> None:
    fed = {"id": "f", "enrol_secret": SECRET, "config": FEDPER}
    bodies = {
        "/v1/federations": [json.dumps({**fed, "quorum": "@"}), json.dumps({**fed, "config": {**FEDPER, "lr": "@"}}),
                            json.dumps({**fed, "config": {**FEDPER, "densities": [0.5, "@"]}})],
        "/v1/devices": ['{"federation": "f", "enrol_secret": "x", "profile": "p", "index": @}'],
        "/v1/rounds/1/updates": [f'{{"digest": "{"0" * 64}", "n_samples": 1, "train_loss": @}}'],
        "/v1/rounds/1/metrics": ['{"accuracy": 0.5, "loss": @, "n_test": 1}',
                                 '{"accuracy": @, "loss": 1, "n_test": 1}'],
    }
    for path, texts in bodies.items():
        for text in texts:
            body = text.replace('"@"', bad).replace("@", bad).encode()
            for token in (None, ADMIN):
                if token is None and path == "/v1/federations":  # the admin's route: the token comes first
                    refused(client, lambda p=path, b=body: post_raw(client, p, b, None), 401, "admin token")
                    continue
                d = refused(client, lambda p=path, b=body, t=token: post_raw(client, p, b, t), 422)
                assert any(w in d["detail"] for w in ("NaN", "Infinity", "not finite", "digits")), d


def test_json_the_parser_chokes_on_is_422(client: TestClient) -> None:
    refused(client, lambda: post_raw(client, "/v1/devices", b"[" * 5000 + b"]" * 5000), 422, "nested too deeply")
    refused(client, lambda: post_raw(client, "/v1/devices", b'{"a": "\xff"}'), 422, "not valid JSON")
    refused(client, lambda: post_raw(client, "/v1/devices", b'{"a": '), 422, "not valid JSON")


def test_a_422_never_echoes_the_input(client: TestClient) -> None:
    marker = "Q" * 60_000
    for body in ({"federation": "f", "enrol_secret": SECRET, "profile": marker},
                 {"federation": marker[:1000], "enrol_secret": SECRET, "profile": "p", marker[:5000]: 1},
                 [marker[:30_000]] * 2):
        r = client.post("/v1/devices", json=body)
        assert r.status_code == 422 and len(r.content) < 3000, r.text[:500]
        assert "Q" * 250 not in r.text and '"input"' not in r.text
        assert all({"loc", "msg", "type"} == set(e) for e in r.json()["detail"])
    r = client.post("/v1/devices", json={f"k{i}": i for i in range(500)})
    assert r.status_code == 422 and len(r.json()["detail"]) == 17 and "more errors" in r.text


def test_a_bug_is_a_json_500_without_a_traceback(tmp_path: Path, broker_url: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with TestClient(create_app(_settings(tmp_path, broker_url)), raise_server_exceptions=False) as c:
        def broken(_fed: str) -> None:
            raise RuntimeError("an invariant broke: secret internals")

        monkeypatch.setattr(c.app.state.pfl.coordinator.metrics, "summary", broken)  # type: ignore[attr-defined]
        r = c.get("/v1/federations/f/metrics", headers=bearer(ADMIN))
        assert r.status_code == 500 and set(r.json()) == {"detail"} and "bug" in r.json()["detail"]
        assert "Traceback" not in r.text and "secret internals" not in r.text


# ------------------------------------------------------------------------------------------ federation bounds


@pytest.mark.parametrize(("change", "match"), [
    ({"config": {**FEDPER, "clients": 10**9}}, "clients must be at most 100,000"),
    ({"config": {**FEDPER, "clients": 1e9}}, "clients must be an integer"),
    ({"config": {**FEDPER, "rounds": 1e308}}, "rounds must be an integer"),
    ({"config": {**FEDPER, "rounds": MAX_ROUND + 1}}, "rounds must be at most"),
    ({"config": {**FEDPER, "samples_per_client": 10**12}}, "samples_per_client must be at most"),
    ({"config": {**FEDPER, "local_epochs": 10**6}}, "local_epochs must be at most"),
    ({"config": {**FEDPER, "batch_size": 10**7}}, "batch_size must be at most"),
    ({"config": {**FEDPER, "lr": 1e300}}, "lr must be at most"),
    ({"config": {**FEDPER, "model": "m" * 5000}}, "a string of 5000 characters; at most 4096"),
    ({"config": {**FEDPER, "x" * 100: 1}}, "is not a name"),
    ({"config": {**FEDPER, "a": [[[[[1]]]]]}}, "nested more than 4"),
    ({"config": {**DISPFL, "clients": 5000, "topology": "full"}}, "4,999 neighbours; at most 1,000"),
    ({"deadline_s": 1e308}, "deadline_s"),
    ({"deadline_s": MAX_DEADLINE_S + 1}, "deadline_s"),
    ({"min_devices": 4}, "more than the config's clients (3)"),
    ({"min_updates": MAX_CLIENTS + 1}, "min_updates"),
    ({"quorum": 0}, "quorum"),
])
def test_absurd_federations_are_refused_at_once(client: TestClient, change: dict[str, Any], match: str) -> None:
    body = {"id": "f", "enrol_secret": SECRET, "config": FEDPER, **change}
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        refused(client, lambda: client.post("/v1/federations", json=body, headers=bearer(ADMIN)), 422, match)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 5.0 and peak < 64 << 20, (time.perf_counter() - t0, peak)


def test_the_simulators_config_has_the_same_bounds() -> None:
    from pfl_edge.errors import ConfigError
    from pfl_edge.federation import SimConfig

    changes: list[dict[str, Any]] = [{"clients": 10**9}, {"rounds": 10**308}, {"batch_size": 2**40},
                                     {"test_per_client": 10**10}]
    for change in changes:
        with pytest.raises(ConfigError, match="must be at most"):
            SimConfig(**change)


# ------------------------------------------------------------------------------------------------- metrics


def test_metrics_only_for_rounds_the_device_was_part_of(client: TestClient) -> None:
    create(client, ADMIN, "f", FEDPER, min_devices=2)
    a, _ = Dev(client, "f"), Dev(client, "f")
    wait_for(lambda: fed_state(client, ADMIN, "f") == (1, "collecting"), what="round 1")
    late = Dev(client, "f")  # joins during round 1: takes part from round 2
    m = {"accuracy": 0.5, "loss": 1.0, "n_test": 8}
    refused(client, lambda: client.post("/v1/rounds/2/metrics", json=m, headers=a.h), 409, "rounds 0..1")
    refused(client, lambda: client.post(f"/v1/rounds/{MAX_ROUND}/metrics", json=m, headers=a.h), 409, "round 1")
    refused(client, lambda: client.post(f"/v1/rounds/{MAX_ROUND + 1}/metrics", json=m, headers=a.h), 422, "t")
    refused(client, lambda: client.post("/v1/rounds/0/metrics", json=m, headers=late.h), 409, "joined in round 1")
    assert client.post("/v1/rounds/1/metrics", json=m, headers=late.h).status_code == 200
    assert client.post("/v1/rounds/0/metrics", json=m, headers=a.h).status_code == 200


# --------------------------------------------------------------------------------------------------- blobs


def test_a_fedper_device_may_upload_its_base_part_only(client: TestClient) -> None:
    create(client, ADMIN, "f", FEDPER)
    a = Dev(client, "f")
    fm = a.fm
    init = fm.init_state()
    base = take(init, fm.base_keys(2))
    whole = encode(perturbed(init, 1), model_id=fm.model_id, round=1)
    files = sorted(p.name for p in Path(client.app.state.pfl.settings.resolved_blob_dir).rglob("*"))  # type: ignore[attr-defined]
    d = refused(client, lambda: client.put(f"/v1/blobs/{sha(whole)}", content=whole, headers=a.h), 422,
                "base part only (kp=2)")
    assert "unexpected tensors" in d["detail"]
    assert sorted(p.name for p in Path(client.app.state.pfl.settings.resolved_blob_dir).rglob("*")) == files  # type: ignore[attr-defined]
    one_personal = encode({**base, "fc2.0.bias": init["fc2.0.bias"]}, model_id=fm.model_id, round=1)
    refused(client, lambda: client.put(f"/v1/blobs/{sha(one_personal)}", content=one_personal, headers=a.h), 422,
            "fc2.0.bias")
    assert a.put(encode(perturbed(base, 2), model_id=fm.model_id, round=1))


def test_a_dispfl_device_uploads_its_whole_sparse_model(client: TestClient) -> None:
    create(client, ADMIN, "d", DISPFL)
    a = Dev(client, "d")
    init = a.fm.init_state()
    ones = mask_bound(a.fm, a.e["density"])  # the server holds each mask to ERK's count at the device's density
    masks = {k: torch.randperm(v.numel(), generator=torch.Generator().manual_seed(1)).view(v.shape) < ones[k]
             for k, v in init.items() if ones[k] < v.numel()}
    digest = a.put(encode(init, model_id=a.fm.model_id, round=0, masks=masks))
    r = a.update(0, digest)
    assert r.status_code == 200 and r.json()["accepted"], r.text


def test_another_federations_blob_is_answered_as_a_missing_one(client: TestClient) -> None:
    create(client, ADMIN, "f", FEDPER)
    create(client, ADMIN, "g", {**FEDPER, "seed": 4})
    a, b = Dev(client, "f"), Dev(client, "g")
    mine = a.put(encode(perturbed(take(a.fm.init_state(), a.fm.base_keys(2)), 1), model_id=a.fm.model_id,
                        round=1))
    for digest in (mine, a.e["init_digest"]):  # a device's upload, and a model the server made
        foreign = client.get(f"/v1/blobs/{digest}", headers=b.h)
        missing = client.get(f"/v1/blobs/{'0' * 64}", headers=b.h)
        assert (foreign.status_code, missing.status_code) == (404, 404)
        assert foreign.json()["detail"].replace(digest, "D") == missing.json()["detail"].replace("0" * 64, "D")
        assert dict(foreign.headers) == dict(missing.headers) | {"content-length": foreign.headers["content-length"]}


def test_a_model_over_the_blob_limit_is_refused_at_creation_not_a_500(tmp_path: Path, broker_url: str) -> None:
    """The cnn's initial model (~1.8 MB) cannot be stored under a 1 MiB max_blob_bytes: its devices could never
    upload it either. Found by the fuzzer's reviewer: this was a 500 from the blob store."""
    s = _settings(tmp_path, broker_url).model_copy(update={"max_blob_bytes": 1 << 20})
    with TestClient(create_app(s)) as c:
        body = {"id": "big", "enrol_secret": SECRET, "config": dict(FEDPER)}
        detail = refused(c, lambda: c.post("/v1/federations", json=body, headers=bearer(ADMIN)), 422,
                         "max_blob_bytes")
        assert "PFL_MAX_BLOB_BYTES" in detail["detail"]


def test_a_device_cut_off_mid_upload_is_no_server_error(tmp_path: Path, broker_url: str) -> None:
    """Found by the soak: a device cut or killed during a blob PUT made the server log an unhandled
    ClientDisconnect with its traceback ("Exception in ASGI application")."""
    import logging

    from server.launch import start_background

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("uvicorn.error")
    gone = threading.Event()  # the server's own word that it saw the device go away mid-PUT
    seen = logging.Handler(logging.INFO)
    seen.emit = lambda r: gone.set() if "went away during PUT" in r.getMessage() else None  # type: ignore[method-assign]
    blob_log = logging.getLogger("server.routers.blobs")
    blob_log.addHandler(seen)
    level = blob_log.level
    blob_log.setLevel(logging.INFO)
    try:
        with start_background(_settings(tmp_path, broker_url)) as srv, httpx.Client(base_url=srv.url) as c:
            logger.addHandler(handler)  # once started: uvicorn's logging config replaces the handlers it finds
            create(c, ADMIN, "cut", FEDPER)
            dev = Dev(c, "cut")
            before = blob_count(tmp_path)
            host, port = srv.url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                token = dev.e["token"]
                sock.sendall(f"PUT /v1/blobs/{'0' * 64} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                             "Content-Type: application/octet-stream\r\nContent-Length: 1000000\r\n\r\n".encode()
                             + b"x" * 4096)
                incoming = tmp_path / "data" / "incoming"
                deadline = time.monotonic() + 30  # cut once the server is spooling the body, not before
                while not (incoming.exists() and any(incoming.iterdir())) and time.monotonic() < deadline:
                    time.sleep(0.02)
            assert gone.wait(30), "the server never saw the cut upload"
            assert c.get("/healthz").status_code == 200
            assert blob_count(tmp_path) == before  # nothing kept of the cut upload
    finally:
        logger.removeHandler(handler)
        blob_log.removeHandler(seen)
        blob_log.setLevel(level)
    assert not [r for r in records if r.levelno >= logging.ERROR], [r.getMessage() for r in records]


def blob_count(tmp_path: Path) -> int:
    blobs = tmp_path / "data" / "blobs"
    return sum(1 for p in blobs.rglob("*") if p.is_file() and not p.name.startswith(".")) if blobs.exists() else 0


@pytest.mark.parametrize("count", ['"100"', "100.0", "true"])
def test_a_sample_count_must_be_a_json_integer(count: str) -> None:
    """n_samples (an update's weight, an enrolment's declaration) is a JSON integer: "100", 100.0 and true were
    taken as 100, 100 and 1."""
    import pydantic

    from pfl_edge.protocol import EnrolRequest, UpdateRequest

    with pytest.raises(pydantic.ValidationError, match="n_samples"):
        UpdateRequest.model_validate_json(f'{{"digest": "{"0" * 64}", "n_samples": {count}}}')
    with pytest.raises(pydantic.ValidationError, match="n_samples"):
        EnrolRequest.model_validate_json(f'{{"federation": "f", "enrol_secret": "s", "profile": "phone-mid", '
                                         f'"n_samples": {count}}}')
    assert UpdateRequest.model_validate_json(f'{{"digest": "{"0" * 64}", "n_samples": 100}}').n_samples == 100


@pytest.mark.parametrize("scheme", ["http", "HTTP", "Http"])
def test_a_ca_file_with_plain_http_is_refused_whatever_the_case(scheme: str) -> None:
    from edge_runtime.http import Http
    from pfl_edge.errors import ConfigError

    with pytest.raises(ConfigError, match="plain http"):
        Http(f"{scheme}://pfl.example.org:8080", 5.0, ca_file="/nonexistent/ca.pem")


def test_the_broker_hooks_token_never_reaches_a_log_line() -> None:
    """uvicorn's access line of a broker's question (``POST /v1/broker/hook/<token>/user``) and any other record
    naming the path: the token is written ``***`` before a handler formats the record."""
    import logging

    from server.ratelimit import install_flood_filter

    install_flood_filter()
    token = "s3cret-hook-token-0123456789"
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    keep = Keep()
    for name, args in (("uvicorn.access", ("127.0.0.1:5555", "POST", f"/v1/broker/hook/{token}/user", "1.1", 200)),
                       ("uvicorn.error", None)):
        log = logging.getLogger(name)
        log.addHandler(keep)
        try:
            if args:
                log.warning('%s - "%s %s HTTP/%s" %d', *args)
            else:
                log.warning(f"refused /v1/broker/hook/{token}/topic")
        finally:
            log.removeHandler(keep)
    assert len(seen) == 2 and all("/v1/broker/hook/***/" in s and token not in s for s in seen), seen


def test_the_heap_made_at_start_up_is_frozen(client: TestClient) -> None:
    """After start-up the cyclic GC no longer walks what the server made to start (bench/gc_freeze.py: a 64 KiB
    body of 21,800 lists answered in 8 ms median, 25 ms at worst, against 15 and 280 ms with the heap walked)."""
    import gc

    assert client.get("/healthz").status_code == 200
    assert gc.get_freeze_count() > 10_000


def test_a_devices_unfinished_uploads_are_refused_before_they_take_disk(tmp_path: Path, broker_url: str) -> None:
    """20 uploads of one device that send their headers (4 MB each announced) and a first KiB, then nothing: 2 are
    received (their bodies wait), the other 18 are answered 429 at once, unread (before, every one spooled its
    body, 960 MB for 20 of 48 MB); once they end, the device uploads again."""
    from server.launch import start_background

    with start_background(_settings(tmp_path, broker_url)) as srv:
        c = httpx.Client(base_url=srv.url, timeout=30)
        create(c, ADMIN, "up", FEDPER)
        d = Dev(c, "up")
        host, port = srv.url.removeprefix("http://").split(":")
        socks, answers = [], []
        try:
            for i in range(20):
                sock = socket.create_connection((host, int(port)), timeout=10)
                socks.append(sock)
                sock.sendall(f"PUT /v1/blobs/{i:064x} HTTP/1.1\r\nHost: x\r\nAuthorization: {d.h['Authorization']}"
                             f"\r\nContent-Type: application/octet-stream\r\nContent-Length: {4_000_000}\r\n\r\n"
                             .encode() + b"x" * 1024)
                time.sleep(0.05)  # in order: the first two take the slots
            for sock in socks[2:]:
                answers.append(sock.recv(4096))
            assert all(a.startswith(b"HTTP/1.1 429") for a in answers), answers[:2]
            assert b"at most 2 at once" in answers[0]
        finally:
            for sock in socks:
                sock.close()
        payload = encode(perturbed(d.get(d.e["init_digest"]).tensors, 1), model_id=d.fm.model_id, round=1)
        deadline = time.monotonic() + 30
        while True:  # the two silent ones end when their sockets close; then the device's slots are free
            r = c.put(f"/v1/blobs/{sha(payload)}", content=payload, headers=d.h)
            if r.status_code != 429 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 201, r.text
