"""The enrolment gate (``server.enrol_gate.EnrolGate``) and the token chain's absolute lifetime (issue 33, items 4
and 7): guesses pay before the KDF runs, one KDF in flight per address, the KDF on the gate's own threads (never
a request thread), the verified secret passes a federation bucket that guesses emptied, unknown federations
share one bucket, and a device's own rotations end ``device_token_max_lifetime_s`` after it last enrolled.

Unit tests use a frozen clock (no bucket refills) and a fake KDF that takes no time but can be held; the HTTP
tests run the real app with scrypt."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest
from fastapi.testclient import TestClient
from server_testkit import FEDPER, SECRET, bearer, create
from sqlalchemy import inspect, text

from server import enrol_gate
from server.app import create_app
from server.db import Device, make_engine
from server.enrol_gate import EnrolGate
from server.errors import Forbidden, TooManyRequests
from server.migrations import SCHEMA_VERSION, STEPS, migrate, schema_version
from server.ratelimit import Buckets
from server.settings import Settings

ADMIN = "admin-token-for-enrol-gate-tests"
RIGHT = "fake$" + SECRET  # what the fake KDF takes for the hash of SECRET
BOUND_S = 30.0  # a generous bound on waiting for an event that should come at once


class FakeKdf:
    """A KDF that takes no time, but holds its caller while ``hold`` is clear; it records each call's secret and
    the thread it ran on, and the address bucket's wait at that moment (``watch``)."""

    def __init__(self, *, held: bool = False) -> None:
        self.calls: list[tuple[str, str]] = []
        self.entered = threading.Event()
        self.hold = threading.Event()
        if not held:
            self.hold.set()
        self.watch: tuple[EnrolGate, str, str] | None = None  # (gate, address, federation key)
        self.seen: list[tuple[float, float]] = []

    def __call__(self, secret: str, stored: str) -> bool:
        self.calls.append((secret, threading.current_thread().name))
        if self.watch is not None:
            gate, address, fkey = self.watch
            self.seen.append((gate.per_address.wait_s(address), gate.per_federation.wait_s(fkey)))
        self.entered.set()
        if not self.hold.wait(BOUND_S):
            raise TimeoutError("the test never let the KDF go")
        return stored == "fake$" + secret


def frozen_gate(kdf: FakeKdf, *, address_burst: int = 20, federation_burst: int = 100, **kw: Any) -> EnrolGate:
    def clock() -> float:
        return 0.0  # frozen: no bucket refills between the steps of a test

    return EnrolGate(Buckets(1.0, address_burst, clock=clock), Buckets(1.0, federation_burst, clock=clock),
                     kdf=kdf, **{"hit_delay_s": 0.0, **kw})


def run_in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn(*args)
        except BaseException as e:
            errors.append(e)

    th = threading.Thread(target=target)
    th.start()
    return th, errors


# ------------------------------------------------------------------------------------------------ unit tests


def test_a_wrong_guess_spends_its_address_before_the_kdf_and_its_federation_after() -> None:
    kdf = FakeKdf()
    gate = frozen_gate(kdf, address_burst=1, federation_burst=1)
    kdf.watch = (gate, "10.0.0.1", "fed:f")
    with pytest.raises(Forbidden):
        gate.check("f", "a-guess", RIGHT, "10.0.0.1")
    # while the KDF ran the address's bucket (one token) was already empty: the guess had paid; the federation's
    # is spent by the wrong answer, after the KDF (the right secret never spends it)
    assert len(kdf.seen) == 1 and kdf.seen[0][0] > 0 and kdf.seen[0][1] == 0
    assert gate.per_federation.wait_s("fed:f") > 0
    with pytest.raises(TooManyRequests):  # and they stay spent
        gate.check("f", "a-guess", RIGHT, "10.0.0.1")
    assert len(kdf.calls) == 1


def test_a_guess_costs_the_same_whatever_the_federations_bucket_holds() -> None:
    """Issue 49: a guess that met an empty federation bucket was answered 429 at once, without the KDF, while the
    verified secret passed; many addresses tested guesses at their summed rate. Now each guess pays the KDF and
    its address's token, full bucket or empty (only its answer's words differ: 403 or 429), and the verified
    secret waits what a guess's KDF takes."""
    kdf = FakeKdf()
    waits: list[float] = []
    gate = frozen_gate(kdf, address_burst=1, federation_burst=1, hit_delay_s=0.125)
    gate.check("f", SECRET, RIGHT, "10.0.0.1")  # verified once: kept
    for i, answer in enumerate((Forbidden, TooManyRequests, TooManyRequests)):  # full, then empty, then empty
        before = len(kdf.calls)
        with pytest.raises(answer):
            gate.check("f", f"guess-{i}", RIGHT, f"10.66.0.{i}")
        assert len(kdf.calls) == before + 1  # the KDF ran
        assert gate.per_address.wait_s(f"10.66.0.{i}") > 0  # the address paid
    import server.enrol_gate as eg

    real_sleep = eg.time.sleep
    try:
        eg.time.sleep = waits.append  # type: ignore[assignment]
        gate.check("f", SECRET, RIGHT, "10.0.1.1")  # the verified secret: no KDF, the KDF's time waited
    finally:
        eg.time.sleep = real_sleep  # type: ignore[assignment]
    assert waits == [0.125] and len(kdf.calls) == 4


