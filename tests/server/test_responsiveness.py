"""Responsiveness and scale, the parts a unit test can hold (the timings are in bench/responsiveness.py and
bench/fleet_load.py): readiness counted in SQL, coalesced worker wake-ups, upload bodies spooled to disk and
decode-checked in other processes, and a /healthz that needs no thread of the request pool."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import anyio
import httpx
import psutil
import pytest
from fastapi import FastAPI
from server_testkit import DISPFL, FEDPER
from sqlalchemy import create_engine

from pfl_edge.aggregate import update_norm
from pfl_edge.codec import encode
from pfl_edge.errors import CodecError
from server.db import Device, Federation, Update, make_engine
from server.errors import Conflict, TooLarge, Unprocessable
from server.fedmodel import FedModel, fed_model
from server.migrations import make_sessionmaker
from server.routers import health
from server.services.enrolment import EnrolmentService
from server.services.planning import Planner
from server.services.spool import BodyStalled, DecodePool, check_update, spool_body
from server.services.worker import RoundWorker


def _federation(fm: FedModel, round: int) -> Federation:
    """A federation row in state ``open`` of ``round``, made directly (no server)."""
    return Federation(id="f", config=fm.cfg.to_dict(), enrol_secret_hash="x", quorum=1.0, deadline_s=60,
                      min_updates=1, min_devices=None, profile_capacity=False, round=round, state="open",
                      init_digest="0" * 64, base_digest="0" * 64)


@pytest.mark.parametrize("config", [FEDPER, DISPFL], ids=["fedper", "dispfl"])
def test_count_active_is_len_of_active(tmp_path: Path, config: dict[str, Any]) -> None:
    """The SQL count the readiness checks use agrees with the device list the round's tasks are made from:
    late joiners, revoked devices and (DisPFL) devices without their initial model are left out of both."""
    fm = fed_model(dict(config, clients=8))
    sessions = make_sessionmaker(make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}"))
    with sessions.begin() as s:
        s.add(_federation(fm, round=1))
        s.flush()
        for i in range(8):
            s.add(Device(id=f"d{i}", federation="f", token_hash=f"{i:064d}", profile="phone-mid", slot=i,
                         density=1.0, kp=2, joined_round=1 if i == 5 else 0,
                         revoked_at=1.0 if i == 6 else None))
        s.flush()
        for i in (0, 1, 2, 5, 6):  # initial models (DisPFL's round 0)
            s.add(Update(federation="f", round=0, device=f"d{i}", digest="1" * 64, n_samples=1))
    with sessions() as s:
        fed = s.get(Federation, "f")
        assert fed is not None
        for t in (1, 2):
            want = [d.id for d in Planner.active(s, fed, fm, t)]
            assert Planner.count_active(s, fed, fm, t) == len(want)
        expected = {1: 3, 2: 4} if fm.algorithm().sends_initial_model else {1: 6, 2: 7}
        assert {t: Planner.count_active(s, fed, fm, t) for t in (1, 2)} == expected


class _Machine:
    def __init__(self) -> None:
        self.steps = 0

    def step(self, fed_id: str) -> None:
        self.steps += 1
        time.sleep(0.002)  # a readiness check's worth of work


def test_worker_coalesces_a_burst_of_wakeups() -> None:
    """2,000 kicks from 4 threads (enrolments arriving together) make a handful of ticks, and a kick after the
    burst still makes one: nothing waits for the next periodic tick."""
    store = SimpleNamespace(read=lambda: _Ids())
    m = _Machine()
    w = RoundWorker(store, m, SimpleNamespace(recover=lambda **_: None), tick_s=60.0,  # type: ignore[arg-type]
                    coalesce_s=0.05)
    w.start()
    try:
        def burst() -> None:
            for _ in range(500):
                w.kick()
                time.sleep(0.0002)

        ts = [threading.Thread(target=burst) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        time.sleep(0.3)
        after_burst = w.ticks
        assert w.kicks == 2000 or w.kicks > 1900  # a statistic: increments may race
        assert 1 <= after_burst <= 40, after_burst
        w.kick()
        deadline = time.monotonic() + 2
        while w.ticks == after_burst and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.ticks == after_burst + 1
    finally:
        w.stop()


class _Ids:
    def __enter__(self) -> _Ids:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def scalars(self, _q: object) -> list[str]:
        return ["f"]


async def _chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


def test_spool_body_writes_and_hashes_as_it_arrives(tmp_path: Path) -> None:
    parts = [bytes([i]) * 70_000 for i in range(5)]
    body = asyncio.run(spool_body(_chunks(parts), 1 << 20, tmp_path))
    whole = b"".join(parts)
    assert body.size == len(whole) and body.sha256 == hashlib.sha256(whole).hexdigest()
    assert body.path.parent == tmp_path and body.read() == whole
    body.discard()
    assert list(tmp_path.iterdir()) == []


def test_spool_body_refuses_over_the_limit_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(TooLarge):  # no Content-Length: found while streaming
        asyncio.run(spool_body(_chunks([b"x" * 600, b"x" * 600]), 1000, tmp_path))
    with pytest.raises(TooLarge):  # a declared length over the limit: refused before reading
        asyncio.run(spool_body(_chunks([]), 1000, tmp_path, declared="1001"))
    assert list(tmp_path.iterdir()) == []


def test_spool_body_refuses_a_drip_slower_than_the_least_rate(tmp_path: Path) -> None:
    """A byte every second resets the idle timer for ever (issue 49: a dripped blob body was never ended); past
    the idle timeout from its start, a body under ``min_rate`` bytes a second on average is refused. The clock is
    the test's: each chunk one second later."""
    t = [0.0]

    async def drip(n: int, size: int) -> AsyncIterator[bytes]:
        for _ in range(n):
            t[0] += 1.0
            yield b"x" * size

    with pytest.raises(BodyStalled, match="bytes a second"):
        asyncio.run(spool_body(drip(100, 1), 1 << 20, tmp_path, idle_timeout_s=30.0, min_rate=1000.0,
                               clock=lambda: t[0]))
    assert 30 <= t[0] <= 32 and list(tmp_path.iterdir()) == []
    t[0] = 0.0  # at 2 kB a second (a slow phone's link) the same body length goes through
    body = asyncio.run(spool_body(drip(100, 2000), 1 << 20, tmp_path, idle_timeout_s=30.0, min_rate=1000.0,
                                  clock=lambda: t[0]))
    assert body.size == 200_000
    body.discard()


