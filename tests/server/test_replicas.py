"""What lets several server processes share one PostgreSQL database: rate-limit buckets in the database, one
leader per federation by advisory lock (taken over when its session dies), the blob table's lock between storing
and collecting, and SQLite's refusal of a second server."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from pfl_edge.errors import ConfigError
from server.db import make_engine
from server.migrations import make_sessionmaker
from server.ratelimit import Buckets, SqlBuckets
from server.services.leadership import AdvisoryLeadership, SoleLeadership, sqlite_guard
from server.services.store import Store
from server.settings import Settings


def _sessions(url: str):  # type: ignore[no-untyped-def]
    return make_sessionmaker(make_engine(Settings(database_url=url).resolved_database_url))


def test_database_buckets_follow_the_memory_buckets_and_are_shared(database_url: str) -> None:
    """The same random spends, refunds and clock steps through Buckets (the reference) and two SqlBuckets on one
    database (two replicas): every wait is the reference's, whichever replica is asked."""
    t = [1000.0]
    ref = Buckets(2.0, 5, clock=lambda: t[0])
    sessions = _sessions(database_url)
    a = SqlBuckets(sessions, "address", 2.0, 5, clock=lambda: t[0], sweep_every=7)
    b = SqlBuckets(sessions, "address", 2.0, 5, clock=lambda: t[0], sweep_every=7)
    rng = random.Random(3)
    for _ in range(150):
        key = rng.choice(["10.0.0.1", "10.0.0.2", "fed:x"])
        op = rng.random()
        replica = rng.choice([a, b])
        if op < 0.55:
            ref.spend(key)
            replica.spend(key)
        elif op < 0.7:
            ref.refund(key)
            replica.refund(key)
        else:
            t[0] += rng.choice([0.05, 0.3, 1.0, 4.0])
        for k in ("10.0.0.1", "10.0.0.2", "fed:x"):
            assert a.wait_s(k) == pytest.approx(ref.wait_s(k), abs=1e-6)
            assert b.wait_s(k) == pytest.approx(ref.wait_s(k), abs=1e-6)
    other = SqlBuckets(sessions, "federation", 2.0, 5, clock=lambda: t[0])  # another kind: its own buckets
    for _ in range(6):
        a.spend("k")
    assert a.wait_s("k") > 0 and other.wait_s("k") == 0


def test_racing_replicas_lose_no_spend(pg_url: str) -> None:
    """Four threads (as four replicas) spend 25 tokens each from one bucket at once: the level is exactly 100
    below where it started (one atomic upsert per spend)."""
    sessions = _sessions(pg_url)
    clock = lambda: 5000.0  # noqa: E731  (a stopped clock: no refill during the race)
    buckets = [SqlBuckets(sessions, "address", 1.0, 1000, clock=clock) for _ in range(4)]

    def spend(bk: SqlBuckets) -> None:
        for _ in range(25):
            bk.spend("shared")

    threads = [threading.Thread(target=spend, args=(bk,)) for bk in buckets]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert buckets[0].wait_s("shared") == 0  # 900 left
    with sessions() as s:
        tokens = s.execute(text("SELECT tokens FROM pfl_rate_buckets")).scalars().all()
    assert tokens == [900.0]


def test_one_leader_per_federation_and_a_takeover_when_its_session_dies(pg_url: str) -> None:
    url = Settings(database_url=pg_url).resolved_database_url
    e1, e2 = make_engine(url), make_engine(url)
    one, two = AdvisoryLeadership(e1), AdvisoryLeadership(e2)
    try:
        led, gained = one.claim({"fa", "fb"})
        assert led == gained == {"fa", "fb"}
        assert one.claim({"fa", "fb"}) == ({"fa", "fb"}, set())  # still held; nothing new
        assert two.claim({"fa", "fb", "fc"}) == ({"fc"}, {"fc"})  # only what nobody holds
        one.release("fa")  # finished
        assert two.claim({"fa", "fb", "fc"}) == ({"fa", "fc"}, {"fa"})
        # the leader's database session dies (as with a SIGKILLed process): its locks go with it
        assert one._conn is not None
        pid = one._conn.execute(text("SELECT pg_backend_pid()")).scalar()
        with e2.connect() as c:
            c.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        # pg_terminate_backend only signals: wait until the backend is gone, and its locks with it
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with e2.connect() as c:
                if not c.execute(text("SELECT 1 FROM pg_stat_activity WHERE pid = :p"), {"p": pid}).first():
                    break
            time.sleep(0.05)
        assert two.claim({"fa", "fb", "fc"}) == ({"fa", "fb", "fc"}, {"fb"})
        assert one.claim({"fa", "fb", "fc"}) == (set(), set())  # it finds out it leads nothing, reconnects
        assert one.claim({"fa", "fb", "fc"}) == (set(), set())  # and finds every federation led elsewhere
    finally:
        one.close()
        two.close()
        e1.dispose()
        e2.dispose()