def test_a_second_attempt_from_one_address_while_its_kdf_runs_is_429_without_a_kdf() -> None:
    kdf = FakeKdf(held=True)
    gate = frozen_gate(kdf)
    first, errors = run_in_thread(gate.check, "f", "guess-1", RIGHT, "10.0.0.1")
    try:
        assert kdf.entered.wait(BOUND_S)
        with pytest.raises(TooManyRequests) as e:
            gate.check("f", "guess-2", RIGHT, "10.0.0.1")
        assert e.value.headers == {"Retry-After": "1"} and len(kdf.calls) == 1
        # the cap is per address: another address's guess gets its KDF
        other, other_errors = run_in_thread(gate.check, "f", "guess-3", RIGHT, "10.0.0.2")
        deadline = time.monotonic() + BOUND_S
        while len(kdf.calls) < 2 and time.monotonic() < deadline:
            kdf.entered.clear()
            kdf.entered.wait(0.05)
        assert [c[0] for c in kdf.calls] == ["guess-1", "guess-3"]
    finally:
        kdf.hold.set()
    first.join(BOUND_S)
    other.join(BOUND_S)
    assert [type(x) for x in errors + other_errors] == [Forbidden, Forbidden]
    with pytest.raises(Forbidden):  # its KDF done, the address may try again
        gate.check("f", "guess-4", RIGHT, "10.0.0.1")


def test_an_attempt_cancelled_while_its_kdf_queues_frees_its_address() -> None:
    kdf = FakeKdf(held=True)
    gate = frozen_gate(kdf, kdf_slots=1)
    first, errors = run_in_thread(gate.check, "f", "guess-1", RIGHT, "10.0.0.1")  # holds the one KDF thread

    async def cancelled() -> None:
        task = asyncio.ensure_future(gate.acheck("f", "guess-2", RIGHT, "10.0.0.2"))
        await asyncio.sleep(0)  # it runs up to its wait for the KDF, queued behind guess-1
        task.cancel()  # its client went away
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        assert kdf.entered.wait(BOUND_S)
        asyncio.run(cancelled())
    finally:
        kdf.hold.set()
    first.join(BOUND_S)
    with pytest.raises(Forbidden):  # not 429: the cancelled attempt is no longer counted as in flight
        gate.check("f", "guess-3", RIGHT, "10.0.0.2")
    assert [c[0] for c in kdf.calls] == ["guess-1", "guess-3"] and [type(e) for e in errors] == [Forbidden]


def test_the_kdf_runs_on_the_gates_own_threads() -> None:
    kdf = FakeKdf()
    gate = frozen_gate(kdf)
    gate.check("f", SECRET, RIGHT, "10.0.0.1")
    with pytest.raises(Forbidden):
        asyncio.run(gate.acheck("f", "a-guess", RIGHT, "10.0.0.2"))
    assert [c[0] for c in kdf.calls] == [SECRET, "a-guess"]
    assert all(c[1].startswith("pfl-kdf") for c in kdf.calls), kdf.calls


def test_a_fleets_first_wave_on_the_event_loop_verifies_once() -> None:
    kdf = FakeKdf(held=True)
    gate = frozen_gate(kdf, address_burst=2, federation_burst=2)

    async def wave() -> list[BaseException | None]:
        tasks = [asyncio.ensure_future(gate.acheck("f", SECRET, RIGHT, f"10.0.0.{i}")) for i in range(8)]
        for _ in range(10):  # each task runs up to its first wait: the first on the KDF, the others on it
            await asyncio.sleep(0)
        kdf.hold.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        got = asyncio.run(wave())
    finally:
        kdf.hold.set()
    # one KDF; the seven others (each from its own address) waited for its answer
    assert got == [None] * 8 and [c[0] for c in kdf.calls] == [SECRET]