def test_decode_pool_checks_in_another_process(tmp_path: Path) -> None:
    """A good payload's round comes back from a worker process; a refusal comes back as the CodecError the
    caller turns into a 422 (the file is passed by its path, never its bytes)."""
    fm = fed_model(dict(FEDPER))
    good = tmp_path / "good"
    good.write_bytes(encode(fm.init_state(), model_id=fm.model_id, round=3))
    bad = tmp_path / "bad"
    bad.write_bytes(good.read_bytes()[:-10])
    pool = DecodePool(1)
    pool.start()
    try:
        kw: dict[str, Any] = dict(expected=fm.shapes, model_id=fm.model_id, max_bytes=1 << 26, allow_missing=True)
        assert pool.check(good, **kw) == 3
        with pytest.raises(CodecError):
            pool.check(bad, **kw)
        with pytest.raises(CodecError, match="model"):
            pool.check(good, **{**kw, "model_id": "another/model"})
        # an update: decoded against exactly its tensors, its norm from the round's start model as the
        # aggregation computes it (the start decoded once in the worker, then kept)
        keys = fm.base_keys(2)
        state = {k: v + 0.5 for k, v in fm.init_state().items() if k in keys}
        upd = tmp_path / "upd"
        upd.write_bytes(encode(state, model_id=fm.model_id, round=3))
        start = ("s" * 64, good, fm.shapes)
        want = update_norm(fm.init_state(), state)
        for _ in range(2):
            rnd, norm = pool.call(check_update, upd, expected=fm.expected(2), model_id=fm.model_id,
                                  max_bytes=1 << 26, start=start)
            assert rnd == 3 and norm == pytest.approx(want, rel=1e-12)
        with pytest.raises(CodecError):  # the whole model where only the base may come
            pool.call(check_update, good, expected=fm.expected(2), model_id=fm.model_id, max_bytes=1 << 26,
                      start=start)
    finally:
        pool.stop()