def test_sole_leadership_leads_everything_and_reports_each_once() -> None:
    sole = SoleLeadership()
    assert sole.claim(["a", "b"]) == ({"a", "b"}, {"a", "b"})
    assert sole.claim(["a", "b", "c"]) == ({"a", "b", "c"}, {"c"})


def test_collecting_blobs_waits_for_a_store_in_flight(pg_url: str) -> None:
    """On PostgreSQL, a collection (``blobs="collect"``) starts only when every ``store`` transaction has
    committed, whichever process holds it: the advisory lock, not this process's lock."""
    store_a, store_b = Store(_sessions(pg_url)), Store(_sessions(pg_url))
    assert store_a.shared and store_b.shared
    order: list[str] = []
    storing, stored = threading.Event(), threading.Event()

    def collect() -> None:
        storing.wait(30)
        with store_b.write(blobs="collect"):
            order.append("collect")

    th = threading.Thread(target=collect)
    th.start()
    with store_a.write(blobs="store"):
        storing.set()
        th.join(0.5)  # bounded: the collector is blocked on the lock, so this returns with it still alive
        assert th.is_alive()
        order.append("store")
        stored.set()
    th.join(30)
    assert order == ["store", "collect"]


def test_a_second_server_on_one_sqlite_database_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    first = sqlite_guard(url)
    assert first is not None
    with pytest.raises(ConfigError, match=r"SQLite serves one server process.*PostgreSQL"):
        sqlite_guard(url)
    first.close()
    again = sqlite_guard(url)  # the first one gone: the next one starts
    assert again is not None
    again.close()
    assert sqlite_guard("postgresql://x@h/db") is None


def test_statuses_are_written_in_batches_each_devices_latest(tmp_path: Path) -> None:
    """A burst of statuses from the MQTT thread becomes one transaction of each device's latest status; one for a
    device of another federation than its topic names changes nothing."""
    import json

    import httpx
    from server_testkit import FEDPER, Dev, create

    from server.launch import start_background

    srv = start_background(Settings(data_dir=tmp_path / "data", admin_token="admin-token-for-statuses"))
    try:
        assert srv.app_state is not None
        pub = srv.app_state.coordinator.publisher
        c = httpx.Client(base_url=srv.url, timeout=30)
        create(c, "admin-token-for-statuses", "f", FEDPER)
        devs = [Dev(c, "f") for _ in range(3)]
        pub.flush_statuses()
        before = pub.status_writes
        burst = [(f"pfl/f/device/{d.id}/status", {"device_id": d.id, "state": s})
                 for d in devs for s in ("offline", "online")]
        burst.append((f"pfl/g/device/{devs[0].id}/status", {"device_id": devs[0].id, "state": "offline"}))
        for topic, msg in burst:
            pub.on_status(topic, json.dumps(msg).encode())
        pub.flush_statuses()
        listed = c.get("/v1/federations/f/devices", headers={"Authorization": "Bearer admin-token-for-statuses"})
        online = {d["device_id"]: d["online"] for d in listed.json()}
        assert online == {d.id: True for d in devs}
        assert pub.status_writes - before <= 2  # the burst in one transaction (or two, if the thread cut it)
        c.close()
    finally:
        srv.stop()