def test_a_wave_behind_one_address_is_told_to_retry_while_its_kdf_runs_then_passes() -> None:
    """Behind one address (NAT) the first attempt's KDF makes the others 429 with Retry-After 1 (the answer does
    not look at the secret: a guess from that address meets the same), and their retry passes on the kept one."""
    kdf = FakeKdf(held=True)
    gate = frozen_gate(kdf, address_burst=20, federation_burst=2)

    async def wave() -> list[BaseException | None]:
        tasks = [asyncio.ensure_future(gate.acheck("f", SECRET, RIGHT, "10.0.0.1")) for _ in range(4)]
        for _ in range(10):
            await asyncio.sleep(0)
        kdf.hold.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        got = asyncio.run(wave())
    finally:
        kdf.hold.set()
    assert got[0] is None and all(isinstance(e, TooManyRequests) and e.retry_after == 1.0 for e in got[1:])
    for _ in range(3):
        gate.check("f", SECRET, RIGHT, "10.0.0.1")
    assert [c[0] for c in kdf.calls] == [SECRET]


def test_the_verified_secret_passes_a_federation_bucket_that_guesses_emptied() -> None:
    kdf = FakeKdf()
    gate = frozen_gate(kdf, address_burst=2, federation_burst=5)
    gate.check("f", SECRET, RIGHT, "10.0.0.1")  # the fleet's first enrolment
    for i in range(5):  # guesses from five addresses empty the federation's bucket
        with pytest.raises(Forbidden):
            gate.check("f", f"guess-{i}", RIGHT, f"10.66.0.{i}")
    with pytest.raises(TooManyRequests):  # from a sixth: its KDF ran, its answer is 429 (the bucket is empty)
        gate.check("f", "guess-5", RIGHT, "10.66.0.5")
    assert len(kdf.calls) == 7
    for i in range(3):  # the right secret needs only its address's bucket (one keyed HMAC, no KDF)
        gate.check("f", SECRET, RIGHT, f"10.0.1.{i}")
    assert len(kdf.calls) == 7
    for _ in range(2):  # a guess at the cache costs its address a token and a KDF: no cheap guesses
        with pytest.raises(TooManyRequests):
            gate.check("f", "guess-6", RIGHT, "10.66.0.6")
    assert len(kdf.calls) == 9
    with pytest.raises(TooManyRequests) as e:  # now its address's bucket (2) is spent: refused before the secret
        gate.check("f", SECRET, RIGHT, "10.66.0.6")
    assert "too many enrolment attempts" in str(e.value) and len(kdf.calls) == 9
    gate.forget("f")  # the secret rotated: the next one verifies afresh (a KDF; the right one spends no bucket)
    gate.check("f", SECRET, RIGHT, "10.0.2.1")
    assert len(kdf.calls) == 10


def test_unknown_federations_share_one_bucket() -> None:
    kdf = FakeKdf()
    gate = frozen_gate(kdf, federation_burst=3)
    for i in range(3):  # each names a fresh federation id: all spend the one bucket of unknown federations
        with pytest.raises(Forbidden):
            gate.check(f"random-{i}", SECRET, None, f"10.0.0.{i}")
    with pytest.raises(TooManyRequests):
        gate.check("random-3", SECRET, None, "10.0.0.3")
    assert len(kdf.calls) == 4  # the dummy hash's KDF: an unknown federation costs what a wrong secret does
    with pytest.raises(Forbidden):  # a known federation keeps a bucket of its own
        gate.check("f", "a-guess", RIGHT, "10.0.0.4")
    gate.check("f", SECRET, RIGHT, "10.0.0.5")


# ------------------------------------------------------------------------------------------------ HTTP


def settings(tmp_path: Path, broker_url: str, **kw: Any) -> Settings:
    return Settings(data_dir=tmp_path / "data", broker_url=broker_url, admin_token=ADMIN, tick_s=0.05,  # type: ignore[arg-type]
                    **kw)


@pytest.fixture
def client(tmp_path: Path, broker_url: str) -> Iterator[TestClient]:
    with TestClient(create_app(settings(tmp_path, broker_url, enrol_burst_per_federation=3,
                                        enrol_rate_per_federation=0.001,
                                        device_token_max_lifetime_s=3600.0))) as c:
        create(c, ADMIN, "f", FEDPER)
        yield c


def body(secret: str = SECRET, **kw: Any) -> dict[str, Any]:
    return {"federation": "f", "enrol_secret": secret, "profile": "phone-mid", **kw}


def from_address(c: TestClient, address: str) -> TestClient:
    """A client of the same (started) app at another address."""
    return TestClient(c.app, client=(address, 40000))