def test_healthz_answers_with_the_request_thread_pool_full() -> None:
    """Every thread of the request pool busy (uploads, updates): /healthz still answers, and says the database
    is up. A plain ``def`` route would wait for a thread."""
    app = FastAPI()
    app.include_router(health.router)
    app.state.pfl = SimpleNamespace(engine=create_engine("sqlite://"), link=SimpleNamespace(connected=True))

    got: list[httpx.Response] = []
    release = threading.Event()

    async def hold() -> None:
        await anyio.to_thread.run_sync(release.wait)

    async def main() -> None:
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = 1
        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            await anyio.sleep(0.05)
            assert limiter.borrowed_tokens == 1
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                    with anyio.fail_after(5):
                        got.append(await c.get("/healthz"))
            finally:
                release.set()

    anyio.run(main)
    r = got[0]
    assert r.status_code == 200 and r.json()["database"] is True and r.json()["status"] == "ok"


def test_slot_is_the_asked_or_lowest_free_one_found_in_sql(tmp_path: Path) -> None:
    """Enrolment picks a slot without loading the fleet's slots: the asked one if free, else the lowest free."""
    fm = fed_model(dict(FEDPER, clients=5))
    sessions = make_sessionmaker(make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}"))
    with sessions.begin() as s:
        s.add(_federation(fm, round=0))

    def take(*slots: int) -> None:
        with sessions.begin() as s:
            for i in slots:
                s.add(Device(id=f"d{i}", federation="f", token_hash=f"{i:064d}", profile="phone-mid", slot=i,
                             density=1.0, kp=2, joined_round=0))

    def slot(asked: int | None) -> int:
        with sessions() as s:
            fed = s.get(Federation, "f")
            assert fed is not None
            return EnrolmentService._slot(cast(EnrolmentService, None), s, fed, asked)  # (no sampling: no rng)

    take(1, 2)
    assert (slot(None), slot(3), slot(1)) == (0, 3, 0)
    take(0, 4)
    assert (slot(None), slot(4), slot(3)) == (3, 3, 3)
    with pytest.raises(Unprocessable):
        slot(5)
    take(3)
    with pytest.raises(Conflict):
        slot(None)


def test_decode_processes_exit_with_a_killed_server(tmp_path: Path) -> None:
    """A server killed with SIGKILL takes its decode processes and their forkserver with it (they held their own
    pipes open and lived on, ~0.7 GB per killed server)."""
    script = ("import os, sys, time\nfrom server.services.spool import DecodePool\np = DecodePool(2)\np.start()\n"
              "print(' '.join(str(c) for c in p._pool._processes), flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        workers = [int(x) for x in proc.stdout.readline().split()]
        assert len(workers) == 2
        forkservers = {psutil.Process(w).ppid() for w in workers}
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 15
    left = set(workers) | forkservers
    while left and time.monotonic() < deadline:
        left = {p for p in left if _alive(p)}
        time.sleep(0.2)
    assert not left, f"still running: {left}"


def _alive(pid: int) -> bool:
    """Running and not a zombie; a process that exits while it is asked about is not alive (no race)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_server_stopped_with_sigterm_ends_its_export_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM while the server exports a federation's programs (phone profiles train with ExecuTorch: each of
    their programs is a child export of tens of seconds): the server's shutdown ends the export worker too (it
    ran on, minutes, after its server was gone)."""
    import signal

    from edge_runtime.fleet import start_server
    from pfl_edge.protocol import API_PREFIX

    monkeypatch.setenv("PFL_EXPORT_ON_CREATE", "all")  # the tests' default is none
    monkeypatch.setenv("PFL_PROGRAMS_DIR", str(tmp_path / "programs"))  # nothing exported yet
    fed = start_server(tmp_path / "run")
    try:
        fed.create("x", {"algorithm": "fedper", "model": "cnn", "dataset": "synthetic", "clients": 2, "rounds": 1,
                         "kp": 1, "batch_size": 8}, deadline_s=60.0)
        fed.get(f"{API_PREFIX}/federations/x")
        server = psutil.Process(fed.server.pid)
        deadline = time.monotonic() + 120
        workers: list[psutil.Process] = []
        while not workers and time.monotonic() < deadline:  # the event: an export worker child is running
            workers = [c for c in server.children(recursive=True)
                       if _alive(c.pid) and "export.worker" in " ".join(c.cmdline())]
            time.sleep(0.1)
        assert workers, "no export worker started"
        fed.server.send_signal(signal.SIGTERM)
        fed.server.wait(60)
        # the shutdown ended it before the server exited (without, it lived on until it next wrote to its closed
        # stderr pipe: 2.2 s here, minutes in an export's quiet phase); 1 s for the kernel to reap it
        deadline = time.monotonic() + 1
        while any(_alive(w.pid) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(w.pid) for w in workers), "the export worker outlived its server"
    finally:
        fed.close()