def test_enrolment_over_http_keeps_scrypt_off_the_request_threads(client: TestClient,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    real = enrol_gate.verify_secret
    threads: list[str] = []
    entered, hold = threading.Event(), threading.Event()

    def held(secret: str, stored: str) -> bool:
        threads.append(threading.current_thread().name)
        entered.set()
        hold.wait(BOUND_S)
        return real(secret, stored)

    monkeypatch.setattr(enrol_gate, "verify_secret", held)
    statuses: list[int] = []
    first = threading.Thread(
        target=lambda: statuses.append(client.post("/v1/devices", json=body("a-guess")).status_code))
    first.start()
    try:
        assert entered.wait(BOUND_S)
        assert client.portal is not None
        # the enrolment waits on its scrypt, yet holds none of the threads that sync routes are served on
        assert client.portal.call(lambda: anyio.to_thread.current_default_thread_limiter().borrowed_tokens) == 0
        assert client.get("/v1/federations/f", headers=bearer(ADMIN)).status_code == 200  # a route on those threads
        r = client.post("/v1/devices", json=body("another-guess"))  # the same address, its scrypt still running
        assert r.status_code == 429 and r.headers["retry-after"] == "1" and len(threads) == 1
    finally:
        hold.set()
    first.join(BOUND_S)
    assert statuses == [403] and threads and all(t.startswith("pfl-kdf") for t in threads)


def test_guesses_from_many_addresses_do_not_lock_out_the_right_secret(client: TestClient) -> None:
    assert client.post("/v1/devices", json=body()).status_code == 201  # verified once: kept as a keyed HMAC
    for i in range(3):  # the federation's bucket (3) emptied by guesses from three addresses
        assert from_address(client, f"10.66.0.{i}").post("/v1/devices", json=body(f"guess-{i}")).status_code == 403
    # a fourth: its scrypt ran, and its answer is 429 (the federation's bucket is empty), not 403
    assert from_address(client, "10.66.0.3").post("/v1/devices", json=body("guess-3")).status_code == 429
    for i in range(2):
        assert from_address(client, f"10.0.1.{i}").post("/v1/devices", json=body()).status_code == 201
    # an unknown federation meets the shared bucket of unknown federations, not this one's
    r = from_address(client, "10.66.0.4").post("/v1/devices", json=body(federation="nope"))
    assert r.status_code == 403 and r.json()["detail"].startswith("wrong enrol secret")


def test_rotation_past_the_chains_lifetime_is_refused(client: TestClient) -> None:
    nonce = "cd" * 16
    r = client.post("/v1/devices", json=body(nonce=nonce))
    assert r.status_code == 201
    dev, token = r.json()["device_id"], r.json()["token"]
    sessions = client.app.state.pfl.coordinator.store.sessions  # type: ignore[attr-defined]

    def row() -> Device:
        with sessions() as s:
            got: Device = s.get(Device, dev)
            return got

    origin = row().token_origin
    assert origin is not None and row().token_expires == pytest.approx(origin + 3600.0)  # not the 30-day ttl
    r = client.post("/v1/devices/me/token", headers=bearer(token))
    assert r.status_code == 200 and r.json()["expires"] <= origin + 3600.0 and row().token_origin == origin
    token = r.json()["token"]

    def age_chain(by_s: float) -> None:  # the chain began longer ago than the lifetime (no waiting)
        with sessions.begin() as s:
            s.get(Device, dev).token_origin = time.time() - by_s

    age_chain(3601.0)
    r = client.post("/v1/devices/me/token", headers=bearer(token))
    assert r.status_code == 401 and "enrol again" in r.json()["detail"]
    # the device enrols again with its secret and nonce: the same device, a new chain
    r = client.post("/v1/devices", json=body(nonce=nonce))
    assert r.status_code == 201 and r.json()["device_id"] == dev
    assert time.time() - (row().token_origin or 0.0) < 60
    assert client.post("/v1/devices/me/token", headers=bearer(r.json()["token"])).status_code == 200
    # the admin's rotation starts a new chain too
    age_chain(3601.0)
    r = client.post(f"/v1/federations/f/devices/{dev}/token", headers=bearer(ADMIN))
    assert r.status_code == 200 and time.time() - (row().token_origin or 0.0) < 60
    # a row from before schema 9 has no origin: its chain starts at its next rotation
    with sessions.begin() as s:
        s.get(Device, dev).token_origin = None
    r = client.post("/v1/devices/me/token", headers=bearer(r.json()["token"]))
    assert r.status_code == 200 and time.time() - (row().token_origin or 0.0) < 60


def test_the_token_origin_column_is_added_to_an_older_database(database_url: str) -> None:
    step = next(s for s in STEPS if "token_origin" in s.what)
    engine = make_engine(Settings(database_url=database_url).resolved_database_url)
    try:
        migrate(engine)
        with engine.begin() as c:
            c.execute(text("ALTER TABLE pfl_devices DROP COLUMN token_origin"))
            c.execute(text("UPDATE pfl_schema SET version = :v"), {"v": step.version - 1})
        assert "token_origin" not in {c["name"] for c in inspect(engine).get_columns("pfl_devices")}
        assert migrate(engine) == step.version - 1
        assert "token_origin" in {c["name"] for c in inspect(engine).get_columns("pfl_devices")}
        assert schema_version(engine) == SCHEMA_VERSION
    finally:
        engine.dispose()
